"""Prefill sends whose decode TP size nobody named, held until a decode speaks.

Behind a router that speaks vLLM's push dialect, neither leg names the decode's TP size.
The decode registers the parts of its own TP, and a part's id says it
(`kvpush.topology.part_id`). A prefill rank holds such a send (`HeldSends`) until its
runtime has a registration, a rejection or a claim (a decode holding the request
queued claims the parts it will register) of one of the send's parts
(`PushRuntime.spoken_before_send`), and then splits the transfer as that says
(`split_spoken`). A held send ends, its blocks freed, if no decode speaks within the
claim window (`claim_window_s`; the transfer deadline without one) plus the handshake
timeout: a router sends the decode leg only once the prefill answered, and a decode
this prefill never met is heard only once the handshake that vouches for it is done.
A cancelled one ends a liveness interval after, having only a registered decode to
tell. This object holds state and returns verdicts; the worker offers and ends what
they name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvpush.config import TimingConfig
from kvpush.integrations.vllm.plan import Send
from kvpush.topology import decode_tp_named

if TYPE_CHECKING:
    from kvpush.runtime import PushRuntime


def split_spoken(tid: str, spoken: Iterable[str], prefill_tp: int) -> int | None:
    """The decode TP size that the first id in `spoken` of a part of `tid` names."""
    return next((d for pid in spoken if (d := decode_tp_named(pid, tid, prefill_tp))), None)


def step_splits(
    sends: Iterable[Send], spoken: Iterable[str], prefill_tp: int
) -> tuple[dict[str, int | None], int]:
    """The decode TP each of a step's sends is split for, as its params named it or as a
    decode rank that registered for (or rejected) one of its parts already said (None:
    not known yet); and how many sends found their decode registered already (push
    running concurrently with the prefill)."""
    spoken = list(spoken)
    splits: dict[str, int | None] = {}
    first = 0
    for snd in sends:
        named = split_spoken(snd.transfer_id, spoken, prefill_tp)
        first += named is not None and not snd.cancel
        splits[snd.transfer_id] = snd.decode_tp_size or named
    return splits, first


class HeldSends:
    """The held sends of one prefill rank, by transfer id."""

    def __init__(self, timing: TimingConfig, vouch_s: float = 0.0) -> None:
        self._timing = timing
        # How long a decode this prefill never met may take to be vouched for (the
        # handshake timeout): its first claim or registration is read only after.
        self._vouch_s = vouch_s
        self._held: dict[str, tuple[Send, float]] = {}  # the send, held until when

    def __bool__(self) -> bool:
        return bool(self._held)

    def __contains__(self, tid: object) -> bool:
        return tid in self._held

    def transfer_ids(self) -> list[str]:
        return list(self._held)

    def hold(self, snd: Send, now: float) -> None:
        """Hold `snd` (its id must not be held already: see `WorkerSide._hold`): for the
        claim window and the handshake timeout (the transfer deadline without a
        window), or, a cancelled one (nothing to move, only a decode that registered
        to tell), one liveness interval, which a decode leg sent with the prefill's (a
        router's concurrent legs) takes to register."""
        t = self._timing
        bound = t.transfer_deadline_s
        if t.claim_window_s is not None:
            bound = min(bound, t.claim_window_s + self._vouch_s)
        if snd.cancel:
            bound = t.liveness_timeout_s
        self._held[snd.transfer_id] = (snd, now + bound)

    def pop(self, tid: str) -> Send | None:
        held = self._held.pop(tid, None)
        return None if held is None else held[0]

    def settle(
        self, spoken: Iterable[str], prefill_tp: int, now: float
    ) -> tuple[list[Send], list[tuple[Send, str]]]:
        """The held sends a decode spoke for, split as it said (all layers computed by
        now: offered whole), and those it did not in time, with why they end."""
        spoken = list(spoken)
        offers: list[Send] = []
        ended: list[tuple[Send, str]] = []
        for tid, (snd, until) in list(self._held.items()):
            split = split_spoken(tid, spoken, prefill_tp)
            if split is None and now < until:
                continue
            del self._held[tid]
            if split is not None:
                offers.append(dataclasses.replace(snd, decode_tp_size=split, layerwise=False))
            elif snd.cancel:
                ended.append((snd, "ended without its KV before any decode registered"))
            else:
                ended.append(
                    (
                        snd,
                        f"no decode registered for nor claimed transfer {tid} in time (its "
                        "params named no decode TP size, which the prefill learns from the "
                        "registration or the claim)",
                    )
                )
        return offers, ended


class SendSplits:
    """A prefill rank's splits: the decode TP each of this step's sends is split for, and
    the sends held until a decode speaks (`held`). It reads what decodes said from the
    runtime it is given; the worker offers, holds and ends the sends it names."""

    def __init__(self, timing: TimingConfig, vouch_s: float, prefill_tp: int) -> None:
        self.held = HeldSends(timing, vouch_s)
        self._prefill_tp = prefill_tp
        self._splits: dict[str, int | None] = {}

    def new_step(self, runtime: PushRuntime, sends: Sequence[Send]) -> int:
        """Once per step, before any of its sends opens (`step_splits`); a send no
        registration names is split as a decode that holds its request queued, and
        claims the parts it will register, says. How many sends found their decode
        registered already."""
        tids = [snd.transfer_id for snd in sends]
        spoken = runtime.spoken_before_send(tids) if tids else []
        self._splits, first = step_splits(sends, spoken, self._prefill_tp)
        unnamed = [tid for tid, split in self._splits.items() if split is None]
        if unnamed:
            claimed = runtime.spoken_before_send(unnamed, claimed=True)
            for tid in unnamed:
                self._splits[tid] = split_spoken(tid, claimed, self._prefill_tp)
        return first

    def split_for(self, transfer_id: str) -> int | None:
        """The decode TP this step's send of `transfer_id` is split for (None: not known:
        the worker holds it)."""
        return self._splits.get(transfer_id)

    def settle(self, runtime: PushRuntime, now: float) -> tuple[list[Send], list[tuple[Send, str]]]:
        """`HeldSends.settle`, with what decodes registered for, rejected or claimed."""
        if not self.held:
            return [], []
        spoken = runtime.spoken_before_send(self.held.transfer_ids(), claimed=True)
        return self.held.settle(spoken, self._prefill_tp, now)


__all__ = ["HeldSends", "SendSplits", "split_spoken", "step_splits"]
