"""The proxy's backends: one `Instance` per server (or per engine of a data-parallel vLLM
server), what it is known to be, how many requests it has in flight, and the `Pool` of a
role that picks the instance a leg goes to."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpush.errors import ConfigError
from kvpush.health import ServerHealth


@dataclass(frozen=True, slots=True)
class ServerShape:
    """A vLLM server's tensor-parallel size, block size (tokens) and pipeline-parallel
    size; None: not known."""

    tp_size: int | None = None
    block_size: int | None = None
    pp_size: int | None = None


@dataclass(slots=True)
class Instance:
    url: str
    # One engine of a data-parallel vLLM server (its index), which each leg names.
    engine: int | None = None
    in_flight: int = 0
    info: ServerHealth | None = None
    # Given up front (a vLLM server's /health tells no side channel): never refetched.
    fixed_info: ServerHealth | None = None
    # A vLLM server's shape, read from its side channel (rank 0's geometry) when first
    # needed and again after a failure; None: not known.
    shape: ServerShape | None = None

    @property
    def label(self) -> str:
        return self.url if self.engine is None else f"{self.url} (engine {self.engine})"

    @property
    def headers(self) -> dict[str, str]:
        """What routes a leg to this engine (vLLM's API server honours the header)."""
        return {} if self.engine is None else {"X-data-parallel-rank": str(self.engine)}


@dataclass(slots=True)
class Pool:
    name: str
    instances: list[Instance]
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    def pick(self) -> Instance:
        # Fewest in flight; ties go round-robin so idle instances share the load.
        start = next(self._turn) % len(self.instances)
        order = self.instances[start:] + self.instances[:start]
        return min(order, key=lambda i: i.in_flight)


class Lease:
    """One request's share of its backends' in-flight counts, given back exactly once."""

    def __init__(self, *instances: Instance) -> None:
        self._instances: list[Instance] | None = list(instances)
        for inst in instances:
            inst.in_flight += 1

    def release(self, inst: Instance | None = None) -> None:
        if self._instances is None:
            return
        if inst is None:
            for i in self._instances:
                i.in_flight -= 1
            self._instances = None
        elif inst in self._instances:
            inst.in_flight -= 1
            self._instances.remove(inst)


def build_pool(
    role: str, urls: Sequence[str], side_channels: Sequence[tuple[str, int]] | None, dp: int
) -> Pool:
    """A role's instances: one per server, or one per engine of a data-parallel server
    (its side channel the given port plus the engine's index, as vLLM's connectors
    serve them)."""
    if side_channels is not None and len(side_channels) != len(urls):
        raise ValueError(
            f"{len(side_channels)} {role} side channels for {len(urls)} {role} servers: "
            "give one per server, in the same order"
        )
    if dp < 1 or (dp > 1 and side_channels is None):
        raise ConfigError(
            f"{role} data parallelism {dp}: expected 1, or more for vLLM {role} servers "
            f"given their side channels (each engine's is that port plus its index)"
        )
    if side_channels is None:
        return Pool(role, [Instance(u.rstrip("/")) for u in urls])
    instances = [
        Instance(
            url.rstrip("/"),
            engine=engine if dp > 1 else None,
            fixed_info=ServerHealth(side_channel_host=host, side_channel_port=port + engine),
        )
        for url, (host, port) in zip(urls, side_channels, strict=True)
        for engine in range(dp)
    ]
    return Pool(role, instances)
