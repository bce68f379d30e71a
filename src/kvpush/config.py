"""kvpush's settings: typed, frozen, loaded once. Nothing else reads the environment.

Sections belong to the parts that use them; add fields with defaults, at the end.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

from kvpush.errors import ConfigError

TOKEN_ENV = "KVPUSH_TOKEN"


@dataclass(frozen=True, slots=True)
class TimingConfig:
    """Liveness and deadlines of the push protocol, in seconds."""

    heartbeat_interval_s: float = 0.5
    # A peer silent for this long is declared gone; well below any transfer deadline.
    liveness_timeout_s: float = 3.0
    # How long the sender may hold blocks without hearing from the receiver.
    lease_s: float = 5.0
    # A transfer not finished by then fails with DEADLINE_EXCEEDED.
    transfer_deadline_s: float = 60.0
    # How long a sender holds a submitted transfer that no receiver has registered for:
    # from submit, and from each receiver heartbeat that claims it (a receiver that has
    # the request queued, blocks not allocated yet: `PushRuntime.claim`). Then it fails
    # with PEER_TIMEOUT, so a receiver that died before registering costs the sender its
    # blocks for this long, not for the deadline. None: such transfers wait for the
    # deadline, for receivers that do not claim (`kvpush.protocol.state`, "Claims").
    claim_window_s: float | None = None

    def __post_init__(self) -> None:
        names = ("heartbeat_interval_s", "liveness_timeout_s", "lease_s", "transfer_deadline_s")
        for name in names:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.claim_window_s is not None and self.claim_window_s <= self.heartbeat_interval_s:
            raise ConfigError(
                f"claim_window_s ({self.claim_window_s}) must be above heartbeat_interval_s "
                f"({self.heartbeat_interval_s}): a receiver claims once per heartbeat interval"
            )
        if self.heartbeat_interval_s >= self.liveness_timeout_s:
            raise ConfigError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be below "
                f"liveness_timeout_s ({self.liveness_timeout_s})"
            )


# The fields of `CacheGeometry.compat_fields()`: what two peers' caches must agree on.
COMPAT_FIELDS = (
    "protocol_version",
    "layout",
    "block_size_tokens",
    "dtype",
    "mode",
    "kv_heads",
    "regions",
)


@dataclass(frozen=True, slots=True)
class CompatibilityPolicy:
    """Which compatibility fields of a peer's cache may differ from ours.

    Checked on every handshake, on both sides, by the protocol itself: a peer whose
    `CacheGeometry.compat_fields()` differ from ours in any field not listed here fails
    the transfers that needed it with INCOMPATIBLE_PEER, the detail naming each field
    that differs, theirs and ours. The default allows nothing. Allowing a field is a
    decision the caller writes down, with `reason`, for a mapping that really handles the
    difference (a later heterogeneous tensor-parallel layout, say); never a way to skip
    the check. `protocol_version` can never be allowed to differ.
    """

    may_differ: frozenset[str] = frozenset()
    reason: str = ""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.may_differ) - set(COMPAT_FIELDS))
        if unknown:
            raise ConfigError(
                f"CompatibilityPolicy.may_differ: unknown fields {unknown}; expected some "
                f"of {list(COMPAT_FIELDS)}"
            )
        if "protocol_version" in self.may_differ:
            raise ConfigError("CompatibilityPolicy: protocol_version can never differ")
        if self.may_differ and not self.reason.strip():
            raise ConfigError(
                "CompatibilityPolicy: say why the fields "
                f"{sorted(self.may_differ)} may differ (reason=...)"
            )


STRICT_COMPATIBILITY = CompatibilityPolicy()


@dataclass(frozen=True, slots=True)
class SideChannelConfig:
    token: str | None = None  # shared secret, proven both ways, never sent; None: no auth
    max_frame_bytes: int = 64 * 1024  # requests larger than this are dropped unread


@dataclass(frozen=True, slots=True)
class Config:
    timing: TimingConfig = field(default_factory=TimingConfig)
    side_channel: SideChannelConfig = field(default_factory=SideChannelConfig)


def load_token(token_file: str | Path | None, env: Mapping[str, str] | None = None) -> str | None:
    """The shared secret: from `token_file` if given, else `$KVPUSH_TOKEN`, else None."""
    if token_file is not None:
        path = Path(token_file)
        try:
            token = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read token file {path}: {exc.strerror}") from None
        if not token:
            raise ConfigError(f"token file {path} is empty: expected a shared secret")
        return token
    env = os.environ if env is None else env
    return env.get(TOKEN_ENV) or None


RDMA_DEVICES = Path("/sys/class/infiniband")


def prepare_ucx_environment(
    env: MutableMapping[str, str] | None = None, rdma_devices: Path = RDMA_DEVICES
) -> None:
    """Set UCX defaults that must be in the environment before NIXL loads UCX.

    On a host with no RDMA device, UCX's InfiniBand modules have nothing to do, and the
    libnl bundled with them crashes the process in its exit handler (SIGSEGV after Python
    has finished, so every NIXL user exits 139: seen with nixl-cu12 1.5.1). Unless the
    user chose `UCX_MODULES` themselves, leave those modules out on such a host.
    """
    env = os.environ if env is None else env
    has_rdma = rdma_devices.is_dir() and any(rdma_devices.iterdir())
    if "UCX_MODULES" not in env and not has_rdma:
        env["UCX_MODULES"] = "^ib,rdmacm"
