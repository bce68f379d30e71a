"""Local Hugging Face Llama checkpoints: loading one, and writing a tiny seeded one.

A checkpoint directory holds `config.json`, one or more `*.safetensors` files and a
`tokenizer.json` readable by the `tokenizers` library. Nothing here touches the network.

`make_model` writes a small random model whose weights are arranged so that greedy
decoding is *repetitive*: the LM head is a permutation of the (large) token embeddings,
so the next token is mostly a fixed function of the current one, and the permutation has
short cycles. The transformer layers (small random weights) perturb that, so the output is
neither constant nor trivially periodic, and prompt-lookup speculation has something to
accept. The tokenizer is byte-level BPE over the 256 byte symbols (no merges), plus `<s>`
and `</s>`, built programmatically.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpush.errors import ConfigError
from kvpush.serving.model import LlamaModel, ModelConfig

BOS, EOS = "<s>", "</s>"


class Tokenizer:
    """A thin, typed wrapper over a `tokenizers.Tokenizer`."""

    def __init__(self, inner: object, bos_token_id: int | None, eos_token_id: int | None) -> None:
        self._inner = inner
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    @classmethod
    def from_file(cls, path: Path, config: ModelConfig) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            inner = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises bare Exceptions
            raise ConfigError(f"cannot load tokenizer {path}: {exc}") from None
        size = inner.get_vocab_size(with_added_tokens=True)
        if size > config.vocab_size:
            raise ConfigError(
                f"tokenizer {path} has {size} tokens: more than the model's vocab_size "
                f"{config.vocab_size}"
            )
        return cls(inner, config.bos_token_id, config.eos_token_id)

    def encode(self, text: str) -> list[int]:
        return list(self._inner.encode(text).ids)  # type: ignore[attr-defined]

    def decode(self, ids: list[int]) -> str:
        return str(self._inner.decode(ids, skip_special_tokens=True))  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class LoadedModel:
    path: Path
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    chat_template: str | None = None  # from tokenizer_config.json, when it has one


def load_model(path: str | Path) -> LoadedModel:
    """Load `config.json`, `*.safetensors` and `tokenizer.json` from a local directory."""
    from safetensors.torch import load_file

    root = Path(path)
    config_path = root / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"no config.json in {root}: expected a Hugging Face Llama checkpoint "
            f"(create one with `kvpush make-model {root}`)"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {config_path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{config_path} must hold a JSON object")
    config = ModelConfig.from_hf_dict(raw)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors file in {root}: expected the model weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except Exception as exc:  # safetensors raises its own untyped errors
            raise ConfigError(f"cannot read weights {f}: {exc}") from None
    tok_path = root / "tokenizer.json"
    if not tok_path.exists():
        raise ConfigError(f"no tokenizer.json in {root}: expected a `tokenizers` tokenizer")
    return LoadedModel(
        root,
        config,
        LlamaModel(config, weights),
        Tokenizer.from_file(tok_path, config),
        _chat_template(root / "tokenizer_config.json"),
    )


def _chat_template(path: Path) -> str | None:
    """The checkpoint's chat template (Hugging Face's `chat_template` key), if any."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    template = raw.get("chat_template") if isinstance(raw, dict) else None
    if template is not None and not isinstance(template, str):
        raise ConfigError(f"{path}: chat_template must be a string (one template)")
    return template


# The tiny model's template: plain role tags, in the style of many small chat models.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _build_tokenizer() -> object:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab[BOS] = len(vocab)
    vocab[EOS] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    return tok


def make_model(
    path: str | Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 2048,
    cycle_lengths: tuple[int, int] = (4, 12),
    layer_scale: float = 0.15,
) -> ModelConfig:
    """Write a tiny seeded Llama checkpoint into `path` (created if missing)."""
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    vocab_size, bos, eos = write_tokenizer(root, max_position_embeddings)
    config = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    gen = torch.Generator().manual_seed(seed)
    next_of = _cycles(vocab_size, bos, cycle_lengths, gen)

    weights: dict[str, torch.Tensor] = {}
    for name, shape in config.parameter_shapes().items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        elif name == "model.embed_tokens.weight":
            weights[name] = torch.randn(shape, generator=gen)
        else:
            weights[name] = torch.randn(shape, generator=gen) * layer_scale
    weights["lm_head.weight"] = cyclic_lm_head(
        weights["model.embed_tokens.weight"], bos, gen, next_of
    )

    save_file({k: v.contiguous() for k, v in weights.items()}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    return config


def _cycles(
    vocab_size: int, bos: int, cycle_lengths: tuple[int, int], gen: torch.Generator
) -> list[int]:
    """next_of[t]: the token the LM head favours after t; short cycles over the byte
    tokens (those below `bos`)."""
    order = torch.randperm(bos, generator=gen).tolist()
    next_of = list(range(vocab_size))
    i = 0
    lo, hi = cycle_lengths
    while i < len(order):
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        cycle = order[i : i + n]
        for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True):
            next_of[a] = b
        i += n
    return next_of


def cyclic_lm_head(
    embed: torch.Tensor,
    bos: int,
    gen: torch.Generator,
    next_of: list[int] | None = None,
    cycle_lengths: tuple[int, int] = (4, 12),
) -> torch.Tensor:
    """An LM head under which a tiny model's greedy output follows short cycles with
    wide margins (so other engines' rounding never flips a token): row `next_of[t]` is
    t's embedding, so after t the head favours next_of[t]."""
    vocab_size, hidden_size = embed.shape
    if next_of is None:
        next_of = _cycles(int(vocab_size), bos, cycle_lengths, gen)
    head = torch.randn((int(vocab_size), int(hidden_size)), generator=gen) * 0.05
    for t in range(bos):
        head[next_of[t]] = embed[t]
    return head


def write_tokenizer(root: Path, max_position_embeddings: int) -> tuple[int, int, int]:
    """The tiny models' byte-level tokenizer, written into `root`: (vocabulary size, BOS
    id, EOS id)."""
    tok = _build_tokenizer()
    vocab_size = int(tok.get_vocab_size(with_added_tokens=True))  # type: ignore[attr-defined]
    tok.save(str(root / "tokenizer.json"))  # type: ignore[attr-defined]
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": BOS,
                "eos_token": EOS,
                "model_max_length": max_position_embeddings,
                "chat_template": TINY_CHAT_TEMPLATE,
            }
        )
        + "\n"
    )
    return vocab_size, vocab_size - 2, vocab_size - 1
