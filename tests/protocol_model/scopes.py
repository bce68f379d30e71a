"""The scopes the checker explores: small enough to finish, rich enough to see bugs."""

from __future__ import annotations

import dataclasses

from kvpush.config import TimingConfig

from .model import Budget, Scope, TransferSpec

T = TransferSpec

SMOKE = Scope(
    "smoke",
    transfers=(T("T1", "S1", 1),),
    budget=Budget(),
    max_depth=30,
)
SMOKE_PROMPT = Scope(
    "smoke-prompt",
    transfers=(T("T1", "S1", 1),),
    budget=Budget(),
    prompt=True,
    max_depth=60,
)

# The bug 2 as reported: a receiver merely slow (stalled), a write in flight.
BUG2 = Scope(
    "bug2",
    transfers=(T("T1", "S1", 1),),
    budget=Budget(stalls=1),
    stallable=("receiver",),
    prompt=True,
    max_depth=30,
)
# The bug 3: a sender stalled past liveness + fence, its Register waiting.
BUG3 = Scope(
    "bug3",
    transfers=(T("T1", "S1", 1),),
    budget=Budget(stalls=1),
    prompt=True,
    stall_mid_write=False,
    max_depth=30,
    # Short timers, so the stall past liveness + fence takes few steps.
    timing=TimingConfig(
        heartbeat_interval_s=1.0, liveness_timeout_s=1.5, lease_s=1.0, transfer_deadline_s=3.0
    ),
)

# Issue 9's bug 1: caches that differ only in dtype.
BUG1 = Scope(
    "bug1",
    transfers=(T("T1", "S1", 1),),
    budget=Budget(),
    prompt=True,
    geometry=(("R", (("dtype", "float16"),)),),
    max_depth=40,
)


def _ok(tid: str, after: str = "") -> tuple[str, str]:
    """The goals "`tid` ends ok on both sides" (on a path with `after`'s fault)."""
    return (f"{tid} ok on the sender{after}", f"{tid} ok on the receiver{after}")


# T1's shortest way to its first write: both handshakes, the heartbeat round trip
# whose echo bounds the receiver's clock (a layer-wise T1 then waits for its layers).
_T1_HANDSHAKES = (
    "expect T1",
    "submit T1",
    "handshake_ok R#1 S1",
    "deliver Register T1",
    "handshake_ok S1#1 R",
    "deliver Heartbeat from the receiver",
    "deliver Heartbeat from the sender",
    "deliver Heartbeat from the receiver",
)
# ... and its bytes landing (its Done on its way, the write not reported yet).
_T1_TO_LANDING = (*_T1_HANDSHAKES, "land write 1 of S1#1")


# Both parts of a request of two (`two-parts`) as far as their first writes.
_TWO_PARTS_HANDSHAKES = (
    "expect T1",  # and T2: an engine starts the parts of a request in one call
    "submit T1",
    "submit T2",
    "handshake_ok R#1 S1",
    "deliver Heartbeat from the receiver [T1]",
    "deliver Register T1",
    "handshake_ok R#1 S1.1",
    "deliver Heartbeat from the receiver [T2]",
    "deliver Register T2",
    "handshake_ok S1#1 R",
    "deliver Heartbeat from the sender [T1]",
    "handshake_ok S1.1#1 R",
    "deliver Heartbeat from the sender [T2]",
)

# ... and of `one-to-two` (the sender looks up R first: "handshake_ok S1#1 R" is it).
_ONE_TO_TWO_HANDSHAKES = (
    "expect T1",
    "submit T1",  # and T2
    "expect T2",
    "handshake_ok R#1 S1",
    "deliver Heartbeat from the receiver [T1]",
    "deliver Register T1",
    "handshake_ok R.1#1 S1",
    "deliver Heartbeat from the receiver [T2]",
    "deliver Register T2",
    "handshake_ok S1#1 R",
    "deliver Heartbeat from the sender [T1]",
    "handshake_ok S1#1 R.1",
    "deliver Heartbeat from the sender [T2]",
)


def _ci(name: str, transfers: tuple[TransferSpec, ...], budget: Budget, **kw: object) -> Scope:
    opts: dict[str, object] = {"prompt": True, "max_depth": 80}
    opts.update(kw)
    return Scope(name, transfers=transfers, budget=budget, **opts)  # type: ignore[arg-type]


