"""The endpoint's half of remote `kvpush bench`: control requests on its side channel.

In push mode the receiver must be told to expect a transfer before the sender can write
it. When `kvpush bench --target HOST:PORT` runs against `kvpush endpoint --transport
nixl`, the bench is the sender and asks the endpoint, over the endpoint's own side channel
(same port, same token), to expect its transfers. These requests are registered with
`MetadataServer(control=BenchService.handlers())`; the server core only routes them.

Requests (msgpack `(kind, body[, nonce, proof])`, see `kvpush.sidechannel.wire`)::

    b"bench_expect"    {"sender": [host, port, rank], "transfers": [[id, [block, ...]], ...]}
        zeroes each transfer's blocks, then `runtime.receive(id, sender, blocks)`.
        -> {"accepted": n, "cpu_s": endpoint CPU seconds so far}
    b"bench_results"   {"transfers": [id, ...]}
        -> {"ended": {id: [ok, reason or None, detail]}, "cpu_s": ...} for those that
           ended; each result is answered once (later requests no longer list it).
    b"bench_checksum"  {"blocks": [[block, ...], ...]}
        -> {"crc": [crc32 of those blocks, region by region, block by block], "cpu_s": ...}
    b"bench_status"    nil
        -> {"cpu_s": ..., "expecting": n, "ended_unclaimed": n}

Every body is validated in full before anything is done (so a batch is accepted whole
or not at all); anything wrong is refused with `RequestRejected`, whose message is the
reason the bench prints, and the side channel keeps serving.

Threads: the handlers run on the side-channel thread; `record()` runs on the thread that
takes the runtime's results (the endpoint's main thread). One lock guards the shared state.
The runtime's own calls are thread-safe.
"""

from __future__ import annotations

import collections
import ctypes
import resource
import threading
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

from kvpush.errors import KVPushError
from kvpush.geometry import CacheGeometry
from kvpush.runtime import PeerAddress, PushRuntime, TransferResult
from kvpush.sidechannel import ControlHandler, RequestRejected

BENCH_EXPECT = b"bench_expect"
BENCH_RESULTS = b"bench_results"
BENCH_CHECKSUM = b"bench_checksum"
BENCH_STATUS = b"bench_status"
BENCH_KINDS = (BENCH_EXPECT, BENCH_RESULTS, BENCH_CHECKSUM, BENCH_STATUS)

MAX_TRANSFERS_PER_REQUEST = 1024
MAX_TRANSFER_ID_CHARS = 128
# Results nobody asked for are forgotten past this many (a bench that died mid-run).
MAX_UNCLAIMED = 100_000


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def blocks_checksum(geometry: CacheGeometry, blocks: Sequence[int]) -> int:
    """CRC32 of `blocks` in every region of `geometry`, region by region, block by block.

    Sender and receiver compute it the same way over their own memory, so equal sums
    mean equal bytes (block i of one side against block i of the other)."""
    crc = 0
    for region in geometry.regions:
        _host_memory(region.device)
        for block in blocks:
            view = (ctypes.c_char * region.block_bytes).from_address(
                region.base_addr + block * region.block_stride
            )
            crc = zlib.crc32(memoryview(view), crc)
    return crc


def zero_blocks(geometry: CacheGeometry, blocks: Iterable[int]) -> None:
    for region in geometry.regions:
        _host_memory(region.device)
        for block in blocks:
            ctypes.memset(region.base_addr + block * region.block_stride, 0, region.block_bytes)


def _host_memory(device: str) -> None:
    if device != "cpu":
        raise RequestRejected(f"bench checks need a cache in host memory, this one is on {device}")


