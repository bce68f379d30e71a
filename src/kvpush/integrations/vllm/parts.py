"""The parts a worker rank cuts a request's transfer into, and what a decode rank checks
before it registers them. Pure: no runtime, no vLLM.

A transfer is one part per pipeline stage of the prefill (`kvpush.topology.stage_part_id`),
per pair of ranks that exchange its KV (`kvpush.topology.transfer_parts`: with equal TP
sizes rank r with rank r; a decode at TP 1 takes a part from each rank of a prefill at
TP 2, each filling its half of the heads of every block) and per KV-cache group of a
hybrid model (`kvpush.integrations.vllm.groups.group_part_id`). A prefill stage's rank on
its side channel is `stage * prefill_tp + tp rank`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

from kvpush.integrations.vllm.groups import group_part_id
from kvpush.integrations.vllm.plan import Claim, GroupBlocks, Receive, Refuse
from kvpush.topology import STAGE_MARK, stage_part_id, transfer_parts

G = TypeVar("G")


def request_parts(
    tid: str,
    prefill_tp: int,
    decode_tp: int,
    groups: Sequence[G],
    *,
    prefill: int | None = None,
    decode: int | None = None,
    stages: int = 1,
    stage: int | None = None,
) -> list[tuple[str, int, int, G]]:
    """Every part of transfer `tid` (`part id, prefill side-channel rank, decode rank,
    group`): only the given stage's, and those of the given prefill or decode
    tensor-parallel rank, where named."""
    return [
        (group_part_id(stage_part_id(pair_id, s, stages), g), s * prefill_tp + p, d, group)
        for s in range(stages)
        if stage in (None, s)
        for p, d, pair_id in transfer_parts(tid, prefill_tp, decode_tp)
        if prefill in (None, p) and decode in (None, d)
        for g, group in enumerate(groups)
    ]


def receive_problem(rcv: Receive, tp_size: int, num_groups: int) -> str | None:
    """Why a decode rank at `tp_size` with `num_groups` KV-cache groups cannot register
    `rcv` (its prefill's parts are then refused at once, saying so); None: it can."""
    sender_tp = rcv.sender_tp_size or tp_size
    split_for = rcv.split_for_tp or tp_size  # unnamed: ours, which the prefill then learns
    if split_for != tp_size:
        return (
            f"the prefill (TP {sender_tp}) split transfer {rcv.transfer_id} for a decode "
            f"at TP {split_for}, but this decode runs TP {tp_size}: expected the prefill "
            f"leg's kv_transfer_params to name it (decode_tp_size: {tp_size}; kvpush proxy "
            f"reads it from --decode-side-channel; or name none, and the prefill "
            f"learns it from this decode's registration)"
        )
    groups = 1 + len(rcv.more_groups)
    if groups != num_groups:
        return (
            f"transfer {rcv.transfer_id} names the blocks of {groups} KV-cache "
            f"group(s), but this rank registered {num_groups}"
        )
    return None


def receive_parts(rcv: Receive, tp_size: int, rank: int) -> list[tuple[str, int, GroupBlocks]]:
    """What decode rank `rank` registers for `rcv`: each part's id, its prefill rank on
    the prefill's side channel, and the blocks of its group."""
    groups = (GroupBlocks(rcv.blocks, rcv.sender_offset), *rcv.more_groups)
    return [
        (pid, p, group)
        for pid, p, _d, group in request_parts(
            rcv.transfer_id,
            rcv.sender_tp_size or tp_size,
            tp_size,
            groups,
            decode=rank,
            stages=rcv.sender_pp_size or 1,
        )
    ]


def claim_parts(
    claim: Claim | Refuse, tp_size: int, rank: int, num_groups: int
) -> list[tuple[str, int]]:
    """What decode rank `rank` claims for a queued request (`Claim`), or rejects of a
    transfer split for another TP than ours (`Refuse`): each part it would register,
    with its prefill rank on the prefill's side channel (the ids `receive_parts`
    names)."""
    return [
        (pid, p)
        for pid, p, d, _g in request_parts(
            claim.transfer_id,
            claim.sender_tp_size or tp_size,
            claim.split_for_tp or tp_size,
            range(num_groups),
            stages=claim.sender_pp_size or 1,
        )
        if d % tp_size == rank
    ]


class UnstagedRegistrations:
    """A pipeline stage's registrations to refuse: a decode whose leg lost the prefill's
    `pp_size` (a router that rewrote the params without it) registers part ids without
    a stage (`stage_part_id`), which no stage sends. Each is named once."""

    def __init__(self) -> None:
        self._named: dict[str, set[str]] = {}  # transfer id -> its parts named already

    def new(self, spoken: Iterable[str], tids: Sequence[str]) -> list[tuple[str, str]]:
        """(part id, transfer id) of each id in `spoken` (what decodes registered for or
        rejected) naming a part of one of our transfers `tids` without a stage, not
        named before; transfers no longer ours are forgotten."""
        for tid in [t for t in self._named if t not in tids]:
            del self._named[tid]
        out = []
        for pid in spoken:
            of = max((t for t in tids if pid.startswith(t)), key=len, default=None)
            if of is None or STAGE_MARK in pid[len(of) :]:
                continue
            named = self._named.setdefault(of, set())
            if pid not in named:
                named.add(pid)
                out.append((pid, of))
        return out


def unstaged_detail(pid: str, pp_size: int) -> str:
    """What a stage tells a decode that registered `pid` (`unstaged_registrations`)."""
    return (
        f"the decode registered {pid}, a part of a prefill without pipeline stages, "
        f"but this prefill runs pipeline_parallel_size {pp_size} (each stage "
        f"sends its own layers, one part each): expected the decode leg's "
        f"kv_transfer_params to carry the prefill's pp_size: {pp_size} (its "
        f"answer has it)"
    )
