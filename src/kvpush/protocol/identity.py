"""Who sent it: the checks in front of the transitions (the rules are in
`kvpush.protocol.state`, "Who sent it").

Two gates, both before a message reaches a transfer:

* the message key (`strip_message_key`): `PushProtocol.receive_message` drops, unread,
  every message that does not begin with our key;
* the sender's identity gate (`SenderGate`, an object `SenderProtocol` owns): a message
  from an agent no side channel has vouched for yet is kept unread while the side channel
  it names is asked who it serves (`handshake_done`/`handshake_failed`); the side
  channel's answer decides whether the agent is believed, and only then are its messages
  read. A believed agent's messages must claim what its side channel said.

The gate answers, and never acts on a transfer: `admit` says whether a message may be
read now (`Admit`), is kept unread (`Hold`) or is dropped (`Drop`); `answered` and
`unanswered` say, per agent waiting on a side channel, whether it is believed (`Believe`,
with the messages it sent meanwhile) or refused (`Refuse`), or which side channel must
be asked again (a `Handshake`). `SenderProtocol` acts on those verdicts: it counts what
was dropped, reads what was held, and ends the transfers of a refused agent
(`peer_lost`).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from kvpush.config import TimingConfig
from kvpush.protocol._common import (
    Handshake,
    PeerAddress,
    PeerInfo,
    _Compatibility,
    _Peer,
)
from kvpush.protocol.messages import (
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


# ----- the verdicts


@dataclass(frozen=True, slots=True)
class Admit:
    """Read the message now: its agent was vouched for, and it claims what was said."""


ADMIT = Admit()


@dataclass(frozen=True, slots=True)
class Hold:
    """The message is kept unread until a side channel vouches for its agent. `ask`: the
    lookup to start (a first message, naming a side channel); None: one is under way."""

    ask: Handshake | None = None


@dataclass(frozen=True, slots=True)
class Drop:
    """The message is dropped unread, to be counted under `reason` ("Who sent it")."""

    reason: str


@dataclass(frozen=True, slots=True)
class Believe:
    """A side channel vouched for `agent`: read `messages`, what it sent meanwhile, in
    order (`stale` more waited too long to be read, and are ignored); then it may be
    written to, unless its KV cache is incompatible with ours (`problem`: what differs)."""

    agent: str
    messages: tuple[Message, ...]
    stale: int
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class Refuse:
    """`agent` is not who its messages said: `dropped` of them were dropped unread (to
    be counted under `reason`). `loaded`: a side channel named this very agent, so the
    runtime loaded it, and it must be lost (`peer_lost`, which unloads it); else the gate
    forgot it already: nothing was bound to it, and the name may be a real peer's,
    borrowed, which must stay loaded."""

    agent: str
    reason: str
    detail: str
    dropped: int
    loaded: bool = False


Vouching = Believe | Refuse | Handshake


# ----- the gate


class SenderGate:
    """The sender's identity gate: which agent a receiver's message may be read from.

    Its state is the identity fields of the sender's peer records (`verified`, `inbox`,
    `rival`, `address`, `engine_id`, `incarnation`): it adds a record for an agent's
    first message, and forgets one it refuses before anything was bound to it."""

    def __init__(
        self, peers: dict[str, _Peer], timing: TimingConfig, compat: _Compatibility
    ) -> None:
        self._peers = peers  # the sender's
        self._timing = timing
        self._compat = compat

    def admit(self, now: float, peer: str, message: Message) -> Admit | Hold | Drop:
        """Whether `message` from agent `peer` may be read now: its agent was vouched
        for and it claims what the side channel said (`Admit`). Else it is kept unread (a
        first message naming a side channel to ask, or one from an agent being looked
        up: `Hold`) or dropped (`Drop`)."""
        p = self._peers.get(peer)
        if p is None:
            address = _named_address(message)
            if address is None:
                return Drop("unknown_agent")
            return Hold(self._note_peer(now, peer, address, message))
        if not p.verified:
            if len(p.inbox) >= _MAX_UNREAD:
                return Drop("unread_overflow")
            p.inbox.append((now, message))
            return Hold()
        if not _claims(p, message):
            return Drop("wrong_engine")
        return ADMIT

    def _note_peer(self, now: float, peer: str, address: PeerAddress, msg: Message) -> Handshake:
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
        return Handshake(address, peer)

    def answered(self, now: float, address: PeerAddress, info: PeerInfo) -> list[Vouching]:
        """The side channel at `address` answered with `info` (the agents it vouched for
        before and does not name now restarted: `SenderProtocol` ends those first).

        An agent waiting there (its messages unread in its inbox) is believed if it is
        the one named; any other is an impostor. A believed one whose engine another
        address was vouched for first waits until that address is looked up again (the
        `Handshake` to send). A believed one with an incompatible cache is believed with
        its `problem`, to be refused (INCOMPATIBLE_PEER) once its messages are read."""
        problem = self._compat.problem(info.compat)
        out: list[Vouching] = []
        for p in list(self._peers.values()):
            if p.rival is None or p.rival[0] != address:
                continue
            if info.agent == p.rival[1]:
                detail = (
                    f"agent {p.agent} claims engine {p.engine_id}, which its side channel "
                    f"at {address} still serves as agent {info.agent}"
                )
                # Its own side channel named it, so the runtime loaded it: unload it.
                out.append(self._refuse(p, "impostor", detail, loaded=True))
            else:  # that address now serves another agent: the one it vouched for is gone
                p.rival = None
                out.append(self._believe(now, p))
        for p in [p for p in self._peers.values() if p.address == address and not p.verified]:
            if p.rival is not None:
                continue
            if p.agent != info.agent:
                detail = f"the side channel at {address} serves agent {info.agent}, not {p.agent}"
                out.append(self._refuse(p, "impostor", detail))
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
            out.append(self._believe(now, p, problem))
        return out

    def unanswered(self, now: float, address: PeerAddress, detail: str) -> list[Vouching]:
        """The lookup of `address` failed: the agents waiting for it are refused
        (nothing was bound to them). An agent waiting for a second look at a rival's
        address is believed: that address no longer vouches for the rival."""
        out: list[Vouching] = []
        for p in list(self._peers.values()):
            if p.rival is not None and p.rival[0] == address:
                p.rival = None
                out.append(self._believe(now, p))
        for p in [p for p in self._peers.values() if p.address == address and not p.verified]:
            if p.rival is None:
                why = f"the side channel at {address} could not vouch for it: {detail}"
                out.append(self._refuse(p, "unverified", why))
        return out

    def _refuse(self, p: _Peer, reason: str, detail: str, *, loaded: bool = False) -> Refuse:
        dropped = len(p.inbox)
        p.inbox.clear()
        if not loaded:
            del self._peers[p.agent]
        return Refuse(p.agent, reason, detail, dropped, loaded)

    def _believe(self, now: float, p: _Peer, problem: str | None = None) -> Believe:
        """`p` is believed: what it sent meanwhile is handed over to be read, in order;
        what waited longer than `liveness_timeout_s` is not (a live receiver sends its
        Registers again every heartbeat interval until we list them, so nothing is lost,
        and a message that old may speak for a transfer its sender gave up since)."""
        p.verified = True
        inbox, p.inbox = p.inbox, []
        fresh = tuple(m for at, m in inbox if not self._too_old_to_read(now, at))
        return Believe(p.agent, fresh, len(inbox) - len(fresh), problem)

    def _too_old_to_read(self, now: float, arrived: float) -> bool:
        return now - arrived > self._timing.liveness_timeout_s
