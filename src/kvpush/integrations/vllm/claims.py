"""What a decode rank tells a prefill's ranks of a transfer it does not register: a claim,
for a request vLLM queued without blocks (it will register later), and a refusal, for a
transfer the prefill split for another decode TP (it never will).

Both name the same parts, the ones this rank would register (`parts.claim_parts`): a
claim keeps the prefill from freeing them while the decode lives (each heartbeat renews
it; `claim_window_s` after the last one the prefill frees them), and ends when the
request's `Receive` registers those parts, its `Refuse` rejects them or it is aborted;
a part claimed but never registered (a registration refused at the call) has its claim
aborted. A refusal fails each part at once on the prefill, which frees its blocks.
The scheduler plans a claim for each decode request vLLM adds (`claim_of`);
`DecodeClaims` holds the claims of one worker rank, which hands it its runtime.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvpush.errors import KVPushError
from kvpush.integrations.vllm.parts import claim_parts
from kvpush.integrations.vllm.plan import Claim
from kvpush.transfer_params import BadTransferParams, parse_remote_prefill

if TYPE_CHECKING:
    from kvpush.integrations.vllm.books import RequestBooks
    from kvpush.integrations.vllm.plan import Refuse
    from kvpush.runtime import PushRuntime

log = logging.getLogger(__name__)


def claim_of(params: dict[str, Any], pairing_id: str | None) -> Claim | None:
    """The claim of a decode request vLLM just queued: named as its `Receive` will name
    it, so params that cannot be read claim nothing (the request fails once it has
    blocks, as before)."""
    try:
        remote = parse_remote_prefill(params, pairing_id=pairing_id)
    except BadTransferParams:
        return None
    return Claim(
        remote.transfer_id,
        remote.remote_host,
        remote.remote_port,
        remote.tp_size,
        remote.decode_tp_size,
        remote.pp_size,
    )


class DecodeClaims:
    """The parts decode rank `rank` (of `tp_size`, in a model of `num_groups` KV-cache
    groups) claimed, by transfer id, until the request registers, is refused or ends."""

    def __init__(self, tp_size: int, rank: int, num_groups: int) -> None:
        self._tp_size = tp_size
        self._rank = rank
        self._num_groups = num_groups
        self._claimed: dict[str, list[str]] = {}

    def claim(self, runtime: PushRuntime, claim: Claim) -> None:
        """Claim every part of a queued request's transfer that this rank will receive
        (or, split for another TP than ours, will refuse), from its prefill rank."""
        from kvpush.runtime import PeerAddress

        tid = claim.transfer_id
        if tid in self._claimed:
            return
        claimed = self._claimed[tid] = []
        for pid, p in claim_parts(claim, self._tp_size, self._rank, self._num_groups):
            try:
                runtime.claim(pid, PeerAddress(claim.host, claim.port, p))
            except KVPushError as exc:
                # Unclaimed, the transfer lives the prefill's claim window: the
                # request's registration still settles it if it comes in time.
                log.warning("could not claim transfer %s: %s", pid, exc)
                continue
            claimed.append(pid)

    def end(self, runtime: PushRuntime, books: RequestBooks, tid: str) -> None:
        """The request of `tid` registered or ended: each part we claimed that no
        request of ours holds now has its claim dropped (a part the runtime refused at
        the call; a registered part's Register speaks for it, a rejected one ended it)."""
        for pid in self._claimed.pop(tid, ()):
            if not books.holds_part("receiver", pid):
                runtime.abort(pid)

    def refuse(self, runtime: PushRuntime, ref: Refuse) -> None:
        """Tell each prefill rank at once that its parts of the transfer will never be
        received (the parts it opened, for the decode TP it split the transfer for),
        each by one rank of ours; the rejections end our claims of them."""
        from kvpush.runtime import PeerAddress

        self._claimed.pop(ref.transfer_id, None)
        for pid, p in claim_parts(ref, self._tp_size, self._rank, self._num_groups):
            try:
                runtime.reject(pid, PeerAddress(ref.host, ref.port, p), ref.detail)
            except KVPushError as exc:
                log.warning("could not refuse transfer %s: %s", pid, exc)


__all__ = ["DecodeClaims", "claim_of"]
