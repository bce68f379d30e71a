"""`Forwarding`: a transport that hands every call to another one, for test wrappers
that watch or record a real transport's traffic and override only what they watch."""

from __future__ import annotations

from collections.abc import Sequence

from kvpush.geometry import CacheGeometry, ScratchRegion
from kvpush.transports.base import Transport, TransportEvent


class Forwarding(Transport):
    def __init__(self, inner: Transport) -> None:
        self._inner = inner

    @property
    def agent_name(self) -> str:
        return self._inner.agent_name

    def start(self) -> None:
        self._inner.start()

    def close(self) -> None:
        self._inner.close()

    def register_memory(self, geometry: CacheGeometry) -> None:
        self._inner.register_memory(geometry)

    def register_scratch(self, scratch: ScratchRegion) -> None:
        self._inner.register_scratch(scratch)

    def metadata(self) -> bytes:
        return self._inner.metadata()

    def add_peer(
        self,
        peer: str,
        metadata: bytes,
        geometry: CacheGeometry,
        *,
        messages_only: bool = False,
        ours: CacheGeometry | None = None,
    ) -> None:
        self._inner.add_peer(peer, metadata, geometry, messages_only=messages_only, ours=ours)

    def remove_peer(self, peer: str) -> None:
        self._inner.remove_peer(peer)

    def has_peer(self, peer: str) -> bool:
        return self._inner.has_peer(peer)

    def write_blocks(
        self,
        peer: str,
        write_id: int,
        our_blocks: Sequence[int],
        their_blocks: Sequence[int],
        notification: bytes | None,
        regions: Sequence[int] | None = None,
    ) -> None:
        self._inner.write_blocks(peer, write_id, our_blocks, their_blocks, notification, regions)

    def write_scratch(self, peer: str, write_id: int, nbytes: int, theirs: ScratchRegion) -> None:
        self._inner.write_scratch(peer, write_id, nbytes, theirs)

    def description(self) -> dict[str, str]:
        return self._inner.description()

    def send_message(self, peer: str, payload: bytes) -> None:
        self._inner.send_message(peer, payload)

    def poll(self) -> list[TransportEvent]:
        return self._inner.poll()
