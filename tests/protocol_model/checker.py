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
    goals: dict[str, bool] = field(default_factory=dict)  # the scope's goals: reached?
    completed: int = 0  # cut states whose bounded completion came to rest cleanly
    quiescent: int = 0  # states explored with nothing left to do
    completion_s: float = 0.0  # of `seconds`, the completions of cut states
    # The scope's scenario events: (the first depth reached, or None; how many states
    # new to the search a step where it happened led to).
    scenario: dict[str, tuple[int | None, int]] = field(default_factory=dict)
    max_depth: int = 0
    room: int = 0

    @property
    def missed(self) -> list[str]:
        return [g for g, ok in self.goals.items() if not ok]

    @property
    def ok(self) -> bool:
        return self.violation is None and not self.missed

    def report(self) -> str:
        lines = [
            f"scope {self.scope}: {self.states} distinct states, {self.transitions} "
            f"transitions, depth {self.depth}"
            f"{' (all explored)' if self.complete else ' (cut at the depth bound)'}, "
            f"{self.seconds:.1f} s"
        ]
        if self.pruned:
            lines.append(f"({self.pruned} steps not taken: they broke another promise)")
        lines.append(
            f"{self.quiescent} states at rest checked; {self.completed} cut states "
            "completed (every timer fired, every message delivered, no new fault) and checked"
            f" in {self.completion_s:.1f} s"
        )
        if self.goals:
            reached = len(self.goals) - len(self.missed)
            lines.append(f"goals reached: {reached}/{len(self.goals)}")
            lines += [f"  MISSED goal: {g}" for g in self.missed]
        for event, (first, n) in self.scenario.items():
            at = "never" if first is None else f"first at depth {first}"
            lines.append(
                f"scenario: {event}: {at} (of {self.max_depth}, room {self.room} wanted), "
                f"{n:,} new states led to"
            )
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


def run_script(model: Model, w: World) -> list[str]:
    """Take the scope's scripted steps (`Scope.script`) in `w`; their trace lines."""
    lines: list[str] = []
    for want in model.scope.script:
        for action in model.actions(w):
            if _action_text(w, action, model).startswith(want):
                lines.append(model.step(w, action))
                break
        else:
            offered = [_action_text(w, a, model) for a in model.actions(w)]
            raise ValueError(f"scope {model.scope.name}: no step {want!r} after {lines}: {offered}")
    return lines


def _trace(
    parents: dict[bytes, tuple[bytes, str] | None], d: bytes, script: list[str] = ()
) -> list[str]:
    out: list[str] = []
    link = parents[d]
    while link is not None:
        d, line = link
        out.append(line)
        link = parents[d]
    return [*script, *out[::-1]]


# A completion that has not come to rest after this many steps is a transfer that never
# ends (the CI scopes' completions take under 40).
COMPLETION_STEPS = 400


class Incomplete(Exception):
    def __init__(self, violation: Violation, lines: list[str]) -> None:
        super().__init__(str(violation))
        self.violation = violation
        self.lines = lines


def complete(model: Model, w: World, memo: set[bytes]) -> int:
    """From a state where the search was cut, let every timer fire and every message
    arrive with no new fault (`Model.completion_action`), checking every invariant on
    the way, until nothing can happen; then every transfer must have ended and nothing
    be held (`check_quiescent`). `memo` holds the states already known to come to rest
    so; a completion that reaches one stops there. Returns the steps taken; raises
    `Incomplete` with the steps that led to a violation."""
    lines: list[str] = []
    seen: list[bytes] = []
    model.completing, model.recording = True, False
    try:
        for _ in range(COMPLETION_STEPS):
            action = model.completion_action(w)
            if action is None:
                model.check_quiescent(w)
                break
            try:
                lines.append(f"(completion) {model.step(w, action)}")
            except Violation as v:
                last = f"(completion) t={w.now:g} {_action_text(w, action, model)}"
                raise Incomplete(v, [*lines, f"{last}  <-- {v}"]) from None
            d = _digest(model.key_of(w))
            if d in memo:
                break
            seen.append(d)
        else:
            v = Violation(
                "never-ended", f"not at rest {COMPLETION_STEPS} steps into a fault-free completion"
            )
            raise Incomplete(v, lines[-20:])
    except Violation as v:
        raise Incomplete(v, [*lines, f"t={w.now:g} (at rest)  <-- {v}"]) from None
    finally:
        model.completing, model.recording = False, True
    memo.update(seen)
    return len(lines)