# The CI scopes: each every interleaving up to its depth (or all, where it completes).
CI = (
    _ci(
        "one", (T("T1", "S1", 1),), Budget(), max_depth=16, goals=_ok("T1"), scenario=("T1 lands",)
    ),
    _ci(
        "layerwise-prefix",
        (T("T1", "S1", 2, offset=1, layerwise=True),),
        Budget(),
        max_depth=14,
        goals=("T1 lands layer-wise", *_ok("T1")),
        scenario=("T1 lands layer-wise",),
    ),
    _ci(
        "full-hit-then-reuse",
        (T("T1", "S1", 1, offset=1), T("T2", "S1", 1)),
        Budget(),
        sender_blocks=1,
        receiver_blocks=1,
        # From both sides' first step: T2 lands only 11 steps in, past the depth that
        # fits in CI from the very start.
        script=("expect T1", "submit T1"),
        max_depth=10,
        goals=(*_ok("T1"), "T2 lands", "T2 ok on the receiver"),
        scenario=("T2 lands",),
        room=1,
    ),
    _ci(
        "lossy",
        (T("T1", "S1", 1),),
        Budget(drops=1, dups=1),
        max_depth=10,
        goals=("T1 ok on the receiver after a drop", "T1 ok on the receiver after a dup"),
        scenario=("drop Register T1 (blocks (0))",),
    ),
    _ci(
        "failures",
        (T("T1", "S1", 1),),
        Budget(failures=1),
        max_depth=14,
        goals=(
            "T1 write_error on the sender",
            "T1 write_error on the receiver",
            "T1 handshake_failed on the receiver",
        ),
        scenario=("T1 write_error on the sender",),
    ),
    _ci(
        "aborts",
        (T("T1", "S1", 1),),
        Budget(aborts=1),
        max_depth=11,
        goals=("T1 cancelled on the sender", "T1 cancelled on the receiver"),
        scenario=("T1 lands while the receiver fences after a abort",),
    ),
    _ci(
        "restart",
        (T("T1", "S1", 1),),
        Budget(restarts=1),
        # From the first engine calls: from the very start, a restart with a write in
        # flight came only at the depth bound, with nothing explored after it.
        script=("expect T1", "submit T1"),
        max_depth=8,
        goals=(
            "T1 lands",
            "T1 peer_gone on the sender after a restart",
            "T1 peer_gone on the receiver after a restart",
        ),
        scenario=("sender restarts with write 1 of T1 in flight",),
    ),
    _ci(
        "sender-stall",
        (T("T1", "S1", 1),),
        Budget(stalls=1),
        script=("expect T1", "submit T1"),
        max_depth=9,
        goals=_ok("T1", " after a stall"),
        scenario=("T1 ended on the receiver while the sender slept",),
    ),
    _ci(
        "receiver-stall",
        (T("T1", "S1", 1),),
        Budget(stalls=1),
        stallable=("receiver",),
        max_depth=11,
        goals=_ok("T1", " after a stall"),
        scenario=("T1 ended on the sender while the receiver slept",),
    ),
    # A receiver stopped while a heartbeat that omits T2 waits in its inbox: the sender
    # gives T2's Register up (its engine has not submitted T2), forgets the id, and its
    # engine submits T2 late; the receiver, running again, reads its inbox before it
    # ticks, so a Register re-sent then, past T2's deadline, would be written for after
    # the sender's Failed ended T2 there.
    _ci(
        "late-submit",
        (T("T1", "S1", 1), T("T2", "S1", 1)),
        Budget(stalls=1),
        stallable=("receiver",),
        script=(
            *_T1_HANDSHAKES[:5],
            "expect T2",
            "stall R#1",
            "deliver Heartbeat from the receiver",
            "deliver Register T2",
        ),
        max_depth=13,
        goals=(
            "T2 peer_timeout on the receiver after a stall",
            "T2 deadline_exceeded on the sender after a stall",
        ),
        scenario=("T2 ended on the sender while the receiver slept",),
    ),
    _ci(
        "two-senders",
        (T("T1", "S1", 1), T("T2", "S2", 1)),
        Budget(),
        senders=("S1", "S2"),
        receiver_blocks=1,
        # T1 as far as its write landing (its Done on the way, the write not reported):
        # the search goes on from there, T1's end interleaved with all of T2 from S2
        # into the block T1 hands back.
        script=_T1_TO_LANDING,
        max_depth=10,
        goals=(*_ok("T1"), "T2 lands", "T2 ok on the receiver"),
        scenario=("T2 lands",),
        room=1,
    ),
    # One request in two parts (issue 20): a decode rank takes head 0 of its block from
    # prefill rank 0 (S1) and head 1 from prefill rank 1 (S1.1), as a TP 2 prefill feeds
    # a TP 1 decode. Its engine hands the block back only with the request's one result
    # (`RequestParts`): finished once both parts finished, failed, after both ended, if
    # one failed; so a write of either part lands before the result or never.
    _ci(
        "two-parts",
        (T("T1", "S1", 1, request="Q", heads=(0,)), T("T2", "S1.1", 1, request="Q", heads=(1,))),
        Budget(failures=1),
        senders=("S1", "S1.1"),
        heads=2,
        sender_blocks=1,
        receiver_blocks=1,
        # Both parts as far as their first write: every handshake done, the sender's
        # heartbeat answered (the receiver's echo, which issues the write, on its way).
        script=_TWO_PARTS_HANDSHAKES,
        max_depth=10,
        goals=(
            "Q ok on the receiver",
            "Q write_error on the receiver after a failure",
            "T2 cancelled on the receiver after a failure",
        ),
        scenario=("T2 cancelled on the receiver after a failure",),
    ),
    # One request in two parts the other way: one prefill rank (S1) writes head 0 of its
    # block into decode rank 0 (R) and head 1 into decode rank 1 (R.1), as a TP 1
    # prefill feeds a TP 2 decode. Its engine reuses the block only with the request's
    # result, never while a write of either part still reads it.
    _ci(
        "one-to-two",
        (
            T("T1", "S1", 1, request="Q", heads=(0,)),
            T("T2", "S1", 1, request="Q", heads=(1,), receiver="R.1"),
        ),
        Budget(failures=1),
        heads=2,
        sender_blocks=1,
        receiver_blocks=1,
        script=_ONE_TO_TWO_HANDSHAKES,
        max_depth=10,
        goals=(
            "Q ok on the sender",
            "Q write_error on the sender after a failure",
            "T2 cancelled on the sender after a failure",
        ),
        scenario=("T2 cancelled on the sender after a failure",),
    ),
    # The fence's margin (issue 38): the receiver's engine gives a layer-wise T1 up
    # while its sender makes a layer ready, so a write may be issued just as the
    # receiver fences (before its Cancel arrives) and take the whole write bound (the
    # margin the fence states) to land; the sender may stall meanwhile, its write in
    # flight. The fence must outlast every such write.
    _ci(
        "fence",
        (T("T1", "S1", 1, layerwise=True),),
        Budget(aborts=1, stalls=1),
        script=_T1_HANDSHAKES,
        max_messages=16,
        max_depth=6,
        goals=(
            "T1 lands while the receiver fences",
            "T1 lands while the receiver fences after a stall",
            "T1 cancelled on the receiver after a stall",
        ),
        scenario=("T1 lands while the receiver fences after a stall",),
    ),
    # Real senders that misbehave (issue 38): S1 and S2 each send R messages about the
    # other's transfer under their own names (Done, Failed, CancelAck, a heartbeat
    # listing it), or a heartbeat about their own claiming another incarnation. R has
    # looked both up, so only "a message about a transfer comes from its counterpart"
    # stands between them and T1.
    _ci(
        "counterparts",
        (T("T1", "S1", 1), T("T2", "S2", 1)),
        Budget(forgeries=1),
        senders=("S1", "S2"),
        impostors=("S1", "S2"),
        # T1 as far as its write landing, then R expects T2 and looks S2 up.
        script=(*_T1_TO_LANDING, "expect T2", "handshake_ok R#1 S2"),
        max_depth=5,
        goals=(
            "R#1 reads a forged Failed T1 (cancelled) from S2#1",
            "R#1 reads a forged Done T2 from S1#1",
            "R#1 reads a forged Heartbeat from the sender [T1] from S1#1",
            *_ok("T1", " after a forgery"),
        ),
        scenario=("R#1 reads a forged Failed T1 (cancelled) from S2#1",),
    ),
    # The real receiver's own name, claiming another incarnation (issue 38): a sender
    # stalled mid-transfer, past the receiver's fence, wakes to a heartbeat under R#1's
    # name that claims another incarnation of R (9) and lists T1. Believed, it would renew the
    # lease of a transfer the receiver gave up, and the next layer would be written into
    # blocks the receiver handed back.
    _ci(
        "incarnations",
        (T("T1", "S1", 1, layerwise=True),),
        Budget(forgeries=1, stalls=1),
        impostors=("R",),
        script=(*_T1_HANDSHAKES, "stall S1#1", "sleep S1#1"),
        max_messages=16,
        max_depth=5,
        goals=(
            "S1#1 reads a forged Heartbeat from the receiver [T1] from R#1",
            "T1 peer_timeout on the sender after a forgery",
        ),
        scenario=("S1#1 reads a forged Heartbeat from the receiver [T1] from R#1",),
    ),
    _ci(
        "incompatible",
        (T("T1", "S1", 1),),
        Budget(),
        geometry=(("R", (("layout", "HND"),)),),
        goals=("T1 incompatible_peer on the sender", "T1 incompatible_peer on the receiver"),
        scenario=("T1 incompatible_peer on the sender",),
    ),
    # Two features at once: a layer-wise transfer whose sender stalls between its
    # layers, past the receiver's liveness timeout and fence. The messages that pile up
    # for the stalled sender (heartbeats, Cancels, the Register again) exceed the default
    # cap of 6 before the fence ends, so the cap here is 16.
    _ci(
        "layerwise-stall",
        (T("T1", "S1", 1, layerwise=True),),
        Budget(stalls=1),
        script=_T1_HANDSHAKES,
        max_messages=16,
        max_depth=8,
        goals=("T1 lands layer-wise after a stall", *_ok("T1", " after a stall")),
        scenario=("T1 ended on the receiver while the sender slept",),
    ),
    # Two features at once: a layer-wise transfer whose write (or handshake) may fail
    # between its layers; a prefix hit over a network that may drop one message.
    _ci(
        "layerwise-failure",
        (T("T1", "S1", 1, layerwise=True),),
        Budget(failures=1),
        script=_T1_HANDSHAKES,
        max_depth=11,
        goals=(
            "T1 lands layer-wise",
            "T1 write_error on the sender after a failure",
            "T1 write_error on the receiver after a failure",
        ),
        scenario=("T1 write_error on the receiver after a failure",),
    ),
    _ci(
        "prefix-lossy",
        (T("T1", "S1", 2, offset=1),),
        Budget(drops=1),
        script=("expect T1",),
        max_depth=11,
        goals=_ok("T1", " after a drop"),
        scenario=("T1 lands after a drop",),
    ),
    # The engines say no: the receiver's rejects T1 instead of expecting it (the sender,
    # submitted or not, hears a Reject), or the sender's refuses T1's Register before any
    # submit (the receiver hears a Failed; a later submit ends as refused).
    _ci(
        "refusals",
        (T("T1", "S1", 1),),
        Budget(rejects=1, refusals=1),
        max_depth=14,
        goals=(
            "T1 rejected on the sender after a reject",
            "T1 rejected on the receiver after a reject",
            "T1 rejected on the sender after a refusal",
            "T1 rejected on the receiver after a refusal",
            *_ok("T1"),
        ),
        scenario=("T1 rejected on the receiver after a refusal",),
    ),
    # A foreign agent sends any message kind, claiming the real engines, for T1 (issue
    # 11): a transfer it ended so would be a [forged-effect] violation.
    _ci(
        "forger",
        (T("T1", "S1", 1),),
        Budget(forgeries=1),
        script=("expect T1",),
        max_depth=9,
        goals=_ok("T1", " after a forgery"),
        scenario=("R#1 reads a forged Failed T1 (cancelled) from X#1",),
    ),
    # An insider (it holds the token, its side channel vouches for it) expects T1 too,
    # before or after the real receiver and the submit that names R (issue 22): a write
    # to it would be a [wrong-receiver] violation; it is refused, and T1 still ends ok.
    _ci(
        "insider",
        (T("T1", "S1", 1),),
        Budget(),
        insider=True,
        # The insider first: its Register on its way before R expects T1 or S1 submits.
        script=("insider_expect T1", "handshake_ok I#1 S1"),
        max_depth=11,
        goals=(*_ok("T1"), "T1 malformed_message on the insider"),
        scenario=("T1 malformed_message on the insider",),
    ),
)

