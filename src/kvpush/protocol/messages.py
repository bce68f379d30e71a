"""The push protocol's wire messages: frozen, tagged msgspec structs in one union.

Every control message between a sender (prefill) and a receiver (decode) is one of the
structs below, encoded as msgpack with a `type` tag. `decode()` is the only way bytes
become a message; it turns anything malformed into `RemoteProtocolError`.

Compatibility rules (the msgspec way): new fields get defaults and go last, so an older
peer keeps decoding what a newer one sends; a change in meaning bumps
`kvpush.geometry.PROTOCOL_VERSION`, which the side channel's compatibility hash covers
and `Register` carries again so a sender can refuse a mismatched receiver.

Transfers are paired by `transfer_id`, carried end to end and never rewritten.

Clocks: `Register.sent_at` and `Heartbeat.sent_at` are the sender of the message's own
monotonic clock when it sent it, and a receiver's `Heartbeat.echo` repeats the newest
`sent_at` it has read from that sender. From these a sender bounds the receiver's clock
from below and measures every lease on the receiver's clock, so that a message that
waited in a stalled process's inbox cannot pass for a fresh one (see
`kvpush.protocol.state`, "Leases measured on the receiver's clock").
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kvpush.errors import FailureReason, RemoteProtocolError
from kvpush.geometry import PROTOCOL_VERSION

__all__ = [
    "PROTOCOL_VERSION",
    "Cancel",
    "CancelAck",
    "Done",
    "Failed",
    "Heartbeat",
    "Message",
    "Register",
    "Reject",
    "decode",
    "encode",
]

TransferId = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
BlockId = Annotated[int, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Detail = Annotated[str, msgspec.Meta(max_length=4096)]


class Register(msgspec.Struct, frozen=True, tag_field="type", tag="register"):
    """Receiver to sender: "write transfer `transfer_id` into these blocks of mine".

    `block_ids[i]` receives the sender's block number `sender_offset + i` (of the block
    list the sender's engine submitted). A prefix-cache hit of `k` blocks is
    `sender_offset=k`; a full hit is an empty `block_ids`. The receiver's side-channel
    address lets the sender handshake back before its first write.

    `sender_block_tokens`: the sender's block size, in tokens, that the receiver counted
    in. Where the receiver's blocks are `k` times larger, its `block_ids` are parts of
    them (`kvpush.geometry.sub_block_ids`), one per sender block; a sender whose blocks
    are of another size refuses the registration rather than take them for its own.
    """

    transfer_id: TransferId
    receiver_engine_id: str
    receiver_incarnation: str
    receiver_host: str
    receiver_port: Port
    receiver_rank: Count
    block_ids: tuple[BlockId, ...]
    sender_offset: Count = 0
    protocol_version: int = PROTOCOL_VERSION
    # The receiver's monotonic clock when it sent this (again, for a resend): the lease
    # this grants runs `lease_s` from here, on the receiver's clock. None (an old peer):
    # the Register grants no lease, so nothing is written for it.
    sent_at: float | None = None
    sender_block_tokens: Count = 0


class Done(msgspec.Struct, frozen=True, tag_field="type", tag="done"):
    """Sender to receiver: every block of the transfer has landed; nothing more will come.

    Usually the data-plane notification of the transfer's last write (delivered after its
    bytes); sent as a plain message when there was nothing to write or when other writes
    of the transfer were still in flight as the last one started, and again when a
    receiver's heartbeat shows it missed it."""

    transfer_id: TransferId
    num_blocks: Count


class Failed(msgspec.Struct, frozen=True, tag_field="type", tag="failed"):
    """The transfer failed on the side that sends this.

    Sent by the sender only: no write for the transfer is in flight and none will ever
    start, so the receiver may reuse its blocks at once.
    """

    transfer_id: TransferId
    reason: FailureReason
    detail: Detail = ""


class Reject(msgspec.Struct, frozen=True, tag_field="type", tag="reject"):
    """Receiver to sender: refused before allocating; the sender may free its blocks.

    `reason` says why: REJECTED (the engine refused the request) or INCOMPATIBLE_PEER
    (the receiver's handshake found the sender's cache incompatible with its own; the
    detail then names each field that differs from the sender's point of view).

    A Reject may be the first message a sender hears from this receiver, so it names
    the receiver as a `Register` does: the sender acts on it only once the side channel
    at that address has vouched for the agent that sent it (see `kvpush.protocol.state`,
    "Who sent it"). An empty `receiver_host` (an older peer) names nobody: such a Reject
    is taken only from an agent the sender already trusts."""

    transfer_id: TransferId
    detail: Detail = ""
    reason: FailureReason = FailureReason.REJECTED
    receiver_engine_id: str = ""
    receiver_incarnation: str = ""
    receiver_host: str = ""
    receiver_port: Port = 0
    receiver_rank: Count = 0


class Cancel(msgspec.Struct, frozen=True, tag_field="type", tag="cancel"):
    """Receiver to sender: stop writing; I hold my blocks until you acknowledge."""

    transfer_id: TransferId
    reason: FailureReason
    detail: Detail = ""


class CancelAck(msgspec.Struct, frozen=True, tag_field="type", tag="cancel_ack"):
    """Sender to receiver: no write for the transfer is in flight and none will start."""

    transfer_id: TransferId


class Heartbeat(msgspec.Struct, frozen=True, tag_field="type", tag="heartbeat"):
    """Liveness, sent every `heartbeat_interval_s` to each peer with live transfers.

    From a receiver, `transfer_ids` are the transfers it still waits for: each listed one
    has its sender-side lease extended, and a finished one has its `Done` sent again.
    From a sender, they are the transfers it knows from that receiver: a receiver that
    misses one of its registrations there sends the `Register` again, and answers with
    its own heartbeat at once (so that the sender learns a fresh `echo`).

    `sent_at` is the sending side's monotonic clock; `echo` (from a receiver only) is the
    newest sender `sent_at` the receiver had read when it sent this one. The sender's
    lease arithmetic rests on the pair: the receiver's clock read `sent_at` only after
    the sender's clock had passed `echo`.

    `claimed` (from a receiver only): transfers whose request the receiver holds, queued,
    without blocks to register yet; each keeps the sender's transfer alive for its
    `claim_window_s` more (see `kvpush.protocol.state`, "Claims"). Such a heartbeat may
    be the first message a sender hears from the receiver, so it names the receiver's
    side channel as a `Register` does (`receiver_host` empty: it names none, and is read
    only from an agent the sender already believes). An older peer ignores both.
    """

    role: Literal["sender", "receiver"]
    engine_id: str
    incarnation: str
    transfer_ids: tuple[TransferId, ...] = ()
    sent_at: float | None = None
    echo: float | None = None
    claimed: tuple[TransferId, ...] = ()
    receiver_host: str = ""
    receiver_port: Port = 0
    receiver_rank: Count = 0


Message = Register | Reject | Done | Failed | Cancel | CancelAck | Heartbeat

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(payload: bytes) -> Message:
    """The one decoder. Raises `RemoteProtocolError` saying what was wrong."""
    try:
        message: Message = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise RemoteProtocolError(
            f"malformed push-protocol message ({len(payload)} bytes): {exc}; expected a "
            "msgpack map tagged with one of register, reject, done, failed, cancel, "
            "cancel_ack, heartbeat"
        ) from None
    return message
