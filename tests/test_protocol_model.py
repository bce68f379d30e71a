"""The protocol model checker (tests/protocol_model) over the bounded CI scopes.

Every interleaving of each CI scope, up to its depth, with the model's engines reusing
blocks the moment they are handed back: zero violations, and a floor on the states
explored so that a model that explores nothing fails. Then the checker must find each of
issue 9's bugs when a mutation puts it back (tests/protocol_model/mutations.py).

The larger scope (docs/protocol-checking.md has its figures) runs with
    KVPUSH_MODEL_SCOPE=large .venv/bin/pytest tests/test_protocol_model.py
or directly: `python -m tests.protocol_model --scope large`.
"""

from __future__ import annotations

import os

import pytest

from protocol_model import loader, scopes
from protocol_model.checker import check
from protocol_model.model import Model

# Exhaustive searches: their wall time is their CPU time (tens of seconds) times the
# host's load, so the per-test bound is wider than the project's 120 s.
pytestmark = pytest.mark.timeout(300)

STATE = loader.load(None)
SCOPES = scopes.group(os.environ.get("KVPUSH_MODEL_SCOPE", "ci"))
# Each CI scope explores at least this many distinct states (the smallest, two
# incompatible peers, under 100; the others thousands).
FLOOR = {"incompatible": 20}


@pytest.mark.parametrize("scope", SCOPES, ids=[s.name for s in SCOPES])
def test_no_violation_in_scope(scope: scopes.Scope) -> None:
    result = check(Model(scope, STATE))
    assert result.violation is None, result.report()
    assert result.states >= FLOOR.get(scope.name, 1000), result.report()


def test_incompatible_peers_never_transfer() -> None:
    """Not only no ok between them: both sides end it INCOMPATIBLE_PEER, and quiescence
    (every transfer ended once, nothing held) is reached."""
    scope = next(s for s in scopes.CI if s.name == "incompatible")
    result = check(Model(scope, STATE))
    assert result.complete and result.violation is None, result.report()


@pytest.mark.parametrize(
    ("mutation", "scope", "kind"),
    [
        ("bug1", scopes.BUG1, "incompatible-ok"),
        ("bug2", scopes.BUG2, "source-reused"),
        ("bug3", scopes.BUG3, "late-write"),
    ],
)
def test_checker_finds_the_bug_put_back(mutation: str, scope: scopes.Scope, kind: str) -> None:
    result = check(Model(scope, STATE, mutation))
    assert result.violation is not None and result.violation.startswith(f"[{kind}]"), (
        result.report()
    )
    # Without the mutation, the same scope up to the same depth is clean.
    clean = check(Model(scope, STATE), max_states=min(result.states, 5000))
    assert clean.violation is None, clean.report()


def test_stuck_receiver_runtime_thread() -> None:
    """The checker's finding (docs/protocol-checking.md, 'Findings'): a Register re-sent
    past the receiver's deadline, after the sender's tombstone expired, was written for
    after the sender's Failed. Fails on the protocol before core's ce763c3."""
    result = check(Model(scopes.STUCK_RECEIVER, STATE))
    assert result.violation is None, result.report()
    assert result.states >= 1000, result.report()
