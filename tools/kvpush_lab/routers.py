"""The routers users put in front of vLLM prefill/decode pairs, for the router end-to-end
test (`tests/test_vllm_router.py`). Lab machinery: the product is
`kvpush.integrations.vllm`.

- `start_vllm_router`: the vLLM project's router (`vllm-router`, the Rust wheel that
  `make test` installs), as its README runs it for P/D: `--vllm-pd-disaggregation
  --prefill URL --decode URL`. It sends the prefill leg (`max_tokens` 1,
  `do_remote_decode`) and then the decode leg under one `X-Request-Id` of its own; a
  prefill answer that says `"transfer_mode": "push"` (kvpush's does) is not forwarded
  but rebuilt in vLLM's push dialect (`remote_engine_id`, `remote_host`, `remote_port`,
  `tp_size`, `remote_request_id`), every other field dropped.
- `push_identity` and `concurrent_legs`: a router that dispatches both legs at once, as
  llm-d's routing sidecar does for push connectors: it learns the prefill's "push
  identity" (`remote_engine_id`, `remote_host`, `remote_port`, `tp_size`,
  `transfer_mode: "push"`) from one prefill answer, caches it, and then sends each
  request's decode leg in vLLM's push dialect without waiting for its prefill leg, both
  under one `X-Request-Id`. Nothing kvpush-specific goes in either leg.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from kvpush.errors import ConfigError
from kvpush.net import http_url
from kvpush.procs.readiness import free_port, wait_ready
from kvpush_lab.vllm_servers import Outcome, VllmServer, answer_outcome

# The fields of a prefill's answer that llm-d's sidecar caches as its push identity.
PUSH_IDENTITY = ("remote_engine_id", "remote_host", "remote_port", "tp_size")


def vllm_router_command() -> Path:
    """The `vllm-router` installed beside this interpreter, or a clear error."""
    router = Path(sys.executable).parent / "vllm-router"
    if not router.exists():
        raise ConfigError(
            f"no vllm-router at {router}: `make venv` installs it (the dev extra's "
            "vllm-router==0.1.17)"
        )
    return router


def start_vllm_router(
    prefill: VllmServer, decode: VllmServer, log_dir: Path, *, extra_args: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], str]:
    """vllm-router in P/D mode in front of one prefill and one decode server: the
    process and its URL, once its /health answers. `extra_args`: more of the router's
    flags (`--log-level debug` logs every leg it sends)."""
    host = prefill.spec.host
    port = free_port(host)
    log = (log_dir / "vllm-router.log").open("ab")
    proc = subprocess.Popen(
        [
            str(vllm_router_command()),
            "--vllm-pd-disaggregation",
            "--prefill",
            prefill.url,
            "--decode",
            decode.url,
            "--host",
            host,
            "--port",
            str(port),
            "--policy",
            "round_robin",
            "--worker-startup-timeout-secs",
            "120",
            # Its metrics listener takes a fixed port unless told another.
            "--prometheus-host",
            host,
            "--prometheus-port",
            str(free_port(host)),
            *extra_args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    url = http_url(host, port)
    wait_ready(proc, http_url=f"{url}/health", timeout_s=150)
    return proc, url


async def push_identity(http: httpx.AsyncClient, prefill_url: str, model: str) -> dict[str, Any]:
    """What a router caches of a prefill server after one request: the fields it names
    the prefill by in vLLM's push dialect."""
    body = {
        "model": model,
        "prompt": "who are you",
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    resp = await http.post(f"{prefill_url}/v1/completions", json=body, timeout=120)
    resp.raise_for_status()
    params = resp.json()["kv_transfer_params"]
    if params.get("transfer_mode") != "push":
        raise AssertionError(f"the prefill does not say it pushes: {params}")
    return {key: params[key] for key in PUSH_IDENTITY}


async def concurrent_legs(
    http: httpx.AsyncClient,
    prefill_url: str,
    decode_url: str,
    body: dict[str, Any],
    identity: dict[str, Any],
    *,
    request_id: str | None = None,
    prefill_after_s: float = 0.0,
    timeout_s: float = 120.0,
) -> Outcome:
    """One request's two legs at once, in vLLM's push dialect, under one `X-Request-Id`
    (`request_id`, or a fresh one): the decode leg does not wait for the prefill's. The
    prefill leg goes `prefill_after_s` after the decode leg (0: together)."""
    rid = request_id or f"router-{uuid.uuid4().hex}"
    headers = {"X-Request-Id": rid}
    p_body = {
        **body,
        "max_tokens": 1,
        "min_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    p_body.pop("stream", None)
    d_body = {
        **body,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            **identity,
            "remote_request_id": rid,
        },
    }
    started = time.monotonic()

    async def leg(url: str, payload: dict[str, Any], after_s: float) -> httpx.Response | str:
        await asyncio.sleep(after_s)
        try:
            return await http.post(
                f"{url}/v1/completions", json=payload, headers=headers, timeout=timeout_s
            )
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"

    p, d = await asyncio.gather(
        leg(prefill_url, p_body, prefill_after_s), leg(decode_url, d_body, 0.0)
    )
    if isinstance(d, str):
        return Outcome(body["prompt"], error=f"decode leg: {d}", seconds=time.monotonic() - started)
    outcome = answer_outcome(body["prompt"], d, started)
    if outcome.ok and (isinstance(p, str) or p.status_code != 200):
        what = p if isinstance(p, str) else f"HTTP {p.status_code}: {p.text[:200]}"
        return Outcome(body["prompt"], error=f"prefill leg: {what}", seconds=outcome.seconds)
    return outcome


__all__ = [
    "PUSH_IDENTITY",
    "concurrent_legs",
    "push_identity",
    "start_vllm_router",
    "vllm_router_command",
]
