#!/usr/bin/env python3
"""Measure the side channel: probe round trip (median of N) and requests served per second.

Starts a `kvpush endpoint` (or uses --target HOST:PORT), then
  1. N sequential probes, each a fresh connection as `kvpush probe` makes (round trip from
     connect to checked reply);
  2. a flood of valid requests from several DEALER clients, each keeping a window of
     requests in flight, for --duration seconds: replies per second.

    .venv/bin/python scripts/sidechannel_rate.py [--preset llama-3.1-8b] [--host ::1]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import time

import msgspec
import zmq

from kvpush.net import parse_host_port, zmq_address
from kvpush.sidechannel import GET_META_MSG, fetch_metadata_timed


def start_endpoint(host: str, preset: str, blocks: int) -> tuple[subprocess.Popen[str], int]:
    command = [sys.executable, "-m", "kvpush", "endpoint", "--host", host, "--port", "0"]
    process = subprocess.Popen(
        [*command, "--preset", preset, "--blocks", str(blocks), "--engine-id", "rate-bench"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    for line in process.stdout:
        if match := re.search(r"ready: .* port=(\d+)", line):
            return process, int(match.group(1))
    raise SystemExit(f"endpoint exited with status {process.wait()} before it was ready")


def probe_round_trips(host: str, port: int, samples: int) -> list[float]:
    fetch_metadata_timed(host, port)  # warm up the ZeroMQ context
    return [fetch_metadata_timed(host, port).round_trip_s for _ in range(samples)]


def flood(host: str, port: int, clients: int, window: int, duration: float) -> tuple[int, float]:
    ctx = zmq.Context.instance()
    request = msgspec.msgpack.encode((GET_META_MSG, 0))
    socks = []
    for _ in range(clients):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        sock.connect(zmq_address(host, port))
        socks.append(sock)
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
        for _ in range(window):
            sock.send(request)
    replies = 0
    started = time.perf_counter()
    end = started + duration
    while (now := time.perf_counter()) < end:
        for sock, _ in poller.poll(max(1, int((end - now) * 1000))):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) != 2 or not frames[0].startswith(b"\x96\xa2ok"):
                    raise SystemExit(f"unexpected reply: {frames[0][:40]!r}")
                replies += 1
                sock.send(request)
    elapsed = time.perf_counter() - started
    for sock in socks:
        sock.close(linger=0)
    return replies, elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--target", metavar="HOST:PORT", help="measure a running endpoint instead")
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--samples", type=int, default=100)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    process = None
    if args.target:
        host, port = parse_host_port(args.target)
    else:
        host = args.host
        process, port = start_endpoint(host, args.preset, args.blocks)
    try:
        rtts = probe_round_trips(host, port, args.samples)
        payload = len(msgspec.msgpack.encode(fetch_metadata_timed(host, port).metadata))
        replies, elapsed = flood(host, port, args.clients, args.window, args.duration)
    finally:
        if process is not None:
            process.send_signal(signal.SIGINT)
            process.communicate(timeout=30)
    ms = sorted(r * 1000 for r in rtts)
    median, p90 = statistics.median(ms), ms[int(0.9 * (len(ms) - 1))]
    result = {
        "address": zmq_address(host, port),
        "preset": None if args.target else args.preset,
        "payload_bytes": payload,
        "probe_round_trip_ms": {
            "samples": len(ms),
            "median": round(median, 3),
            "p90": round(p90, 3),
            "min": round(ms[0], 3),
            "max": round(ms[-1], 3),
        },
        "requests_per_s": round(replies / elapsed),
        "flood": {"clients": args.clients, "window": args.window, "seconds": round(elapsed, 2)},
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"side channel {result['address']} ({args.preset}, {payload}-byte metadata)\n"
            f"  probe round trip, fresh connection: median {median:.3f} ms, "
            f"p90 {p90:.3f} ms over {len(ms)} probes\n"
            f"  requests served: {replies / elapsed:.0f}/s "
            f"({args.clients} clients x {args.window} in flight, {elapsed:.1f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
