"""Step 4: a real write between the two servers' own agents, into scratch buffers.

For each pair of ranks the roles allow (a sender's rank writing into a receiver's),
the doctor asks the writing rank's side channel to start a check (`kvpush.node`,
DOCTOR_WRITE) with a fresh random seed, reads where it stands until it ends
(DOCTOR_RESULT), then asks the receiving rank for the digest of its buffer
(DOCTOR_DIGEST) and compares it with the digest of the pattern the seed stands for.
The figures are the writing rank's own: each write timed from its post to its
completion on the runtime's thread (`kvpush.doctor_probe.rank`). Nothing but the scratch
buffers is written: the writing rank refuses a buffer that overlaps a KV region.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

from kvpush.doctor.report import StepResult, Verdict
from kvpush.doctor_probe import DOCTOR_DIGEST, DOCTOR_RESULT, DOCTOR_WRITE, PROBE_TIMEOUT_S
from kvpush.doctor_probe.scratch import LARGE_WRITE, SMALL_WRITE, digest, pattern
from kvpush.errors import SideChannelError
from kvpush.sidechannel import PeerMetadata, RequestRejected, control_request

_POLL_S = 0.02
_WRITERS = ("sender", "both")
_READERS = ("receiver", "both")

# What to change when a write does not get through: UCX's transport and interface choice.
UCX_ACTION = (
    "the prefill's NIXL agent cannot write into the decode's memory. Make UCX on both "
    "servers able to reach each other: UCX_NET_DEVICES must name an interface the other "
    "host reaches (not lo when the peer is elsewhere; the same network on both sides), "
    "UCX_TLS a transport both have (tcp everywhere; rc or dc where RDMA is), and no "
    "firewall may drop UCX's connections between the hosts; UCX_LOG_LEVEL=info on the "
    "prefill shows what UCX tried (its log already has UCX's own error)"
)


def _size(n: int) -> str:
    return f"{n // (1024 * 1024)} MiB" if n >= 1024 * 1024 else f"{n // 1024} KiB"


def check_data_plane(
    step: StepResult,
    ranks: dict[str, list[PeerMetadata]],
    addresses: dict[str, tuple[str, int]],
    *,
    token: str | None,
    timeout_ms: int,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Run step 4 into `step`: `ranks` by role, each server's side channel by role."""
    ran = False
    for src, dst in (("prefill", "decode"), ("decode", "prefill")):
        writers = [m for m in ranks.get(src, []) if m.role in _WRITERS]
        readers = [m for m in ranks.get(dst, []) if m.role in _READERS]
        if not writers or not readers:
            continue
        for reader in readers:
            writer = writers[reader.rank % len(writers)]
            ran = True
            _one_pair(step, src, writer, dst, reader, addresses, token, timeout_ms, sleep)
    if not ran:
        step.add(
            Verdict.SKIP,
            "no rank of one server writes into a rank of the other (their published roles)",
        )


