"""Bugs put into the current protocol by the model alone, one per promise the checker
keeps, so that it shows it finds each.

Each mutation subclasses the real classes (the protocol's files are never edited) and
changes one behaviour; `MUTATIONS` maps it to the violation `--scope ci` must report.

Issue 9's three bugs, as they were:

* `bug1`: compatibility is not enforced: every field but the protocol version may
  differ (as when the check was opt-in and callers skipped it).
* `bug2`: a sender abandons its transfers with a receiver silent for the liveness
  timeout at once, releasing the blocks while a write may still read them.
* `bug3`: a sender writes for any Register it holds, however old: the lease is never
  found expired where a write is issued, a stale Register is never refused, and one
  kept unread while its sender was being looked up is read however long that took.

Issue 21's, one for each other promise and the two bugs the checker once missed:

* `twice`: the receiver reports a transfer ok but keeps its record (so a duplicate
  Done, or its deadline, ends it again).
* `never-ended`: the receiver forgets a transfer that failed without telling its engine.
* `phantom`: the sender hands back the receiver's block ids, not its own.
* `write-after-end`: the first Register for a sender transfer that ended before any
  came starts it again (it is answered from the tombstone in the real code).
* `wrong-bytes`: the sender writes from its first blocks, forgetting the prefix offset.
* `held-at-rest`: the sender has no timer for a transfer still waiting for its Register.
* `forged-effect`: the receiver takes a Failed or CancelAck from any agent as its
  transfer's sender's.
* `lease-first-write`: the lease is checked only before a transfer's first write, so
  later layer-wise writes skip it.
* `empty-layers`: `SenderWrites.check_layers` treats `[]` (no layer ready yet) as all
  layers ready.
* `resend-past-deadline`: the fix at `_resend_registers` reverted (`now < rec.deadline`
  dropped): a receiver re-sends its Register past its transfer's deadline.

Issue 22's:

* `wrong-receiver`: the sender takes a Register from any receiver the side channel
  admitted, not only from the decode server its engine named at submit.

Issue 38's, one per term of the receiver's fence (`fence_s = lease_s + 2 *
liveness_timeout_s`: the lease, then the margin for writes already issued):

* `fence-short-liveness`: the fence shortened by one liveness interval.
* `fence-lease-only`: the fence is the lease alone, no margin at all.

and two in the checks of who sent a message, which only real peers misbehaving
(`Scope.impostors`) can reach:

* `counterpart`: the receiver takes a Done, Failed or CancelAck for a transfer from any
  sender it looked up, not only from the transfer's own.
* `incarnation`: the sender believes what a receiver's message claims when its engine
  (and address) is the one the side channel vouched for, whatever incarnation it names.

The `refused-call` invariant's:

* `claim-ignored` (issue 39): the sender reads a receiver's heartbeat without the
  transfers it claims, so it gives up a queued request's transfer one claim window after
  submit, however often its living receiver claimed it.
* `early-claim-forgotten` (issue 39): the sender does not remember a claim of a
  transfer its engine has not submitted (`claimed_before_submit` names nothing), so an
  engine that holds a send until a receiver speaks for it gives it up at its window
  while its living receiver claims it.
* `layer-after-end`: the sender refuses (`LocalProtocolError`) a layer made ready for a
  transfer it has ended, as if the engine could know: one whose end the engine has not
  heard yet (a call queued while the process was stopped) is a legal call.

Issue 20's, in the rule that turns a request's parts into its one result
(`kvpush.protocol.parts.RequestParts`), on one side each:

* `receive-first-part`: a decode rank reports a request as soon as the first of its
  parts ended (finished if it finished), without waiting for the others.
* `send-first-part`: the same on a prefill rank, whose engine then reuses the blocks
  another part's write still reads.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import msgspec

from kvpush.config import COMPAT_FIELDS, CompatibilityPolicy
from kvpush.errors import FailureReason, LocalProtocolError

# Each mutation, and the violation kind that `--scope ci` reports for it.
MUTATIONS: dict[str, str] = {
    "bug1": "incompatible-ok",
    "bug2": "source-reused",
    "bug3": "late-write",
    "twice": "twice",
    "never-ended": "never-ended",
    "phantom": "phantom",
    "write-after-end": "write-after-end",
    "wrong-bytes": "wrong-bytes",
    "held-at-rest": "held-at-rest",
    "forged-effect": "forged-effect",
    "lease-first-write": "late-write",
    "empty-layers": "wrong-bytes",
    "resend-past-deadline": "fence-margin",
    "wrong-receiver": "wrong-receiver",
    "receive-first-part": "wrong-bytes",
    "send-first-part": "source-reused",
    "fence-short-liveness": "fence-margin",
    "fence-lease-only": "fence-margin",
    "counterpart": "wrong-bytes",
    "claim-ignored": "claim-lost",
    "early-claim-forgotten": "claim-lost",
    "incarnation": "late-write",
    "layer-after-end": "refused-call",
}
_PARTS_MUTATIONS = {"receive-first-part": "receiver", "send-first-part": "sender"}


def parts_class(parts: ModuleType, mutation: str | None) -> type:
    """The `RequestParts` class the engines of a scope with requests use: the real one,
    or, for a mutation of the rule, one whose given side reports a request at its first
    part's end."""
    real: type = parts.RequestParts
    if mutation not in _PARTS_MUTATIONS:
        return real
    mutated_side = _PARTS_MUTATIONS[mutation]

    class FirstPartReports(real):  # type: ignore[misc,valid-type]
        def part_ended(self, part_id: str, reason: Any, detail: str) -> Any:
            tid = self.transfer_of(part_id)
            if self.side == mutated_side and tid is not None:
                for other in self.open_parts(tid):  # taken as finished, not waited for
                    if other != part_id:
                        super().part_ended(other, None, "")
            return super().part_ended(part_id, reason, detail)

    _register(FirstPartReports)
    return FirstPartReports


