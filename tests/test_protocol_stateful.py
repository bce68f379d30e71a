"""Hypothesis drives a sender and a receiver through random interleavings.

Engine events (submit, register, layer by layer, reject, aborts on both sides), message
drops, duplicates and reorders, write failures, peer deaths and restarts, and clock jumps.
After every step: no transfer is reported twice on one side (the `Wire` asserts it at the
report), no write is issued after its sender ended and no write lands in a receiver block
that was released (the `Wire` asserts both), nothing is held past its bound, and a
receiver that finished holds the sender's bytes. The engines reuse memory as real ones
do (`ReusingWire`): a block handed back is overwritten at once, and each submit writes
content unique to its transfer, so a write that lands late from a block since reused by
the next transfer copies that transfer's bytes and the content check catches it; a sender
that hands back blocks a write still reads fails at once. Either side may stall (SIGSTOP)
across its timers. At the end, after enough quiet time, every transfer handed to a live
endpoint has been reported exactly once and no block is held.

CI runs a fixed-seed, derandomized batch. A longer run:
    KVPUSH_HYPOTHESIS_EXAMPLES=5000 .venv/bin/pytest tests/test_protocol_stateful.py
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from helpers.wire import NUM_BLOCKS, TIMING, Wire
from kvpush.errors import FailureReason, RemoteProtocolError
from kvpush.protocol import Effect, SenderState, TransferEnded

EXAMPLES = int(os.environ.get("KVPUSH_HYPOTHESIS_EXAMPLES", "200"))
# Writes finish (land or fail) and messages arrive within these bounds, or are lost:
# the model's assumption about the data plane (see kvpush.protocol.state).
WRITE_BOUND_S = 0.5
MESSAGE_BOUND_S = 0.5
MAX_JUMP_S = 10.0


class ReusingWire(Wire):
    """The `Wire`, whose sender engine computes new content into a block for every
    transfer it submits: a block reused by the next transfer never holds bytes that
    would pass for the previous transfer's. The data plane copies at landing time (the
    `Wire` does), so a late write from reused memory lands the wrong bytes."""

    def submit(
        self, p: str, tid: str, blocks: Sequence[int], layers: Sequence[int] | None = None
    ) -> None:
        # Before the protocol sees the submit (a write may be issued at once).
        for layer, memory in enumerate(self.memory[p]):
            for b in blocks:
                memory[b] = self.content(p, layer, b, tid)
        self.submitted[(p, tid)] = tuple(blocks)
        self.apply(p, self.ends[p].sender.submit(self.now, tid, blocks, layers))

    def apply(self, src: str, effects: Sequence[Effect]) -> None:
        for eff in effects:
            if isinstance(eff, TransferEnded) and eff.side == "sender":
                # The engine overwrites them now: no write may still read them (a write
                # to a dead process lands nowhere, so what it reads does not matter).
                reading = [
                    w.write.write_id
                    for w in self.writes
                    if w.src == src
                    and w.write.peer not in self.dead
                    and set(w.write.our_blocks) & set(eff.blocks)
                ]
                assert not reading, (
                    f"{src} hands back {eff.blocks} of {eff.transfer_id} while its writes "
                    f"{reading} still read them"
                )
            super().apply(src, [eff])

    @staticmethod
    def content(p: str, layer: int, block: int, tid: str) -> bytes:
        return f"{p}:L{layer}:B{block}:{tid}".encode()

    def check_content(self, d: str, tid: str, blocks: tuple[int, ...]) -> None:
        p, offset = self.expected[(d, tid)]
        sent = self.submitted[(p, tid)]
        for layer in range(self.num_layers):
            for i, b in enumerate(blocks):
                want = self.content(p, layer, sent[offset + i], tid)
                got = self.memory[d][layer][b]
                assert got == want, f"{tid}: block {b} layer {layer} holds {got!r}, not {want!r}"


class Plan:
    def __init__(self, tid: str, n: int, offset: int, layerwise: bool) -> None:
        self.tid = tid
        self.n = n
        self.offset = offset
        self.layerwise = layerwise
        self.p: str | None = None  # the sender agent it was submitted to
        self.d: str | None = None  # the receiver agent it was registered on
        self.submitted_at = 0.0
        self.expected_at = 0.0
        self.layers_left = [0, 1]


class PushProtocolMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.wire = ReusingWire()
        self.p = "p-1"
        self.d = "d-1"
        self.wire.add(self.p, "engine-p")
        self.wire.add(self.d, "engine-d")
        self.plans: list[Plan] = []
        self.restarts = 0
        self.seen: dict[tuple[str, str, bytes], float] = {}
        self.stalled_s = 0.0  # stalls stretch every bound by their length

    # ----- helpers

    def free_blocks(self, agent: str, side: str, n: int) -> list[int] | None:
        if side == "receiver":
            used = set(self.wire.owner[agent])
        else:
            held = self.wire.ends[agent].sender.held_blocks().values()
            used = {b for bs in held for b in bs}
        free = [b for b in range(NUM_BLOCKS) if b not in used]
        return free[:n] if len(free) >= n else None

    def reported(self, agent: str, side: str, tid: str) -> bool:
        return any(r.transfer_id == tid and r.side == side for r in self.wire.results[agent])

    # ----- engine events

    @precondition(lambda self: len(self.plans) < 8)
    @rule(
        n=st.integers(1, 3),
        offset=st.sampled_from([0, 0, 0, 1, 2, 3]),
        layerwise=st.booleans(),
        start=st.sampled_from(["both", "submit", "expect", "neither"]),
    )
    def new_transfer(self, n: int, offset: int, layerwise: bool, start: str) -> None:
        plan = Plan(f"t{len(self.plans)}", n, min(offset, n), layerwise)
        self.plans.append(plan)
        if start in ("both", "submit"):
            self.do_submit(plan)
        if start in ("both", "expect"):
            self.do_expect(plan)

    def do_submit(self, plan: Plan) -> None:
        blocks = self.free_blocks(self.p, "sender", plan.n)
        if blocks is None:
            return
        plan.p, plan.submitted_at = self.p, self.wire.now
        self.wire.submit(self.p, plan.tid, blocks, layers=[] if plan.layerwise else None)

    def do_expect(self, plan: Plan) -> None:
        blocks = self.free_blocks(self.d, "receiver", plan.n - plan.offset)
        if blocks is None:
            return
        plan.d, plan.expected_at = self.d, self.wire.now
        self.wire.expect(self.d, plan.tid, self.p, blocks, plan.offset)

    def pick(self, data: st.DataObject) -> int:
        """Mostly a transfer still in flight somewhere: events on ended ones teach little."""
        live = [
            i
            for i, plan in enumerate(self.plans)
            if not (plan.p and self.reported(plan.p, "sender", plan.tid))
            or not (plan.d and self.reported(plan.d, "receiver", plan.tid))
        ]
        pool = live or list(range(len(self.plans)))
        return pool[data.draw(st.integers(0, len(pool) - 1), label="transfer")]

    @precondition(lambda self: bool(self.plans))
    @rule(data=st.data())
    def submit(self, data: st.DataObject) -> None:
        plan = self.plans[self.pick(data)]
        if plan.p is None:
            self.do_submit(plan)

    @precondition(lambda self: bool(self.plans))
    @rule(data=st.data())
    def expect(self, data: st.DataObject) -> None:
        plan = self.plans[self.pick(data)]
        if plan.d is None:
            self.do_expect(plan)

    @precondition(lambda self: bool(self.plans))
    @rule(data=st.data())
    def reject(self, data: st.DataObject) -> None:
        i = self.pick(data)
        if self.plans[i].d is not None or data.draw(st.integers(0, 3)):  # rarely
            return
        plan = self.plans[i]
        plan.d = ""  # rejected: nothing registered
        effects = self.wire.ends[self.d].receiver.reject(
            self.wire.now, plan.tid, self.wire.address_of[self.p], "no"
        )
        self.wire.apply(self.d, effects)

    @precondition(lambda self: bool(self.plans))
    @rule(data=st.data())
    def layer_ready(self, data: st.DataObject) -> None:
        plan = self.plans[self.pick(data)]
        if plan.p is None or plan.p in self.wire.dead or not plan.layers_left:
            return
        layer = plan.layers_left.pop(0)
        sender = self.wire.ends[plan.p].sender
        self.wire.apply(plan.p, sender.layers_ready(self.wire.now, plan.tid, [layer]))

    @precondition(lambda self: bool(self.plans))
    @rule(data=st.data(), on_sender=st.booleans())
    def abort(self, data: st.DataObject, on_sender: bool) -> None:
        plan = self.plans[self.pick(data)]
        agent = plan.p if on_sender else plan.d
        if not agent or agent in self.wire.dead:
            return
        proto = self.wire.ends[agent]
        machine = proto.sender if on_sender else proto.receiver
        self.wire.apply(agent, machine.abort(self.wire.now, plan.tid))

    # ----- the network

    @precondition(lambda self: bool(self.wire.queue))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        # Any message, not only the oldest: that is a reorder.
        i = data.draw(st.integers(0, len(self.wire.queue) - 1))
        self.wire.deliver(i)

    @precondition(lambda self: bool(self.wire.queue))
    @rule()
    def deliver_all(self) -> None:
        while self.wire.queue:
            self.wire.deliver()

    @precondition(lambda self: bool(self.wire.queue))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        self.wire.queue.pop(data.draw(st.integers(0, len(self.wire.queue) - 1)))

    @precondition(lambda self: bool(self.wire.queue))
    @rule(data=st.data())
    def duplicate(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.wire.queue) - 1))
        self.wire.queue.append(self.wire.queue[i])

    @precondition(lambda self: bool(self.wire.writes))
    @rule(data=st.data(), ok=st.booleans())
    def finish_write(self, data: st.DataObject, ok: bool) -> None:
        self.wire.complete_write(data.draw(st.integers(0, len(self.wire.writes) - 1)), ok)

    @rule(dt=st.sampled_from([0.1, 0.2, 0.5, 1.0, 3.0, MAX_JUMP_S]), network_up=st.booleans())
    def advance(self, dt: float, network_up: bool) -> None:
        # The model of the data plane: a write finishes (lands or fails) within
        # WRITE_BOUND_S of being issued, and a message arrives within MESSAGE_BOUND_S or
        # is lost. Time moves in steps no longer than those bounds.
        w = self.wire
        target = w.now + dt
        while w.now < target:
            step = min(WRITE_BOUND_S, target - w.now)
            for i in reversed(range(len(w.writes))):
                if w.now + step - w.writes[i].issued_at >= WRITE_BOUND_S:
                    w.complete_write(i)
            self.note_messages()
            w.queue = [m for m in w.queue if w.now + step - self.seen[m] < MESSAGE_BOUND_S]
            w.advance(step, settle=False)
            while network_up and w.queue:
                w.deliver()

    @precondition(lambda self: self.stalled_s < 30)
    @rule(sender=st.booleans(), dt=st.sampled_from([1.0, 4.0, 12.0]))
    def stall(self, sender: bool, dt: float) -> None:
        """One endpoint stops (SIGSTOP) for `dt`: it neither ticks nor reads, and no
        write lands or fails meanwhile; the other runs and handles what it gets."""
        w = self.wire
        runner = self.d if sender else self.p
        if runner in w.dead:
            return
        self.note_messages()
        w.run_only(runner, dt)
        self.stalled_s += dt
        # What waited for the stopped one is still there: it is fresh mail, not lost.
        self.seen = {m: w.now for m in self.seen}

    def note_messages(self) -> None:
        for m in self.wire.queue:
            self.seen.setdefault(m, self.wire.now)

    @rule(to_sender=st.booleans())
    def garbage(self, to_sender: bool) -> None:
        src, dst = (self.d, self.p) if to_sender else (self.p, self.d)
        if dst in self.wire.dead:
            return
        proto = self.wire.ends[dst]
        with pytest.raises(RemoteProtocolError):
            proto.receive_message(self.wire.now, src, b"\x93garbage")
        self.wire.apply(dst, proto.peer_misbehaved(self.wire.now, src, "garbage"))

    # ----- deaths and restarts

    @precondition(lambda self: self.restarts < 2)
    @rule(sender=st.booleans(), announce=st.booleans())
    def restart(self, sender: bool, announce: bool) -> None:
        self.restarts += 1
        old = self.p if sender else self.d
        self.wire.kill(old)
        if announce:  # the data plane saw it go (else: only silence tells)
            survivor = self.d if sender else self.p
            effects = self.wire.ends[survivor].peer_lost(
                self.wire.now, old, FailureReason.PEER_GONE, "killed"
            )
            self.wire.apply(survivor, effects)
        new = f"{old[0]}-{int(old[2:]) + 1}"
        self.wire.add(new, "engine-p" if sender else "engine-d", incarnation=new)
        if sender:
            self.p = new
        else:
            self.d = new

    # ----- invariants

    @invariant()
    def age_messages(self) -> None:
        if hasattr(self, "wire"):
            self.note_messages()

    @invariant()
    def bounded(self) -> None:
        if not hasattr(self, "wire"):
            return
        w, t = self.wire, TIMING
        slack = MAX_JUMP_S + WRITE_BOUND_S + self.stalled_s
        for plan in self.plans:
            if plan.p and plan.p not in w.dead and not self.reported(plan.p, "sender", plan.tid):
                bound = plan.submitted_at + t.transfer_deadline_s + t.liveness_timeout_s
                assert w.now <= bound + slack, f"sender holds {plan.tid} past its bound"
            if plan.d and plan.d not in w.dead and not self.reported(plan.d, "receiver", plan.tid):
                fence = w.ends[plan.d].receiver.fence_s
                bound = plan.expected_at + t.transfer_deadline_s + fence
                assert w.now <= bound + slack, f"receiver holds {plan.tid} past its bound"

    @invariant()
    def nothing_held_past_its_lease(self) -> None:
        """A sender writing for a receiver stops within its lease (plus the drain)."""
        if not hasattr(self, "wire"):
            return
        w, t = self.wire, TIMING
        for agent, proto in w.ends.items():
            if agent in w.dead:
                continue
            for tid, state in proto.sender.states().items():
                if state in (SenderState.WRITING, SenderState.ENDING):
                    held_for = w.now - w.renewed[(agent, tid)]
                    bound = t.lease_s + t.liveness_timeout_s + WRITE_BOUND_S + self.stalled_s
                    assert held_for <= bound, (
                        f"{agent} holds {tid} {held_for:.1f}s after its last lease renewal"
                    )

    @invariant()
    def held_blocks_belong_to_unreported_transfers(self) -> None:
        if not hasattr(self, "wire"):
            return
        for agent, proto in self.wire.ends.items():
            if agent in self.wire.dead:
                continue
            for tid in proto.sender.held_blocks():
                assert not self.reported(agent, "sender", tid)
            for tid in proto.receiver.held_blocks():
                assert not self.reported(agent, "receiver", tid)

    def teardown(self) -> None:
        if not hasattr(self, "wire"):
            return
        w, t = self.wire, TIMING
        # Quiet time: a full deadline plus every fence, delivering everything.
        w.settle()
        quiet = t.transfer_deadline_s + w.ends[self.d].receiver.fence_s + t.lease_s + 2
        w.run_for(quiet, step=WRITE_BOUND_S)
        for plan in self.plans:
            for agent, side in ((plan.p, "sender"), (plan.d, "receiver")):
                if agent and agent not in w.dead:
                    rs = [r for r in w.results[agent] if r.transfer_id == plan.tid]
                    rs = [r for r in rs if r.side == side]
                    assert len(rs) == 1, f"{plan.tid} on {side} {agent}: {rs}"
                    if side == "sender" and rs[0].reason is FailureReason.REJECTED:
                        assert plan.d == ""
        for agent, proto in w.ends.items():
            if agent not in w.dead:
                assert proto.sender.held_blocks() == {}, agent
                assert proto.receiver.held_blocks() == {}, agent
                assert not proto.in_flight()


def test_push_protocol_stateful() -> None:
    run_state_machine_as_test(
        PushProtocolMachine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=50,
            derandomize=True,
            deadline=None,
            database=None,
            print_blob=True,
        ),
    )
