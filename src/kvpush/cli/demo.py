"""`kvpush demo`: start an endpoint, wait until it is ready, probe it, stop it.

Until the reference serving stack exists, this is the side-channel round trip end to end:
a real `kvpush endpoint` process, `wait_ready` on its pid and side channel, a probe, and
a clean SIGTERM shutdown (exit 0) of the endpoint.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

from kvpush.errors import KVPushError, NotReady
from kvpush.net import zmq_address
from kvpush.readiness import free_port, wait_ready
from kvpush.sidechannel.client import fetch_metadata_timed

_STOP_TIMEOUT_S = 15.0


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run the end-to-end demo (today: endpoint, wait-ready, probe, stop)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="where the endpoint listens")
    p.add_argument("--preset", default="llama-3.1-8b", help="model shape (default %(default)s)")
    p.add_argument("--blocks", type=int, default=16, help="blocks in the cache (default 16)")
    p.add_argument("--timeout", type=float, default=60.0, help="readiness deadline, s")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    port = free_port(args.host)
    address = zmq_address(args.host, port)
    command = [
        sys.executable,
        "-m",
        "kvpush",
        "endpoint",
        "--host",
        args.host,
        "--port",
        str(port),
        "--preset",
        args.preset,
        "--blocks",
        str(args.blocks),
        "--engine-id",
        "demo-endpoint",
    ]
    print(f"demo: starting kvpush endpoint on {address} ({args.preset}, {args.blocks} blocks)")
    sys.stdout.flush()
    endpoint = subprocess.Popen(command)
    try:
        report = wait_ready(endpoint, side_channel=(args.host, port), timeout_s=args.timeout)
        print(f"demo: endpoint pid {endpoint.pid} ready after {report.elapsed_s:.2f} s")
        result = fetch_metadata_timed(args.host, port, 0)
        meta, g = result.metadata, result.metadata.geometry
        print(
            f"demo: probe {address} rank 0: engine {meta.engine_id}, incarnation "
            f"{meta.incarnation[:12]}, {g.layout} {g.dtype}, {g.num_layers} layers, "
            f"{len(g.regions)} regions x {g.num_blocks} blocks, {g.total_bytes} bytes "
            f"registered, round trip {result.round_trip_s * 1000:.3f} ms"
        )
    finally:
        code = _stop(endpoint)
    if code != 0:
        raise NotReady("process", f"the endpoint exited with status {code} when stopped")
    print("demo: endpoint stopped cleanly (exit 0); demo OK")
    return 0


def _stop(process: subprocess.Popen[bytes]) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise KVPushError(
            f"the endpoint (pid {process.pid}) did not stop within {_STOP_TIMEOUT_S:.0f} s "
            "of SIGTERM; killed it"
        ) from None
