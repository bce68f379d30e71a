"""Drive `tests/chaos_peer.py` ranks from a test: start, command, stop and resume them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from helpers.waiting import wait_until  # chaos_late_write.py takes it from here
from nixl_procs import ScriptProcess

CHAOS_PEER = Path(__file__).with_name("chaos_peer.py")

Results = list[dict[str, Any]]


class ChaosRank(ScriptProcess):
    """One `chaos_peer.py` process: commands in, replies and transfer results out."""

    def __init__(
        self,
        engine_id: str,
        role: str,
        *options: str,
        env: dict[str, str] | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.results: Results = []
        self.resumed = threading.Event()
        self._cv = threading.Condition()
        self.port = 0
        self.stopped = False
        super().__init__(
            CHAOS_PEER,
            engine_id,
            role,
            *options,
            env=os.environ | (env or {}),
            capture_stderr=True,
            name=engine_id,
        )
        self.pid = self.process.pid

    def ready(self) -> ChaosRank:
        """Wait for the process to be up (start several first: they come up in parallel)."""
        if not self.port:
            self.port = self._reply(timeout=60)["port"]
        return self

    def _line(self, kind: str, body: str) -> None:
        if kind == "@result":
            with self._cv:
                self.results.append(json.loads(body))
                self._cv.notify_all()
        elif kind == "@resumed":
            self.resumed.set()

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert not self.stopped, f"{self.engine_id} is stopped: it cannot answer {cmd}"
        return super().call(**cmd)

    def stop_after(self, *calls: dict[str, Any]) -> dict[str, Any]:
        """The engine makes `calls` (send / layers_ready), and the process stops itself
        before its runtime thread can take them."""
        self.resumed.clear()
        self.tell(op="stop_after", then=list(calls))
        reply = self._reply()
        self.stopped = True
        wait_until(self.is_stopped, 10, f"{self.engine_id} to stop")
        return reply

    def sigstop(self) -> None:
        self.process.send_signal(signal.SIGSTOP)
        self.stopped = True
        wait_until(self.is_stopped, 10, f"{self.engine_id} to stop")

    def sigcont(self) -> None:
        self.process.send_signal(signal.SIGCONT)
        self.stopped = False

    def is_stopped(self) -> bool:
        """The kernel says every thread of the process is stopped (state T)."""
        states = []
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):  # a thread that just exited
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        return bool(states) and all(s == "T" for s in states)

    def wait_results(self, until: Callable[[Results], bool], timeout: float) -> Results:
        with self._cv:
            if not self._cv.wait_for(lambda: until(self.results), timeout):
                pytest.fail(f"{self.engine_id}: timed out; results so far {self.results}")
            return list(self.results)

    def result_of(self, transfer_id: str) -> Results:
        with self._cv:
            return [r for r in self.results if r["transfer_id"] == transfer_id]

    def ask_to_exit(self) -> None:
        """Resume it if stopped and tell it to exit, once; `close()` then waits for it."""
        if self.stopped:
            self.sigcont()
        super().ask_to_exit()


def close_all(ranks: list[ChaosRank]) -> None:
    """Close ranks in parallel: each takes a second or more to shut its runtime down."""
    for rank in ranks:
        rank.ask_to_exit()
    for rank in ranks:
        rank.close()


def ended(*transfer_ids: str) -> Callable[[Results], bool]:
    return lambda results: {r["transfer_id"] for r in results} >= set(transfer_ids)


class Ledger:
    """Per test run: which transfers ran between which ranks, and what each must show.

    `audit()` returns every violation of the transfer contract that the bytes and the
    results show: a transfer not ended exactly once per side; a receiver `ok` whose
    blocks do not hold what the sender's engine submitted; a sender that handed blocks
    back while a write of them was unfinished on the data plane; a canary (a receiver
    block reused after its transfer ended) overwritten."""

    def __init__(self, receiver: ChaosRank, sender: ChaosRank) -> None:
        self.receiver, self.sender = receiver, sender
        self.submitted: dict[str, list[list[str]]] = {}
        self.stalls = 0
        self.must_fail: set[str] = set()  # the receiver gave up on these: ok is a lie
        self.canaries_checked = 0

    def sent(self, transfer_id: str, sums: list[list[str]]) -> None:
        self.submitted[transfer_id] = sums

    def wait_ended(self, timeout: float) -> None:
        """Both sides reported every transfer and hold nothing more."""
        tids = tuple(self.submitted)
        for rank in (self.receiver, self.sender):
            rank.wait_results(ended(*tids), timeout)
            wait_until(
                lambda rank=rank: rank.call(op="stats")["in_flight"] == 0,
                timeout,
                f"{rank.engine_id} to hold no transfer",
            )
        # Every write NIXL still runs for the sender has landed before canaries are read.
        wait_until(
            lambda: self.sender.call(op="stats")["writes_in_flight"] == 0,
            timeout,
            "the sender's data plane to finish its writes",
        )

    def audit(self) -> list[str]:
        bad: list[str] = []
        for tid, want in self.submitted.items():
            for rank in (self.receiver, self.sender):
                got = rank.result_of(tid)
                if len(got) != 1:
                    bad.append(f"{tid}: {rank.engine_id} reported it {len(got)} times: {got}")
            for rank in (self.receiver, self.sender):
                for r in rank.result_of(tid):
                    if tid in self.must_fail and r["reason"] is None:
                        bad.append(
                            f"{tid}: {rank.engine_id} reported ok after the receiver gave up on it"
                        )
            for r in self.receiver.result_of(tid):
                if r["reason"] is None and r["at_end"] != want:
                    bad.append(
                        f"{tid}: the receiver reported ok, but its blocks do not hold "
                        "the bytes the sender's engine submitted"
                    )
            for r in self.sender.result_of(tid):
                if r["still_read_by"]:
                    bad.append(
                        f"{tid}: the sender handed back blocks {r['blocks']} while "
                        f"the data plane still ran {r['still_read_by']}"
                    )
        check = self.receiver.call(op="check")
        self.canaries_checked += check["canaries_checked"]
        overwritten = set(check["canaries_overwritten"])
        for r in self.receiver.results:
            hit = sorted(overwritten.intersection(r["canaries"]))
            if hit:
                bad.append(
                    f"{r['transfer_id']}: written into receiver blocks {hit} after the "
                    f"receiver reported it ({r['reason'] or 'ok'}) and reused them "
                    "(canaries overwritten)"
                )
        for rank in (self.receiver, self.sender):
            dup = rank.call(op="stats")["duplicate_reports"]
            if dup:
                bad.append(f"{rank.engine_id}: {dup} duplicate reports suppressed")
        return bad

    def figures(self, violations: list[str]) -> str:
        return (
            f"transfers={len(self.submitted)} stalls={self.stalls} "
            f"canaries_checked={self.canaries_checked} violations={len(violations)}"
        )
