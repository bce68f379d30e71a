"""The world the checker explores: protocol endpoints, engines that reuse blocks at once,
a network that drops, duplicates and reorders, and a data plane that copies bytes late.

A `World` is plain data (picklable): the checker copies it to branch and hashes its
pickle to recognise a state seen before. `Model.actions(world)` lists every step the
world can take next; `Model.step(world, action)` takes one, in place, and returns a
readable line for the trace. A broken promise raises `Violation` from inside the step
that broke it, so the trace ends at the first bad step.

What the engines do, and why it gives the checker teeth:
* The sender's engine overwrites a block with new content the moment kvpush hands it
  back (a TransferEnded on the sender). A write still reading that block would copy the
  new content.
* The receiver's engine gives a handed-back block to the next transfer (lowest free
  block first) the moment kvpush hands it back.
* The data plane copies what the source block holds when the write *lands*, which may be
  any time after it was issued; the write's notification (a `Done`) enters the network
  only when its bytes have landed, and the sender learns the outcome later still.

Time is global and discrete: it jumps to the next timer of some endpoint (its
`next_deadline()`), so every timer boundary is visited in every order the interleaving
allows. Each endpoint sees it through its own clock offset, as two hosts' monotonic
clocks differ. A stalled endpoint neither handles messages nor ticks while time passes
(its engine's calls queue up); on resume it first works through what queued up, in any
order, and only then ticks.
"""

from __future__ import annotations

import collections
import copyreg
import dataclasses
import enum
import functools
import io
import operator
import pickle
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from kvpush.config import TimingConfig
from kvpush.errors import FailureReason, LocalProtocolError

from . import api as api_mod
from .api import PORTS

# The foreign agent of scopes with a forgeries budget: no process of the model, no side
# channel; it only puts messages on the network.
FORGER = "X#1"
# The insider engine of scopes with `insider=True`: a real receiver with a side channel
# of its own (it holds the token), which expects the scope's transfers too, predicted.
INSIDER = "I"


class Violation(Exception):
    """A promise of the protocol was broken by the step being taken. `kind` names which
    (see KINDS), so a search can look for one kind past states that break another."""

    def __init__(self, kind: str, message: str) -> None:
        assert kind in KINDS, kind
        super().__init__(message)
        self.kind = kind


KINDS = {
    "twice": "a transfer ended twice on one side",
    "never-ended": "a transfer handed to a live side never ended there",
    "phantom": "a side reported or wrote a transfer it was never handed, or other blocks",
    "write-after-end": "a sender wrote for a transfer it had ended",
    "late-write": "a write landed in a receiver block after it was handed back",
    "source-reused": "a sender handed back blocks that a write still reads",
    "wrong-bytes": "a receiver reported ok without exactly the submitted bytes",
    "held-at-rest": "something is still held when nothing can happen any more",
    "refused-call": "the protocol raised on a call the engine may make",
    "incompatible-ok": "a transfer ended ok between incompatible geometries",
    "forged-effect": "a forged message ended a transfer (a reason only the forger could cause)",
    "wrong-receiver": "a sender wrote KV to a receiver other than the one its engine named",
    "fence-margin": (
        "a receiver handed back blocks that a write may still land in (the write's latest "
        "landing, issued + write bound, is not before the hand-back: the fence's end)"
    ),
    "claim-lost": (
        "a sender gave up a transfer as unclaimed less than a claim window after it read "
        "its receiver's claim of it (or, for one its engine holds unsubmitted, did not "
        "name it to the engine for a liveness timeout after)"
    ),
}

# A model engine named `ENGINE.RANK` is rank RANK of engine ENGINE: the same side
# channel (port) and engine id, a process of its own ("R.1": decode rank 1).


@dataclass(frozen=True)
class TransferSpec:
    tid: str
    sender: str  # the sender engine that computes it
    n: int  # blocks the sender submits
    offset: int = 0  # prefix hit: the receiver registers blocks n - offset
    layerwise: bool = False  # submitted with no layer ready; layers come one by one
    receiver: str = "R"  # the receiver engine (or rank: "R.1") it goes to
    # A part of a request (`Scope.heads` > 1): the request it is part of, and the heads
    # of each block it moves. The parts of a request at one engine share its blocks,
    # which that engine hands back only with the request's one result
    # (`kvpush.protocol.parts.RequestParts`), and are started there in one call.
    request: str = ""
    heads: tuple[int, ...] = ()  # () = every head
    # Its sender's engine holds it, unsubmitted, until a receiver speaks for it (registers,
    # rejects or claims it: `spoken_before_submit`, `claimed_before_submit`), as a vLLM
    # prefill holds a send whose decode TP nobody named (issue 39).
    held: bool = False

    @property
    def owner(self) -> str:
        """What holds the blocks at an engine: the request, or the transfer itself."""
        return self.request or self.tid


@dataclass(frozen=True)
class Budget:
    drops: int = 0
    dups: int = 0
    aborts: int = 0
    restarts: int = 0
    stalls: int = 0
    failures: int = 0  # write failures and failed handshakes
    # Messages a foreign agent (`FORGER`) sends: any kind, naming the real engines and
    # the scope's transfer ids (see `Model._forgeries`).
    forgeries: int = 0
    # An engine says no: the receiver's engine rejects a transfer instead of expecting
    # it (the protocol's `reject`); the sender's engine refuses a Register it holds for
    # an id it has not submitted (`refuse`).
    rejects: int = 0
    refusals: int = 0


@dataclass(frozen=True)
class Scope:
    name: str
    transfers: tuple[TransferSpec, ...]
    budget: Budget
    senders: tuple[str, ...] = ("S1",)
    sender_blocks: int = 2  # per sender engine: few, so reuse comes at once
    receiver_blocks: int = 2
    num_layers: int = 2
    max_depth: int = 40
    # Who may stall: "sender", "receiver" or both.
    stallable: tuple[str, ...] = ("sender",)
    # Engines start their transfers in order (T1 before T2), which keeps the
    # state count down without losing an interleaving of one transfer with another.
    ordered: bool = True
    max_messages: int = 6  # the network holds at most this many distinct messages
    # A prompt network delivers (or loses) every message before time moves on, except
    # to a stalled process: then only stalls, slow writes and drops make silence.
    # Otherwise a message may wait any time (an asynchronous network).
    prompt: bool = False
    # May a process stall while one of its writes is still being copied (the write then
    # lands during or after the stall)? Off, stalls begin only between writes: what is
    # left is what a stalled sender does when it wakes.
    stall_mid_write: bool = True
    # A write lands or fails within this many seconds of being issued. None: the margin
    # the fence states (`fence_s = lease_s + 2 * liveness_timeout_s`, so twice the
    # liveness timeout), the protocol's own assumption about its writes. Taken from
    # that statement, never from the receiver: a fence made shorter must not make the
    # model's writes faster with it.
    write_bound_s: float | None = None
    # Tick a running endpoint in the same step whenever one of its timers is due (as
    # the runtime's loop does), rather than as a step of its own in every order.
    eager_ticks: bool = True
    # Does a stalled process's side channel still answer handshakes? Not when the whole
    # process is stopped (SIGSTOP); yes when only its runtime thread is stuck.
    stalled_side_channel_answers: bool = False
    # Offer a stalled process a step that sleeps through every timer at once.
    long_stalls: bool = True
    # Geometry per engine (a compatibility token); the checker's bug-1 invariant.
    geometry: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()
    timing: TimingConfig = field(
        default_factory=lambda: TimingConfig(
            heartbeat_interval_s=1.0, liveness_timeout_s=2.0, lease_s=2.0, transfer_deadline_s=4.0
        )
    )
    # What the search must reach for the scope to mean anything (`Model.reached` names
    # the events): "T1 ok on the receiver", "T2 lands", "T1 ok on the sender after a
    # stall", "T1 incompatible_peer on the sender"; `check` fails a scope that misses one.
    goals: tuple[str, ...] = ()
    # The situation the scope exists for (events, as goals name them): each must be
    # reached at least `room` steps before the depth bound, so that the search explores
    # what comes after it (`check` fails the scope otherwise).
    scenario: tuple[str, ...] = ()
    room: int = 2
    # Steps taken before the search starts, each named by how its trace line begins
    # ("expect T1", "deliver Register T1", "land write 1"): the search explores every
    # interleaving from where they lead, so a scope can start where its scenario does.
    script: tuple[str, ...] = ()
    # An insider (`INSIDER`) expects every transfer as well, at any time; the senders'
    # engines name R's side channel at submit (issue 22), so a write to the insider is a
    # [wrong-receiver] violation.
    insider: bool = False
    # Heads per block: bytes of a block that different parts of a request move.
    heads: int = 1
    # Real peers that misbehave (issue 38): the forger (`forgeries` budget) sends under
    # the names of these engines' live agents (instead of as the stranger `FORGER`), as
    # those processes could themselves: every message kind about the transfers of
    # another counterpart, under the agent's own name and incarnation; and, about its
    # own transfers, a heartbeat that claims another incarnation of its engine than its
    # side channel said. (A message under a counterpart's name that claims the truth is
    # that counterpart's, as far as anyone without the token can tell:
    # docs/protocol-checking.md, "What the model leaves to the unit tests".)
    impostors: tuple[str, ...] = ()
    # Claims (issue 39): the receiver's engine may claim each transfer, once, at any
    # step before it expects it (a request queued, no blocks yet). Give `timing` a
    # `claim_window_s`, so that the sender gives up what nobody registered or claimed.
    claims: bool = False

    @property
    def write_bound(self) -> float:
        """How long after it was issued a write may still land (`write_bound_s`)."""
        if self.write_bound_s is not None:
            return self.write_bound_s
        return 2 * self.timing.liveness_timeout_s

    @property
    def receivers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(("R", *(t.receiver for t in self.transfers))))


