"""`kvpush make-model DIR`: write a tiny seeded Llama checkpoint for demos and tests."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "make-model",
        help="write a tiny seeded random Llama checkpoint (Hugging Face format)",
        description=(
            "Write config.json, model.safetensors and tokenizer.json for a tiny random "
            "Llama model into DIR. The same seed always gives the same bytes."
        ),
    )
    p.add_argument("dir", help="directory to write (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    p.add_argument("--force", action="store_true", help="overwrite an existing checkpoint")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvpush.errors import ConfigError
    from kvpush.serving.checkpoint import make_model

    root = Path(args.dir)
    if (root / "config.json").exists() and not args.force:
        raise ConfigError(f"{root} already holds a checkpoint: pass --force to overwrite it")
    if args.hidden % args.heads:
        raise ConfigError(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    config = make_model(
        root,
        seed=args.seed,
        num_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
    )
    print(
        f"wrote {root}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} heads / {config.num_key_value_heads} KV heads, "
        f"vocab {config.vocab_size}, seed {args.seed}"
    )
    return 0
