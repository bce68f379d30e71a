"""`kvpush serve`'s options: one typed, frozen value, checked once, read by the server
assembly (`app`) and the prefill/decode roles (`disagg`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.config import TimingConfig
from kvpush.errors import ConfigError
from kvpush.net import check_port, is_wildcard
from kvpush.roles import SERVER_ROLES
from kvpush.serving.http import DEFAULT_MAX_BODY_BYTES
from kvpush.serving.worker import AdmissionConfig


@dataclass(frozen=True, slots=True)
class ServeOptions:
    model: str
    role: str = "both"
    host: str = "127.0.0.1"
    port: int = 8000
    # The address peers are told to reach the side channel at (default: `host`, which
    # it binds); set when it binds a wildcard or sits behind an address it cannot bind.
    advertise_host: str | None = None
    side_channel_port: int | None = None
    served_model_name: str | None = None
    block_size: int = 16
    num_blocks: int = 1024
    max_batch_tokens: int = 4096
    speculative_tokens: int = 0
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    prefix_caching: bool = True
    layerwise: bool = False
    idle_poll_ms: float = 5.0
    # The side channel's secret (else $KVPUSH_TOKEN, else none); /kvpush/abort needs it too.
    token_file: str | None = None
    # `kvpush doctor`'s test writes into a scratch buffer (never a KV block): on with a
    # token (the doctor proves it), else only when the operator allows them.
    allow_doctor_writes: bool = False
    log_level: int = 0
    max_waiting: int = 512  # requests queued for KV blocks; one more gets 429
    queue_timeout_s: float = 30.0  # a request queued longer gets 503
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413
    # A transfer not finished by then fails; keep it above the other side's queue timeout.
    transfer_deadline_s: float = TimingConfig().transfer_deadline_s
    # A prefill gives up a transfer that no decode registered for, nor claimed (a decode
    # claims the requests it holds queued), for this long: a decode that died before
    # registering costs it its blocks for this long, not for the deadline.
    claim_window_s: float = 10.0
    # Told to stop (SIGTERM): once HTTP stopped, how long the transfers held may still
    # finish before the runtime closes and hands back what is left, telling each peer.
    drain_s: float = 10.0
    # A peer silent this long is declared gone and the transfers with it fail. The
    # runtime's heartbeats come from a thread beside the engine's: raise it where the
    # engine can hold that thread off for seconds (a loaded host).
    liveness_timeout_s: float = TimingConfig().liveness_timeout_s

    @property
    def side_channel_host(self) -> str:
        """The side channel's address as peers are told it."""
        return self.advertise_host if self.advertise_host else self.host

    def timing(self) -> TimingConfig:
        """The runtime's bounds, as these options set them (the rest: defaults)."""
        return TimingConfig(
            liveness_timeout_s=self.liveness_timeout_s,
            transfer_deadline_s=self.transfer_deadline_s,
            claim_window_s=self.claim_window_s,
        )

    def admission(self) -> AdmissionConfig:
        return AdmissionConfig(max_waiting=self.max_waiting, queue_timeout_s=self.queue_timeout_s)

    def __post_init__(self) -> None:
        if self.role not in SERVER_ROLES:
            raise ConfigError(f"role {self.role!r}: expected one of {', '.join(SERVER_ROLES)}")
        check_port(self.port)
        if self.advertise_host is not None and is_wildcard(self.advertise_host):
            raise ConfigError(
                f"--advertise-host {self.advertise_host}: a wildcard peers cannot connect to; "
                "expected an address of this host they can reach (--host may be the wildcard)"
            )
        if self.role != "both" and self.side_channel_port is None:
            raise ConfigError(f"--role {self.role} needs --side-channel-port")
        for name in ("block_size", "num_blocks", "max_batch_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_waiting < 0 or self.queue_timeout_s <= 0 or self.max_body_bytes <= 0:
            raise ConfigError(
                "max_waiting must be 0 or more, queue_timeout_s and max_body_bytes positive"
            )
        if self.transfer_deadline_s <= 0:
            raise ConfigError(
                f"transfer_deadline_s must be positive, got {self.transfer_deadline_s}"
            )
        if self.idle_poll_ms <= 0:
            raise ConfigError(f"idle_poll_ms must be positive, got {self.idle_poll_ms}")
        if self.drain_s < 0:
            raise ConfigError(f"drain_s must be 0 or more, got {self.drain_s}")
        self.timing()  # its own checks (claim window, liveness), now rather than at start
        if self.speculative_tokens < 0:
            raise ConfigError("speculative_tokens must be 0 (off) or positive")
        if self.speculative_tokens and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