# ------------------------------------------------------------------------ world state


@dataclass
class End:
    agent: str
    engine: str
    role: str  # "sender" or "receiver"
    offset: float  # local clock = global clock + offset
    proto: Any
    alive: bool = True
    phase: str = "running"  # running | stalled | catchup
    queued: list[tuple[Any, ...]] = field(default_factory=list)  # engine calls while stalled
    inbox: list[tuple[Any, ...]] = field(default_factory=list)  # what catch-up works through


@dataclass
class Write:
    src: str
    dst: str
    wid: int
    tid: str
    ours: tuple[int, ...]
    theirs: tuple[int, ...]
    layers: tuple[int, ...] | None
    notification: bytes | None
    issued_at: float
    heads: tuple[int, ...]
    landed: bool = False


@dataclass
class Tx:
    s_agent: str | None = None
    s_blocks: tuple[int, ...] = ()
    # The content of each (block index, layer, head) it moves, at submit.
    submitted: dict[tuple[int, int, int], str] = field(default_factory=dict)
    layers_left: list[int] = field(default_factory=list)
    r_agent: str | None = None
    r_blocks: tuple[int, ...] = ()
    s_ended: list[str] = field(default_factory=list)
    r_ended: list[str] = field(default_factory=list)
    # The insider's side of the same id (`Scope.insider`).
    i_agent: str | None = None
    i_blocks: tuple[int, ...] = ()
    i_ended: list[str] = field(default_factory=list)
    # Claims: whether the receiver's engine claimed it, and when (global clock) its
    # sender last read a claim of it from that receiver after its submit.
    claimed: bool = False
    claim_read_at: float = float("-inf")
    # A held transfer (`TransferSpec.held`): when (its sender's clock) its sender last read
    # a claim of it before its submit.
    early_claim_read_at: float = float("-inf")


@dataclass
class World:
    now: float = 0.0
    ends: dict[str, End] = field(default_factory=dict)
    current: dict[str, str] = field(default_factory=dict)  # engine -> its live agent
    incarnations: dict[str, int] = field(default_factory=dict)
    net: list[tuple[str, str, bytes]] = field(default_factory=list)  # sorted, distinct
    writes: list[Write] = field(default_factory=list)
    handshakes: list[tuple[str, str]] = field(default_factory=list)  # (who, whom)
    memory: dict[str, dict[tuple[int, int, int], str]] = field(default_factory=dict)
    versions: dict[str, dict[int, int]] = field(default_factory=dict)
    held: dict[str, dict[int, str]] = field(default_factory=dict)  # agent: block -> tid
    tx: dict[str, Tx] = field(default_factory=dict)
    used: dict[str, int] = field(default_factory=dict)  # budget spent, by kind
    noticed: list[tuple[str, str]] = field(default_factory=list)  # (observer, dead agent)
    # Scopes with requests: each agent's `RequestParts` (the real one, or a mutant), the
    # aborts it asked for that its runtime has not run yet, and each request's results
    # per agent.
    books: dict[str, Any] = field(default_factory=dict)
    part_aborts: list[tuple[str, str]] = field(default_factory=list)  # (agent, part)
    requests: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    # Messages the forger put on the network (under its name or a borrowed one).
    forged: list[tuple[str, str, bytes]] = field(default_factory=list)


_SINGULAR = {
    "drops": "drop",
    "dups": "dup",
    "aborts": "abort",
    "restarts": "restart",
    "stalls": "stall",
    "failures": "failure",
    "forgeries": "forgery",
    "rejects": "reject",
    "refusals": "refusal",
}


def _fmt_blocks(blocks: tuple[int, ...]) -> str:
    return "(" + ",".join(map(str, blocks)) + ")"


