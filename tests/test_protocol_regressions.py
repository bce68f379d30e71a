"""Three bugs that the protocol checker once missed, pinned by plain unit tests with the
real protocol objects and the fake wire (its clock is `wire.now`, moved by hand).

Each test fails with the bug put back (the mutations of the same names in
tests/protocol_model/mutations.py: `empty-layers`, `lease-first-write`,
`resend-past-deadline`)."""

from __future__ import annotations

from helpers.wire import TIMING, Wire
from kvpush.protocol import Heartbeat, Register, WriteBlocks, decode, encode


def _registers(wire: Wire, src: str) -> list[Register]:
    return [m for s, _, p in wire.queue if s == src and isinstance(m := decode(p), Register)]


def test_a_layerwise_submit_with_no_layer_ready_writes_nothing_until_one_is(wire: Wire) -> None:
    """`submit(..., ready_layers=[])` means no layer computed yet, not all of them."""
    wire.submit("p-1", "t1", [1], layers=[])
    wire.expect("d-1", "t1", "p-1", [5])
    wire.settle()
    assert wire.writes == [] and wire.write_log == []
    assert wire.memory["d-1"][0][5] == b"d-1:L0:B5"
    effects = wire.ends["p-1"].sender.layers_ready(wire.now, "t1", [0])
    writes = [e for e in effects if isinstance(e, WriteBlocks)]
    assert [w.layers for w in writes] == [(0,)]


def test_a_later_layer_is_not_written_once_the_lease_ran_out(wire: Wire) -> None:
    """The lease holds for every write of a transfer, not only its first: a layer that
    becomes ready after the receiver stopped renewing gets no write (the sender asks
    the receiver again first)."""
    wire.submit("p-1", "t1", [1], layers=[])
    wire.expect("d-1", "t1", "p-1", [5])
    wire.settle()
    sender = wire.ends["p-1"].sender
    first = [e for e in sender.layers_ready(wire.now, "t1", [0]) if isinstance(e, WriteBlocks)]
    assert len(first) == 1
    wire.apply("p-1", first)
    wire.complete_write()
    wire.settle()
    # Nothing heard since: the receiver's lease (granted at its last heartbeat) runs out
    # before the engine has layer 1 ready. No tick in between: only `layers_ready` decides.
    wire.now += TIMING.lease_s + 1.0
    later = sender.layers_ready(wire.now, "t1", [1])
    assert [e for e in later if isinstance(e, WriteBlocks)] == [], later


def test_a_receiver_past_its_deadline_sends_no_register_again(wire: Wire) -> None:
    """A receiver that reads a sender's heartbeat before its own tick (it was stopped,
    and catches up) does not re-send a Register past the transfer's deadline: the sender
    may have forgotten the id by then and would write for it."""
    wire.expect("d-1", "t1", "p-1", [5])
    assert len(_registers(wire, "d-1")) == 1
    wire.queue.clear()  # the Register is lost: the sender never lists t1
    engine, incarnation = "engine-p", "1"
    beat = Heartbeat("sender", engine, incarnation, (), sent_at=wire.now + 1.0)
    wire.now += 1.0
    wire.apply("d-1", wire.ends["d-1"].receive_message(wire.now, "p-1", encode(beat)))
    assert len(_registers(wire, "d-1")) == 1  # before the deadline it goes again
    wire.queue.clear()
    wire.now += TIMING.transfer_deadline_s  # past the deadline, no tick yet
    beat = Heartbeat("sender", engine, incarnation, (), sent_at=wire.now)
    wire.apply("d-1", wire.ends["d-1"].receive_message(wire.now, "p-1", encode(beat)))
    assert _registers(wire, "d-1") == []
