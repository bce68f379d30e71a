"""Who sent it: the checks in front of the transitions (the rules are in
`kvpush.protocol.state`, "Who sent it").

Two gates, both before a message reaches a transfer:

* the message key (`strip_message_key`): `PushProtocol.receive_message` drops, unread,
  every message that does not begin with our key;
* the sender's identity gate (`SenderGate`, a part of `SenderProtocol`): a message from
  an agent no side channel has vouched for yet is kept unread while the side channel it
  names is asked who it serves (`handshake_done`/`handshake_failed`); the side channel's
  answer decides whether the agent is believed, and only then are its messages read. A
  believed agent's messages must claim what its side channel said.

Nothing here ends a transfer by itself: a refused agent's transfers end through
`peer_lost`, and a believed agent's messages go to `SenderProtocol.handle`'s transitions.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from kvpush.config import TimingConfig
from kvpush.errors import FailureReason
from kvpush.protocol._common import (
    Effect,
    Handshake,
    PeerAddress,
    PeerInfo,
    SendMessage,
    _Compatibility,
    _Outgoing,
    _Peer,
    _Side,
)
from kvpush.protocol.messages import (
    Cancel,
    Failed,
    Heartbeat,
    Message,
    Register,
    Reject,
)

# How many messages an agent may send before a side channel vouched for it (a real
# receiver sends a Register or Reject or two, and a heartbeat, in that time); the rest
# are dropped and counted.
_MAX_UNREAD = 64


def strip_message_key(key: bytes, payload: bytes) -> bytes | None:
    """`payload` without our message `key` in front; None when it does not begin with
    it (compared in constant time). An empty key: every payload passes as it is."""
    if not key:
        return payload
    if not hmac.compare_digest(payload[: len(key)], key):
        return None
    return payload[len(key) :]


def _named_address(message: Message) -> PeerAddress | None:
    """The side channel a message names as its sender's (Register, and Reject or a
    claiming Heartbeat from a peer that fills it in), to ask whether it vouches for the
    agent that sent it."""
    match message:
        case Register(receiver_host=host, receiver_port=port, receiver_rank=rank):
            return PeerAddress(host, port, rank)
        case Reject(receiver_host=host, receiver_port=port, receiver_rank=rank) if host:
            return PeerAddress(host, port, rank)
        case Heartbeat(
            role="receiver", receiver_host=host, receiver_port=port, receiver_rank=rank
        ) if host:
            return PeerAddress(host, port, rank)
    return None


def _claims(p: _Peer, message: Message) -> bool:
    """Whether what `message` says about its sender is what `p`'s side channel said."""
    match message:
        case Register(receiver_engine_id=engine, receiver_incarnation=inc):
            return (engine, inc, _named_address(message)) == (
                p.engine_id,
                p.incarnation,
                p.address,
            )
        case Reject(receiver_engine_id=engine, receiver_incarnation=inc, receiver_host=host):
            if not host:
                return True
            return (engine, inc, _named_address(message)) == (
                p.engine_id,
                p.incarnation,
                p.address,
            )
        case Heartbeat(engine_id=engine, incarnation=inc, receiver_host=host):
            if (engine, inc) != (p.engine_id, p.incarnation):
                return False
            return not host or _named_address(message) == p.address
    return True