class BenchService:
    """What `kvpush endpoint` answers to a remote bench, for one rank's runtime."""

    def __init__(self, runtime: PushRuntime, geometry: CacheGeometry) -> None:
        self._runtime = runtime
        self._geometry = geometry
        self._lock = threading.Lock()
        self._expecting: set[str] = set()
        self._ended: collections.OrderedDict[str, tuple[bool, str | None, str]] = (
            collections.OrderedDict()
        )

    def handlers(self) -> dict[bytes, ControlHandler]:
        return {
            BENCH_EXPECT: self.expect,
            BENCH_RESULTS: self.results,
            BENCH_CHECKSUM: self.checksum,
            BENCH_STATUS: self.status,
        }

    # ------------------------------------------------------------- side-channel thread

    def expect(self, body: Any) -> dict[str, Any]:
        body = _mapping(body, BENCH_EXPECT, ("sender", "transfers"))
        sender = _sender(body["sender"])
        transfers = _list(body["transfers"], "transfers", MAX_TRANSFERS_PER_REQUEST)
        parsed: list[tuple[str, tuple[int, ...]]] = []
        seen: set[str] = set()
        for i, item in enumerate(transfers):
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise RequestRejected(f"transfers[{i}]: expected [transfer_id, [block, ...]]")
            tid = _transfer_id(item[0], f"transfers[{i}]")
            if tid in seen:
                raise RequestRejected(f"transfers[{i}]: transfer id {tid!r} given twice")
            seen.add(tid)
            parsed.append((tid, self._blocks(item[1], f"transfers[{i}] ({tid})")))
        with self._lock:
            busy = sorted(t for t in seen if t in self._expecting or t in self._ended)
            if busy:
                raise RequestRejected(
                    f"transfer id {busy[0]!r} is already expected here (ids must be new)"
                )
            self._expecting |= seen
        try:
            zero_blocks(self._geometry, {b for _, blocks in parsed for b in blocks})
            for tid, blocks in parsed:
                self._runtime.receive(tid, sender, blocks)
        except KVPushError as exc:
            with self._lock:
                self._expecting -= seen
            raise RequestRejected(f"the runtime refused the transfers: {exc}") from None
        return {"accepted": len(parsed), "cpu_s": cpu_seconds()}

    def results(self, body: Any) -> dict[str, Any]:
        body = _mapping(body, BENCH_RESULTS, ("transfers",))
        wanted = _list(body["transfers"], "transfers", 16 * MAX_TRANSFERS_PER_REQUEST)
        ids = [_transfer_id(t, "transfers") for t in wanted]
        ended: dict[str, list[Any]] = {}
        with self._lock:
            for tid in ids:
                result = self._ended.pop(tid, None)
                if result is not None:
                    ended[tid] = list(result)
        return {"ended": ended, "cpu_s": cpu_seconds()}

    def checksum(self, body: Any) -> dict[str, Any]:
        body = _mapping(body, BENCH_CHECKSUM, ("blocks",))
        slots = _list(body["blocks"], "blocks", MAX_TRANSFERS_PER_REQUEST)
        parsed = [self._blocks(s, f"blocks[{i}]") for i, s in enumerate(slots)]
        crcs = [blocks_checksum(self._geometry, blocks) for blocks in parsed]
        return {"crc": crcs, "cpu_s": cpu_seconds()}

    def status(self, body: Any) -> dict[str, Any]:
        if body is not None:
            raise RequestRejected("bench_status takes no body (nil)")
        with self._lock:
            return {
                "cpu_s": cpu_seconds(),
                "expecting": len(self._expecting),
                "ended_unclaimed": len(self._ended),
            }

    # ------------------------------------------------------------- results thread

    def record(self, results: Iterable[TransferResult]) -> None:
        """The runtime's results, as the endpoint takes them; bench transfers are kept
        for `bench_results`, others ignored."""
        with self._lock:
            for r in results:
                if r.transfer_id not in self._expecting:
                    continue
                self._expecting.discard(r.transfer_id)
                self._ended[r.transfer_id] = (
                    r.ok,
                    None if r.reason is None else r.reason.value,
                    r.detail,
                )
                while len(self._ended) > MAX_UNCLAIMED:
                    self._ended.popitem(last=False)

    # ------------------------------------------------------------- validation

    def _blocks(self, value: object, where: str) -> tuple[int, ...]:
        blocks = _list(value, where, self._geometry.num_blocks)
        limit = self._geometry.num_blocks
        for b in blocks:
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < limit:
                raise RequestRejected(
                    f"{where}: block {_short(b)} is not a block id of this cache (0..{limit - 1})"
                )
        if len(set(blocks)) != len(blocks):
            raise RequestRejected(f"{where}: a block id is listed twice")
        return tuple(blocks)


def _mapping(body: object, kind: bytes, keys: tuple[str, ...]) -> dict[str, Any]:
    form = "{" + ", ".join(f'"{k}": ...' for k in keys) + "}"
    if not isinstance(body, dict) or set(body) != set(keys):
        raise RequestRejected(f"{kind.decode()}: expected a map {form}, got {_short(body)}")
    return body


def _list(value: object, where: str, most: int) -> list[Any]:
    if not isinstance(value, (list, tuple)) or not value:
        raise RequestRejected(f"{where}: expected a non-empty array, got {_short(value)}")
    if len(value) > most:
        raise RequestRejected(f"{where}: {len(value)} items, at most {most} per request")
    return list(value)


def _transfer_id(value: object, where: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TRANSFER_ID_CHARS:
        raise RequestRejected(
            f"{where}: a transfer id must be a string of 1..{MAX_TRANSFER_ID_CHARS} "
            f"characters, got {_short(value)}"
        )
    return value


def _sender(value: object) -> PeerAddress:
    if (
        isinstance(value, (list, tuple))
        and len(value) == 3
        and isinstance(value[0], str)
        and value[0]
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value[1:])
        and 0 < value[1] < 65536
        and value[2] >= 0
    ):
        return PeerAddress(value[0], value[1], value[2])
    raise RequestRejected(
        f"sender: expected [host, port 1..65535, rank >= 0] (its side channel), got {_short(value)}"
    )


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