def check(
    model: Model,
    max_states: int | None = None,
    progress: Any = None,
    find: frozenset[str] | None = None,
    completion: bool = True,
) -> Result:
    """Explore `model`'s scope; stop at the first violation (of a kind in `find`, if
    given: a step breaking another kind is not taken, and the search goes on). Every
    state where the search is cut (the depth bound, or `max_states`) is completed
    (`complete`) and checked; the scope's goals are what the search reached."""
    scope = model.scope
    result = Result(scope.name, max_depth=scope.max_depth, room=scope.room)
    model.reached.clear()
    model.first.clear()
    counts: dict[str, int] = {}
    start = time.monotonic()
    try:
        _search(model, max_states, progress, find, result, completion, counts)
    finally:
        result.goals = {g: g in model.reached for g in scope.goals}
        last = scope.max_depth - scope.room
        for event in scope.scenario:
            first = model.first.get(event)
            result.scenario[event] = (first, counts.get(event, 0))
            # Reached with room after it: at least `room` steps before the depth bound.
            result.goals[f"{event} (by depth {last})"] = first is not None and first <= last
        result.seconds = time.monotonic() - start
    return result


def _search(
    model: Model,
    max_states: int | None,
    progress: Any,
    find: frozenset[str] | None,
    result: Result,
    completion: bool,
    counts: dict[str, int],
) -> None:
    start = time.monotonic()
    key_of = model.key_of
    w0 = model.initial()
    model.depth = 0
    try:
        script = run_script(model, w0)
    except Violation as v:
        result.violation = f"[{v.kind}] {v} (in the scope's script)"
        return
    first = key_of(w0)
    root = _digest(first)
    parents: dict[bytes, tuple[bytes, str] | None] = {root: None}
    frontier: list[tuple[bytes, bytes]] = [(root, first)]
    depth = 0
    cut: list[tuple[bytes, bytes]] = []
    try:
        while frontier:
            if depth >= model.scope.max_depth:
                cut = frontier
                break
            nxt: list[tuple[bytes, bytes]] = []
            model.depth = depth + 1
            for j, (d, key) in enumerate(frontier):
                w = pickle.loads(key)
                actions = model.actions(w)
                if not actions:
                    result.quiescent += 1
                    try:
                        model.check_quiescent(w)
                    except Violation as v:
                        if find is not None and v.kind not in find:
                            result.pruned += 1
                            continue
                        result.violation = f"[{v.kind}] {v}"
                        result.trace = [
                            *_trace(parents, d, script),
                            f"t={w.now:g} (nothing left to do)",
                        ]
                        return
                for i, action in enumerate(actions):
                    # `actions` changed nothing, so the first step can use `w` itself.
                    w2 = w if i == 0 else pickle.loads(key)
                    result.transitions += 1
                    model.step_events.clear()
                    try:
                        line = model.step(w2, action)
                    except Violation as v:
                        if find is not None and v.kind not in find:
                            result.pruned += 1
                            continue
                        result.violation = f"[{v.kind}] {v}"
                        last = f"t={w2.now:g} {_action_text(w2, action, model)}"
                        result.trace = [*_trace(parents, d, script), f"{last}  <-- {v}"]
                        return
                    key2 = key_of(w2)
                    d2 = _digest(key2)
                    if d2 in parents:
                        continue
                    parents[d2] = (d, line)
                    nxt.append((d2, key2))
                    for event in model.step_events:
                        counts[event] = counts.get(event, 0) + 1
                if max_states is not None and len(parents) >= max_states:
                    cut = frontier[j + 1 :] + nxt
                    break
            else:
                frontier = nxt
                depth += 1
                if progress is not None:
                    progress(depth, len(parents), len(frontier), time.monotonic() - start)
                continue
            break
        result.complete = not frontier
        memo: set[bytes] = set()
        started = time.monotonic()
        for d, key in cut if completion else ():
            try:
                complete(model, pickle.loads(key), memo)
            except Incomplete as inc:
                v = inc.violation
                if find is not None and v.kind not in find:
                    result.pruned += 1
                    continue
                result.violation = f"[{v.kind}] {v} (in the completion of a cut state)"
                result.trace = [*_trace(parents, d, script), *inc.lines]
                return
            result.completed += 1
        result.completion_s = time.monotonic() - started
    finally:
        result.states = len(parents)
        result.depth = depth
