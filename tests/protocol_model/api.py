"""How the model drives one protocol implementation: the only file that knows its API.

The checker runs the protocol of the working tree, or one loaded from a git revision
(`loader.load("main")`), so the calls that differ between versions live here.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvpush.errors import FailureReason

if TYPE_CHECKING:
    from .model import Scope, World


def Api(state: ModuleType, scope: Scope, mutation: str | None) -> ApiBase:
    """The adapter for `state`'s API: main's (the receiver handshakes outside the
    protocol) or the one with handshakes, compatibility and clock-stamped messages."""
    if hasattr(state, "PeerAddress"):
        return ApiV2(state, scope, mutation)
    if mutation is not None:
        raise ValueError(f"mutations apply to the current protocol only, not {state.__name__}")
    return ApiV1(state, scope, mutation)


PORTS = {"R": 5000, "S1": 5001, "S2": 5002, "I": 5003}


def place(engine: str) -> tuple[str, int]:
    """A model engine's engine id and rank: "R.1" is rank 1 of engine R (one side
    channel, answering by rank), "R" rank 0."""
    base, _, rank = engine.partition(".")
    return base, int(rank or 0)


def engine_at(port: int, rank: int) -> str:
    """The model engine whose side channel answers at `port` for `rank`."""
    base = next(e for e, p in PORTS.items() if p == port)
    return f"{base}.{rank}" if rank else base


class ApiBase:
    def __init__(self, state: ModuleType, scope: Scope, mutation: str | None) -> None:
        self.state = state
        self.scope = scope
        self.mutation = mutation
        self.messages = _sibling(state, "messages")
        self.SendMessage = state.SendMessage
        self.WriteBlocks = state.WriteBlocks
        self.Handshake = state.Handshake
        self.DropPeer = state.DropPeer
        self.TransferEnded = state.TransferEnded
        self.encode = self.messages.encode
        self.decode = self.messages.decode
        self._describe_cache: dict[bytes, str] = {}

    def identity(self, engine: str, incarnation: int) -> Any:
        base, rank = place(engine)
        return self.state.LocalIdentity(base, str(incarnation), "127.0.0.1", PORTS[base], rank)

    def parts_class(self, package: str) -> type:
        """`RequestParts` of the protocol being checked (or the mutation's)."""
        import importlib

        from . import mutations

        return mutations.parts_class(importlib.import_module(f"{package}.parts"), self.mutation)

    def endpoint(self, engine: str, agent: str, incarnation: int, role: str) -> Any:
        raise NotImplementedError

    def expect(
        self, proto: Any, now: float, tid: str, sender_agent: str, spec: Any, blocks: Any
    ) -> list[Any]:
        raise NotImplementedError

    def handshake_target(self, eff: Any) -> str:
        """Whom a Handshake effect looks up (an agent or an engine, by API)."""
        raise NotImplementedError

    def handshake_possible(self, w: World, target: str) -> bool:
        raise NotImplementedError

    def handshake_ok(self, w: World, end: Any, now: float, target: str) -> list[Any]:
        raise NotImplementedError

    def handshake_fail(self, w: World, end: Any, now: float, target: str) -> list[Any]:
        raise NotImplementedError

    def held(self, proto: Any) -> dict[str, Any]:
        out = {}
        out.update({f"sender {t}": b for t, b in proto.sender.held_blocks().items()})
        out.update({f"receiver {t}": b for t, b in proto.receiver.held_blocks().items()})
        return out

    def fencing(self, proto: Any, tid: str) -> bool:
        """`proto`'s receiver has given `tid` up and fences its blocks (a Cancel sent,
        the blocks kept until the sender confirms or the fence ends)."""
        fencing = getattr(self.state.ReceiverState, "FENCING", None)
        return fencing is not None and proto.receiver.state_of(tid) is fencing

    def describe(self, payload: bytes) -> str:
        text = self._describe_cache.get(payload)
        if text is None:
            text = self._describe_cache[payload] = _describe(self.decode(payload))
        return text


class ApiV1(ApiBase):
    """main's API: `expect` names an agent the runtime handshook; only the sender asks
    for a `Handshake` (back to the receiver's agent)."""

    def endpoint(self, engine: str, agent: str, incarnation: int, role: str) -> Any:
        ident = self.identity(engine, incarnation)
        return self.state.PushProtocol(ident, self.scope.timing, self.scope.num_layers)

    def expect(
        self, proto: Any, now: float, tid: str, sender_agent: str, spec: Any, blocks: Any
    ) -> list[Any]:
        return list(
            proto.receiver.expect(
                now, tid, sender_agent, spec.sender, blocks, sender_offset=spec.offset
            )
        )

    def handshake_target(self, eff: Any) -> str:
        return str(eff.peer)

    def handshake_possible(self, w: World, target: str) -> bool:
        return w.ends[target].alive

    def handshake_ok(self, w: World, end: Any, now: float, target: str) -> list[Any]:
        return list(end.proto.sender.peer_ready(now, target))

    def handshake_fail(self, w: World, end: Any, now: float, target: str) -> list[Any]:
        return list(
            end.proto.sender.peer_unreachable(
                now, target, FailureReason.HANDSHAKE_FAILED, "could not load its metadata"
            )
        )


class ApiV2(ApiBase):
    """The API with both handshakes in the protocol: a `Handshake` names a side-channel
    address; its answer is the `PeerInfo` of whichever incarnation serves there now."""

    def __init__(self, state: ModuleType, scope: Scope, mutation: str | None) -> None:
        super().__init__(state, scope, mutation)
        from . import mutations

        self.push_class, self.policy = mutations.apply(state, mutation)
        self._infos: dict[str, Any] = {}

    def compat(self, engine: str) -> dict[str, object]:
        fields: dict[str, object] = {
            "protocol_version": self.messages.PROTOCOL_VERSION,
            "layout": "NHD",
            "block_size_tokens": 16,
            "dtype": "bfloat16",
            "mode": "push",
            "regions": [("kv", 0, 4096)],
        }
        fields.update(dict(dict(self.scope.geometry).get(engine, ())))
        return fields

    def endpoint(self, engine: str, agent: str, incarnation: int, role: str) -> Any:
        ident = self.identity(engine, incarnation)
        return self.push_class(
            ident,
            self.scope.timing,
            self.scope.num_layers,
            self.compat(engine),
            compatibility=self.policy,
        )

    def address(self, engine: str) -> Any:
        base, rank = place(engine)
        return self.state.PeerAddress("127.0.0.1", PORTS[base], rank)

    def registered(self, proto: Any, tid: str) -> bool:
        """`proto`'s sender holds a Register for `tid`, not submitted yet."""
        return bool(proto.sender.state_of(tid) is self.state.SenderState.REGISTERED)

    def spoken(self, proto: Any, tid: str) -> bool:
        """A receiver registered for, rejected or claimed `tid` before `proto`'s engine
        submitted it: what its engine reads to submit a held send."""
        sender = proto.sender
        claimed = getattr(sender, "claimed_before_submit", lambda _prefixes: [])
        return tid in (*sender.spoken_before_submit([tid]), *claimed([tid]))

    def expect(
        self, proto: Any, now: float, tid: str, sender_agent: str, spec: Any, blocks: Any
    ) -> list[Any]:
        return list(
            proto.receiver.expect(
                now, tid, self.address(spec.sender), blocks, sender_offset=spec.offset
            )
        )

    def handshake_target(self, eff: Any) -> str:
        return engine_at(eff.address.port, eff.address.rank)

    def handshake_possible(self, w: World, target: str) -> bool:
        # A stalled process's side channel does not answer either (the lookup waits,
        # or times out: a failure).
        e = w.ends[w.current[target]]
        answers = e.phase != "stalled" or self.scope.stalled_side_channel_answers
        return e.alive and answers

    def handshake_ok(self, w: World, end: Any, now: float, target: str) -> list[Any]:
        agent = w.current[target]
        e = w.ends[agent]
        inc = agent.split("#")[1]
        info = self._infos.get(agent)
        if info is None:  # one object per agent (the checker pickles it by identity)
            base = place(target)[0]
            info = self._infos[agent] = self.state.PeerInfo(agent, base, inc, self.compat(target))
        del e
        return list(end.proto.handshake_done(now, self.address(target), info))

    def handshake_fail(self, w: World, end: Any, now: float, target: str) -> list[Any]:
        return list(
            end.proto.handshake_failed(
                now,
                self.address(target),
                FailureReason.HANDSHAKE_FAILED,
                "could not load its metadata",
            )
        )


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
