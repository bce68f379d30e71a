"""The push protocol without I/O: wire messages and the two sides' state machines.

`messages` defines what travels between a sender and a receiver; `state` holds the
theory of operation and `PushProtocol`, the one entry point, and names the module each
transition lives in (`sender`, its `identity` gate and `leases`, `receiver`). Nothing in
this package opens a socket, starts a thread or reads a clock.
"""

from kvpush.protocol.messages import (
    PROTOCOL_VERSION,
    Cancel,
    CancelAck,
    Done,
    Failed,
    Heartbeat,
    Message,
    Register,
    Reject,
    decode,
    encode,
)
from kvpush.protocol.state import (
    REVALIDATE_AFTER_S,
    DropPeer,
    Effect,
    Handshake,
    LocalIdentity,
    PeerAddress,
    PeerClock,
    PeerInfo,
    PushProtocol,
    ReceiverProtocol,
    ReceiverState,
    SenderProtocol,
    SenderState,
    SendMessage,
    Side,
    TransferEnded,
    WriteBlocks,
    ended_unreported,
)

__all__ = [
    "PROTOCOL_VERSION",
    "REVALIDATE_AFTER_S",
    "Cancel",
    "CancelAck",
    "Done",
    "DropPeer",
    "Effect",
    "Failed",
    "Handshake",
    "Heartbeat",
    "LocalIdentity",
    "Message",
    "PeerAddress",
    "PeerClock",
    "PeerInfo",
    "PushProtocol",
    "ReceiverProtocol",
    "ReceiverState",
    "Register",
    "Reject",
    "SendMessage",
    "SenderProtocol",
    "SenderState",
    "Side",
    "TransferEnded",
    "WriteBlocks",
    "decode",
    "encode",
    "ended_unreported",
]
