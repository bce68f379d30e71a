"""What the data-plane MAC costs per message: `python -m kvpush.bench.auth_cost`.

For each message kind the push protocol sends, as big as it gets in practice, it times
(best of several rounds, each of many messages) what a message costs without a token
(encode, put the peer's message key in front; check the key, decode) and the MAC's share
with one (`MessageAuth.seal` and `open`, `kvpush.protocol.auth`), in microseconds per
message, on this machine. The end-to-end figure (1-block latency, side by side with
kvpush without a token) is `kvpush bench --modes kvpush,kvpush-token`.
"""

from __future__ import annotations

import argparse
import json
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

from kvpush.errors import FailureReason
from kvpush.protocol.auth import MessageAuth
from kvpush.protocol.identity import strip_message_key
from kvpush.protocol.messages import (
    Cancel,
    Done,
    Heartbeat,
    Message,
    Register,
    decode,
    encode,
)


def _messages() -> dict[str, Message]:
    tid = "cmpl-" + secrets.token_hex(16)
    inc = "0" * 32

    def register(blocks: int) -> Register:
        return Register(
            tid, "engine-d", inc, "10.0.0.2", 5600, 0, tuple(range(blocks)), sent_at=1.0
        )

    return {
        "register (1 block)": register(1),
        "register (512 blocks)": register(512),
        "done": Done(tid, 512),
        "cancel": Cancel(tid, FailureReason.CANCELLED, "engine aborted the request"),
        "heartbeat (64 ids)": Heartbeat(
            "receiver", "engine-d", inc, tuple(f"{tid}-{i}" for i in range(64)), 1.0, 0.5
        ),
    }


def _per_call_us(fn: Callable[[], object], n: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n / 1e3)
    return best


def measure(n: int = 20000, rounds: int = 5) -> list[dict[str, Any]]:
    """One row per message kind: its size, and microseconds per message."""
    key = secrets.token_bytes(16)
    sender = MessageAuth("token", "sender-agent", "inc-s")
    receiver = MessageAuth("token", "receiver-agent", "inc-r")
    sender.learn("receiver-agent", "inc-r")
    rows = []
    for kind, message in _messages().items():
        body = encode(message)
        framed = key + body

        def plain(framed: bytes = framed, message: Message = message) -> object:
            encode(message)
            return decode(strip_message_key(key, framed) or b"")

        def mac(body: bytes = body) -> bytes:
            return sender.seal("receiver-agent", body)

        sealed = iter([mac() for _ in range(n * rounds)])

        def check(frames: Iterator[bytes] = sealed) -> object:
            opened = receiver.open("sender-agent", next(frames))
            assert isinstance(opened, bytes), opened
            return opened

        plain_us = _per_call_us(plain, n, rounds)
        seal_us = _per_call_us(mac, n, rounds)
        open_us = _per_call_us(check, n, rounds)
        rows.append(
            {
                "kind": kind,
                "bytes": len(body),
                "without_token_us": plain_us,
                "seal_us": seal_us,
                "open_us": open_us,
                "mac_us": seal_us + open_us,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpush.bench.auth_cost")
    parser.add_argument("-n", type=int, default=20000, help="messages per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (the best one counts)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    rows = measure(args.n, args.rounds)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"{'message':<22} {'bytes':>6} {'no token us':>12} {'seal us':>8} {'open us':>8} "
        f"{'MAC us':>7}"
    )
    for r in rows:
        print(
            f"{r['kind']:<22} {r['bytes']:>6} {r['without_token_us']:>12.2f} "
            f"{r['seal_us']:>8.2f} {r['open_us']:>8.2f} {r['mac_us']:>7.2f}"
        )
    print("(no token: encode + key + decode; MAC: seal + open, per message, best round)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
