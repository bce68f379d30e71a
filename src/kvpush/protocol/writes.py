"""The sender's write ledger: which of its writes are in flight and for which transfer,
what a transfer's next write carries, and the checks on what a write would cover (the
layers the engine names, the mapping a receiver registered).

`SenderWrites` is an object `SenderProtocol` owns. It answers (the write to issue, the
transfer a reported write was for, what is wrong with a mapping) and ends nothing: the
sender decides whether a write may go at all (handshake done, clock bounded, lease
holding) and ends the transfer once its writes drained (`_end_transfer`).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpush.errors import LocalProtocolError
from kvpush.protocol._common import WriteBlocks, _Outgoing
from kvpush.protocol.messages import Done


class SenderWrites:
    """The writes of one sender in flight (write id -> transfer id; ids never reused),
    over the sender's transfers, whose `inflight`, `issued_layers` and `done_write` it
    keeps."""

    def __init__(self, num_layers: int, transfers: dict[str, _Outgoing]) -> None:
        self._num_layers = num_layers
        self._transfers = transfers  # the sender's
        self._in_flight: dict[int, str] = {}
        self._next_id = 1

    def __len__(self) -> int:
        """Writes issued whose outcome the data plane has not reported yet."""
        return len(self._in_flight)

    def check_layers(self, tid: str, layers: Iterable[int] | None) -> set[int]:
        """The layers the engine names for `tid` (None: all), checked."""
        if layers is None:
            return set(range(self._num_layers))
        out = set(layers)
        bad = [x for x in out if not isinstance(x, int) or not 0 <= x < self._num_layers]
        if bad:
            raise LocalProtocolError(
                f"transfer {tid!r}: layers {sorted(map(str, bad))} out of range: "
                f"expected 0..{self._num_layers - 1}"
            )
        return out

    @staticmethod
    def mapping_problem(rec: _Outgoing, block_tokens: int) -> str | None:
        """What is wrong with the blocks `rec`'s receiver registered against ours (our
        blocks hold `block_tokens` tokens); None: they map."""
        assert rec.blocks is not None and rec.register is not None
        reg = rec.register
        if reg.sender_block_tokens != block_tokens:
            return (
                f"receiver counted in blocks of {reg.sender_block_tokens} tokens, but the "
                f"sender's blocks hold {block_tokens}: expected the receiver to "
                f"name the sender's block size (its kv_transfer_params)"
            )
        if reg.sender_offset + len(reg.block_ids) != len(rec.blocks):
            return (
                f"receiver registered {len(reg.block_ids)} blocks at offset "
                f"{reg.sender_offset}, but the sender has {len(rec.blocks)} blocks: expected "
                f"offset + registered blocks = {len(rec.blocks)}"
            )
        return None

    def issue(self, rec: _Outgoing, new: set[int]) -> WriteBlocks:
        """The write of `rec`'s layers `new` (ready, not issued yet), now in flight."""
        assert rec.blocks is not None and rec.register is not None and rec.peer is not None
        all_now = not rec.issued_layers and len(new) == self._num_layers
        rec.issued_layers |= new
        wid = self._next_id
        self._next_id += 1
        self._in_flight[wid] = rec.transfer_id
        # The last write carries Done, which the data plane delivers after its bytes: no
        # round trip after the data. Only when no other write of the transfer is in
        # flight, though (Done promises that nothing more will land): else Done goes
        # alone once the last WriteDone is in (`SenderProtocol._maybe_done`).
        done: Done | None = None
        if not rec.inflight and len(rec.issued_layers) == self._num_layers:
            done = Done(rec.transfer_id, len(rec.register.block_ids))
            rec.done_write = wid
        rec.inflight.add(wid)
        off = rec.register.sender_offset
        return WriteBlocks(
            rec.peer,
            rec.transfer_id,
            wid,
            rec.blocks[off:],
            rec.register.block_ids,
            None if all_now else tuple(sorted(new)),
            done,
        )

    def all_written(self, rec: _Outgoing) -> bool:
        """Every layer of `rec` was issued (or there is nothing to write: a full hit)."""
        assert rec.register is not None
        return len(rec.issued_layers) == self._num_layers or not rec.register.block_ids

    def landed(self, write_id: int) -> _Outgoing | None:
        """The data plane reported `write_id`: the transfer it was for, if that is still
        in flight (None: it ended, or the write was forgotten with its peer)."""
        tid = self._in_flight.pop(write_id, None)
        rec = self._transfers.get(tid) if tid is not None else None
        if rec is not None:
            rec.inflight.discard(write_id)
        return rec

    def forget(self, rec: _Outgoing) -> None:
        """`rec`'s peer is gone: its writes' outcomes are not waited for."""
        for wid in rec.inflight:
            self._in_flight.pop(wid, None)

    def clear(self) -> None:
        """The data plane closed: no write can report any more."""
        self._in_flight.clear()