class SenderGate(_Side[_Outgoing]):
    """The sender's identity gate: which agent a receiver's message may be read from.

    Its state is the peer records' identity fields (`verified`, `inbox`, `rival`,
    `address`, `engine_id`, `incarnation`); `SenderProtocol` holds it, with the rest."""

    _timing: TimingConfig
    _compat: _Compatibility
    ignored_messages: int

    if TYPE_CHECKING:
        # What the gate hands on to, in `SenderProtocol`.
        def handle(self, now: float, peer: str, message: Message) -> list[Effect]: ...
        def _peer_ready(self, now: float, p: _Peer) -> list[Effect]: ...
        def _remember_cancel(self, now: float, peer: str, tid: str) -> None: ...

    def _admit(self, now: float, peer: str, message: Message) -> list[Effect] | None:
        """None when `message` may be read now: its agent `peer` was vouched for and it
        claims what the side channel said. Else what the gate did with it instead: kept
        unread (a first message naming a side channel to ask, or one from an agent being
        looked up) or dropped and counted."""
        p = self._peers.get(peer)
        if p is None:
            address = _named_address(message)
            if address is not None:
                return self._note_peer(now, peer, address, message)
            if isinstance(message, Cancel):
                # Counted, and still remembered against that agent's own Register: a
                # receiver's Cancel may overtake (or outlive) its first Register.
                self._remember_cancel(now, peer, message.transfer_id)
            return self._drop("unknown_agent")
        if not p.verified:
            if len(p.inbox) >= _MAX_UNREAD:
                return self._drop("unread_overflow")
            p.inbox.append((now, message))
            return []
        if not _claims(p, message):
            return self._drop("wrong_engine")
        return None

    def _note_peer(self, now: float, peer: str, address: PeerAddress, msg: Message) -> list[Effect]:
        """A first message from `peer`, naming the side channel at `address`: keep it
        unread and ask that side channel who it serves (`handshake_done`).

        What the message claims is not believed: nothing is bound to `peer` until the
        side channel names it, and a new incarnation of a known engine is recognised only
        when the side channel that vouched for the old one says so."""
        match msg:
            case Register(receiver_engine_id=engine) | Reject(receiver_engine_id=engine):
                pass
            case Heartbeat(engine_id=engine):
                pass
            case _:
                engine = ""
        self._peers[peer] = _Peer(
            peer,
            engine,
            last_heard=now,
            ready=False,
            address=address,
            verified=False,
            inbox=[(now, msg)],
        )
        return [Handshake(address, peer)]

    def handshake_done(self, now: float, address: PeerAddress, info: PeerInfo) -> list[Effect]:
        """The side channel at `address` answered with `info`.

        An agent vouched for there before and not named now restarted (PEER_RESTARTED).
        An agent waiting there (its messages unread in its inbox) is believed if it is
        the one named, and its messages are read; any other is an impostor, and its
        messages are dropped and counted. A believed one whose engine another address
        was vouched for first waits until that address is looked up again. A believed
        one with an incompatible cache is refused (INCOMPATIBLE_PEER); else it is ready
        for writes."""
        now = self._clock.advance(now)
        out = self._restarted(now, address, info)
        problem = self._compat.problem(info.compat)
        for p in list(self._peers.values()):
            if p.rival is None or p.rival[0] != address:
                continue
            if info.agent == p.rival[1]:
                detail = (
                    f"agent {p.agent} claims engine {p.engine_id}, which its side channel "
                    f"at {address} still serves as agent {info.agent}"
                )
                # Its own side channel named it, so the runtime loaded it: unload it.
                out += self._refuse(now, p, "impostor", detail, loaded=True)
            else:  # that address now serves another agent: the one it vouched for is gone
                p.rival = None
                out += self._verified(now, p)
        for p in [p for p in self._peers.values() if p.address == address and not p.verified]:
            if p.rival is not None:
                continue
            if p.agent != info.agent:
                detail = f"the side channel at {address} serves agent {info.agent}, not {p.agent}"
                out += self._refuse(now, p, "impostor", detail)
                continue
            p.engine_id, p.incarnation = info.engine_id, info.incarnation
            rival = next(
                (
                    q
                    for q in self._peers.values()
                    if q.verified
                    and q.engine_id == info.engine_id
                    and q.address is not None
                    and q.address.rank == address.rank
                    and q.address != address
                ),
                None,
            )
            if problem is None and rival is not None and rival.address is not None:
                # Two addresses claim one rank of one engine: the one that vouched first
                # is asked again, and believed if it still serves its agent. (Other
                # ranks of an engine are other agents, each vouched for by its address:
                # one prefill rank writes into several decode ranks when TPs differ.)
                p.rival = (rival.address, rival.agent)
                out.append(Handshake(rival.address, rival.agent, revalidate=True))
                continue
            if problem is not None:
                out += self._incompatible(now, p, address, info, problem)
            else:
                out += self._verified(now, p)
        return out

    def handshake_failed(
        self, now: float, address: PeerAddress, reason: FailureReason, detail: str
    ) -> list[Effect]:
        """The lookup of `address` failed: the agents waiting for it are not believed
        (their messages are dropped and counted; nothing was bound to them). An agent
        waiting for a second look at a rival's address is believed: that address no
        longer vouches for the rival."""
        now = self._clock.advance(now)
        out: list[Effect] = []
        for p in list(self._peers.values()):
            if p.rival is not None and p.rival[0] == address:
                p.rival = None
                out += self._verified(now, p)
        for p in [p for p in self._peers.values() if p.address == address and not p.verified]:
            if p.rival is None:
                why = f"the side channel at {address} could not vouch for it: {detail}"
                out += self._refuse(now, p, "unverified", why)
        return out

    def _refuse(
        self, now: float, p: _Peer, reason: str, detail: str, *, loaded: bool = False
    ) -> list[Effect]:
        """`p` is not who its messages said: drop them unread, and forget it (nothing
        was bound to it). `DropPeer` only if `loaded` (a side channel named this very
        agent, so the runtime loaded it): else the runtime never loaded that name, and
        the name may be a real peer's, borrowed, which must stay loaded."""
        self._drop(reason, len(p.inbox))
        p.inbox.clear()
        if loaded:
            return self.peer_lost(now, p.agent, FailureReason.UNKNOWN_PEER, detail)
        del self._peers[p.agent]
        return []

    def _read_inbox(self, now: float, p: _Peer) -> list[Effect]:
        """Read what a peer just vouched for sent meanwhile, in order; what waited longer
        than `liveness_timeout_s` is dropped (a live receiver sends its Registers again
        every heartbeat interval until we list them, so nothing is lost, and a message
        that old may speak for a transfer its sender gave up since)."""
        p.verified = True
        out: list[Effect] = []
        inbox, p.inbox = p.inbox, []
        for at, m in inbox:
            if self._too_old_to_read(now, at):
                self.ignored_messages += 1
            else:
                out += self.handle(now, p.agent, m)
        return out

    def _too_old_to_read(self, now: float, arrived: float) -> bool:
        return now - arrived > self._timing.liveness_timeout_s

    def _verified(self, now: float, p: _Peer) -> list[Effect]:
        """The side channel vouched for `p`: read what it sent meanwhile, then write."""
        out = self._read_inbox(now, p)
        if p.agent in self._peers:
            out += self._peer_ready(now, p)
        return out

    def _incompatible(
        self, now: float, p: _Peer, address: PeerAddress, info: PeerInfo, problem: str
    ) -> list[Effect]:
        # Nothing was written (writes wait for the handshake): read what it sent (writes
        # still wait), then say why with a Failed per transfer, so the receiver gives its
        # blocks back now, not at its deadline.
        out = self._read_inbox(now, p)
        failure = FailureReason.INCOMPATIBLE_PEER
        view = f"sender refused our KV cache: {self._compat.their_view(info.compat)}"
        for rec in [r for r in self._transfers.values() if r.peer == p.agent]:
            out.append(SendMessage(p.agent, Failed(rec.transfer_id, failure, view)))
        detail = f"receiver at {address}: {problem}"
        return out + self.peer_lost(now, p.agent, failure, detail)
