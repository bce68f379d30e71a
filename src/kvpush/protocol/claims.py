"""The requests a receiver holds, queued, before it has blocks for them (`claim`).

A claim keeps the sender from giving its transfer up while the receiver waits for
blocks: every heartbeat to that sender lists it (`Heartbeat.claimed`). A claim ends at
`expect` (its Register speaks for it then), `reject` or `abort` of its id, when its
sender's address turns out unreachable or incompatible, or at its time. The table
answers what is claimed, from where and until when; the receiver decides what to send.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvpush.protocol._common import LocalIdentity, PeerAddress
from kvpush.protocol.lookups import Lookups
from kvpush.protocol.messages import Heartbeat

# How many ids one claiming heartbeat lists at most (more go in the next ones).
MAX_CLAIMED_PER_HEARTBEAT = 1024


@dataclass(slots=True)
class Claim:
    """A request we hold, queued, before we have blocks for it (`claim`)."""

    address: PeerAddress  # the sender's side channel
    until: float  # forgotten then (`transfer_deadline_s` after the claim), if still here


class Claims:
    """The claims of one receiver, by transfer id, in claim order."""

    def __init__(self) -> None:
        self._by_id: dict[str, Claim] = {}

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._by_id

    def ids(self) -> list[str]:
        return list(self._by_id)

    def items(self) -> Iterator[tuple[str, PeerAddress]]:
        """Each claimed id with its sender's side channel, in claim order."""
        return ((tid, c.address) for tid, c in self._by_id.items())

    def add(self, transfer_id: str, address: PeerAddress, until: float) -> None:
        self._by_id[transfer_id] = Claim(address, until)

    def drop(self, transfer_id: str) -> None:
        self._by_id.pop(transfer_id, None)

    def drop_address(self, address: PeerAddress) -> None:
        """Every claim on the sender at `address` (unreachable, or incompatible)."""
        for tid in [t for t, c in self._by_id.items() if c.address == address]:
            del self._by_id[tid]

    def clear(self) -> None:
        self._by_id.clear()

    def at(self, address: PeerAddress) -> bool:
        """Whether any claim is on the sender at `address`."""
        return any(c.address == address for c in self._by_id.values())

    def expire(self, now: float) -> None:
        """Claims past their time are dropped."""
        for tid in [t for t, c in self._by_id.items() if now >= c.until]:
            del self._by_id[tid]

    def addresses(self) -> list[PeerAddress]:
        """The sender side channel of each claim, in claim order (repeats kept)."""
        return [c.address for c in self._by_id.values()]

    def from_agent(self, agent: str, book: Lookups) -> list[str]:
        """The ids claimed from the sender agent `agent` (its side channel looked up)."""
        out = []
        for tid, claim in self._by_id.items():
            info = book.info(claim.address)
            if info is not None and info.agent == agent:
                out.append(tid)
        return out

    def earliest(self) -> float:
        """When the first claim runs out (there must be one)."""
        return min(c.until for c in self._by_id.values())


def claiming_heartbeats(
    me: LocalIdentity,
    waiting: tuple[str, ...],
    claimed: list[str],
    now: float,
    echo: float | None,
) -> list[Heartbeat]:
    """Our heartbeats to a sender listing `claimed` (at most
    `MAX_CLAIMED_PER_HEARTBEAT` ids each), naming our side channel; the first also lists
    the transfers `waiting` for it."""
    out: list[Heartbeat] = []
    for i in range(0, len(claimed), MAX_CLAIMED_PER_HEARTBEAT):
        out.append(
            Heartbeat(
                "receiver",
                me.engine_id,
                me.incarnation,
                waiting if i == 0 else (),
                sent_at=now,
                echo=echo,
                claimed=tuple(claimed[i : i + MAX_CLAIMED_PER_HEARTBEAT]),
                receiver_host=me.host,
                receiver_port=me.port,
                receiver_rank=me.rank,
            )
        )
    return out