class Model:
    """The rules of the world for one scope, over one protocol implementation."""

    def __init__(self, scope: Scope, state_module: ModuleType, mutation: str | None = None):
        self.scope = scope
        self.api = api_mod.Api(state_module, scope, mutation)
        self.specs = {t.tid: t for t in scope.transfers}
        import kvpush.config
        import kvpush.errors

        package = state_module.__name__.rsplit(".", 1)[0]
        # The protocol's modules (one file before the split along the sender/receiver
        # seam, several since), whose classes the keyer pickles quickly.
        names = (
            "_common",
            "tombstones",
            "writes",
            "choice",
            "sender",
            "lookups",
            "claims",
            "receiver_messages",
            "receiver_timers",
            "receiver",
        )
        parts = [sys.modules.get(f"{package}.{n}") for n in names]
        modules = (state_module, *(m for m in parts if m is not None), self.api.messages)
        from . import mutations

        sides = tuple(getattr(state_module, n) for n in ("SenderProtocol", "ReceiverProtocol"))
        self.key_of = Keyer((*modules, mutations, kvpush.config, kvpush.errors), sides)
        # Events the search saw (what goals name); not recorded during a completion.
        self.reached: set[str] = set()
        # The depth of the states the steps being taken lead to (set by the search), the
        # first depth each event was seen at, and the events of the step being taken.
        self.depth = 0
        self.first: dict[str, int] = {}
        self.step_events: set[str] = set()
        self.recording = True
        # A bounded completion (`checker.complete`): no new faults, no message cap.
        self.completing = False
        # Scopes with requests: the class that turns their parts' ends into one result.
        self.parts_class = (
            self.api.parts_class(package) if any(t.request for t in scope.transfers) else None
        )

    # ----- the first state

    def initial(self) -> World:
        w = World()
        for t in self.scope.transfers:
            w.tx[t.tid] = Tx()
        for r in self.scope.receivers:
            self._start_incarnation(w, r, "receiver")
        if self.scope.insider:
            self._start_incarnation(w, INSIDER, "receiver")
        for s in self.scope.senders:
            self._start_incarnation(w, s, "sender")
        return w

    def _start_incarnation(self, w: World, engine: str, role: str) -> str:
        inc = w.incarnations.get(engine, 0) + 1
        w.incarnations[engine] = inc
        agent = f"{engine}#{inc}"
        # Clocks of different processes have different origins.
        offset = (1000.0 if role == "receiver" else 0.0) + 500.0 * (inc - 1)
        if engine == INSIDER:
            offset += 2000.0
        proto = self.api.endpoint(engine, agent, inc, role)
        w.ends[agent] = End(agent, engine, role, offset, proto)
        w.current[engine] = agent
        pool = self.scope.receiver_blocks if role == "receiver" else self.scope.sender_blocks
        w.versions[agent] = dict.fromkeys(range(pool), 0)
        w.memory[agent] = {}
        for b in range(pool):
            self._fill(w, agent, b, "init")
        w.held[agent] = {}
        if self.parts_class is not None:
            w.books[agent] = self.parts_class(role)
        return agent

    def _fill(self, w: World, agent: str, b: int, what: str, layers: Any = None) -> None:
        """Block `b` of `agent` holds new content `what` (in these layers: all if None)."""
        many = self.scope.heads > 1
        for layer in range(self.scope.num_layers) if layers is None else layers:
            for h in range(self.scope.heads):
                head = f":h{h}" if many else ""
                w.memory[agent][(b, layer, h)] = f"{agent}:b{b}:L{layer}{head}:{what}"

    def heads_of(self, t: TransferSpec) -> tuple[int, ...]:
        return t.heads or tuple(range(self.scope.heads))

    def group(self, tid: str, side: str) -> tuple[str, ...]:
        """The transfers an engine starts with one call along with `tid`: the parts of
        its request at the same engine on that side (`tid` alone outside a request)."""
        t = self.specs[tid]
        if not t.request:
            return (tid,)
        where = (lambda u: u.receiver) if side == "receiver" else (lambda u: u.sender)
        return tuple(
            u.tid for u in self.scope.transfers if u.request == t.request and where(u) == where(t)
        )

    # ----- helpers

    def local(self, w: World, agent: str) -> float:
        return w.now + w.ends[agent].offset

    def spent(self, w: World, kind: str) -> bool:
        if self.completing:
            return True  # no new faults while completing
        return w.used.get(kind, 0) >= getattr(self.scope.budget, kind)

    def note(self, w: World, event: str) -> None:
        """`event` happened; so did "`event` after a KIND" for each fault on this path
        (the budget spent is part of the state, so it is the path's own)."""
        if not self.recording:
            return
        events = [event]
        for kind, n in w.used.items():
            if n:
                events.append(f"{event} after a {_SINGULAR[kind]}")
        for e in events:
            self.reached.add(e)
            self.step_events.add(e)
            self.first.setdefault(e, self.depth)

    def spend(self, w: World, kind: str) -> None:
        w.used[kind] = w.used.get(kind, 0) + 1

    def free_blocks(self, w: World, agent: str, n: int) -> tuple[int, ...] | None:
        free = [b for b in sorted(w.versions[agent]) if b not in w.held[agent]]
        return tuple(free[:n]) if len(free) >= n else None

    def running(self, w: World, agent: str) -> bool:
        e = w.ends.get(agent)
        return e is not None and e.alive and e.phase != "stalled"

    # ----- actions

    def _forgeries(self, w: World) -> list[tuple[str, str, bytes]]:
        """What the forger may send, from which name, to whom: as `FORGER`, every kind,
        claiming to be the real counterpart (its engine, incarnation and side-channel
        address), for every id; under an impostor's name (`Scope.impostors`), what
        `_borrowed` lists."""
        if not self.scope.impostors:
            return [(FORGER, dst, payload) for dst, payload in self._foreign_forgeries(w)]
        out: list[tuple[str, str, bytes]] = []  # (the `forger` scope has the stranger)
        for engine in self.scope.impostors:
            out += self._borrowed(w, engine)
        return out

    def _borrowed(self, w: World, engine: str) -> list[tuple[str, str, bytes]]:
        """What the live agent of `engine`, a real peer, may send that its protocol
        never would: every kind about a transfer whose counterpart it is not, under its
        own name and claiming its own engine and incarnation; and about a transfer it
        is the counterpart of, a heartbeat claiming another incarnation of its engine."""
        a = self.api
        m = a.messages
        agent = w.current[engine]
        inc = agent.split("#")[1]
        base, rank = api_mod.place(engine)
        now = self.local(w, agent)
        reason = FailureReason.CANCELLED
        other_inc = str(int(inc) + 8)  # an incarnation its side channel never served
        out: list[tuple[str, str, bytes]] = []
        for t in self.scope.transfers:
            if w.ends[agent].role == "sender":
                dst = w.current[t.receiver]
                if t.sender == engine:
                    sent: list[Any] = [
                        m.Heartbeat("sender", base, other_inc, (t.tid,), sent_at=now)
                    ]
                else:
                    blocks = t.n - t.offset
                    sent = [
                        m.Done(t.tid, blocks),
                        m.Failed(t.tid, reason, "forged"),
                        m.CancelAck(t.tid),
                        m.Heartbeat("sender", base, inc, (t.tid,), sent_at=now),
                    ]
            else:
                dst = w.current[t.sender]
                if t.receiver == engine:
                    sent = [m.Heartbeat("receiver", base, other_inc, (t.tid,), sent_at=now)]
                else:
                    port = PORTS[base]
                    blocks_ids = tuple(range(t.n - t.offset))
                    register = m.Register(
                        t.tid, base, inc, "127.0.0.1", port, rank, blocks_ids, t.offset, sent_at=now
                    )
                    sent = [
                        register,
                        m.Cancel(t.tid, reason, "forged"),
                        m.Reject(t.tid, "forged"),
                        m.Heartbeat("receiver", base, inc, (t.tid,), sent_at=now),
                    ]
            if dst != agent:
                out += [(agent, dst, a.encode(x)) for x in sent]
        return out

    def _foreign_forgeries(self, w: World) -> list[tuple[str, bytes]]:
        """What `FORGER` may send, to whom: every kind, claiming to be the real
        counterpart (its engine, incarnation and side-channel address), for every id."""
        a = self.api
        m = a.messages
        reason = FailureReason.CANCELLED
        rv = w.current["R"]
        out: list[tuple[str, bytes]] = []
        for t in self.scope.transfers:
            inc = rv.split("#")[1]
            port = PORTS["R"]
            s_agent = w.current[t.sender]
            s_inc = s_agent.split("#")[1]
            blocks = tuple(range(t.n - t.offset))
            # Stamped with the clocks of the processes it claims to be (the worst case:
            # a forger that knows them), so that a Register it forges grants a lease.
            r_now, s_now = self.local(w, rv), self.local(w, s_agent)
            register = m.Register(
                t.tid, "R", inc, "127.0.0.1", port, 0, blocks, t.offset, sent_at=r_now
            )
            to_sender = [
                register,
                m.Cancel(t.tid, reason, "forged"),
                m.Reject(t.tid, "forged"),
                m.Heartbeat("receiver", "R", inc, (t.tid,), sent_at=r_now),
            ]
            to_receiver = [
                m.Done(t.tid, len(blocks)),
                m.Failed(t.tid, reason, "forged"),
                m.CancelAck(t.tid),
                m.Heartbeat("sender", t.sender, s_inc, (t.tid,), sent_at=s_now),
            ]
            out += [(s_agent, a.encode(x)) for x in to_sender]
            out += [(rv, a.encode(x)) for x in to_receiver]
        return out

    def actions(self, w: World) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = []
        if not self.spent(w, "forgeries"):
            for src, dst, payload in self._forgeries(w):
                if w.ends[dst].alive and (src, dst, payload) not in w.net:
                    out.append(("forge", src, dst, payload))
        catching_up = any(e.alive and e.phase == "catchup" for e in w.ends.values())
        # Engine calls.
        for i, t in enumerate(self.scope.transfers):
            tx = w.tx[t.tid]
            rv = w.ends[w.current[t.receiver]]
            sender_agent = w.current[t.sender]
            prev_expected = i == 0 or not self.scope.ordered or self._started(w, i - 1, "r")
            prev_submitted = i == 0 or not self.scope.ordered or self._started(w, i - 1, "s")
            if (
                tx.r_agent is None
                and prev_expected
                and self.group(t.tid, "receiver")[0] == t.tid
                and rv.alive
                and rv.phase != "stalled"
                and w.ends[sender_agent].alive
                and self.free_blocks(w, rv.agent, t.n - t.offset) is not None
            ):
                out.append(("expect", t.tid))
                if not self.spent(w, "rejects"):
                    out.append(("reject", t.tid))
            if (
                self.scope.claims
                and not tx.claimed
                and tx.r_agent is None
                and self.running(w, rv.agent)
            ):
                out.append(("claim", t.tid))
            if (
                tx.s_agent is None
                and not self.spent(w, "refusals")
                and self.running(w, sender_agent)
                and self.api.registered(w.ends[sender_agent].proto, t.tid)
            ):
                out.append(("refuse", t.tid))
            if self.scope.insider and tx.i_agent is None:
                insider = w.ends[w.current[INSIDER]]
                if self.running(w, insider.agent) and self.free_blocks(
                    w, insider.agent, t.n - t.offset
                ):
                    out.append(("insider_expect", t.tid))
            if (
                tx.s_agent is None
                and prev_submitted
                and self.group(t.tid, "sender")[0] == t.tid
                and w.ends[sender_agent].alive
                and self.free_blocks(w, sender_agent, t.n) is not None
                and (not t.held or self.api.spoken(w.ends[sender_agent].proto, t.tid))
            ):
                out.append(("submit", t.tid))
            if tx.s_agent is not None and not tx.s_ended and w.ends[tx.s_agent].alive:
                if tx.layers_left:
                    out.append(("layer", t.tid))
                if not self.spent(w, "aborts"):
                    out.append(("abort", "sender", t.tid))
            if (
                tx.r_agent is not None
                and not tx.r_ended
                and self.running(w, tx.r_agent)
                and not self.spent(w, "aborts")
            ):
                out.append(("abort", "receiver", t.tid))
        # Aborts a request's parts asked for (its first failure), not run yet.
        for agent, pid in w.part_aborts:
            if self.running(w, agent):
                out.append(("part_abort", agent, pid))
        # The network.
        for m in w.net:
            if self.running(w, m[1]):
                out.append(("deliver", m))
                if not self.spent(w, "dups"):
                    out.append(("dup", m))
            if not self.spent(w, "drops"):
                out.append(("drop", m))
        # The data plane.
        for wr in w.writes:
            key = (wr.src, wr.wid)
            if not wr.landed:
                if w.ends[wr.dst].alive:
                    out.append(("land", key))
                if self.running(w, wr.src) and (
                    not w.ends[wr.dst].alive or not self.spent(w, "failures")
                ):
                    out.append(("fail", key))
            elif self.running(w, wr.src):
                out.append(("complete", key))
        for who, whom in w.handshakes:
            if self.running(w, who):
                possible = self.api.handshake_possible(w, whom)
                if possible:
                    out.append(("handshake_ok", who, whom))
                if not possible or not self.spent(w, "failures"):
                    out.append(("handshake_fail", who, whom))
        # Deaths, restarts, stalls.
        for agent, e in w.ends.items():
            if not e.alive:
                for obs_agent, obs in w.ends.items():
                    if obs.alive and obs.phase != "stalled" and (obs_agent, agent) not in w.noticed:
                        out.append(("lost", obs_agent, agent))
                continue
            if not self.spent(w, "restarts"):
                out.append(("restart", agent))
            if e.phase == "running" and e.role in self.scope.stallable:
                mid_write = any(wr.src == agent and not wr.landed for wr in w.writes)
                if not self.spent(w, "stalls") and (self.scope.stall_mid_write or not mid_write):
                    out.append(("stall", agent))
            elif e.phase == "stalled":
                out.append(("resume", agent))
                if self.scope.long_stalls:
                    out.append(("sleep", agent))
            elif e.phase == "catchup":
                # Messages in any order; the engine's calls in the order it made them.
                first_call = True
                for i, item in enumerate(e.inbox):
                    if item[0] == "message":
                        out.append(("inbox", agent, i))
                    elif first_call:
                        first_call = False
                        out.append(("inbox", agent, i))
        # Time.
        if not catching_up:
            for agent, e in w.ends.items():
                if e.alive and e.phase == "running" and not self.scope.eager_ticks:
                    nd = e.proto.next_deadline()
                    if nd is not None and nd <= self.local(w, agent):
                        out.append(("tick", agent))
            target = self.next_time(w)
            waiting = [m for m in w.net if self.running(w, m[1])]
            if self.scope.prompt and waiting:
                target = None
            bound = self.scope.write_bound
            # The data plane's promise: a write lands or fails within the bound.
            if target is not None and any(
                not wr.landed and target > wr.issued_at + bound for wr in w.writes
            ):
                target = None
            capped = len(w.net) > self.scope.max_messages and not self.completing
            if target is not None and not capped:
                out.append(("clock", target))
        return out

    # What a completion does first: end stalls, then work through what is queued and
    # on its way, and let time pass only when nothing else is left. No faults (the
    # budgets count as spent), no new transfers; the engine still makes its layers.
    _COMPLETION_ORDER = {
        "resume": 0,
        "inbox": 1,
        "part_abort": 1,
        "deliver": 2,
        "land": 3,
        "complete": 4,
        "fail": 5,  # only a write to a process that is gone (no failures left)
        "handshake_ok": 6,
        "handshake_fail": 7,  # only a handshake that cannot succeed
        "layer": 8,
        "tick": 9,
        "clock": 10,
        "lost": 11,
    }

    def completion_action(self, w: World) -> tuple[Any, ...] | None:
        """The next step of a bounded completion (`checker.complete`), or None when it
        has come to rest."""
        order = self._COMPLETION_ORDER
        best: tuple[Any, ...] | None = None
        for a in self.actions(w):
            rank = order.get(a[0])
            if rank is not None and (best is None or rank < order[best[0]]):
                best = a
        return best

    def _started(self, w: World, i: int, side: str) -> bool:
        tx = w.tx[self.scope.transfers[i].tid]
        return (tx.r_agent if side == "r" else tx.s_agent) is not None

    def next_time(self, w: World) -> float | None:
        """The next timer boundary of any live endpoint (a stalled one's too: its timers
        pass while it sleeps). A timer already due that a tick did not move hides the
        ones behind it, so then time moves by a heartbeat interval."""
        times = []
        for e in w.ends.values():
            if not e.alive:
                continue
            nd = e.proto.next_deadline()
            if nd is None:
                continue
            t = nd - e.offset
            if t > w.now:
                times.append(t)
            elif e.phase == "running":
                times.append(w.now + self.scope.timing.heartbeat_interval_s)
        return min(times) if times else None

    # ----- one step

    def step(self, w: World, action: tuple[Any, ...]) -> str:
        kind = action[0]
        handler = getattr(self, "_do_" + kind)
        line: str = handler(w, *action[1:])
        if self.scope.eager_ticks:
            line += self._due_ticks(w)
        self._check_held(w)
        return f"t={w.now:g} {line}"

    def _check_held(self, w: World) -> None:
        """`[claim-lost]` for a held transfer: a sender that read a claim of it names it
        to its engine (`claimed_before_submit`) for a liveness timeout after, or the
        engine gives up, at its claim window, a send its living receiver claims."""
        liveness = self.scope.timing.liveness_timeout_s
        for t in self.scope.transfers:
            tx = w.tx[t.tid]
            if not t.held or tx.s_agent is not None:
                continue
            agent = w.current[t.sender]
            e = w.ends[agent]
            read = tx.early_claim_read_at
            if not e.alive or self.local(w, agent) >= read + liveness - 1e-9:
                continue
            if not self.api.spoken(e.proto, t.tid):
                raise Violation(
                    "claim-lost",
                    f"{agent} read its receiver's claim of {t.tid} (held, not submitted) "
                    f"{self.local(w, agent) - read:g}s ago and does not name it to its "
                    f"engine: the engine gives up, at its claim window, a send its living "
                    "receiver claims",
                )

    def _due_ticks(self, w: World) -> str:
        """The runtime ticks in the same pass when a timer is due (once: a timer that a
        tick does not move is the protocol's business, and the clock steps past it)."""
        said = []
        for agent, e in w.ends.items():
            if e.alive and e.phase == "running":
                nd = e.proto.next_deadline()
                if nd is not None and nd <= self.local(w, agent):
                    text = self._apply(w, agent, self._call(w, agent, e.proto.tick))
                    if text:
                        said.append(f"{agent} ticks{text}")
        return ("; " + "; ".join(said)) if said else ""

    def _do_expect(self, w: World, tid: str) -> str:
        return self._expect(w, tid, w.ends[w.current[self.specs[tid].receiver]], "receiver")

    def _do_claim(self, w: World, tid: str) -> str:
        """The receiver's engine holds `tid`'s request queued: it claims it."""
        t = self.specs[tid]
        rv = w.ends[w.current[t.receiver]]
        w.tx[tid].claimed = True
        address = self.api.address(t.sender)
        effects = self._call(w, rv.agent, lambda now: rv.proto.receiver.claim(now, tid, address))
        return f"receiver {rv.agent}: claim {tid}" + self._apply(w, rv.agent, effects)

    def _note_claims(self, w: World, src: str, dst: str, payload: bytes) -> None:
        """A sender reads a heartbeat of the receiver that claims transfers it submitted:
        when, for the `[claim-lost]` invariant."""
        if not self.scope.claims:
            return
        # Read only from an agent its side channel vouched for; until then the gate
        # keeps it unread (and reads it when the handshake back is done, unrecorded).
        peer = w.ends[dst].proto.sender._peers.get(src)
        if peer is None or not peer.verified:
            return
        try:
            msg = self.api.messages.decode(payload)
        except Exception:
            return
        for tid in getattr(msg, "claimed", ()):
            tx = w.tx.get(tid)
            if (
                tx is not None
                and tx.s_agent is None
                and self.specs[tid].held
                and w.current.get(self.specs[tid].sender) == dst
                and w.current.get(self.specs[tid].receiver) == src
            ):
                tx.early_claim_read_at = self.local(w, dst)
                self.note(w, f"{tid} claimed before submit")
            if (
                tx is not None
                and tx.s_agent == dst
                and w.current.get(self.specs[tid].receiver) == src
            ):
                tx.claim_read_at = w.now
                self.note(w, f"{tid} claimed")

    def _do_insider_expect(self, w: World, tid: str) -> str:
        return self._expect(w, tid, w.ends[w.current[INSIDER]], "insider")

    def _expect(self, w: World, tid: str, rv: End, who: str) -> str:
        """`rv`'s engine expects `tid` into its lowest free blocks (`who`: "receiver",
        the real one, or "insider")."""
        t = self.specs[tid]
        blocks = self.free_blocks(w, rv.agent, t.n - t.offset)
        assert blocks is not None
        for b in blocks:
            w.held[rv.agent][b] = t.owner
        group = self.group(tid, "receiver") if who == "receiver" else (tid,)
        if t.request:
            w.books[rv.agent].open(t.request, t.request, group)
        lines = []
        for pid in group:
            part = self.specs[pid]
            tx = w.tx[pid]
            if who == "insider":
                tx.i_agent, tx.i_blocks = rv.agent, blocks
            else:
                tx.r_agent, tx.r_blocks = rv.agent, blocks
            sender_agent = w.current[part.sender]
            effects = self._call(
                w,
                rv.agent,
                lambda now, p=part, s=sender_agent: self.api.expect(
                    rv.proto, now, p.tid, s, p, blocks
                ),
            )
            hit = f" after a prefix hit of {t.offset}" if t.offset else ""
            lines.append(
                f"expect {pid} from {sender_agent} into blocks {_fmt_blocks(blocks)}{hit}"
                + self._apply(w, rv.agent, effects)
            )
        return f"{who} {rv.agent}: " + "; ".join(lines)

    def _do_submit(self, w: World, tid: str) -> str:
        t = self.specs[tid]
        agent = w.current[t.sender]
        blocks = self.free_blocks(w, agent, t.n)
        assert blocks is not None
        nl = self.scope.num_layers
        for b in blocks:
            w.held[agent][b] = t.owner
        group = self.group(tid, "sender")
        if t.request:
            w.books[agent].open(t.request, t.request, group)
        lines = []
        for pid in group:
            part = self.specs[pid]
            tx = w.tx[pid]
            tx.s_agent, tx.s_blocks = agent, blocks
            many = self.scope.heads > 1
            tx.submitted = {
                # Not computed yet: a block holds its final content only once its layer
                # is ready (`_do_layer`), so a write issued earlier copies what is there.
                (i, layer, h): (
                    f"{agent}:b{b}:L{layer}{f':h{h}' if many else ''}:{part.owner}"
                    if part.layerwise
                    else w.memory[agent][(b, layer, h)]
                )
                for i, b in enumerate(blocks)
                for layer in range(nl)
                for h in self.heads_of(part)
            }
            tx.layers_left = list(range(nl)) if part.layerwise else []
            what = "no layer ready yet" if part.layerwise else "all layers ready"
            lines.append(
                f"submit {pid} blocks {_fmt_blocks(blocks)}, {what}"
                + self._engine_call(w, agent, ("submit", pid, blocks, part.layerwise))
            )
        return f"sender {agent}: " + "; ".join(lines)

    def _do_layer(self, w: World, tid: str) -> str:
        tx = w.tx[tid]
        assert tx.s_agent is not None
        layer = tx.layers_left.pop(0)
        for i, b in enumerate(tx.s_blocks):
            for h in self.heads_of(self.specs[tid]):
                w.memory[tx.s_agent][(b, layer, h)] = tx.submitted[(i, layer, h)]
        line = f"sender {tx.s_agent}: layer {layer} of {tid} ready"
        return line + self._engine_call(w, tx.s_agent, ("layer", tid, layer))

    def _do_reject(self, w: World, tid: str) -> str:
        """The receiver's engine refuses `tid` before allocating anything (and will not
        expect it later in the scope): it is reported at once, with no blocks."""
        self.spend(w, "rejects")
        t = self.specs[tid]
        rv = w.ends[w.current[t.receiver]]
        w.tx[tid].r_agent, w.tx[tid].r_blocks = rv.agent, ()
        sender = self.api.address(t.sender)
        effects = self._call(
            w, rv.agent, lambda now: rv.proto.receiver.reject(now, tid, sender, "no room")
        )
        return f"receiver {rv.agent}: the engine rejects {tid}" + self._apply(w, rv.agent, effects)

    def _do_refuse(self, w: World, tid: str) -> str:
        """The sender's engine refuses a Register for `tid`, an id it has not submitted
        (it may still submit it later: that submit ends as the refusal did)."""
        self.spend(w, "refusals")
        agent = w.current[self.specs[tid].sender]
        line = f"sender {agent}: the engine refuses the registration of {tid}"
        return line + self._engine_call(w, agent, ("refuse", tid))

    def _do_abort(self, w: World, side: str, tid: str) -> str:
        self.spend(w, "aborts")
        tx = w.tx[tid]
        agent = tx.s_agent if side == "sender" else tx.r_agent
        assert agent is not None
        line = f"{side} {agent}: the engine aborts {tid}"
        for pid in self.group(tid, side):  # every part of its request there
            if side == "sender":
                line += self._engine_call(w, agent, ("abort", pid))
            else:
                line += self._abort_receive(w, agent, pid)
        return line

    def _abort_receive(self, w: World, agent: str, tid: str) -> str:
        proto = w.ends[agent].proto
        return self._apply(
            w, agent, self._call(w, agent, lambda now: proto.receiver.abort(now, tid))
        )

    def _do_part_abort(self, w: World, agent: str, pid: str) -> str:
        """The runtime runs an abort the request's first failure asked for (ignored by
        the protocol if the part ended meanwhile)."""
        w.part_aborts.remove((agent, pid))
        e = w.ends[agent]
        line = f"{agent} aborts part {pid} (its request failed)"
        if e.role == "sender":
            return line + self._apply(
                w, agent, self._call(w, agent, lambda now: e.proto.sender.abort(now, pid))
            )
        return line + self._abort_receive(w, agent, pid)

    def _engine_call(self, w: World, agent: str, call: tuple[Any, ...]) -> str:
        e = w.ends[agent]
        if e.phase == "stalled":
            e.queued.append(call)
            return " (queued: the sender is stalled)"
        if e.phase == "catchup" and any(item[0] != "message" for item in e.inbox):
            # Behind the calls that queued while it was stalled (a layer before its
            # submit would be a call the engine never makes).
            e.inbox.append(call)
            return " (queued behind the engine's earlier calls)"
        return self._apply(w, agent, self._call(w, agent, lambda now: self._run_call(e, now, call)))

    def _run_call(self, e: End, now: float, call: tuple[Any, ...]) -> list[Any]:
        s = e.proto.sender
        match call:
            case ("submit", tid, blocks, layerwise):
                layers = [] if layerwise else None
                if self.scope.insider:  # the engine names the decode server, R
                    return list(s.submit(now, tid, blocks, layers, receiver=self.api.address("R")))
                return list(s.submit(now, tid, blocks, layers))
            case ("layer", tid, layer):
                return list(s.layers_ready(now, tid, [layer]))
            case ("abort", tid):
                return list(s.abort(now, tid))
            case ("refuse", tid):
                return list(s.refuse(now, tid, "not ours to send"))
        raise AssertionError(call)

    def _call(self, w: World, agent: str, fn: Any) -> list[Any]:
        try:
            return list(fn(self.local(w, agent)))
        except LocalProtocolError as exc:
            raise Violation(
                "refused-call", f"{agent}: the protocol refused a legal call: {exc}"
            ) from None

    # network

    def _describe(self, payload: bytes) -> str:
        return self.api.describe(payload)

    def _do_deliver(self, w: World, m: tuple[str, str, bytes], keep: bool = False) -> str:
        src, dst, payload = m
        if not keep:
            w.net.remove(m)
        what = self._describe(payload)
        self._note_forged(w, m, keep)
        self._note_claims(w, src, dst, payload)
        effects = self._call(
            w, dst, lambda now: w.ends[dst].proto.receive_message(now, src, payload)
        )
        verb = "deliver a copy of" if keep else "deliver"
        return f"{verb} {what} {src} -> {dst}" + self._apply(w, dst, effects)

    def _note_forged(self, w: World, m: tuple[str, str, bytes], keep: bool = False) -> None:
        """The scenario of a scope with a forger: its message read by a real process.
        (Forgotten once read, unless a copy stays on the network: a path's state holds
        only the forged messages still on their way.)"""
        if m in w.forged:
            self.note(w, f"{m[1]} reads a forged {self._describe(m[2])} from {m[0]}")
            if not keep:
                w.forged.remove(m)

    def _do_forge(self, w: World, src: str, dst: str, payload: bytes) -> str:
        self.spend(w, "forgeries")
        if (src, dst, payload) not in w.net:
            w.forged.append((src, dst, payload))
        self._send(w, src, dst, payload)
        if src == FORGER:
            return f"{FORGER} forges {self._describe(payload)} to {dst}"
        m = self.api.decode(payload)
        claim = getattr(m, "incarnation", None) or getattr(m, "receiver_incarnation", None)
        claims = f", claiming incarnation {claim}" if claim else ""
        what = self._describe(payload)
        return f"{src} (or a forger under its name) sends {what} to {dst}{claims}"

    def _do_dup(self, w: World, m: tuple[str, str, bytes]) -> str:
        self.spend(w, "dups")
        return self._do_deliver(w, m, keep=True)

    def _do_drop(self, w: World, m: tuple[str, str, bytes]) -> str:
        self.spend(w, "drops")
        w.net.remove(m)
        self.note(w, f"drop {self._describe(m[2])}")
        if m in w.forged:
            w.forged.remove(m)
        return f"drop {self._describe(m[2])} {m[0]} -> {m[1]}"

    # data plane

    def _write(self, w: World, key: tuple[str, int]) -> Write:
        for wr in w.writes:
            if (wr.src, wr.wid) == key:
                return wr
        raise AssertionError(key)

    def _do_land(self, w: World, key: tuple[str, int]) -> str:
        wr = self._write(w, key)
        wr.landed = True
        owners = w.held[wr.dst]
        t = self.specs[wr.tid]
        for b in wr.theirs:
            if owners.get(b) != t.owner:
                now_held = f"given to {owners[b]}" if b in owners else "handed back"
                raise Violation(
                    "late-write",
                    f"write {wr.wid} of {wr.tid} lands in block {b} of {wr.dst}, "
                    f"which the receiver's engine has {now_held}",
                )
        tx = w.tx[wr.tid]
        if t.request and tx.r_agent == wr.dst and tx.r_ended:
            # Its request still holds the blocks, but the part ended there: what it
            # writes now may come after the request's result.
            raise Violation(
                "late-write",
                f"write {wr.wid} of {wr.tid} lands in {wr.dst} after {wr.tid} ended there "
                f"({tx.r_ended[0]})",
            )
        layers = range(self.scope.num_layers) if wr.layers is None else wr.layers
        for layer in layers:
            for ours, theirs in zip(wr.ours, wr.theirs, strict=True):
                for h in wr.heads:
                    w.memory[wr.dst][(theirs, layer, h)] = w.memory[wr.src][(ours, layer, h)]
        self.note(w, f"{wr.tid} lands")
        if self.api.fencing(w.ends[wr.dst].proto, wr.tid):
            self.note(w, f"{wr.tid} lands while the receiver fences")
        if wr.layers is not None:
            self.note(w, f"{wr.tid} lands layer-wise")
        line = (
            f"write {wr.wid} of {wr.tid} lands: {wr.src} blocks {_fmt_blocks(wr.ours)} -> "
            f"{wr.dst} blocks {_fmt_blocks(wr.theirs)}, layers "
            f"{'all' if wr.layers is None else _fmt_blocks(wr.layers)}"
        )
        if wr.notification is not None:
            self._send(w, wr.src, wr.dst, wr.notification)
            line += f"; its notification {self._describe(wr.notification)} is on its way"
        return line

    def _do_complete(self, w: World, key: tuple[str, int]) -> str:
        wr = self._write(w, key)
        w.writes.remove(wr)
        proto = w.ends[wr.src].proto
        effects = self._call(w, wr.src, lambda now: proto.sender.write_done(now, wr.wid))
        return f"{wr.src} learns write {wr.wid} of {wr.tid} is done" + self._apply(
            w, wr.src, effects
        )

    def _do_fail(self, w: World, key: tuple[str, int]) -> str:
        wr = self._write(w, key)
        if w.ends[wr.dst].alive:
            self.spend(w, "failures")
        w.writes.remove(wr)
        proto = w.ends[wr.src].proto
        effects = self._call(
            w,
            wr.src,
            lambda now: proto.sender.write_failed(
                now, wr.wid, FailureReason.WRITE_ERROR, "injected"
            ),
        )
        return f"write {wr.wid} of {wr.tid} fails" + self._apply(w, wr.src, effects)

    def _do_handshake_ok(self, w: World, who: str, whom: str) -> str:
        w.handshakes.remove((who, whom))
        effects = self._call(w, who, lambda now: self.api.handshake_ok(w, w.ends[who], now, whom))
        return f"{who}: handshake with {whom} succeeds" + self._apply(w, who, effects)

    def _do_handshake_fail(self, w: World, who: str, whom: str) -> str:
        w.handshakes.remove((who, whom))
        if self.api.handshake_possible(w, whom):
            self.spend(w, "failures")
        effects = self._call(w, who, lambda now: self.api.handshake_fail(w, w.ends[who], now, whom))
        return f"{who}: handshake with {whom} fails" + self._apply(w, who, effects)

    # deaths, stalls, time

    def _do_restart(self, w: World, agent: str) -> str:
        self.spend(w, "restarts")
        e = w.ends[agent]
        for wr in w.writes:
            if agent in (wr.src, wr.dst) and not wr.landed:
                self.note(w, f"{e.role} restarts with write {wr.wid} of {wr.tid} in flight")
        e.alive = False
        w.net = [m for m in w.net if m[1] != agent]
        w.forged = [m for m in w.forged if m[1] != agent]
        w.writes = [wr for wr in w.writes if wr.src != agent]
        w.handshakes = [h for h in w.handshakes if h[0] != agent]
        new = self._start_incarnation(w, e.engine, e.role)
        return f"{agent} dies (its writes with it); {e.engine} restarts as {new}"

    def _do_lost(self, w: World, observer: str, dead: str) -> str:
        w.noticed.append((observer, dead))
        proto = w.ends[observer].proto
        effects = self._call(
            w, observer, lambda now: proto.peer_lost(now, dead, FailureReason.PEER_GONE, "gone")
        )
        return f"{observer}: the data plane reports {dead} gone" + self._apply(w, observer, effects)

    def _do_stall(self, w: World, agent: str) -> str:
        self.spend(w, "stalls")
        w.ends[agent].phase = "stalled"
        return f"{agent} stalls (a SIGSTOP, a swap storm, a long GIL hold)"

    def _do_sleep(self, w: World, agent: str) -> str:
        """The stall goes on across every timer there is, in one step (the same states
        as a clock step at a time, reached in fewer steps: shorter traces)."""
        start = w.now
        lines = []
        for _ in range(100):
            clock = [a for a in self.actions(w) if a[0] == "clock"]
            if not clock:
                break
            lines.append(self._do_clock(w, clock[0][1]))
        said = [line.split("; ", 1)[1] for line in lines if "; " in line]
        return f"{agent} stays stalled {w.now - start:g} s more" + (
            ": " + "; ".join(said) if said else ""
        )

    def _do_resume(self, w: World, agent: str) -> str:
        e = w.ends[agent]
        for tid, tx in w.tx.items():
            # What the scopes with a stall exist for: a process waking to find that its
            # counterpart ended the transfer meanwhile.
            if e.role == "sender" and tx.s_agent == agent and tx.r_ended and not tx.s_ended:
                self.note(w, f"{tid} ended on the receiver while the sender slept")
            if e.role == "receiver" and tx.r_agent == agent and tx.s_ended and not tx.r_ended:
                self.note(w, f"{tid} ended on the sender while the receiver slept")
        e.phase = "catchup"
        # What waited: the engine's calls, then every message that arrived meanwhile.
        e.inbox = list(e.queued) + [("message", m) for m in w.net if m[1] == agent]
        e.queued = []
        w.net = [m for m in w.net if m[1] != agent]
        line = f"{agent} runs again, with {len(e.inbox)} things queued"
        return line + self._maybe_caught_up(w, agent)

    def _do_inbox(self, w: World, agent: str, i: int) -> str:
        e = w.ends[agent]
        item = e.inbox.pop(i)
        if item[0] == "message":
            m = item[1]
            self._note_forged(w, m)
            self._note_claims(w, m[0], agent, m[2])
            effects = self._call(w, agent, lambda now: e.proto.receive_message(now, m[0], m[2]))
            line = f"{agent} handles queued {self._describe(m[2])} from {m[0]}"
        else:
            effects = self._call(w, agent, lambda now: self._run_call(e, now, item))
            line = f"{agent} runs queued engine call {item[0]} {item[1]}"
        return line + self._apply(w, agent, effects) + self._maybe_caught_up(w, agent)

    def _maybe_caught_up(self, w: World, agent: str) -> str:
        e = w.ends[agent]
        if e.inbox:
            return ""
        e.phase = "running"
        effects = self._call(w, agent, e.proto.tick)
        return "; then it ticks" + self._apply(w, agent, effects)

    def _do_tick(self, w: World, agent: str) -> str:
        e = w.ends[agent]
        return f"{agent} ticks" + self._apply(w, agent, self._call(w, agent, e.proto.tick))

    def _do_clock(self, w: World, target: float) -> str:
        dt = target - w.now
        w.now = target
        parts = []
        for agent, e in w.ends.items():
            if e.alive and e.phase == "running":
                effects = self._call(w, agent, e.proto.tick)
                text = self._apply(w, agent, effects)
                if text:
                    parts.append(f"{agent} ticks{text}")
        stalled = [a for a, e in w.ends.items() if e.alive and e.phase == "stalled"]
        line = f"{dt:g} s pass"
        if stalled:
            line += f" ({', '.join(stalled)} stalled)"
        return line + ("; " + "; ".join(parts) if parts else "")

    # ----- effects and the invariants checked as they happen

    def _send(self, w: World, src: str, dst: str, payload: bytes) -> None:
        if dst not in w.ends or not w.ends[dst].alive:
            return  # to a dead process: nobody reads it
        m = (src, dst, payload)
        if m not in w.net:  # an identical message already on its way: one of them is lost
            w.net.append(m)
            w.net.sort()

    def _apply(self, w: World, agent: str, effects: list[Any]) -> str:
        said: list[str] = []
        for eff in effects:
            said.append(self._apply_one(w, agent, eff))
        said = [s for s in said if s]
        return (": " + ", ".join(said)) if said else ""

    def _apply_one(self, w: World, agent: str, eff: Any) -> str:
        a = self.api
        if isinstance(eff, a.SendMessage):
            payload = a.encode(eff.message)
            self._send(w, agent, eff.peer, payload)
            return f"sends {self._describe(payload)} to {eff.peer}"
        if isinstance(eff, a.WriteBlocks):
            tx = w.tx.get(eff.transfer_id)
            if tx is None or tx.s_agent != agent:
                raise Violation(
                    "phantom", f"{agent} writes for {eff.transfer_id}, never submitted to it"
                )
            if tx.s_ended:
                raise Violation(
                    "write-after-end", f"{agent} writes for {eff.transfer_id} after ending it"
                )
            if eff.peer in w.ends and w.ends[eff.peer].engine == INSIDER:
                raise Violation(
                    "wrong-receiver",
                    f"{agent} writes {eff.transfer_id}'s KV to the insider {eff.peer}; its "
                    "engine named R's side channel",
                )
            note = a.encode(eff.notification) if eff.notification is not None else None
            w.writes.append(
                Write(
                    agent,
                    eff.peer,
                    eff.write_id,
                    eff.transfer_id,
                    tuple(eff.our_blocks),
                    tuple(eff.their_blocks),
                    None if eff.layers is None else tuple(eff.layers),
                    note,
                    w.now,
                    self.heads_of(self.specs[eff.transfer_id]),  # the part's view
                )
            )
            layers = "all layers" if eff.layers is None else f"layers {_fmt_blocks(eff.layers)}"
            rides = " with Done riding on it" if note is not None else ""
            return (
                f"issues write {eff.write_id} of {eff.transfer_id} "
                f"{_fmt_blocks(eff.our_blocks)} -> {_fmt_blocks(eff.their_blocks)}, "
                f"{layers}{rides}"
            )
        if isinstance(eff, a.Handshake):
            target = a.handshake_target(eff)
            if (agent, target) not in w.handshakes:
                w.handshakes.append((agent, target))
            return f"starts a handshake with {target}"
        if isinstance(eff, a.DropPeer):
            return f"forgets {eff.peer}"
        if isinstance(eff, a.TransferEnded):
            return self._ended(w, agent, eff)
        raise AssertionError(f"unknown effect {eff!r}")

    def _ended(self, w: World, agent: str, eff: Any) -> str:
        tid, side = eff.transfer_id, eff.side
        tx = w.tx.get(tid)
        outcome = "ok" if eff.reason is None else f"failed ({eff.reason.value})"
        if w.ends[agent].engine == INSIDER:
            return self._insider_ended(w, agent, eff, outcome)
        where = tx.s_agent if (tx and side == "sender") else (tx.r_agent if tx else None)
        if tx is None or where != agent:
            raise Violation(
                "phantom", f"{agent} reports {tid} on the {side} side, never handed to it"
            )
        ended = tx.s_ended if side == "sender" else tx.r_ended
        if ended:
            raise Violation(
                "twice", f"{agent} reports {tid} a second time ({ended[0]}, now {outcome})"
            )
        ended.append(outcome)
        self.note(w, f"{tid} {'ok' if eff.reason is None else eff.reason.value} on the {side}")
        window = self.scope.timing.claim_window_s
        if (
            side == "sender"
            and window is not None
            and "no receiver registered or claimed" in eff.detail
            and w.now < tx.claim_read_at + window - 1e-9
        ):
            raise Violation(
                "claim-lost",
                f"{agent} gives up {tid} as unclaimed ({eff.detail}), "
                f"{w.now - tx.claim_read_at:g}s after it read its receiver's claim of it: "
                f"a claim keeps it for {window}s",
            )
        if self.scope.budget.forgeries and (
            eff.reason in self._forgery_reasons() or "forged" in eff.detail
        ):
            raise Violation(
                "forged-effect",
                f"{agent} reports {tid} {outcome}: {eff.detail}; nothing in the scope but a "
                "forger could end it so",
            )
        if eff.reason is None:
            geometry = dict(self.scope.geometry)
            engines = sorted({self.specs[tid].sender, self.specs[tid].receiver})
            if len({geometry.get(e, ()) for e in engines}) > 1:
                caches = ", ".join(f"{e} {dict(geometry.get(e, ())) or 'default'}" for e in engines)
                raise Violation(
                    "incompatible-ok",
                    f"{agent} reports {tid} ok between incompatible caches: {caches}",
                )
        want = tx.s_blocks if side == "sender" else tx.r_blocks
        if tuple(eff.blocks) != want:
            raise Violation(
                "phantom", f"{agent} hands back {tid} blocks {eff.blocks}, it held {want}"
            )
        request = self.specs[tid].request
        if side == "sender":
            # Its own writes (another part's may still read blocks of its request).
            self._check_unread(w, agent, want, tid, tid if request else None)
        elif eff.reason is None:
            self._check_content(w, agent, tid, tx, f"{agent} reports {tid} ok")
        if request:
            return f"reports {tid} {outcome}" + self._part_ended(w, agent, eff)
        self._hand_back(w, agent, side, want)
        return f"reports {tid} {outcome}"

    def _check_unread(
        self, w: World, agent: str, blocks: tuple[int, ...], what: str, only: str | None
    ) -> None:
        """No write of `agent` (of transfer `only`, if given) still reads `blocks`."""
        for wr in w.writes:
            # A write to a dead process lands nowhere: what it reads does not matter.
            alive = w.ends[wr.dst].alive
            if only is not None and wr.tid != only:
                continue
            if wr.src == agent and not wr.landed and alive and set(wr.ours) & set(blocks):
                raise Violation(
                    "source-reused",
                    f"{agent} hands back blocks {_fmt_blocks(blocks)} of {what} while its "
                    f"write {wr.wid} of {wr.tid} still reads them; the engine overwrites them now",
                )

    def _hand_back(self, w: World, agent: str, side: str, blocks: tuple[int, ...]) -> None:
        """The engine has the blocks back, and reuses them at once: a sender's get new
        content, a receiver's go to the next transfer."""
        if side == "receiver":
            self._check_fence(w, agent, blocks)
        for b in blocks:
            del w.held[agent][b]
            if side == "sender":
                w.versions[agent][b] += 1
                self._fill(w, agent, b, f"v{w.versions[agent][b]}")

    def _check_fence(self, w: World, agent: str, blocks: tuple[int, ...]) -> None:
        """A receiver hands `blocks` back only when no write into them can land any
        more: each write still in flight into them may land until it was issued plus
        the write bound (the margin the fence states), and that must be before now,
        the end of the receiver's fence. (Without this check, the search would have
        to land that write in a later step to see the late write.)"""
        bound = self.scope.write_bound
        for wr in w.writes:
            if wr.dst == agent and not wr.landed and set(wr.theirs) & set(blocks):
                raise Violation(
                    "fence-margin",
                    f"{agent} hands back blocks {_fmt_blocks(blocks)} at t={w.now:g}, while "
                    f"write {wr.wid} of {wr.tid} by {wr.src}, issued at t={wr.issued_at:g}, "
                    f"may land until t={wr.issued_at + bound:g}; its engine reuses them now",
                )

    def _part_ended(self, w: World, agent: str, eff: Any) -> str:
        """A part's end, through the engine's `RequestParts`: the aborts it asks for
        wait for the runtime (`part_abort`); the request's result hands its blocks back."""
        outcome = w.books[agent].part_ended(eff.transfer_id, eff.reason, eff.detail)
        said = []
        for pid in outcome.abort:
            w.part_aborts.append((agent, pid))
            said.append(f"its engine aborts part {pid}")
        if outcome.ended is not None:
            said.append(self._request_ended(w, agent, outcome.ended))
        return "".join(f"; {x}" for x in said)

    def _request_ended(self, w: World, agent: str, req: Any) -> str:
        rid, side = req.request_id, w.ends[agent].role
        outcome = "finished" if req.ok else f"failed ({req.reason.value})"
        results = w.requests.setdefault((agent, rid), [])
        if results:
            raise Violation(
                "twice",
                f"{agent} reports request {rid} a second time ({results[0]}, now {outcome})",
            )
        results.append(outcome)
        self.note(w, f"{rid} {'ok' if req.ok else req.reason.value} on the {side}")
        blocks = tuple(sorted(b for b, owner in w.held[agent].items() if owner == rid))
        engine = w.ends[agent].engine
        parts = [
            t.tid
            for t in self.scope.transfers
            if t.request == rid and (t.sender if side == "sender" else t.receiver) == engine
        ]
        if side == "sender":
            self._check_unread(w, agent, blocks, f"request {rid}", None)
        elif req.ok:
            for pid in parts:
                what = f"{agent} reports request {rid} finished"
                self._check_content(w, agent, pid, w.tx[pid], what)
        self._hand_back(w, agent, side, blocks)
        return f"its engine has request {rid} {outcome}"

    def _insider_ended(self, w: World, agent: str, eff: Any, outcome: str) -> str:
        """The insider's own side of an id it expected: ended once, its blocks back."""
        tid = eff.transfer_id
        tx = w.tx.get(tid)
        if tx is None or tx.i_agent != agent or eff.side != "receiver":
            raise Violation(
                "phantom", f"{agent} reports {tid} on the {eff.side} side, never handed to it"
            )
        if tx.i_ended:
            raise Violation(
                "twice", f"{agent} reports {tid} a second time ({tx.i_ended[0]}, now {outcome})"
            )
        if tuple(eff.blocks) != tx.i_blocks:
            raise Violation(
                "phantom", f"{agent} hands back {tid} blocks {eff.blocks}, it held {tx.i_blocks}"
            )
        tx.i_ended.append(outcome)
        self.note(w, f"{tid} {'ok' if eff.reason is None else eff.reason.value} on the insider")
        for b in tx.i_blocks:
            del w.held[agent][b]
        return f"reports {tid} {outcome}"

    def _forgery_reasons(self) -> frozenset[FailureReason]:
        """With a forger in the scope, the reasons that only it could cause there (what a
        forged Cancel, Reject or Failed causes says "forged" in its detail instead)."""
        b = self.scope.budget
        out = {FailureReason.MALFORMED_MESSAGE, FailureReason.BLOCK_MISMATCH}
        out.add(FailureReason.UNKNOWN_PEER)
        if not b.restarts:
            out |= {FailureReason.PEER_RESTARTED, FailureReason.PEER_GONE}
        return frozenset(out)

    def _check_content(self, w: World, agent: str, tid: str, tx: Tx, what: str) -> None:
        """Each block `tid` registered at `agent` holds, in every layer and in the heads
        `tid` moves, what its sender submitted."""
        t = self.specs[tid]
        if tx.s_agent is None:
            raise Violation("wrong-bytes", f"{what}, but no sender ever had {tid}")
        for i, b in enumerate(tx.r_blocks):
            for layer in range(self.scope.num_layers):
                for h in self.heads_of(t):
                    want = tx.submitted[(t.offset + i, layer, h)]
                    got = w.memory[agent][(b, layer, h)]
                    if got != want:
                        head = f" head {h}" if self.scope.heads > 1 else ""
                        raise Violation(
                            "wrong-bytes",
                            f"{what}, but its block {b} layer {layer}{head} holds {got!r}, "
                            f"not the submitted {want!r} of {tid}",
                        )

    # ----- at rest

    def check_quiescent(self, w: World) -> None:
        """Nothing can happen any more: every transfer ended once on each live side
        that had it, and nothing is held."""
        for agent, e in w.ends.items():
            if not e.alive:
                continue
            if e.proto.in_flight():
                raise Violation(
                    "held-at-rest", f"{agent} still has transfers in flight, and no timer left"
                )
            held = self.api.held(e.proto)
            if held:
                raise Violation("held-at-rest", f"{agent} still holds blocks at rest: {held}")
        # The protocol holds nothing: a transfer not reported forgot its engine.
        for tid, tx in w.tx.items():
            for agent, ended, side in (
                (tx.s_agent, tx.s_ended, "sender"),
                (tx.r_agent, tx.r_ended, "receiver"),
                (tx.i_agent, tx.i_ended, "insider"),
            ):
                if agent is not None and w.ends[agent].alive and len(ended) != 1:
                    raise Violation("never-ended", f"{tid} never ended on the {side} {agent}")
        for agent, book in w.books.items():
            if w.ends[agent].alive and len(book):
                raise Violation(
                    "never-ended", f"{agent}'s engine never heard how {len(book)} request(s) ended"
                )
        for agent, e in w.ends.items():
            if e.alive and w.held[agent]:
                raise Violation(
                    "held-at-rest", f"{agent}'s engine never got back blocks {w.held[agent]}"
                )


