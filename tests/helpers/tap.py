"""What a reader of the network sees of a rank, written down for an attacker to use.

`TappedTransport` wraps a real transport (NIXL in `tests/runtime_peer.py`) and appends to
a file, as JSON lines, every data-plane message the rank sends exactly as it goes on the
wire: a message when it is sent, a notification riding on a write when the write is done
(the data plane sends it after the data, so that is when a reader sees it), and `record_metadata`
the metadata its side channel answers with (agent metadata, message key, incarnation),
which travels in clear too. `read_tap` reads a file back.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from helpers.forwarding import Forwarding
from kvpush.sidechannel import PeerMetadata
from kvpush.transports.base import Transport, TransportEvent, WriteDone, WriteFailed


class TappedTransport(Forwarding):
    """`inner`, with every payload it sends copied to `path` (`{"to", "hex"}` lines)."""

    def __init__(self, inner: Transport, path: Path) -> None:
        super().__init__(inner)
        self._path = path
        self._lock = threading.Lock()
        self._riding: dict[int, tuple[str, bytes]] = {}  # write id -> its notification

    def _record(self, peer: str, payload: bytes) -> None:
        with self._lock, self._path.open("a") as f:
            f.write(json.dumps({"to": peer, "hex": payload.hex()}) + "\n")

    def write_blocks(
        self,
        peer: str,
        write_id: int,
        our_blocks: Sequence[int],
        their_blocks: Sequence[int],
        notification: bytes | None,
        regions: Sequence[int] | None = None,
    ) -> None:
        super().write_blocks(peer, write_id, our_blocks, their_blocks, notification, regions)
        if notification is not None:
            self._riding[write_id] = (peer, notification)

    def send_message(self, peer: str, payload: bytes) -> None:
        super().send_message(peer, payload)
        self._record(peer, payload)

    def poll(self) -> list[TransportEvent]:
        events = super().poll()
        for ev in events:
            match ev:
                case WriteDone(write_id=wid) if wid in self._riding:
                    self._record(*self._riding.pop(wid))
                case WriteFailed(write_id=wid):
                    self._riding.pop(wid, None)
                case _:
                    pass
        return events


def record_metadata(path: Path, meta: PeerMetadata) -> None:
    """The side channel's answer for this rank, as a reader of the network saw it."""
    with path.open("a") as f:
        f.write(json.dumps({"metadata": msgspec.msgpack.encode(meta).hex()}) + "\n")


def read_tap(path: Path) -> tuple[PeerMetadata | None, list[tuple[str, bytes]]]:
    """The metadata and the (recipient, payload) frames recorded in `path` so far."""
    meta: PeerMetadata | None = None
    frames: list[tuple[str, bytes]] = []
    if not path.exists():
        return meta, frames
    for line in path.read_text().splitlines():
        try:
            entry: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if "metadata" in entry:
            meta = msgspec.msgpack.decode(bytes.fromhex(entry["metadata"]), type=PeerMetadata)
        else:
            frames.append((entry["to"], bytes.fromhex(entry["hex"])))
    return meta, frames
