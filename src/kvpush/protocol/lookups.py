"""The receiver's book of sender side channels: the addresses being looked up (and who
waits for each), and the handshakes it keeps (`PeerInfo`, when it was looked up, when
its agent was last heard from).

A kept handshake is trusted for a new transfer while it is fresh: its agent heard from,
or looked up, within `revalidate_after_s`. Older ones may belong to a process that
restarted at that address, and are looked up again. The book answers; the receiver
decides what each answer means for its transfers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpush.protocol._common import Effect, Handshake, PeerAddress, PeerInfo


@dataclass(slots=True)
class Known:
    info: PeerInfo
    handshaken_at: float


@dataclass(slots=True)
class Lookup:
    """One address being looked up: who waits for it."""

    transfers: list[str] = field(default_factory=list)
    rejects: list[tuple[str, str]] = field(default_factory=list)  # (transfer id, detail)


class Lookups:
    """The side channels a receiver knows, and the ones it is looking up."""

    def __init__(self, revalidate_after_s: float) -> None:
        self._revalidate_after_s = revalidate_after_s
        self._known: dict[PeerAddress, Known] = {}
        self._pending: dict[PeerAddress, Lookup] = {}
        self._heard_at: dict[str, float] = {}  # agent -> when it last sent us anything

    def known_count(self) -> int:
        return len(self._known)

    def info(self, address: PeerAddress) -> PeerInfo | None:
        """The handshake kept for `address`, fresh or not."""
        known = self._known.get(address)
        return None if known is None else known.info

    def fresh_info(self, now: float, address: PeerAddress) -> PeerInfo | None:
        """The handshake kept for `address` if it is still the process we handshaked
        with: heard from (or looked up) lately."""
        known = self._known.get(address)
        if known is None:
            return None
        heard = self._heard_at.get(known.info.agent, known.handshaken_at)
        if now - max(heard, known.handshaken_at) <= self._revalidate_after_s:
            return known.info
        return None

    def pending(self, address: PeerAddress) -> Lookup | None:
        """The lookup of `address` in progress, if any."""
        return self._pending.get(address)

    def is_pending(self, address: PeerAddress) -> bool:
        return address in self._pending

    def start(self, address: PeerAddress) -> tuple[Lookup, list[Effect]]:
        """The lookup of `address`: the one in progress, or a new one with the
        `Handshake` that begins it."""
        lookup = self._pending.get(address)
        if lookup is not None:
            return lookup, []
        lookup = self._pending[address] = Lookup()
        return lookup, [Handshake(address)]

    def take(self, address: PeerAddress) -> Lookup | None:
        """The lookup of `address` is over: who waited for it."""
        return self._pending.pop(address, None)

    def remember(self, address: PeerAddress, info: PeerInfo, now: float) -> None:
        self._known[address] = Known(info, now)

    def drop(self, address: PeerAddress) -> None:
        self._known.pop(address, None)

    def forget(self, agent: str) -> None:
        """`agent`'s handshakes are not trusted for a new transfer any more."""
        self._heard_at.pop(agent, None)
        for address in [a for a, k in self._known.items() if k.info.agent == agent]:
            del self._known[address]

    def heard(self, agent: str, now: float) -> None:
        self._heard_at[agent] = now

    def clear(self) -> None:
        """Forget every lookup and every kept handshake (the receiver shuts down)."""
        self._pending.clear()
        self._known.clear()
