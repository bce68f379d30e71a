"""Issue 9's three bugs, put back into the current protocol by the model alone.

Each mutation subclasses the real classes (the protocol's files are never edited) and
restores one old behaviour, so the checker can show that it finds the bug:

* `bug1`: compatibility is not enforced: every field but the protocol version may
  differ (as when the check was opt-in and callers skipped it).
* `bug2`: a sender abandons its transfers with a receiver silent for the liveness
  timeout at once, releasing the blocks while a write may still read them.
* `bug3`: a sender writes for any Register it holds, however old: the lease is never
  found expired where a write is issued, a stale Register is never refused, and one
  kept unread while its sender was being looked up is read however long that took.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from kvpush.config import COMPAT_FIELDS, CompatibilityPolicy
from kvpush.errors import FailureReason

MUTATIONS = ("bug1", "bug2", "bug3")


def apply(state: ModuleType, mutation: str | None) -> tuple[type, Any]:
    """The PushProtocol class and the compatibility policy to build endpoints with."""
    if mutation is None:
        return state.PushProtocol, state.STRICT_COMPATIBILITY
    if mutation == "bug1":
        anything = frozenset(COMPAT_FIELDS) - {"protocol_version"}
        policy = CompatibilityPolicy(anything, reason="mutation bug1: the check callers skip")
        return state.PushProtocol, policy
    if mutation == "bug2":
        return _with_sender(state, _bug2_sender(state)), state.STRICT_COMPATIBILITY
    if mutation == "bug3":
        return _with_sender(state, _bug3_sender(state)), state.STRICT_COMPATIBILITY
    raise ValueError(f"unknown mutation {mutation!r}: expected one of {MUTATIONS}")


def _with_sender(state: ModuleType, sender_class: type) -> type:
    class MutantPushProtocol(state.PushProtocol):  # type: ignore[name-defined,misc]
        def __init__(self, identity: Any, timing: Any, num_layers: int, compat: Any, **kw: Any):
            super().__init__(identity, timing, num_layers, compat, **kw)
            policy = kw.get("compatibility", state.STRICT_COMPATIBILITY)
            self.sender = sender_class(identity, timing, num_layers, compat, compatibility=policy)

    MutantPushProtocol.__name__ = f"MutantPushProtocol_{sender_class.__name__}"
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
    class Bug3Sender(state.SenderProtocol):  # type: ignore[name-defined,misc]
        def _stale_register(self, now: float, peer: str, granted: float) -> str | None:
            return None

        def _too_old_to_read(self, now: float, arrived: float) -> bool:
            return False  # a Register kept unread during the handshake back, however old

        def _issue_writes(self, now: float, rec: Any) -> list[Any]:
            # As if every lease held at the moment a write is issued.
            kept = rec.lease_until_theirs
            rec.lease_until_theirs = float("inf")
            try:
                return list(super()._issue_writes(now, rec))
            finally:
                rec.lease_until_theirs = kept

    _register(Bug3Sender)
    return Bug3Sender


def _register(cls: type) -> None:
    """Make the class findable by pickle (the checker copies states by pickling)."""
    import sys

    module = sys.modules[__name__]
    cls.__module__ = __name__
    cls.__qualname__ = cls.__name__
    setattr(module, cls.__name__, cls)