# Claims (issue 39): the receiver may claim T1 (its request queued, no blocks yet) at
# any step before it expects it, and may stall; the sender gives up what nobody
# registered or claimed for its claim window (2 s, half the deadline). A claim read
# must keep the transfer for a window (`[claim-lost]`), and the transfer still ends
# once on each side with nothing written after (every other invariant).
CLAIMS = _ci(
    "claims",
    (T("T1", "S1", 1),),
    Budget(stalls=1),
    stallable=("receiver",),
    claims=True,
    timing=TimingConfig(
        heartbeat_interval_s=1.0,
        liveness_timeout_s=2.0,
        lease_s=2.0,
        transfer_deadline_s=4.0,
        claim_window_s=2.0,
    ),
    script=("submit T1", "claim T1", "handshake_ok R#1 S1"),
    max_depth=10,
    goals=(*_ok("T1"), "T1 peer_timeout on the sender", "T1 claimed"),
    scenario=("T1 claimed",),
)
# A held send (issue 39): the sender's engine submits T1 only once a receiver spoke for
# it, as a vLLM prefill that does not know its decode's TP; the receiver claims it first
# (its request queued, no blocks yet). A claim read must name T1 to the engine for a
# liveness timeout (`[claim-lost]`), so that the engine submits it instead of giving it
# up at its window; and T1 then ends once on each side as any other.
CLAIMS_HELD = _ci(
    "claims-held",
    (T("T1", "S1", 1, held=True),),
    Budget(),
    claims=True,
    timing=CLAIMS.timing,
    script=("claim T1", "handshake_ok R#1 S1"),
    max_depth=10,
    goals=(*_ok("T1"), "T1 claimed before submit"),
    scenario=("T1 claimed before submit",),
)
CI = (*CI, CLAIMS, CLAIMS_HELD)