def apply(state: ModuleType, mutation: str | None) -> tuple[type, Any]:
    """The PushProtocol class and the compatibility policy to build endpoints with."""
    strict = state.STRICT_COMPATIBILITY
    if mutation is None or mutation in _PARTS_MUTATIONS:
        return state.PushProtocol, strict
    if mutation == "bug1":
        anything = frozenset(COMPAT_FIELDS) - {"protocol_version"}
        policy = CompatibilityPolicy(anything, reason="mutation bug1: the check callers skip")
        return state.PushProtocol, policy
    senders = {
        "bug2": _bug2_sender,
        "bug3": _bug3_sender,
        "phantom": _phantom_sender,
        "write-after-end": _write_after_end_sender,
        "wrong-bytes": _wrong_bytes_sender,
        "held-at-rest": _held_at_rest_sender,
        "lease-first-write": _lease_first_write_sender,
        "empty-layers": _empty_layers_sender,
        "wrong-receiver": _wrong_receiver_sender,
        "incarnation": _incarnation_sender,
        "layer-after-end": _layer_after_end_sender,
        "claim-ignored": _claim_ignored_sender,
        "early-claim-forgotten": _early_claim_forgotten_sender,
    }
    receivers = {
        "twice": _twice_receiver,
        "never-ended": _never_ended_receiver,
        "forged-effect": _forged_effect_receiver,
        "resend-past-deadline": _resend_past_deadline_receiver,
        "fence-short-liveness": _fence_receiver(liveness_intervals=1),
        "fence-lease-only": _fence_receiver(liveness_intervals=0),
        "counterpart": _counterpart_receiver,
    }
    if mutation in senders:
        return _with_sides(state, sender_class=senders[mutation](state)), strict
    if mutation in receivers:
        return _with_sides(state, receiver_class=receivers[mutation](state)), strict
    raise ValueError(f"unknown mutation {mutation!r}: expected one of {sorted(MUTATIONS)}")


