"""Breadth-first search over every state a scope can reach.

Breadth first, so the first violation found comes with a shortest trace (fewest steps).
A state is the pickle of the whole world (protocol objects included); two paths that
reach byte-identical pickles are one state. That identification is conservative: states
that differ only in, say, dict insertion order count twice, never two as one.
"""

from __future__ import annotations

import hashlib
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

from .model import Model, Violation, World


@dataclass
class Result:
    scope: str
    states: int = 0
    transitions: int = 0
    depth: int = 0
    complete: bool = False  # every reachable state within max_depth explored
    seconds: float = 0.0
    violation: str | None = None
    pruned: int = 0  # steps not taken because they broke a promise not looked for
    trace: list[str] = field(default_factory=list)

    def report(self) -> str:
        lines = [
            f"scope {self.scope}: {self.states} distinct states, {self.transitions} "
            f"transitions, depth {self.depth}"
            f"{' (all explored)' if self.complete else ' (cut at the depth bound)'}, "
            f"{self.seconds:.1f} s"
        ]
        if self.pruned:
            lines.append(f"({self.pruned} steps not taken: they broke another promise)")
        if self.violation is None:
            lines.append("no violation")
        else:
            lines.append(f"VIOLATION: {self.violation}")
            lines.append(f"shortest trace ({len(self.trace)} steps):")
            lines += [f"{i:3d}. {line}" for i, line in enumerate(self.trace, 1)]
        return "\n".join(lines)


def _digest(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=16).digest()


def _action_text(w: World, action: tuple[Any, ...], model: Model) -> str:
    kind, args = action[0], action[1:]
    match kind:
        case "deliver" | "dup" | "drop":
            src, dst, payload = args[0]
            return f"{kind} {model.api.describe(payload)} {src} -> {dst}"
        case "land" | "complete" | "fail":
            src, wid = args[0]
            return f"{kind} write {wid} of {src}"
        case _:
            return " ".join(str(a) for a in action)


def _trace(parents: dict[bytes, tuple[bytes, str] | None], d: bytes) -> list[str]:
    out: list[str] = []
    link = parents[d]
    while link is not None:
        d, line = link
        out.append(line)
        link = parents[d]
    return out[::-1]


def check(
    model: Model,
    max_states: int | None = None,
    progress: Any = None,
    find: frozenset[str] | None = None,
) -> Result:
    """Explore `model`'s scope; stop at the first violation (of a kind in `find`, if
    given: a step breaking another kind is not taken, and the search goes on)."""
    result = Result(model.scope.name)
    start = time.monotonic()
    key_of = model.key_of
    first = key_of(model.initial())
    root = _digest(first)
    parents: dict[bytes, tuple[bytes, str] | None] = {root: None}
    frontier: list[tuple[bytes, bytes]] = [(root, first)]
    depth = 0
    try:
        while frontier:
            if depth >= model.scope.max_depth:
                break
            nxt: list[tuple[bytes, bytes]] = []
            for d, key in frontier:
                w = pickle.loads(key)
                actions = model.actions(w)
                if not actions:
                    try:
                        model.check_quiescent(w)
                    except Violation as v:
                        if find is not None and v.kind not in find:
                            result.pruned += 1
                            continue
                        result.violation = f"[{v.kind}] {v}"
                        result.trace = [*_trace(parents, d), f"t={w.now:g} (nothing left to do)"]
                        return result
                for i, action in enumerate(actions):
                    # `actions` changed nothing, so the first step can use `w` itself.
                    w2 = w if i == 0 else pickle.loads(key)
                    result.transitions += 1
                    try:
                        line = model.step(w2, action)
                    except Violation as v:
                        if find is not None and v.kind not in find:
                            result.pruned += 1
                            continue
                        result.violation = f"[{v.kind}] {v}"
                        last = f"t={w2.now:g} {_action_text(w2, action, model)}"
                        result.trace = [*_trace(parents, d), f"{last}  <-- {v}"]
                        return result
                    key2 = key_of(w2)
                    d2 = _digest(key2)
                    if d2 in parents:
                        continue
                    parents[d2] = (d, line)
                    nxt.append((d2, key2))
                if max_states is not None and len(parents) >= max_states:
                    return result
            frontier = nxt
            depth += 1
            if progress is not None:
                progress(depth, len(parents), len(frontier), time.monotonic() - start)
        result.complete = not frontier
    finally:
        result.states = len(parents)
        result.depth = depth
        result.seconds = time.monotonic() - start
    return result
