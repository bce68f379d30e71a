#!/usr/bin/env python3
"""What proving the token costs on the side channel (`kvpush.sidechannel.wire`): signing
a request, checking it, the reply's proof, and a whole lookup's round trip with and
without a token, interleaved, against real `MetadataServer`s on 127.0.0.1.

    PYTHONPATH=src .venv/bin/python scripts/measure_side_channel_proof.py [--lookups 300]

A lookup happens once per peer handshake, not per data-plane message.
"""

from __future__ import annotations

import argparse
import statistics
import timeit

from kvpush.bench.presets import synthetic_kv_cache
from kvpush.config import SideChannelConfig
from kvpush.sidechannel import MetadataServer, PeerMetadata, fetch_metadata_timed
from kvpush.sidechannel.wire import decode_request, encode_request, new_nonce, reply_proof

TOKEN = "a-shared-token"


def per_call_us(fn: object, n: int) -> float:
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6  # type: ignore[arg-type]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lookups", type=int, default=300)
    p.add_argument("--n", type=int, default=20_000)
    args = p.parse_args()
    cache = synthetic_kv_cache(preset="llama-3.1-8b", num_blocks=4, fill=None)
    meta = PeerMetadata(
        "engine", "1", 0, "both", "agent", bytes(600), cache.geometry, "0.1.0", bytes(16)
    )
    signed = encode_request(0, TOKEN, new_nonce())
    signature = decode_request(signed)[1]
    assert signature is not None
    n = args.n
    sign = per_call_us(lambda: encode_request(0, TOKEN, new_nonce()), n)
    unsigned = per_call_us(lambda: encode_request(0), n)
    check = per_call_us(lambda: signature.made_with(TOKEN), n)
    reply = per_call_us(lambda: reply_proof(TOKEN, bytes(16), bytes(40), bytes(3000)), n)
    print(
        f"sign a request {sign:.1f} us (unsigned {unsigned:.1f} us); check it {check:.1f} us; "
        f"reply proof {reply:.1f} us"
    )
    took: dict[str, list[float]] = {"no token": [], "token": []}
    with (
        MetadataServer("127.0.0.1", 0, SideChannelConfig(), {0: meta}) as open_server,
        MetadataServer("127.0.0.1", 0, SideChannelConfig(token=TOKEN), {0: meta}) as guarded,
    ):
        for _ in range(args.lookups):
            took["no token"].append(
                fetch_metadata_timed("127.0.0.1", open_server.port).round_trip_s
            )
            took["token"].append(
                fetch_metadata_timed("127.0.0.1", guarded.port, token=TOKEN).round_trip_s
            )
    p50 = {k: statistics.median(v) * 1e3 for k, v in took.items()}
    print(
        f"lookup round trip p50: {p50['no token']:.3f} ms without a token, "
        f"{p50['token']:.3f} ms with ({p50['token'] / p50['no token']:.2f}x), "
        f"{args.lookups} each, interleaved"
    )


if __name__ == "__main__":
    main()
