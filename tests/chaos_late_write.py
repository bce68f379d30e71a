"""Measure what the fence still assumes: a sender stopped right after it posts a write.

The protocol's lease check stops a stalled sender from *starting* a write the receiver no
longer expects; a write it already handed to the data plane before the stop is outside
that check. Whether such a write can land late depends on the data plane: UCX over CMA
(one host, the default here) copies at post time, while UCX over TCP (hosts without
RDMA) moves the bytes only while the sender's process runs. This script stops the sender
`--delay-ms` after it announces the last layer of a large write, past liveness + fence,
resumes it, and audits the run like `tests/test_nixl_stalls.py` (canaries, one end per
side, `ok` only when the receiver also finished). Not a test: timing decides whether the
write is in flight at the stop, so it reports how often each outcome happened.

    .venv/bin/python tests/chaos_late_write.py --runs 10 [--ucx-tls tcp] [--block-bytes B]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chaos_procs import ChaosRank, Ledger, close_all, ended, wait_until

LIVENESS_S, LEASE_S = 1.0, 2.0
FENCE_S = LEASE_S + 2 * LIVENESS_S


def one_run(tls: str | None, block_bytes: int, delay_s: float) -> list[str]:
    env = {"UCX_TLS": tls} if tls else {}
    options = ["--liveness", str(LIVENESS_S), "--lease", str(LEASE_S), "--blocks", "16"]
    options += ["--block-bytes", str(block_bytes)]
    receiver = ChaosRank("decode", "receiver", "--seed", "1", *options, env=env)
    sender = ChaosRank("prefill", "sender", "--seed", "2", *options, env=env)
    try:
        receiver.ready()
        sender.ready()
        ledger = Ledger(receiver, sender)
        receiver.call(op="receive", transfer_id="warm-up", sender_port=sender.port, blocks=[0])
        ledger.sent("warm-up", sender.call(op="send", transfer_id="warm-up", blocks=[0])["sums"])
        receiver.wait_results(ended("warm-up"), 20)
        blocks = list(range(1, 9))
        receiver.call(op="receive", transfer_id="t1", sender_port=sender.port, blocks=blocks)
        sums = sender.call(
            op="send", transfer_id="t1", blocks=[b + 7 for b in blocks], ready_layers=[0]
        )
        ledger.sent("t1", sums["sums"])
        wait_until(
            lambda: (
                sender.call(op="stats")["writes_in_flight"] == 0
                and sender.call(op="stats")["sending"] == {"writing": 1}
            ),
            20,
            "layer 0",
        )
        sender.tell(op="layers_ready", transfer_id="t1", layers=[1])
        time.sleep(delay_s)
        sender.sigstop()
        stopped = time.monotonic()
        receiver.wait_results(ended("t1"), FENCE_S + 20)
        if receiver.result_of("t1")[0]["reason"] is not None:
            ledger.must_fail.add("t1")
        time.sleep(max(0.0, LIVENESS_S + FENCE_S + 1.0 - (time.monotonic() - stopped)))
        sender.sigcont()
        sender.replies.get(timeout=20)  # the layers_ready reply, sent after the resume
        ledger.wait_ended(20)
        return ledger.audit()
    finally:
        close_all([receiver, sender])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="chaos_late_write")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--ucx-tls", default=None, help="e.g. tcp: no CMA, as across hosts")
    p.add_argument("--block-bytes", type=int, default=1 << 20)
    p.add_argument("--delay-ms", type=float, default=5.0)
    args = p.parse_args(argv)
    outcomes: collections.Counter[str] = collections.Counter()
    for i in range(args.runs):
        violations = one_run(args.ucx_tls, args.block_bytes, args.delay_ms / 1000)
        kinds = sorted(
            {
                "canaries overwritten" if "canaries" in v else "ok on one side only"
                for v in violations
            }
        )
        outcome = ", ".join(kinds) or "clean"
        outcomes[outcome] += 1
        print(f"run {i + 1}: {outcome}", *violations, sep="\n  ", flush=True)
    write_mib = 8 * 2 * args.block_bytes / (1 << 20)
    print(
        f"UCX_TLS={args.ucx_tls or '(default)'}, a {write_mib:g} MiB write, sender stopped "
        f"{args.delay_ms:g} ms after it was announced, {args.runs} runs: {dict(outcomes)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