def _with_sides(
    state: ModuleType, sender_class: type | None = None, receiver_class: type | None = None
) -> type:
    class MutantPushProtocol(state.PushProtocol):  # type: ignore[name-defined,misc]
        def __init__(self, identity: Any, timing: Any, num_layers: int, compat: Any, **kw: Any):
            super().__init__(identity, timing, num_layers, compat, **kw)
            policy = kw.get("compatibility", state.STRICT_COMPATIBILITY)
            if sender_class is not None:
                self.sender = sender_class(
                    identity, timing, num_layers, compat, compatibility=policy
                )
            if receiver_class is not None:
                self.receiver = receiver_class(identity, timing, compat, compatibility=policy)

    mutant = sender_class or receiver_class
    assert mutant is not None
    MutantPushProtocol.__name__ = f"MutantPushProtocol_{mutant.__name__}"
    _register(MutantPushProtocol)
    return MutantPushProtocol


def _bug2_sender(state: ModuleType) -> type:
    class Bug2Sender(state.SenderProtocol):  # type: ignore[name-defined,misc]
        def tick(self, now: float) -> list[Any]:
            out: list[Any] = []
            timeout = self._timing.liveness_timeout_s
            for p in list(self._peers.values()):
                live = [r for r in self._transfers.values() if r.peer == p.agent]
                if live and now - p.last_heard >= timeout:
                    detail = f"receiver {p.agent} silent (mutation bug2: abandoned at once)"
                    out += self.peer_lost(now, p.agent, FailureReason.PEER_TIMEOUT, detail)
            return out + list(super().tick(now))

    _register(Bug2Sender)
    return Bug2Sender


def _bug3_sender(state: ModuleType) -> type:
    class Bug3Leases(_module(state, "leases").SenderLeases):  # type: ignore[misc]
        def stale_register(self, now: float, peer: str, granted: float) -> str | None:
            return None

    class Bug3Gate(_module(state, "identity").SenderGate):  # type: ignore[misc]
        def _too_old_to_read(self, now: float, arrived: float) -> bool:
            return False  # a Register kept unread during the handshake back, however old

    class Bug3Sender(state.SenderProtocol):  # type: ignore[name-defined,misc]
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self._leases = _leases(self, Bug3Leases)
            self._gate = _gate(self, Bug3Gate)

        def _issue_writes(self, now: float, rec: Any) -> list[Any]:
            # As if every lease held at the moment a write is issued.
            kept = rec.lease_until_theirs
            rec.lease_until_theirs = float("inf")
            try:
                return list(super()._issue_writes(now, rec))
            finally:
                rec.lease_until_theirs = kept

    for cls in (Bug3Leases, Bug3Gate, Bug3Sender):
        _register(cls)
    return Bug3Sender


def _module(state: ModuleType, name: str) -> ModuleType:
    """The protocol's module `name`, of the same revision as `state`."""
    import sys

    return sys.modules[state.__name__.rsplit(".", 1)[0] + "." + name]


def _gate(sender: Any, cls: type) -> Any:
    """A mutated gate for a sender just built, over its tables (as its own was)."""
    return cls(sender._peers, sender._timing, sender._compat)


def _leases(sender: Any, cls: type) -> Any:
    """Mutated leases for a sender just built, over its tables (as its own were)."""
    return cls(sender._me, sender._timing, sender._transfers, sender._peers, sender._tombstones)


def _twice_receiver(state: ModuleType) -> type:
    class TwiceReceiver(state.ReceiverProtocol):  # type: ignore[name-defined,misc]
        def _end(self, now: float, rec: Any, reason: Any, detail: str) -> list[Any]:
            out = list(super()._end(now, rec, reason, detail))
            if reason is None:
                self._transfers[rec.transfer_id] = rec  # the record stays
            return out

    _register(TwiceReceiver)
    return TwiceReceiver


