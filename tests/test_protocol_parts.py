"""`RequestParts`: a request of several parts ends once, as its rules say.

The exhaustive checker drives the same class between real protocol endpoints (scopes
`two-parts` and `one-to-two`, tests/test_protocol_model.py); these tests pin each rule
on its own, by name.
"""

from __future__ import annotations

import pytest

from kvpush.errors import FailureReason, LocalProtocolError
from kvpush.protocol.parts import PartsOutcome, RequestParts

WRITE_ERROR = FailureReason.WRITE_ERROR


def test_a_request_finishes_only_when_its_last_part_finished() -> None:
    book = RequestParts("receiver")
    assert book.open("req", "x", ["x#0>0", "x#1>0"]) == PartsOutcome()
    assert book.part_ended("x#1>0", None, "") == PartsOutcome()
    assert book.open_parts("x") == ("x#0>0",)
    outcome = book.part_ended("x#0>0", None, "")
    assert outcome.abort == ()
    assert outcome.ended is not None and outcome.ended.ok
    assert (outcome.ended.request_id, outcome.ended.transfer_id) == ("req", "x")
    assert outcome.ended.num_parts == 2 and len(book) == 0


def test_the_first_failure_aborts_the_others_and_the_request_waits_for_them() -> None:
    book = RequestParts("receiver")
    book.open("req", "x", ["x#0>0", "x#1>0", "x#2>0"])
    first = book.part_ended("x#1>0", WRITE_ERROR, "injected")
    assert first.abort == ("x#0>0", "x#2>0") and first.ended is None
    # The aborted parts end (cancelled, or as they would have): asked once, not again.
    assert book.part_ended("x#0>0", FailureReason.CANCELLED, "aborted") == PartsOutcome()
    last = book.part_ended("x#2>0", None, "")
    assert last.abort == () and last.ended is not None
    assert last.ended.reason is WRITE_ERROR
    assert last.ended.detail == "part x#1>0: injected"


def test_a_part_refused_at_the_call_fails_the_request_once_the_started_ones_ended() -> None:
    book = RequestParts("sender")
    opened = book.open("req", "x", ["x#0>0"], refused="KVPushError: in flight already")
    assert opened.abort == ("x#0>0",) and opened.ended is None
    outcome = book.part_ended("x#0>0", FailureReason.CANCELLED, "aborted")
    assert outcome.ended is not None and outcome.ended.reason is FailureReason.LOCAL_ERROR
    assert outcome.ended.detail == "KVPushError: in flight already"
    assert outcome.ended.num_parts == 2


@pytest.mark.parametrize(
    ("side", "refused", "ok"),
    [
        ("receiver", None, False),
        ("receiver", "no", False),
        ("sender", None, True),
        ("sender", "no", False),
    ],
)
def test_a_request_with_no_part_started_ends_at_once(
    side: str, refused: str | None, ok: bool
) -> None:
    book = RequestParts(side)  # type: ignore[arg-type]
    outcome = book.open("req", "x", [], refused=refused)
    assert outcome.ended is not None and outcome.ended.ok is ok and len(book) == 0


def test_the_end_of_a_part_it_never_opened_is_not_its_business() -> None:
    book = RequestParts("receiver")
    book.open("req", "x", ["x#0>0"])
    assert book.part_ended("y#0>0", None, "") == PartsOutcome()
    assert book.request_of("x#0>0") == "req" and book.request_of("y#0>0") is None


def test_a_transfer_or_part_opened_twice_is_refused() -> None:
    book = RequestParts("receiver")
    book.open("req", "x", ["x#0>0"])
    with pytest.raises(LocalProtocolError, match="transfer x is open already"):
        book.open("req", "x", ["x#1>0"])
    with pytest.raises(LocalProtocolError, match="open already or named twice"):
        book.open("other", "y", ["x#0>0"])
    with pytest.raises(LocalProtocolError, match="open already or named twice"):
        book.open("other", "z", ["z#0>0", "z#0>0"])
