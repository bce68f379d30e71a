"""kvpush: push-mode KV cache transfer between prefill and decode servers, on NIXL."""

from kvpush.errors import FailureReason, KVPushError, TransferFailed

__version__ = "0.1.0"

__all__ = ["FailureReason", "KVPushError", "TransferFailed", "__version__"]
