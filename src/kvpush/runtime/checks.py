"""The engine's arguments, checked at the call (`PushRuntime`'s methods), before anything
is queued: transfer ids, peer addresses, block ids and layers against our cache. Each
refusal is a `LocalProtocolError` that says what was wrong and what was expected."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvpush.errors import LocalProtocolError
from kvpush.geometry import CacheGeometry
from kvpush.protocol import PeerAddress

__all__ = ["CallChecks"]

_MAX_ID_CHARS = 512


class CallChecks:
    """What an engine may hand a runtime whose cache is `geometry`."""

    def __init__(self, geometry: CacheGeometry) -> None:
        self._num_blocks = geometry.num_blocks
        self._block_tokens = geometry.block_size_tokens
        self._layers = sorted({r.layer for r in geometry.regions}) or [0]
        self._layer_set = frozenset(self._layers)

    def transfer_id(self, transfer_id: str) -> None:
        if not isinstance(transfer_id, str) or not transfer_id:
            raise LocalProtocolError(f"transfer id must be a non-empty str, got {transfer_id!r}")
        if len(transfer_id) > _MAX_ID_CHARS:
            raise LocalProtocolError(
                f"transfer id is {len(transfer_id)} characters long: expected at most "
                f"{_MAX_ID_CHARS}"
            )

    def address(self, address: PeerAddress, what: str = "sender") -> None:
        if not isinstance(address, PeerAddress):
            raise LocalProtocolError(
                f"{what} must be a kvpush.runtime.PeerAddress(host, port, rank), got {address!r}"
            )

    def blocks(self, transfer_id: str, blocks: Sequence[int], ratio: int = 1) -> tuple[int, ...]:
        """`blocks` as a tuple, checked: ids of our blocks, or of their `ratio` parts."""
        self.transfer_id(transfer_id)
        n = self._num_blocks * ratio
        out = tuple(blocks)
        # Plain ints in range (the usual case) pass without building the list of bad ones.
        if all(type(b) is int and 0 <= b < n for b in out):
            if len(out) > 1 and len(set(out)) != len(out):
                raise LocalProtocolError(f"transfer {transfer_id!r}: block ids repeat: {list(out)}")
            return out
        bad = [b for b in out if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < n]
        if bad:
            raise LocalProtocolError(
                f"transfer {transfer_id!r}: block ids {bad[:8]} are outside the cache: "
                f"expected integers in 0..{n - 1}"
            )
        if len(set(out)) != len(out):
            raise LocalProtocolError(f"transfer {transfer_id!r}: block ids repeat: {list(out)}")
        return out

    def layers(self, transfer_id: str, layers: Iterable[int]) -> tuple[int, ...]:
        out = tuple(layers)
        bad = [x for x in out if x not in self._layer_set]
        if bad:
            raise LocalProtocolError(
                f"transfer {transfer_id!r}: layers {bad} are not in the cache: expected "
                f"some of {self._layers}"
            )
        return out

    def block_ratio(self, transfer_id: str, sender_block_tokens: int | None) -> int:
        """How many of the sender's blocks make one of ours (1 for None: ours)."""
        ours = self._block_tokens
        if sender_block_tokens is None:
            return 1
        if (
            isinstance(sender_block_tokens, bool)
            or not isinstance(sender_block_tokens, int)
            or sender_block_tokens < 1
            or ours % sender_block_tokens
        ):
            raise LocalProtocolError(
                f"transfer {transfer_id!r}: sender_block_tokens {sender_block_tokens!r} does "
                f"not divide our {ours}-token blocks: expected a sender whose blocks are ours "
                f"or a whole fraction of them"
            )
        return ours // sender_block_tokens

    def sender_offset(self, sender_offset: int) -> None:
        if isinstance(sender_offset, bool) or not isinstance(sender_offset, int):
            raise LocalProtocolError(f"sender_offset must be an int, got {sender_offset!r}")
        if sender_offset < 0:
            raise LocalProtocolError(f"sender_offset must be >= 0, got {sender_offset}")