def _never_ended_receiver(state: ModuleType) -> type:
    class NeverEndedReceiver(state.ReceiverProtocol):  # type: ignore[name-defined,misc]
        def _end(self, now: float, rec: Any, reason: Any, detail: str) -> list[Any]:
            out = list(super()._end(now, rec, reason, detail))
            return out if reason is None else []  # a failure forgotten, not reported

    _register(NeverEndedReceiver)
    return NeverEndedReceiver


def _forged_effect_receiver(state: ModuleType) -> type:
    class ForgedEffectReceiver(state.ReceiverProtocol):  # type: ignore[name-defined,misc]
        def handle(self, now: float, peer: str, message: Any) -> list[Any]:
            rec = self._transfers.get(getattr(message, "transfer_id", None))
            final = type(message).__name__ in ("Failed", "CancelAck")
            if final and rec is not None and rec.peer is not None and peer != rec.peer:
                peer = rec.peer  # whoever sent it, taken as the transfer's sender
            return list(super().handle(now, peer, message))

    _register(ForgedEffectReceiver)
    return ForgedEffectReceiver


def _resend_past_deadline_receiver(state: ModuleType) -> type:
    waiting = state.ReceiverState.WAITING
    send = state.SendMessage

    class ResendPastDeadlineReceiver(state.ReceiverProtocol):  # type: ignore[name-defined,misc]
        def _resend_registers(self, now: float, peer: str) -> list[Any]:
            # `_resend_registers` as it was before `now < rec.deadline` was added.
            p = self._peers.get(peer)
            if p is None:
                return []
            known = p.known_by_them or frozenset()
            out: list[Any] = []
            for rec in self._transfers.values():
                if (
                    rec.peer == peer
                    and rec.register is not None
                    and rec.state is waiting
                    and rec.transfer_id not in known
                    and now >= rec.register_sent_at + self._timing.heartbeat_interval_s
                ):
                    rec.register_sent_at = now
                    rec.register = msgspec.structs.replace(rec.register, sent_at=now)
                    out.append(send(peer, rec.register))
            return out

    _register(ResendPastDeadlineReceiver)
    return ResendPastDeadlineReceiver


def _fence_receiver(liveness_intervals: int) -> Any:
    """A receiver whose fence is the lease plus `liveness_intervals` liveness timeouts
    (the protocol's is two: `fence_s = lease_s + 2 * liveness_timeout_s`)."""

    def build(state: ModuleType) -> type:
        class ShortFenceReceiver(state.ReceiverProtocol):  # type: ignore[name-defined,misc]
            @property
            def fence_s(self) -> float:
                t = self._timing
                return float(t.lease_s + liveness_intervals * t.liveness_timeout_s)

        ShortFenceReceiver.__name__ = f"ShortFenceReceiver{liveness_intervals}"
        _register(ShortFenceReceiver)
        return ShortFenceReceiver

    return build


def _counterpart_receiver(state: ModuleType) -> type:
    class CounterpartReceiver(state.ReceiverProtocol):  # type: ignore[name-defined,misc]
        def handle(self, now: float, peer: str, message: Any) -> list[Any]:
            rec = self._transfers.get(getattr(message, "transfer_id", None))
            final = type(message).__name__ in ("Done", "Failed", "CancelAck")
            if final and rec is not None and rec.peer is not None and peer in self._peers:
                peer = rec.peer  # any sender we looked up, taken as the transfer's own
            return list(super().handle(now, peer, message))

    _register(CounterpartReceiver)
    return CounterpartReceiver


