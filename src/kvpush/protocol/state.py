"""The push protocol's state machines, with no I/O: the theory of operation, and
`PushProtocol`, the one entry point for both.

Where each rule lives:

* `receiver.py` — `ReceiverProtocol`, the receiving side: the engine's calls, the
  handshakes, the transitions on a sender's messages, and `_end`, where each of its
  transfers ends. Beside it, tables and timers that answer and never act: `claims.py`
  (`Claims`), `lookups.py` (`Lookups`), `receiver_timers.py` (`ReceiverTimers`: a sender
  silent, a deadline passed, a fence over, a Cancel to repeat, `next_deadline`), and
  `receiver_messages.py`, where what it sends is built, naming it the same way in each.
  What is left in `ReceiverProtocol` is its transition table, kept whole for the reason
  `sender.py` gives: each transition may end a transfer, and must reach `_end`.
* `sender.py` — `SenderProtocol`: the engine's calls, the transitions on a believed
  receiver's messages, the writes, and `_end_transfer`, the one exit every sender
  transfer ends through. It owns objects, one concern each, which answer with
  verdicts and never call back into it:
* `identity.py` — "Who sent it": the message-key check in front of `PushProtocol`, and
  the sender's identity gate in front of `SenderProtocol.handle` (`SenderGate`: admit,
  hold or drop a message; believe or refuse an agent a side channel answered for).
* `leases.py` — "Leases measured on the receiver's clock": the sender's leases, clock
  bound, heartbeats and timers (`SenderLeases`: a lease lapsed or held, what `tick`
  must end, `next_deadline`).
* `tombstones.py` — the sender's memory of what is over: the ids that ended and the
  answer a late message about one gets, and Cancels that overtook their Register
  (`Tombstones`).
* `writes.py` — the sender's write ledger and what its next write carries, Done riding
  on the last one (`SenderWrites`).
* `choice.py` — which receiver a sender transfer goes to: the one named at submit, the
  Registers held until then, claims (`ReceiverChoice`).
* `_common.py` — what both sides share: values, effects, a peer, the clock, the
  compatibility decision, and `ended_unreported`.
* this file — the theory of operation, and `PushProtocol`, which holds both machines.

Every name is importable from here (and from `kvpush.protocol`).

Theory of operation
===================

Two machines per rank: `SenderProtocol` (the side whose engine computed the KV blocks,
usually prefill) and `ReceiverProtocol` (the side that allocated blocks for them, usually
decode). `PushProtocol` holds both and is the one inbound entry point for wire bytes and
handshake results. They take engine calls, decoded messages, transport events, handshake
results and the current time `now` (monotonic seconds, fed by the caller), and return
lists of *effects*: `SendMessage`, `WriteBlocks`, `Handshake`, `DropPeer`,
`TransferEnded`. They import no socket, thread or clock; the runtime carries out the
effects. Every `TransferEnded` is built in this package: by the machines, and, for a
transfer whose end they did not report before the runtime stopped (its data plane
closed), by `ended_unreported`. The runtime only passes them on.

A transfer is named by its `transfer_id`, end to end. Peers are named by data-plane agent
name, which is new for every process incarnation, so a restarted peer is a new peer.
Side channels are named by `PeerAddress` (host, port, rank); a handshake looks one up
and yields a `PeerInfo` (agent, engine id, incarnation, the peer's compatibility
fields).

The happy path::

    receiver                                 sender
    expect(T, address, blocks)
      (Handshake(address) unless known)
    handshake_done(address, info)
                       --Register(T)-->      (Handshake back if new peer, then a
                       <--Heartbeat--         heartbeat whose echo sets the clock bound)
                       --Heartbeat(echo)-->
                                             submit(T, blocks) / layers_ready(T, ...)
                       <==WRITE blocks===    (one write per batch of ready layers)
                       <--Done(T)--          the last write's notification
    TransferEnded(ok)                        TransferEnded(ok) on its WriteDone

Handshakes are keyed by address: every transfer waiting for one address waits for one
lookup, lookups of different addresses are independent, and one result answers both
machines (`PushProtocol.handshake_done`). A receiver registers from a cached `PeerInfo`
without a lookup while the peer was heard from within `revalidate_after_s`; older ones
are looked up again first, so a peer restarted at the same address is found by the
lookup, not by a failed transfer. A transfer's deadline runs from `expect`/`submit`,
handshake included.

Compatibility, on both sides, by default: a `PeerInfo` whose compatibility fields
(`CacheGeometry.compat_fields()`: protocol version, layout, block size, dtype, mode,
regions) differ from ours in a field the `CompatibilityPolicy` does not allow fails
every transfer that waited for it with INCOMPATIBLE_PEER, the detail naming each field,
theirs and ours; the peer is never registered with or written to.

`Done` rides on the transfer's last write as its data-plane notification, which arrives
only after that write's bytes (NIXL's guarantee, and the loopback's): no round trip after
the data. It rides only when no other write of the transfer is in flight; otherwise, and
for a full prefix hit (nothing to write), it goes as a message once every write reported
`WriteDone`. A write that fails delivers no notification, so the sender sends `Failed`.

Registration may come before or after the sender's engine submits: whichever comes
second starts the writes. `Register.sender_offset = k` says the receiver's blocks stand
for the sender's blocks from `k` on (a prefix-cache hit); a full hit registers no blocks
and the sender answers `Done` at once without writing.

The fencing rules, which make "nothing is written after a failure" hold:

* The sender sends `Done`, `Failed` or `CancelAck` for a transfer only when none of its
  writes is in flight (a `Done` riding on the last write is delivered only after that
  write landed), and never writes for it afterwards (it keeps a tombstone). So a
  receiver that gets any of these may reuse its blocks at once.
* Silent is not dead. A sender that ends a transfer for any reason but a certainly gone
  peer (receiver silence, lease expiry, deadline, engine abort, cancel, runtime
  shutdown) first waits for every write in flight to report `WriteDone`/`WriteFailed`,
  however long that takes: the transfer stays ENDING and its blocks stay held (see
  `statistics()`), because a write that has not reported may still be reading them.
  Only the data plane's verdict ends a write; a runtime that closes reports its
  transfers only after its transport is closed (no write can read or land then).
* A receiver that gives up on its own (engine abort, deadline, silent sender, bad
  message) sends `Cancel` and *fences* its blocks: it keeps them until the sender's
  `CancelAck`/`Failed`/`Done`, or until the sender's lease has certainly run out
  (`fence_s = lease_s + 2 * liveness_timeout_s` after it stopped renewing it), and
  reports the transfer only then. `TransferEnded` therefore always means "the blocks
  are yours".
* A peer whose process is certainly gone (the data plane lost it, or its side channel
  now serves a new incarnation: a restart proven by a handshake, never by what a message
  claims) can write nothing more: its transfers end at once, and `DropPeer` tells the
  runtime to forget it, so the next transfer handshakes afresh.

Who sent it
-----------

A message is attributed to the agent the data plane says sent it (NIXL keys every
notification by the sending agent's name), never to what it says about itself, and an
agent is believed to be an engine (id and incarnation) only once that engine's side
channel (token-authenticated, when a token is configured) has named it:

* The receiver writes to, and hears from, only senders it looked up itself: a message
  from any other agent, a heartbeat that claims another engine or incarnation than the
  agent's side channel said, or a `Done`/`Failed`/`CancelAck` for a transfer registered
  with another sender is dropped and counted (`PushProtocol.forged_messages()`).
* The sender learns receivers from their `Register` (or `Reject`), which names the
  receiver's side channel. A first message from a new agent is kept unread (up to
  `_MAX_UNREAD`) while the sender asks that side channel who it serves; nothing is bound
  to the agent meanwhile. If the side channel names that agent, its messages are read
  in order; if it names another (an impostor, or a receiver that restarted meanwhile) or
  does not answer, they are dropped and counted. A verified agent's messages must claim
  the engine, incarnation and address its side channel gave, else they are dropped.
* A restart is proven only by the side channel that vouched for the old agent: the next
  lookup of that address names a new agent (PEER_RESTARTED). A second address claiming
  a rank of an engine that is vouched for elsewhere (another host or port, the same
  rank: an engine's other ranks are other agents, as when one prefill rank writes into
  several decode ranks) is believed only after the first address is
  looked up again (`Handshake(revalidate=True)`) and no longer serves its agent, and that
  lookup never ends the old agent's transfers by itself; what is certainly gone ends
  them (the data plane's verdict, or that address naming someone else), what merely went
  quiet ends them the safe way (liveness, lease, deadline).
* Only a transfer's own counterpart can end it: `Cancel`, `Reject`, `Done`, `Failed`,
  `CancelAck` and heartbeats act only on transfers bound to the agent they came from.
  A `Cancel` for an id its agent has not registered (yet) is remembered for that agent
  only (`Tombstones.remember_cancel`): it ends that agent's Register for the id when it
  comes, and a transfer of ours that nobody registered yet waits for its own receiver's
  Register or its deadline, since it names no receiver that could end it.

The data plane does not authenticate agent names: any process holding our NIXL metadata
can connect and send notifications under any name, a real peer's included (how that was
shown: docs/benchmarks.md, "Design notes moved from docstrings"). Two checks come before
a message is read:

* The message key: every incarnation has a random 16-byte key, published in its
  side-channel metadata, and `PushProtocol(message_key=...)` drops every message that
  does not begin with it ("bad_key", `identity.strip_message_key`). It costs less than
  decoding and keeps strays (another deployment, a stale peer) out; but it travels in
  clear, in metadata answers and in front of every message, so it proves nothing to
  someone who can read the network.
* With a token configured, a MAC (`kvpush.protocol.auth`, `PushProtocol(auth=...)`):
  every message carries a tag under a key for its (sending rank, receiving rank, both
  incarnations), derived from the token and the incarnations the side channel gave and
  never sent, and a sequence number per pair. A message no token holder made for this
  pair, or one changed on the way, is dropped ("bad_mac"); one that came before, by
  anyone, is dropped too ("replayed"). Neither ends a transfer. So what a reader of the
  network sees (agent names, message keys, metadata, earlier messages) grants nothing:
  with a token, only token holders can make a message that counts, under any name.

Without a token neither the side channel nor the data plane authenticates anyone: the
side channel serves the message key to anyone who asks, and identity rests on the rules
above, which hold against any agent that does not borrow a real peer's name. A process
that can reach the data plane and borrows one (the receiver's agent name and
incarnation, both in its side channel's answer) can end or disturb that peer's
transfers, and can make a wrong byte land: a heartbeat forged under the receiver's name
renews the lease of a transfer the receiver already gave up, and the sender's next
write lands in blocks the receiver handed back (the exhaustive checker finds it in 15
steps, with the forger borrowing real names: docs/protocol-checking.md). Only the MAC
stops it: set a token wherever the data plane can be reached by anyone but the
deployment's own engines.

What an agent admitted by the side channel (it holds the token, or none is set) can do,
under its own name and with a side channel of its own: register a transfer id it
predicted before the real receiver does. Where the engine names the receiver
(`SenderProtocol.submit(receiver=...)`, the decode server's side-channel address), that
Register is refused and counted (`wrong_receivers`): a receiver is the one named only if
the side channel at that address vouched for its agent, which an insider cannot make it
do. Registers that come before submit are held, unanswered, until submit names the one.
Where the engine names none, the first receiver to register takes the transfer.

Leases measured on the receiver's clock
---------------------------------------

The sender holds its blocks for a transfer under a lease that the receiver grants
(`Register`) and renews (`Heartbeat`s listing it) for `lease_s` *on the receiver's
clock*, from the message's `sent_at`. A message's arrival time proves nothing about its
age: it may have waited in the inbox of a sender that was stopped (SIGSTOP, a cgroup
freeze, swap, a long GIL hold). So the sender bounds the receiver's clock from below by
round trips: each sender `Heartbeat` carries our `sent_at`, the receiver echoes the
newest one it has read in its next heartbeat (and answers a sender heartbeat at once),
and a receiver heartbeat with `sent_at = r` and `echo = t0` proves that the receiver's
clock read `r` after ours read `t0`, so `skew = ours - theirs >= t0 - r`. The sender
keeps the bound from the newest heartbeat of its own that came back (`skew_lb`; an old
echo repeated after an idle spell is not newer, so it cannot loosen it) and holds that
a lease granted at the receiver's `s` runs out, in our clock, at `s + lease_s +
skew_lb`, which is no later
than the truth however long either process stalled (a stall only makes the bound
looser, i.e. the lease shorter). The lease is checked where every `WriteBlocks` is
issued (submit, layers_ready, Register, handshake done, a fresh echo), not only in
`tick`. Until a peer's first echo there is no bound: writes wait for it (one data-plane
round trip on first contact with a peer, not per transfer). A Register that is older
than its lease by that bound is refused with `Failed(PEER_TIMEOUT)`: nothing is written
for it.

A loose bound is measured again before it condemns anything. A round trip that waited
(a starved or stopped receiver read our heartbeat late) leaves `skew_lb` too small by
the wait, and with no transfer in flight no heartbeat would measure it again: every
later Register would look stale, for good. So a lease that looks over (a Register, a write about to
start, `tick`) first makes the sender send the receiver a heartbeat, which it answers at
once with a fresh echo and the ids it still waits for (renewing their leases); the
transfer is decided on that bound (`_Outgoing.recheck`). Nothing is written meanwhile,
so the wait costs one round trip of liveness, never safety; silence ends it as any
silence does.

The receiver's fence runs `lease_s + 2 * liveness_timeout_s` from when it gave up, and
it stopped renewing no later than that, so by the time it reuses the blocks the sender
has started no write for at least `2 * liveness_timeout_s` (6 s by default). What the
fence still assumes: a write the sender *issued* before its lease ran out lands (or
fails) within that margin. A process stopped in the middle of handing a write to the
data plane, or a data plane that copies in the stopped sender's own process (UCX over
shared memory or TCP progresses only when the sender polls), can land such a write late,
after the margin; a NIC doing RDMA does not stop with the process. The default 6 s
margin is far longer than any write a running sender issues takes (the data plane's
speed: docs/benchmarks.md); only a stop of the sender in the middle of one is outside
it. Monotonic clocks of two hosts may also drift apart: the bound is taken afresh from
every echo (about every `heartbeat_interval_s` while transfers flow), so drift counts
only over an idle spell before the next echo, far below the margin at common rates (100
ppm is 0.36 s an hour). On one host both ends read the same monotonic clock: no drift at
all.

Claims
------

A submitted transfer that no receiver registered for names no receiver whose silence
could end it: until claims, it waited for its deadline (60 s by default), holding its
blocks, when its receiver died before registering. With `TimingConfig.claim_window_s`
set, it lives that window from submit, and each receiver heartbeat that claims it
(`Heartbeat.claimed`: the receiver holds the request, queued, with no blocks to register
yet; `ReceiverProtocol.claim`) keeps it a window more from when the claim is read; then
it ends as PEER_TIMEOUT. A claiming heartbeat names the receiver's side channel, as a
Register does, so that a sender that never heard from that receiver vouches for it
first (`SenderGate`); a claim of a transfer named for another receiver (`submit(
receiver=)`) keeps nothing. The claimer certainly gone ends what it claimed at once.
A claim of an id not submitted yet keeps nothing either: the sender only remembers the
id for a liveness timeout after the last heartbeat that claimed it
(`claimed_before_submit`, kept by `ReceiverChoice`), so that an engine that learns the
receiver's shape from the parts it names (as from an early Register) can split and
submit it.

A claim only keeps or ends a transfer nothing was written for (it has no Register), so
it cannot touch the fencing rules; what it bounds is liveness. A receiver that died
costs the sender the blocks of a transfer it never registered for at most the window
after its last claim (or the submit), and of one it registered for the liveness timeout
(silence) or less; a receiver stopped for less than the window (and, once registered,
less than the liveness timeout) keeps its transfers. The window is off by default
(None: the deadline): a sender cannot know whether its receivers claim, and one that
does not would lose a request queued longer than the window. The exhaustive checker
explores claims, stalls of the claiming receiver and the window (scope `claims`), and
a send held until a claim names it (scope `claims-held`).

One exception to "a lost peer ends its transfers": a receiver's first `Register` sent
from a cached `PeerInfo` that certainly reached no live sender (the runtime saw the data
plane lose the peer in the same pass that sent it, and nothing was heard from the peer
since) may be `withdraw`n: the transfer goes back to handshaking its address, once. No
byte of it can have been written, and nothing is reported for the withdrawn attempt.

Every transfer the engine handed in ends with exactly one `TransferEnded`, on each side,
within `transfer_deadline_s` plus the fence, except a sender whose data plane never
reports on a write (above). Tombstones make late, duplicate and reordered messages
harmless: a late `Register` gets the recorded answer again, a `Cancel` that overtakes its
`Register` is remembered for its agent, and that agent's `Register` then meets it.

Errors: engine misuse raises `LocalProtocolError` at the call; bytes that are not a
message raise `RemoteProtocolError` from `PushProtocol.receive_message` with no state
changed (the runtime then calls `peer_misbehaved`). A decodable message that makes no
sense for its transfer fails that transfer with MALFORMED_MESSAGE.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

from kvpush.config import STRICT_COMPATIBILITY, CompatibilityPolicy, TimingConfig
from kvpush.errors import (
    FailureReason,
    RemoteProtocolError,
)
from kvpush.protocol._common import (
    REVALIDATE_AFTER_S,
    DropPeer,
    Effect,
    Handshake,
    LocalIdentity,
    PeerAddress,
    PeerClock,
    PeerInfo,
    ReceiverState,
    SenderState,
    SendMessage,
    Side,
    TransferEnded,
    WriteBlocks,
    _Compatibility,
    ended_unreported,
)
from kvpush.protocol.auth import MessageAuth
from kvpush.protocol.identity import strip_message_key
from kvpush.protocol.messages import (
    Cancel,
    Heartbeat,
    Message,
    Register,
    Reject,
    decode,
    encode,
)
from kvpush.protocol.receiver import ReceiverProtocol
from kvpush.protocol.sender import SenderProtocol

# --------------------------------------------------------------------------- both


class PushProtocol:
    """Both sides of one rank, and the one inbound entry point for wire bytes and for
    handshake results.

    `compat` is our `CacheGeometry.compat_fields()`; every peer's is compared with it on
    every handshake, on both sides, under `compatibility` (default: nothing may differ).

    `message_key`: when set, every message we accept must begin with it, and anything
    else is dropped unread and counted ("bad_key"). We publish it on our side channel
    (`PeerInfo.message_key` on the other side); `wire()` puts each peer's own key in front
    of what we send it. It keeps strays out; it travels in clear.

    `auth` (with a token configured): every message we send is sealed for its peer and
    every message we accept must open, else it is dropped unread and counted ("bad_mac",
    "replayed"); see "Who sent it" and `kvpush.protocol.auth`.
    """

    def __init__(
        self,
        identity: LocalIdentity,
        timing: TimingConfig,
        num_layers: int,
        compat: Mapping[str, object],
        *,
        compatibility: CompatibilityPolicy = STRICT_COMPATIBILITY,
        revalidate_after_s: float = REVALIDATE_AFTER_S,
        message_key: bytes = b"",
        auth: MessageAuth | None = None,
    ) -> None:
        self.identity = identity
        self._key = bytes(message_key)
        self._auth = auth
        self._peer_keys: dict[str, bytes] = {}  # agent -> the key it wants from us
        self._forged: collections.Counter[str] = collections.Counter()
        self.sender = SenderProtocol(
            identity, timing, num_layers, compat, compatibility=compatibility
        )
        self.receiver = ReceiverProtocol(
            identity,
            timing,
            compat,
            compatibility=compatibility,
            revalidate_after_s=revalidate_after_s,
        )
        self._compat = _Compatibility(compat, compatibility)

    def receive_message(self, now: float, peer: str, payload: bytes) -> list[Effect]:
        """Decode and route one message from agent `peer` (as the data plane names the
        sender). Without our message key in front it is dropped unread and counted.
        Raises `RemoteProtocolError` (nothing changed) when the bytes are not a message;
        the caller then calls `peer_misbehaved`."""
        unkeyed = strip_message_key(self._key, payload)
        if unkeyed is None:
            self._forged["bad_key"] += 1
            return []
        if self._auth is not None:
            opened = self._auth.open(peer, unkeyed)
            if isinstance(opened, str):
                self._forged[opened] += 1
                return []
            unkeyed = opened
        try:
            message = decode(unkeyed)
        except RemoteProtocolError:
            self.receiver.heard_from(peer, now)
            raise
        match message:
            case Register() | Cancel() | Reject() | Heartbeat(role="receiver"):
                self.receiver.heard_from(peer, now)
                return self.sender.handle(now, peer, message)
            case _:
                return self.receiver.handle(now, peer, message)

    def wire(self, peer: str, message: Message) -> bytes:
        """`message` as bytes for agent `peer`: its message key (from its handshake), then
        the encoded message, sealed for that peer when we authenticate messages."""
        body = encode(message)
        if self._auth is not None:
            body = self._auth.seal(peer, body)
        return self._peer_keys.get(peer, b"") + body

    def forged_messages(self) -> dict[str, int]:
        """Messages dropped unread because of who sent them, by reason: "bad_key" (not
        our message key), "bad_mac" (no token holder made it for this pair of ranks, or
        it was changed), "replayed" (a message that came before, sent again),
        "unknown_agent" (an agent no side channel vouched for, naming
        none to ask), "impostor" (the side channel it named serves another agent, or the
        engine it claims still runs elsewhere), "unverified" (the side channel it named
        did not answer), "wrong_engine" (its agent was vouched for as another engine),
        "not_counterpart" (about a transfer of another peer), "unread_overflow" (too
        many before a side channel vouched for it)."""
        out = self._forged + self.sender.forged + self.receiver.forged
        return dict(out)

    def handshake_done(self, now: float, address: PeerAddress, info: PeerInfo) -> list[Effect]:
        """A `Handshake` of `address` found `info`: both machines learn it."""
        if info.message_key:
            self._peer_keys[info.agent] = bytes(info.message_key)
        if self._auth is not None:
            self._auth.learn(info.agent, info.incarnation)
        return self.receiver.handshake_done(now, address, info) + self.sender.handshake_done(
            now, address, info
        )

    def handshake_failed(
        self, now: float, address: PeerAddress, reason: FailureReason, detail: str
    ) -> list[Effect]:
        """A `Handshake` of `address` failed (unreachable, refused, unloadable)."""
        return self.receiver.handshake_failed(
            now, address, reason, detail
        ) + self.sender.handshake_failed(now, address, reason, detail)

    def incompatibility(self, compat: Mapping[str, object]) -> str | None:
        """The protocol's compatibility verdict on a peer's compat fields, for a caller
        that must decide whether to load the peer on the data plane at all (None: ok)."""
        return self._compat.problem(compat)

    def peer_misbehaved(self, now: float, peer: str, detail: str) -> list[Effect]:
        """`peer` sent garbage: everything with it fails (MALFORMED_MESSAGE), safely,
        the detail naming it."""
        out: list[Effect] = []
        reason = FailureReason.MALFORMED_MESSAGE
        detail = f"agent {peer} sent garbage: {detail}"
        for tid in list(self.sender.states()):
            out += self.sender.abort_with_peer(now, tid, peer, reason, detail)
        for tid in list(self.receiver.states()):
            out += self.receiver.abort_with_peer(now, tid, peer, reason, detail)
        return out

    def peer_lost(self, now: float, peer: str, reason: FailureReason, detail: str) -> list[Effect]:
        return self.sender.peer_lost(now, peer, reason, detail) + self.receiver.peer_lost(
            now, peer, reason, detail
        )

    def shutdown(self, now: float, reason: FailureReason, detail: str) -> list[Effect]:
        """End everything at once; only once the data plane can touch no memory of ours
        (see `SenderProtocol.shutdown`)."""
        return self.sender.shutdown(now, reason, detail) + self.receiver.shutdown(
            now, reason, detail
        )

    def tick(self, now: float) -> list[Effect]:
        return self.sender.tick(now) + self.receiver.tick(now)

    def in_flight(self) -> bool:
        return self.sender.in_flight() or self.receiver.in_flight()

    def next_deadline(self) -> float | None:
        times = [
            t for t in (self.sender.next_deadline(), self.receiver.next_deadline()) if t is not None
        ]
        return min(times) if times else None


__all__ = [
    "REVALIDATE_AFTER_S",
    "DropPeer",
    "Effect",
    "Handshake",
    "LocalIdentity",
    "PeerAddress",
    "PeerClock",
    "PeerInfo",
    "PushProtocol",
    "ReceiverProtocol",
    "ReceiverState",
    "RemoteProtocolError",
    "SendMessage",
    "SenderProtocol",
    "SenderState",
    "Side",
    "TransferEnded",
    "WriteBlocks",
    "ended_unreported",
]
