"""The protocol model checker (tests/protocol_model) over the bounded CI scopes.

Every interleaving of each CI scope, up to its depth, with the model's engines reusing
blocks the moment they are handed back: zero violations, every state where the search
is cut completed and checked (every transfer ended, nothing held), and each scope's
coverage goals reached (what it is there to explore: "T2 lands", "T1 ok on the
receiver after a drop"). Then every mutation (tests/protocol_model/mutations.py), one
per promise, must be found by the CI scope named for it; without the mutation that
scope is clean to the same depth with no state cap (`test_scope`, same scope).

The larger scope (docs/protocol-checking.md has its figures) runs with
    KVPUSH_MODEL_SCOPE=large .venv/bin/pytest tests/test_protocol_model.py
or directly: `python -m tests.protocol_model --scope large`.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from protocol_model import loader, scopes, table
from protocol_model.checker import check
from protocol_model.model import Model
from protocol_model.mutations import MUTATIONS

# Exhaustive searches: their wall time is their CPU time (tens of seconds) times the
# host's load, so the per-test bound is wider than the project's 120 s.
pytestmark = pytest.mark.timeout(300)

STATE = loader.load(None)
SCOPES = scopes.group(os.environ.get("KVPUSH_MODEL_SCOPE", "ci"))
CI = {s.name: s for s in scopes.CI}


DOC_TABLE = table.read("ci")


@pytest.mark.parametrize("scope", SCOPES, ids=[s.name for s in SCOPES])
def test_scope(scope: scopes.Scope) -> None:
    """No violation, the cut states completed cleanly, every goal reached and the
    scenario reached with room after it; and the figures docs/protocol-checking.md
    shows for the scope are the ones it explores. A failure says which changed: the
    verdict (a violation, a goal or the scenario missed: a bug, in the protocol or the
    model) or only the figures (the same verdict over other states)."""
    result = check(Model(scope, STATE))
    assert result.violation is None, f"the verdict changed: a violation\n{result.report()}"
    assert scope.goals and not result.missed, (
        f"the verdict changed: goals missed {result.missed}\n{result.report()}"
    )
    assert result.complete or result.completed > 0, (
        f"the verdict changed: no cut state completed\n{result.report()}"
    )
    if scope.name in CI and SCOPES is scopes.CI:
        shown = DOC_TABLE.get(scope.name)
        ours = table.parse(table.row(result, scope.max_depth))
        assert ours is not None and shown == ours[1:], (
            f"the verdict is unchanged (no violation, {len(result.goals)} goals reached, "
            f"{result.completed} cut states completed cleanly); only the figures moved: "
            f"docs/protocol-checking.md shows {scope.name} as (depth, states, goals) "
            f"{shown}, it explores {ours[1:] if ours else ours}. If the change to the "
            "model or protocol that moved them is meant, run `python -m tests.protocol_model "
            "--scope ci --write-doc`"
        )


@pytest.mark.parametrize("scope", SCOPES, ids=[s.name for s in SCOPES])
def test_writes_may_take_the_whole_margin_the_fence_states(scope: scopes.Scope) -> None:
    """The model's writes land within the margin the receiver's fence leaves for writes
    already issued (its fence less the lease), not sooner: a shorter bound hides every
    fence shortened by less than the difference (issue 38: at 2 s, half the margin, a
    fence one liveness interval short passed every scope)."""
    receiver = Model(scope, STATE).initial().ends["R#1"].proto.receiver
    assert scope.write_bound == receiver.fence_s - scope.timing.lease_s


def test_a_scenario_reached_only_at_the_depth_bound_fails_its_scope() -> None:
    """The check a scenario adds can fail: `restart` from the very start (no script)
    reaches a restart with a write in flight only at its depth bound, with no room
    after it (issue 38), and is failed for it, though no goal is missed."""
    scope = dataclasses.replace(CI["restart"], script=())
    result = check(Model(scope, STATE))
    assert result.violation is None and result.missed == [
        f"sender restarts with write 1 of T1 in flight (by depth {scope.max_depth - 2})"
    ], result.report()
    assert result.scenario["sender restarts with write 1 of T1 in flight"][0] == scope.max_depth


def test_incompatible_peers_never_transfer() -> None:
    """Not only no ok between them: both sides end it INCOMPATIBLE_PEER on some path,
    none ends it ok or lands a write, and the whole scope is explored (quiescence, where
    every transfer ended once and nothing is held, is checked at every leaf)."""
    model = Model(CI["incompatible"], STATE)
    result = check(model)
    assert result.complete and result.violation is None, result.report()
    assert result.quiescent > 0, result.report()
    assert {
        "T1 incompatible_peer on the sender",
        "T1 incompatible_peer on the receiver",
    } <= model.reached, sorted(model.reached)
    assert not {"T1 ok on the sender", "T1 ok on the receiver", "T1 lands"} & model.reached, sorted(
        model.reached
    )


# The CI scope that finds each mutation first (`python -m tests.protocol_model --scope
# ci --mutation NAME` stops there).
CAUGHT_IN = {
    "bug1": "incompatible",
    "bug2": "receiver-stall",
    "bug3": "layerwise-stall",
    "twice": "one",
    "never-ended": "one",
    "phantom": "layerwise-prefix",
    "write-after-end": "one",
    "wrong-bytes": "layerwise-prefix",
    "held-at-rest": "one",
    "forged-effect": "forger",
    "lease-first-write": "layerwise-stall",
    "empty-layers": "layerwise-prefix",
    "wrong-receiver": "insider",
    "resend-past-deadline": "late-submit",
    "receive-first-part": "two-parts",
    "send-first-part": "one-to-two",
    "fence-short-liveness": "fence",
    "fence-lease-only": "fence",
    "counterpart": "counterparts",
    "incarnation": "incarnations",
    "layer-after-end": "layerwise-stall",
    "claim-ignored": "claims",
    "early-claim-forgotten": "claims-held",
}


def test_every_mutation_has_a_scope() -> None:
    assert set(CAUGHT_IN) == set(MUTATIONS)
    assert set(CAUGHT_IN.values()) <= set(CI), "every mutation is caught by a CI scope"


@pytest.mark.parametrize("mutation", sorted(CAUGHT_IN))
def test_checker_finds_the_bug_put_back(mutation: str) -> None:
    scope = CI[CAUGHT_IN[mutation]]
    result = check(Model(scope, STATE, mutation))
    assert result.violation is not None, result.report()
    assert result.violation.startswith(f"[{MUTATIONS[mutation]}]"), result.report()


def test_stuck_receiver_runtime_thread() -> None:
    """The checker's finding (docs/protocol-checking.md, 'Findings'): a Register re-sent
    past the receiver's deadline, after the sender's tombstone expired, was written for
    after the sender's Failed. Fails on the protocol before core's ce763c3 (not with
    that fix alone reverted: the `late-submit` scope catches that, `resend-past-deadline`)."""
    result = check(Model(scopes.STUCK_RECEIVER, STATE))
    assert result.violation is None and not result.missed, result.report()


def test_engine_calls_made_during_catch_up_wait_behind_the_queued_ones() -> None:
    """A model fault, fixed: a sender stalled before its layer-wise submit, then running
    again with the submit still queued, was offered its first layer at once, and the
    protocol rightly refused a layer for a transfer not submitted yet (a false
    [refused-call] in 4 steps). Its calls now run in the order the engine made them."""
    scope = dataclasses.replace(CI["layerwise-stall"], script=(), max_depth=6, goals=())
    result = check(Model(scope, STATE))
    assert result.violation is None, result.report()
    assert result.completed > 0, result.report()