def _incarnation_sender(state: ModuleType) -> type:
    identity = _module(state, "identity")

    class IncarnationGate(identity.SenderGate):  # type: ignore[misc]
        def admit(self, now: float, peer: str, message: Any) -> Any:
            p = self._peers.get(peer)
            if p is not None and p.verified and _same_engine(p, message):
                return identity.ADMIT  # its engine (and address): believed, whatever incarnation
            return super().admit(now, peer, message)

    class IncarnationSender(state.SenderProtocol):  # type: ignore[name-defined,misc]
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self._gate = _gate(self, IncarnationGate)

    _register(IncarnationGate)
    _register(IncarnationSender)
    return IncarnationSender


def _same_engine(p: Any, message: Any) -> bool:
    """What a receiver's message claims, compared with its peer record as the gate does,
    but for the incarnation."""
    match type(message).__name__:
        case "Heartbeat":
            return bool(message.engine_id == p.engine_id)
        case "Register":
            where = (message.receiver_host, message.receiver_port, message.receiver_rank)
            address = p.address
            ours = None if address is None else (address.host, address.port, address.rank)
            return bool(message.receiver_engine_id == p.engine_id and where == ours)
    return False


def _layer_after_end_sender(state: ModuleType) -> type:
    class LayerAfterEndSender(state.SenderProtocol):  # type: ignore[name-defined,misc]
        def layers_ready(self, now: float, transfer_id: str, layers: Any) -> list[Any]:
            if transfer_id not in self._transfers and transfer_id in self._tombstones:
                raise LocalProtocolError(f"layers_ready: transfer {transfer_id!r} has ended")
            return list(super().layers_ready(now, transfer_id, layers))

    _register(LayerAfterEndSender)
    return LayerAfterEndSender


def _claim_ignored_sender(state: ModuleType) -> type:
    class ClaimIgnoredSender(state.SenderProtocol):  # type: ignore[name-defined,misc]
        def _on_heartbeat(self, now: float, peer: str, hb: Any) -> list[Any]:
            return list(super()._on_heartbeat(now, peer, msgspec.structs.replace(hb, claimed=())))

    _register(ClaimIgnoredSender)
    return ClaimIgnoredSender


def _early_claim_forgotten_sender(state: ModuleType) -> type:
    class EarlyClaimForgottenSender(state.SenderProtocol):  # type: ignore[name-defined,misc]
        def claimed_before_submit(self, prefixes: Any) -> list[str]:
            return []

    _register(EarlyClaimForgottenSender)
    return EarlyClaimForgottenSender


def _phantom_sender(state: ModuleType) -> type:
    class PhantomSender(state.SenderProtocol):  # type: ignore[name-defined,misc]
        def _end_transfer(self, now: float, rec: Any, *args: Any, **kw: Any) -> list[Any]:
            out = list(super()._end_transfer(now, rec, *args, **kw))
            if rec.register is None:
                return out
            theirs = tuple(rec.register.block_ids)
            return [
                dataclasses.replace(e, blocks=theirs) if isinstance(e, state.TransferEnded) else e
                for e in out
            ]

    _register(PhantomSender)
    return PhantomSender


def _write_after_end_sender(state: ModuleType) -> type:
    awaiting = state.SenderState.AWAITING_REGISTER

    class WriteAfterEndSender(state.SenderProtocol):  # type: ignore[name-defined,misc]
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self.unregistered_ends: dict[str, Any] = {}

        def _end_transfer(self, now: float, rec: Any, *args: Any, **kw: Any) -> list[Any]:
            if rec.register is None and rec.blocks is not None:
                self.unregistered_ends[rec.transfer_id] = rec
            return list(super()._end_transfer(now, rec, *args, **kw))

        def _on_register(self, now: float, peer: str, msg: Any) -> list[Any]:
            tid = msg.transfer_id
            tomb = self._tombstones.get(tid)
            rec = self.unregistered_ends.pop(tid, None)
            if tomb is not None and tomb.peer is None and rec is not None:
                # The first Register for a transfer that ended before any came starts
                # it again, instead of being answered from its tombstone.
                self._tombstones.unbury(tid)
                rec.state = awaiting
                rec.deadline = now + self._timing.transfer_deadline_s
                self._transfers[tid] = rec
            return list(super()._on_register(now, peer, msg))

    _register(WriteAfterEndSender)
    return WriteAfterEndSender


