"""The one exception tree of kvpush, and the closed set of reasons a transfer can fail.

Foreign exceptions (zmq, NIXL, msgspec, OS) are translated into these at the edge where
they are caught, once. `FailureReason` travels on the wire inside failure messages, so
its values are part of the protocol: add members, never rename or reuse one.
"""

from __future__ import annotations

import enum


class FailureReason(enum.StrEnum):
    """Why a transfer ended as failed. Carried by exceptions and by wire messages."""

    PEER_TIMEOUT = "peer_timeout"  # the peer went silent past its liveness bound
    PEER_GONE = "peer_gone"  # the peer's process or connection is gone
    PEER_RESTARTED = "peer_restarted"  # the peer came back with a new incarnation
    HANDSHAKE_FAILED = "handshake_failed"  # could not reach or load the peer's metadata
    HANDSHAKE_REFUSED = "handshake_refused"  # the peer refused us (authentication)
    INCOMPATIBLE_PEER = "incompatible_peer"  # compatibility hash mismatch
    UNKNOWN_PEER = "unknown_peer"  # a message names a peer or transfer we do not know
    WRITE_ERROR = "write_error"  # the data plane reported a failed write
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the transfer did not finish in time
    CANCELLED = "cancelled"  # the engine aborted the transfer
    REJECTED = "rejected"  # the receiver refused the request before allocating
    MALFORMED_MESSAGE = "malformed_message"  # a message could not be decoded or made no sense
    LOCAL_ERROR = "local_error"  # an unexpected exception on one of our threads
    SHUTDOWN = "shutdown"  # the runtime was closed with the transfer in flight
    # The receiver's blocks do not match the sender's: registered blocks + offset differ
    # from the blocks the sender submitted, or a Done counts other blocks than registered.
    BLOCK_MISMATCH = "block_mismatch"


class KVPushError(Exception):
    """Root of every error kvpush raises on purpose."""


class ConfigError(KVPushError):
    """A setting is missing, malformed or out of range."""


class KVLayoutError(KVPushError):
    """The KV cache handed to kvpush does not have the geometry it was declared with."""


class AddressError(KVPushError, ValueError):
    """A host or host:port string could not be understood."""


class ClosedError(KVPushError):
    """The object was closed by us; calling it now is a local mistake."""


class BrokenError(KVPushError):
    """The object stopped on a failure, not because we closed it; calling it now cannot
    work. Not a `ClosedError`: "closed by us" and "broken" are told apart."""


class LocalProtocolError(KVPushError):
    """We misused the protocol (a bug on our side, or a wrong call by the engine)."""


class RemoteProtocolError(KVPushError):
    """The peer sent something the protocol does not allow."""


class SideChannelError(KVPushError):
    """The side channel (metadata handshake) did not give us usable metadata."""


class PeerUnreachable(SideChannelError):
    """Connection refused, or no answer before the deadline."""


class AuthenticationRefused(SideChannelError):
    """The peer refused our token, or we refused theirs."""


class IncompatiblePeer(SideChannelError):
    """The peer's compatibility hash differs from ours: mixing would corrupt KV data."""


class UnknownRank(SideChannelError):
    """The peer serves no metadata for the rank we asked for."""


class MalformedReply(SideChannelError):
    """The peer answered with bytes that are not a valid side-channel reply."""


class TransportError(KVPushError):
    """The data plane failed. `reason` says how it maps onto a failed transfer."""

    def __init__(self, reason: FailureReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


class TransferFailed(KVPushError):
    """A transfer ended as failed; raised to the engine or reported by `poll()`."""

    def __init__(self, transfer_id: str, reason: FailureReason, detail: str) -> None:
        super().__init__(f"transfer {transfer_id} failed ({reason.value}): {detail}")
        self.transfer_id = transfer_id
        self.reason = reason
        self.detail = detail


class NotReady(KVPushError):
    """A freshly started server did not pass a readiness check before its deadline."""

    def __init__(self, check: str, detail: str) -> None:
        super().__init__(f"{check}: {detail}")
        self.check = check
        self.detail = detail


class ServerExited(NotReady):
    """The server process ended before it was ready; `returncode` is None when unknown."""

    def __init__(self, pid: int, returncode: int | None, detail: str) -> None:
        super().__init__("process", detail)
        self.pid = pid
        self.returncode = returncode


class RuntimeStopped(BrokenError):
    """The push runtime's background thread stopped on an unexpected error.

    Every transfer it had in flight was reported as failed (LOCAL_ERROR); the error that
    stopped it is chained as `__cause__`.
    """
