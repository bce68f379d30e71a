"""How the model drives one protocol implementation: the only file that knows its API.

The checker runs the protocol of the working tree, or one loaded from a git revision
(`loader.load("main")`), so the calls that differ between versions live here.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvpush.errors import FailureReason

if TYPE_CHECKING:
    from .model import Model, Scope, World


class Api:
    def __init__(self, state: ModuleType, scope: Scope, mutation: str | None) -> None:
        self.state = state
        self.scope = scope
        self.messages = _sibling(state, "messages")
        self.SendMessage = state.SendMessage
        self.WriteBlocks = state.WriteBlocks
        self.Handshake = state.Handshake
        self.DropPeer = state.DropPeer
        self.TransferEnded = state.TransferEnded
        self.encode = self.messages.encode
        self.decode = self.messages.decode
        if mutation is not None:
            raise ValueError(f"unknown mutation {mutation!r}")
        self._describe_cache: dict[bytes, str] = {}

    # ----- endpoints and engine calls

    def endpoint(self, engine: str, agent: str, incarnation: int, role: str) -> Any:
        ident = self.state.LocalIdentity(engine, str(incarnation), "127.0.0.1", 5000, 0)
        return self.state.PushProtocol(ident, self.scope.timing, self.scope.num_layers)

    def expect(
        self, proto: Any, now: float, tid: str, sender_agent: str, spec: Any, blocks: Any
    ) -> list[Any]:
        sender_engine = sender_agent.split("#")[0]
        return list(
            proto.receiver.expect(
                now, tid, sender_agent, sender_engine, blocks, sender_offset=spec.offset
            )
        )

    def handshake_ok(self, end: Any, now: float, whom: str) -> list[Any]:
        return list(end.proto.sender.peer_ready(now, whom))

    def handshake_fail(self, end: Any, now: float, whom: str) -> list[Any]:
        return list(
            end.proto.sender.peer_unreachable(
                now, whom, FailureReason.HANDSHAKE_FAILED, "could not load its metadata"
            )
        )

    def knows(self, proto: Any, agent: str) -> bool:
        return True

    def held(self, proto: Any) -> dict[str, Any]:
        out = {}
        out.update({f"sender {t}": b for t, b in proto.sender.held_blocks().items()})
        out.update({f"receiver {t}": b for t, b in proto.receiver.held_blocks().items()})
        return out

    def check_ended(self, model: Model, w: World, agent: str, tid: str, eff: Any) -> None:
        return None

    def other_effect(self, model: Model, w: World, agent: str, eff: Any) -> str:
        return f"{type(eff).__name__}"

    # ----- messages, readably

    def describe(self, payload: bytes) -> str:
        text = self._describe_cache.get(payload)
        if text is None:
            text = self._describe_cache[payload] = _describe(self.decode(payload))
        return text


def _describe(m: Any) -> str:
    name = type(m).__name__
    tid = getattr(m, "transfer_id", None)
    if name == "Register":
        off = f" at offset {m.sender_offset}" if m.sender_offset else ""
        return f"Register {tid} (blocks ({','.join(map(str, m.block_ids))}){off})"
    if name == "Heartbeat":
        return f"Heartbeat from the {m.role} [{','.join(m.transfer_ids)}]"
    if name in ("Cancel", "Failed"):
        return f"{name} {tid} ({m.reason.value})"
    return f"{name} {tid}"


def _sibling(state: ModuleType, name: str) -> ModuleType:
    import sys

    package = state.__name__.rsplit(".", 1)[0]
    return sys.modules[f"{package}.{name}"]
