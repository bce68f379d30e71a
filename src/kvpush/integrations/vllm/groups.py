"""A hybrid model's KV-cache groups: which of a request's blocks move, and as which parts.

vLLM's hybrid KV-cache manager gives each kind of attention layer a KV-cache group of
its own (Gemma-3, gpt-oss, a Llama with `layer_types`: full-attention and sliding-window
layers), each with its own block table for a request. The groups share one block pool
and lie over each other in memory (`kvcache.layer_slots`): a block id names the bytes of
one group only, in every region, so a group moves by its block ids alone.

- A full-attention group moves every block of the prompt (after the decode's own prefix
  hit, as a one-group model does).
- A sliding-window group moves only the blocks its window still holds. vLLM frees a
  request's blocks before `num_tokens - window + 1` (`SlidingWindowManager.
  get_num_skipped_tokens`) on both engines: the prefill when the request finishes, the
  decode when it allocates the blocks the KV lands in. Those block positions hold vLLM's
  null block on both sides; the blocks from the first one the window reaches to the
  prompt's last are the ones the next token attends, and the ones that move.
- A Mamba group holds a request's recurrent state in one block, the last of its list
  (vLLM's `MambaManager`: with prefix caching off, its list is that block alone; in
  its `align` mode the earlier positions hold null or superseded states). That block
  moves, whatever the decode's own prefix hit: the state is of the whole prompt.
  A state cannot take a token twice, so the prefill computes the prompt but its last
  token and the decode computes that one (`prefill_backoff`), as vLLM's NIXL
  connectors do; the state moves as it was one token before the prompt's end.

Each group is a part of the request's transfer of its own (its own block lists and
offset, so a decode prefix hit is counted per group), with the part id of group 0
unchanged: a one-group model's transfers are what they were. Pure: no vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpush.geometry import KVCacheGroup, sub_block_ids
from kvpush.integrations.vllm.plan import GroupBlocks
from kvpush.topology import UnsupportedShape


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def moved_span(group: KVCacheGroup, num_tokens: int) -> tuple[int, int]:
    """Block positions `[first, stop)` of a request of `num_tokens` computed tokens
    whose KV moves in `group`: all of them for full attention; from the first block the
    window still holds for a sliding window (vLLM's skipped tokens:
    `max(0, num_tokens - window + 1)`); the last, holding the state, for Mamba."""
    bs = group.block_size_tokens
    stop = _cdiv(num_tokens, bs)
    if group.kind == "mamba":
        return max(0, stop - 1), stop
    if group.kind != "sliding_window" or group.sliding_window is None:
        return 0, stop
    skipped_tokens = max(0, num_tokens - group.sliding_window + 1)
    return min(skipped_tokens // bs, stop), stop


def sent_blocks(
    groups: Sequence[KVCacheGroup], block_ids: Sequence[Sequence[int]], num_tokens: int
) -> tuple[tuple[int, ...], ...]:
    """The prefill's blocks that move, per group (`block_ids`: vLLM's, one list per
    group, as `request_finished_all_groups` has them)."""
    out = []
    for group, ids in zip(groups, block_ids, strict=True):
        first, stop = moved_span(group, num_tokens)
        out.append(tuple(ids[first:stop]))
    return tuple(out)


def received_blocks(
    groups: Sequence[KVCacheGroup],
    block_ids: Sequence[Sequence[int]],
    num_tokens: int,
    local_hit_tokens: int,
) -> tuple[GroupBlocks, ...]:
    """The decode's blocks that receive, per group, each with the offset of its first
    one in the prefill's `sent_blocks` of that group: those after the decode's own
    prefix hit, within what moves."""
    out = []
    for group, ids in zip(groups, block_ids, strict=True):
        first, stop = moved_span(group, num_tokens)
        start = first
        if group.kind != "mamba":
            start = max(first, min(local_hit_tokens // group.block_size_tokens, stop))
        out.append(GroupBlocks(tuple(ids[start:stop]), start - first))
    return tuple(out)


def in_sender_blocks(
    groups: Sequence[KVCacheGroup],
    received: tuple[GroupBlocks, ...],
    num_tokens: int,
    block_tokens: int,
    sender_block_tokens: int,
) -> tuple[GroupBlocks, ...]:
    """`received_blocks` counted in the prefill's blocks, where the decode's
    (`block_tokens`, the engine's block size) are a whole multiple `k` of them (vLLM
    lets the two engines' block sizes differ so): each decode block is `k` parts
    (`kvpush.geometry.sub_block_ids`), one per prefill block, as many as the prefill
    has after the decode's prefix hit. Unchanged at one block size.
    Raises `UnsupportedShape` for sizes that are not so, or a model with more than one
    full-attention KV-cache group (whose other groups count in the engine's blocks)."""
    ours = block_tokens  # the engine's: a Mamba group's own block size is a state's
    if sender_block_tokens == ours:
        return received
    both = f"the prefill's blocks hold {sender_block_tokens} tokens, the decode's {ours}"
    if sender_block_tokens > ours or ours % sender_block_tokens:
        larger = -(-ours // sender_block_tokens) * sender_block_tokens
        raise UnsupportedShape(
            f"{both}: expected the decode's block size to be a whole multiple of the "
            f"prefill's (--block-size {larger} on the decode, say)"
        )
    if len(groups) != 1 or groups[0].kind != "full_attention":
        raise UnsupportedShape(
            f"{both}: expected one block size on both, as this model's "
            f"{' and '.join(g.describe() for g in groups)} count in the engine's blocks"
        )
    ratio = ours // sender_block_tokens
    [group] = received
    offset = group.sender_offset * ratio
    parts = sub_block_ids(group.blocks, ratio, _cdiv(num_tokens, sender_block_tokens) - offset)
    return (GroupBlocks(parts, offset),)


def tokens_moved(groups: Sequence[KVCacheGroup], num_prompt_tokens: int) -> int:
    """The prompt tokens whose KV (and state) moves: all but the last where a Mamba
    group's state moves, as the decode computes that one (vLLM's decode recomputes the
    last prompt token after a full load; attention takes it twice unchanged, a state
    cannot), so none of a one-token prompt; else all."""
    has_state = any(g.kind == "mamba" for g in groups)
    return num_prompt_tokens - 1 if has_state and num_prompt_tokens > 0 else num_prompt_tokens


def prefill_backoff(groups: Sequence[KVCacheGroup], num_prompt_tokens: int) -> int:
    """How many of a prompt's last tokens the prefill drops from its request, to compute
    only what moves (`tokens_moved`); never the whole prompt."""
    moved = tokens_moved(groups, num_prompt_tokens)
    return num_prompt_tokens - moved if moved > 0 else 0


def state_lost(group: KVCacheGroup, num_tokens: int, computed_tokens: int) -> bool:
    """Whether a prefill request that computed `computed_tokens` of a `num_tokens`
    prompt no longer holds what `group` moves: a sliding window's first blocks freed, or
    a Mamba state advanced past the prompt."""
    if group.kind == "mamba":
        return computed_tokens > num_tokens
    return moved_span(group, computed_tokens)[0] > moved_span(group, num_tokens)[0]


def group_part_id(part_id: str, group: int) -> str:
    """The transfer id of one group's part of a rank pair's part: group 0 keeps the
    pair's id (a one-group model's ids are what they were), group g > 0 is `id@g`."""
    return part_id if group == 0 else f"{part_id}@g{group}"