def _one_pair(
    step: StepResult,
    src: str,
    writer: PeerMetadata,
    dst: str,
    reader: PeerMetadata,
    addresses: dict[str, tuple[str, int]],
    token: str | None,
    timeout_ms: int,
    sleep: Callable[[float], None],
) -> None:
    pair = f"{src} rank {writer.rank} -> {dst} rank {reader.rank}"
    for role, meta in ((src, writer), (dst, reader)):
        if meta.scratch is None:
            step.add(
                Verdict.SKIP,
                f"{pair}: not checked: the {role} rank registers no scratch buffer for test "
                "writes (a kvpush serve without a token and without --allow-doctor-writes, "
                "or a vLLM server without a token and without allow_doctor_writes in its "
                "kv_connector_extra_config)",
                side=role,
            )
            return
    (src_host, src_port), (dst_host, dst_port) = addresses[src], addresses[dst]
    # Where each rank's checks are served: its side channel, or one of the rank's own
    # that it names (a vLLM worker's, on the same host: `integrations.vllm.doctor`).
    src_checks = writer.probe_port or src_port
    dst_checks = reader.probe_port or dst_port
    seed = secrets.token_bytes(16)

    def ask(host: str, port: int, kind: bytes, body: dict[str, object]) -> object:
        return control_request(host, port, kind, body, timeout_ms=timeout_ms, token=token)

    try:
        started = ask(
            src_host,
            src_checks,
            DOCTOR_WRITE,
            {"rank": writer.rank, "to": [dst_host, dst_port, reader.rank], "seed": seed},
        )
        probe = started["probe"] if isinstance(started, dict) else None
        report: object = None
        deadline = time.monotonic() + PROBE_TIMEOUT_S + 2 * timeout_ms / 1000
        while time.monotonic() < deadline:
            report = ask(src_host, src_checks, DOCTOR_RESULT, {"rank": writer.rank, "probe": probe})
            if not isinstance(report, dict) or report.get("state") != "running":
                break
            sleep(_POLL_S)
        if not isinstance(report, dict) or report.get("state") == "running":
            step.add(
                Verdict.FAIL,
                f"{pair}: the check did not end within {PROBE_TIMEOUT_S:g} s",
                side=src,
                next_action=UCX_ACTION,
            )
            return
        if report.get("state") == "refused":
            raise RequestRejected(str(report.get("detail")))
        if report.get("state") != "ok":
            step.add(
                Verdict.FAIL,
                f"{pair}: the test write failed: {report.get('detail')}",
                side=src,
                next_action=UCX_ACTION,
            )
            return
        landed = ask(
            dst_host, dst_checks, DOCTOR_DIGEST, {"rank": reader.rank, "bytes": LARGE_WRITE}
        )
    except RequestRejected as exc:
        step.add(
            Verdict.WARN,
            f"{pair}: the check was refused: {exc}",
            side=src,
            next_action="run the doctor again once no other doctor is checking this pair; "
            "a server without a token takes test writes only with --allow-doctor-writes",
        )
        return
    except SideChannelError as exc:
        step.add(
            Verdict.FAIL,
            f"{pair}: a side channel stopped answering during the check: "
            f"{type(exc).__name__}: {exc}",
            side=src,
            next_action="check both servers are running and not overloaded (step 1 and 2 "
            "answered), then run the doctor again",
        )
        return
    expected = digest(pattern(seed, LARGE_WRITE))
    got = landed.get("sha256") if isinstance(landed, dict) else None
    if got != expected:
        step.add(
            Verdict.FAIL,
            f"{pair}: the writes completed, but the {dst}'s buffer holds other bytes than "
            f"were sent (sha256 {str(got)[:16]}..., expected {expected[:16]}...)",
            side=dst,
            next_action="do not serve from this pair: the data plane corrupts what it "
            "carries. Report it with both hosts' UCX and NIXL versions and UCX_TLS",
        )
        return
    step.add(Verdict.OK, f"{pair}: {_describe(report, reader)}", side=src)
    step.figures[f"{src}{writer.rank}->{dst}{reader.rank}"] = {
        "sizes": report.get("sizes"),
        "transport": report.get("transport"),
        "their_device": report.get("their_device"),
        "verified_bytes": LARGE_WRITE,
    }


def _describe(report: dict[str, object], reader: PeerMetadata) -> str:
    sizes = report.get("sizes")
    sizes = sizes if isinstance(sizes, dict) else {}
    parts: list[str] = []
    for n in (SMALL_WRITE, LARGE_WRITE):
        figure = sizes.get(str(n))
        if isinstance(figure, dict) and isinstance(figure.get("seconds"), float):
            rate = figure.get("gb_per_s")
            parts.append(
                f"{_size(n)} in {figure['seconds'] * 1000:.2f} ms"
                + (f" ({rate:.2f} GB/s)" if isinstance(rate, float) else "")
                + f", median of {figure.get('writes')}"
            )
    transport = report.get("transport")
    transport = transport if isinstance(transport, dict) else {}
    config = ", ".join(f"{k}={v}" for k, v in transport.items() if k.startswith("UCX_"))
    if not config and "UCX" in str(transport.get("transport")):
        config = "UCX_TLS and UCX_NET_DEVICES not set (UCX picks among all it has)"
    memory = _memory(str(transport.get("memory", "")), str(report.get("their_device", "")))
    return (
        f"{'; '.join(parts)}; the {_size(LARGE_WRITE)} landed intact (sha256 compared); "
        f"{transport.get('transport', 'transport not known')}"
        + (f", {config}" if config else "")
        + f"; {memory}"
    )


def _memory(ours: str, their_device: str) -> str:
    if ours in ("DRAM", "") and their_device == "cpu":
        return "host memory on both sides, so nothing is staged"
    return (
        f"GPU memory registered with NIXL ({ours} here, {their_device} there): UCX writes "
        "it directly where its transports reach GPU memory (cuda_ipc, rc with GPUDirect); "
        "whether it staged through host memory is not visible through NIXL"
    )