def _rebuild(cls: type, values: tuple[Any, ...]) -> Any:
    # Unpickling a copy of an object the real protocol built, as pickle's own path for
    # slotted classes does (`cls.__new__`, then the slots), minus its per-object cost.
    obj = cls.__new__(cls)
    for name, value in zip(cls.__slots__, values, strict=True):
        object.__setattr__(obj, name, value)
    return obj


# Counters a protocol side keeps for its metrics and never reads back: not part of a
# state (two states that differ only in how many messages were ignored are one), and
# zero in the copies the search makes.
_STATS = {"ignored_messages": 0, "stale_registers": 0, "wrong_receivers": 0, "forged": None}


def _rebuild_side(cls: type, values: dict[str, Any]) -> Any:
    obj = cls.__new__(cls)
    obj.__dict__.update(values)
    for name, zero in _STATS.items():
        obj.__dict__[name] = collections.Counter() if zero is None else zero
    return obj


def _reduce_side(cls: type, obj: Any) -> tuple[Any, ...]:
    values = {k: v for k, v in obj.__dict__.items() if k not in _STATS}
    return (_rebuild_side, (cls, values))


_CONSTANTS: list[Any] = []  # every Keyer's, for `_constant` (kept alive: ids stay unique)


def _constant(i: int) -> Any:
    return _CONSTANTS[i]