def _wrong_bytes_sender(state: ModuleType) -> type:
    class WrongBytesSender(state.SenderProtocol):  # type: ignore[name-defined,misc]
        def _issue_writes(self, now: float, rec: Any) -> list[Any]:
            out = list(super()._issue_writes(now, rec))
            return [
                dataclasses.replace(e, our_blocks=rec.blocks[: len(e.their_blocks)])
                if isinstance(e, state.WriteBlocks)
                else e
                for e in out
            ]

    _register(WrongBytesSender)
    return WrongBytesSender


def _held_at_rest_sender(state: ModuleType) -> type:
    awaiting = state.SenderState.AWAITING_REGISTER

    class HeldAtRestSender(state.SenderProtocol):  # type: ignore[name-defined,misc]
        def next_deadline(self) -> float | None:
            if all(r.state is awaiting for r in self._transfers.values()):
                return None  # a transfer waiting for its Register has no timer
            return super().next_deadline()  # type: ignore[no-any-return]

    _register(HeldAtRestSender)
    return HeldAtRestSender


def _lease_first_write_sender(state: ModuleType) -> type:
    class LeaseFirstWriteSender(state.SenderProtocol):  # type: ignore[name-defined,misc]
        def _issue_writes(self, now: float, rec: Any) -> list[Any]:
            if not rec.issued_layers:
                return list(super()._issue_writes(now, rec))
            # A later layer-wise write: as if the lease held.
            kept = rec.lease_until_theirs
            rec.lease_until_theirs = float("inf")
            try:
                return list(super()._issue_writes(now, rec))
            finally:
                rec.lease_until_theirs = kept

        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self._leases = _leases(self, LeaseFirstWriteLeases)

    class LeaseFirstWriteLeases(_module(state, "leases").SenderLeases):  # type: ignore[misc]
        def expired(self, now: float, rec: Any) -> bool:
            return not rec.issued_layers and super().expired(now, rec)

    _register(LeaseFirstWriteLeases)
    _register(LeaseFirstWriteSender)
    return LeaseFirstWriteSender


def _empty_layers_sender(state: ModuleType) -> type:
    class EmptyLayersWrites(_module(state, "writes").SenderWrites):  # type: ignore[misc]
        def check_layers(self, tid: str, layers: Any) -> set[int]:
            if layers is not None:
                layers = list(layers)
                if not layers:
                    layers = None  # [] taken as "all ready"
            return super().check_layers(tid, layers)  # type: ignore[no-any-return]

    class EmptyLayersSender(state.SenderProtocol):  # type: ignore[name-defined,misc]
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self._writes = EmptyLayersWrites(self._writes._num_layers, self._transfers)

    _register(EmptyLayersWrites)
    _register(EmptyLayersSender)
    return EmptyLayersSender


def _register(cls: type) -> None:
    """Make the class findable by pickle (the checker copies states by pickling)."""
    import sys

    module = sys.modules[__name__]
    cls.__module__ = __name__
    cls.__qualname__ = cls.__name__
    setattr(module, cls.__name__, cls)


def _wrong_receiver_sender(state: ModuleType) -> type:
    class WrongReceiverChoice(_module(state, "choice").ReceiverChoice):  # type: ignore[misc]
        def is_for(self, rec: Any, peer: str) -> bool:
            return True  # any receiver the side channel admitted may take the transfer

    class WrongReceiverSender(state.SenderProtocol):  # type: ignore[name-defined,misc]
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self._choice = WrongReceiverChoice(self._timing, self._peers)

    _register(WrongReceiverChoice)
    _register(WrongReceiverSender)
    return WrongReceiverSender
