#!/usr/bin/env python3
"""What authenticating a data-plane message costs, per message: the message key that
`kvpush.protocol.PushProtocol` checks (compare a 16-byte prefix, then decode) against an
HMAC-SHA256 of the message (compute and compare, then decode), on receive and on send.

    PYTHONPATH=src .venv/bin/python scripts/measure_message_key.py [--n 200000]

Each figure is the best of 7 runs (on a loaded host the others measure the load). The
figures quoted in `kvpush.protocol.state` ("Who sent it") come from this script.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import secrets
import timeit
from collections.abc import Callable

from kvpush.protocol.messages import Done, Heartbeat, Message, decode, encode


def _ns(call: Callable[[], object], n: int) -> float:
    # The best of 7 runs: on a loaded host the others measure the load, not the call.
    return min(timeit.repeat(call, number=max(1, n // 7), repeat=7)) / max(1, n // 7) * 1e9


def measure(name: str, message: Message, key: bytes, n: int) -> str:
    def mac(data: bytes) -> bytes:
        return hmac.new(key, data, hashlib.sha256).digest()[:16]

    raw = encode(message)
    keyed = key + raw
    maced = mac(raw) + raw
    decode_ns = _ns(lambda: decode(raw), n)
    key_ns = _ns(lambda: hmac.compare_digest(keyed[:16], key) and decode(keyed[16:]), n)
    mac_ns = _ns(lambda: hmac.compare_digest(maced[:16], mac(maced[16:])) and decode(maced[16:]), n)
    encode_ns = _ns(lambda: encode(message), n)
    key_send_ns = _ns(lambda: key + encode(message), n)
    mac_send_ns = _ns(lambda: (payload := encode(message), mac(payload) + payload), n)
    return (
        f"{name} ({len(raw)} B): receive: decode {decode_ns:.0f} ns, key check "
        f"+{key_ns - decode_ns:.0f} ns, HMAC-SHA256 +{mac_ns - decode_ns:.0f} ns; send: "
        f"encode {encode_ns:.0f} ns, key +{key_send_ns - encode_ns:.0f} ns, HMAC-SHA256 "
        f"+{mac_send_ns - encode_ns:.0f} ns"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--n", type=int, default=200_000, help="repetitions per figure")
    n = parser.parse_args().n
    key = secrets.token_bytes(16)
    ids = tuple(f"req-{i:08d}" for i in range(8))
    samples: list[tuple[str, Message]] = [
        ("done", Done("req-00000001", 16)),
        ("heartbeat, 8 ids", Heartbeat("receiver", "engine-d", "inc-0123", ids, 1.0, 0.5)),
    ]
    for name, message in samples:
        print(measure(name, message, key, n))


if __name__ == "__main__":
    main()
