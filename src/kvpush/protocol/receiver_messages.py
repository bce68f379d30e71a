"""What a receiver sends its senders, built in one place: each message names us (engine,
incarnation, side channel, rank) the same way, so that a sender that has not heard from
us yet can ask our side channel who we are before it believes the message (see "Who
sent it" in `kvpush.protocol.state`). Values in, messages out; nothing is decided here.
"""

from __future__ import annotations

from kvpush.errors import FailureReason
from kvpush.protocol._common import LocalIdentity, _Incoming
from kvpush.protocol.claims import claiming_heartbeats
from kvpush.protocol.messages import Heartbeat, Register, Reject


def register_for(me: LocalIdentity, rec: _Incoming, now: float) -> Register:
    """Our Register of `rec`'s blocks, sent at `now` (the lease it asks for runs from
    then, on our clock)."""
    return Register(
        rec.transfer_id,
        me.engine_id,
        me.incarnation,
        me.host,
        me.port,
        me.rank,
        rec.blocks,
        rec.sender_offset,
        sent_at=now,
        sender_block_tokens=rec.sender_block_tokens,
    )


def reject_from(
    me: LocalIdentity,
    transfer_id: str,
    detail: str,
    reason: FailureReason = FailureReason.REJECTED,
) -> Reject:
    """Our Reject, naming us as a Register does."""
    return Reject(
        transfer_id, detail, reason, me.engine_id, me.incarnation, me.host, me.port, me.rank
    )


def heartbeats_from(
    me: LocalIdentity,
    waiting: tuple[str, ...],
    claimed: list[str],
    now: float,
    echo: float | None,
) -> list[Heartbeat]:
    """Our heartbeat to a sender, listing the transfers `waiting` for it; where we claim
    requests of it (`claimed`), the heartbeats that list those too (`claiming_heartbeats`)."""
    if not claimed:
        return [
            Heartbeat("receiver", me.engine_id, me.incarnation, waiting, sent_at=now, echo=echo)
        ]
    return claiming_heartbeats(me, waiting, claimed, now, echo)
