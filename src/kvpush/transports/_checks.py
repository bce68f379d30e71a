"""Argument checks shared by every transport, so that all refuse bad input alike."""

from __future__ import annotations

from collections.abc import Sequence

from kvpush.errors import FailureReason, LocalProtocolError, TransportError
from kvpush.geometry import CacheGeometry, ScratchRegion


def check_region_fits(ours: CacheGeometry, theirs: CacheGeometry, peer: str) -> None:
    """Writes copy block b of our region r into block b' of their region r: the two
    geometries must have the same regions with the same block size."""
    if len(ours.regions) != len(theirs.regions):
        raise TransportError(
            FailureReason.INCOMPATIBLE_PEER,
            f"peer {peer} has {len(theirs.regions)} KV regions, we have {len(ours.regions)}",
        )
    for i, (a, b) in enumerate(zip(ours.regions, theirs.regions, strict=True)):
        if a.block_bytes != b.block_bytes:
            raise TransportError(
                FailureReason.INCOMPATIBLE_PEER,
                f"region {i} ({a.name}): peer {peer} has {b.block_bytes}-byte blocks, "
                f"we have {a.block_bytes}-byte blocks",
            )


def validate_write(
    ours: CacheGeometry,
    theirs: CacheGeometry,
    peer: str,
    our_blocks: Sequence[int],
    their_blocks: Sequence[int],
    regions: Sequence[int] | None,
    notification: bytes | None = None,
) -> tuple[int, ...]:
    """Check a write's arguments; return the region indices it covers."""
    if notification is not None and not notification:
        raise TransportError(
            FailureReason.LOCAL_ERROR,
            f"write to {peer}: the notification is empty; NIXL cannot send an empty "
            "notification, so pass None for no notification or at least one byte",
        )
    if len(our_blocks) != len(their_blocks):
        raise TransportError(
            FailureReason.LOCAL_ERROR,
            f"write to {peer}: {len(our_blocks)} source blocks but {len(their_blocks)} "
            "destination blocks; expected one destination per source block",
        )
    for label, blocks, limit in (
        ("our", our_blocks, ours.num_blocks),
        ("their", their_blocks, theirs.num_blocks),
    ):
        for b in blocks:
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < limit:
                raise TransportError(
                    FailureReason.LOCAL_ERROR,
                    f"write to {peer}: {label} block id {b!r} is out of range; expected an "
                    f"integer in [0, {limit})",
                )
    if regions is None:
        return tuple(range(len(ours.regions)))
    out = tuple(regions)
    for r in out:
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < len(ours.regions):
            raise TransportError(
                FailureReason.LOCAL_ERROR,
                f"write to {peer}: region index {r!r} is out of range; expected an integer "
                f"in [0, {len(ours.regions)})",
            )
    if len(set(out)) != len(out):
        raise TransportError(
            FailureReason.LOCAL_ERROR, f"write to {peer}: region indices {out} repeat"
        )
    return out


def validate_scratch_write(
    ours: ScratchRegion | None, theirs: ScratchRegion, peer: str, nbytes: int
) -> None:
    """Check a scratch write's arguments: a buffer here, and `nbytes` inside both."""
    if ours is None:
        raise TransportError(
            FailureReason.LOCAL_ERROR,
            f"scratch write to {peer}: no scratch buffer is registered here (register_scratch)",
        )
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise TransportError(
            FailureReason.LOCAL_ERROR,
            f"scratch write to {peer}: expected a positive byte count, got {nbytes!r}",
        )
    if nbytes > min(ours.nbytes, theirs.nbytes):
        raise TransportError(
            FailureReason.LOCAL_ERROR,
            f"scratch write to {peer}: {nbytes} bytes do not fit (our buffer has "
            f"{ours.nbytes}, theirs {theirs.nbytes})",
        )


def check_scratch_registration(
    endpoint: str, geometry: CacheGeometry | None, registered: ScratchRegion | None
) -> None:
    """`register_scratch` comes once, after `register_memory`."""
    if geometry is None:
        raise LocalProtocolError(f"{endpoint}: register_memory() before register_scratch()")
    if registered is not None:
        raise LocalProtocolError(
            f"{endpoint}: the scratch buffer is registered once; it already is"
        )
