"""Prefill sends whose decode TP size nobody named, held until a decode speaks.

Behind a router that speaks vLLM's push dialect, neither leg names the decode's TP size.
The decode registers the parts of its own TP, and a part's id says it
(`kvpush.topology.part_id`). A prefill rank holds such a send (`HeldSends`) until its
runtime has a registration, or a rejection, of one of the send's parts
(`PushRuntime.spoken_before_send`), and then splits the transfer as that says
(`split_spoken`). A held send ends, its blocks freed, if no decode speaks within the
transfer deadline (one liveness interval for a cancelled one, which has only a
registered decode to tell). This object holds state and returns verdicts; the worker
offers and ends what they name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from kvpush.config import TimingConfig
from kvpush.integrations.vllm.plan import Send
from kvpush.topology import decode_tp_named


def split_spoken(tid: str, spoken: Iterable[str], prefill_tp: int) -> int | None:
    """The decode TP size that the first id in `spoken` of a part of `tid` names."""
    return next((d for pid in spoken if (d := decode_tp_named(pid, tid, prefill_tp))), None)


class HeldSends:
    """The held sends of one prefill rank, by transfer id."""

    def __init__(self, timing: TimingConfig) -> None:
        self._timing = timing
        self._held: dict[str, tuple[Send, float]] = {}  # the send, held until when

    def __bool__(self) -> bool:
        return bool(self._held)

    def __contains__(self, tid: object) -> bool:
        return tid in self._held

    def transfer_ids(self) -> list[str]:
        return list(self._held)

    def hold(self, snd: Send, now: float) -> None:
        """Hold `snd` (its id must not be held already: see `WorkerSide._hold`)."""
        t = self._timing
        bound = t.liveness_timeout_s if snd.cancel else t.transfer_deadline_s
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
                        f"no decode registered for transfer {tid} in time (its params named "
                        "no decode TP size, which the prefill learns from the registration)",
                    )
                )
        return offers, ended


__all__ = ["HeldSends", "split_spoken"]