# A receiver whose runtime thread is stuck while its side channel still answers: finds
# a late write in the current protocol (see docs/protocol-checking.md, "Findings").
STUCK_RECEIVER = _ci(
    "stuck-receiver",
    (T("T1", "S1", 1),),
    Budget(stalls=1),
    stallable=("receiver",),
    stalled_side_channel_answers=True,
    max_depth=16,
    goals=_ok("T1", " after a stall"),
)

# The larger scope: deeper, and the scopes that do not fit in CI.
LARGE = (
    *(dataclasses.replace(s, max_depth=s.max_depth + 4) for s in CI),
    _ci(
        "three-transfers",
        (T("T1", "S1", 1, layerwise=True), T("T2", "S1", 2, offset=1), T("T3", "S1", 1)),
        Budget(aborts=1, drops=1),
        sender_blocks=2,
        receiver_blocks=1,
        max_depth=12,
        goals=("T1 lands layer-wise",),
    ),
    STUCK_RECEIVER,
    _ci(
        "forger-2",
        (T("T1", "S1", 1),),
        Budget(forgeries=2),
        script=("expect T1",),
        max_depth=9,
        goals=_ok("T1", " after a forgery"),
    ),
)

GROUPS: dict[str, tuple[Scope, ...]] = {
    "ci": CI,
    "large": LARGE,
    "stuck-receiver": (STUCK_RECEIVER,),
    "smoke": (SMOKE,),
    "smoke-prompt": (SMOKE_PROMPT,),
    "bug1": (BUG1,),
    "bug2": (BUG2,),
    "bug3": (BUG3,),
}


def group(name: str) -> tuple[Scope, ...]:
    if name in GROUPS:
        return GROUPS[name]
    for scopes in GROUPS.values():
        for s in scopes:
            if s.name == name:
                return (s,)
    raise SystemExit(f"unknown scope {name!r}: expected one of {sorted(GROUPS)} or a scope name")