class _Constants:
    """Objects that never change once built (a process's identity, its timing and
    compatibility, a peer's address and info): pickled as an index into a table, so
    that a state's pickle holds what changes. Equal objects (by their own `==`: by
    identity for those without one) get the same index, and a copy gets the object
    itself back (shared: none of them is mutated)."""

    def __init__(self) -> None:
        self.index: dict[Any, int] = {}

    def reduce(self, obj: Any) -> tuple[Any, ...]:
        i = self.index.get(obj)
        if i is None:
            i = self.index[obj] = len(_CONSTANTS)
            _CONSTANTS.append(obj)
        return (_constant, (i,))


# What `_Constants` holds, by class name (in the protocol's modules and kvpush.config).
# Not PeerAddress: the protocol builds a new one per message, and a copy that shared
# one object where its original had two equal ones would pickle differently.
_CONSTANT = {
    "LocalIdentity",
    "PeerInfo",
    "_Compatibility",
    "TimingConfig",
    "CompatibilityPolicy",
}


def _reducers(
    modules: tuple[ModuleType, ...], sides: tuple[type, ...] = (), constants: Any = None
) -> dict[type, Any]:
    """Faster pickling of the protocol's slotted dataclasses and enums (the stock path
    runs `dataclasses.fields()` per object, and an enum's lookup by value, per state),
    and the protocol's two sides without their metric counters (`_STATS`)."""
    table: dict[type, Any] = dict(copyreg.dispatch_table)
    for module in modules:
        for obj in vars(module).values():
            if not isinstance(obj, type) or obj.__module__ != module.__name__:
                continue
            if constants is not None and obj.__name__ in _CONSTANT:
                table[obj] = constants.reduce
            elif sides and issubclass(obj, sides):
                table[obj] = functools.partial(_reduce_side, obj)
            elif issubclass(obj, enum.Enum):
                table[obj] = lambda e: (getattr, (type(e), e.name))
            elif dataclasses.is_dataclass(obj) and "__slots__" in obj.__dict__:
                get = operator.attrgetter(*obj.__slots__)
                one = len(obj.__slots__) == 1
                table[obj] = functools.partial(_reduce_slots, obj, get, one)
    return table


def _reduce_slots(cls: type, get: Any, one: bool, obj: Any) -> tuple[Any, ...]:
    values = (get(obj),) if one else get(obj)
    if any(isinstance(v, (set, frozenset)) for v in values):
        # A set's iteration order depends on its insertion history and, for strings, on
        # the process's hash seed: rebuilt in sorted order, equal sets pickle alike, and
        # a scope explores the same states in every process.
        values = tuple(
            type(v)(sorted(v, key=repr)) if isinstance(v, (set, frozenset)) else v for v in values
        )
    return (_rebuild, (cls, values))


class Keyer:
    """A world's pickle: its identity for the search, and the way to copy it."""

    def __init__(self, modules: tuple[ModuleType, ...], sides: tuple[type, ...] = ()) -> None:
        self._constants = _Constants()
        self._table = _reducers(modules, sides, self._constants)

    def __call__(self, w: World) -> bytes:
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = self._table
        pickler.dump(w)
        return buf.getvalue()
