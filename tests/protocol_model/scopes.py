"""The scopes the checker explores: small enough to finish, rich enough to see bugs."""

from __future__ import annotations

from .model import Budget, Scope, TransferSpec

T = TransferSpec

SMOKE = Scope(
    "smoke",
    transfers=(T("T1", "S1", 1),),
    budget=Budget(),
    max_depth=30,
)
SMOKE_PROMPT = Scope(
    "smoke-prompt",
    transfers=(T("T1", "S1", 1),),
    budget=Budget(),
    prompt=True,
    max_depth=60,
)

# The bug 2 as reported: a receiver merely slow (stalled), a write in flight.
BUG2 = Scope(
    "bug2",
    transfers=(T("T1", "S1", 1),),
    budget=Budget(stalls=1),
    stallable=("receiver",),
    prompt=True,
    max_depth=30,
)
# The bug 3: a sender stalled past liveness + fence, its Register waiting.
BUG3 = Scope(
    "bug3",
    transfers=(T("T1", "S1", 1), T("T2", "S1", 1)),
    receiver_blocks=1,
    budget=Budget(stalls=1),
    prompt=True,
    stall_mid_write=False,
    max_depth=30,
)

# Issue 9's bug 1: caches that differ only in dtype.
BUG1 = Scope(
    "bug1",
    transfers=(T("T1", "S1", 1),),
    budget=Budget(),
    prompt=True,
    geometry=(("R", (("dtype", "float16"),)),),
    max_depth=40,
)

GROUPS: dict[str, tuple[Scope, ...]] = {"smoke": (SMOKE,), "smoke-prompt": (SMOKE_PROMPT,), "bug1": (BUG1,), "bug2": (BUG2,), "bug3": (BUG3,)}


def group(name: str) -> tuple[Scope, ...]:
    if name in GROUPS:
        return GROUPS[name]
    for scopes in GROUPS.values():
        for s in scopes:
            if s.name == name:
                return (s,)
    raise SystemExit(f"unknown scope {name!r}: expected one of {sorted(GROUPS)} or a scope name")
