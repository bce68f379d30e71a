"""What the vLLM end-to-end modules share: the connector's timing in their servers, the
bound it puts on a failure, the prompts every deployment shape answers, and the warm-up
each server gets before them (`kvpush_lab.vllm_servers.warm_up`, which scripts use too)."""

from __future__ import annotations

from kvpush_lab.vllm_servers import warm_up

__all__ = [
    "HOST",
    "LIVENESS_BOUND_S",
    "MAX_TOKENS",
    "PROMPTS",
    "SHARED_PREFIX",
    "TIMING",
    "warm_up",
]

HOST = "127.0.0.1"
MAX_TOKENS = 12
# Liveness 8 s: heartbeats come from a thread inside vLLM's worker process, whose main
# thread busy-polls its queue with sched_yield while holding the GIL; on this 2-core
# host under other work (load average 15) live peers went silent for 5 s both ways.
# A decode request whose sender died waits at most liveness + fence
# (lease + 2 x liveness), plus a few engine steps.
TIMING = {"heartbeat_interval_s": 0.5, "liveness_timeout_s": 8.0, "lease_s": 5.0}
LIVENESS_BOUND_S = 8.0 + 5.0 + 2 * 8.0 + 10.0

SHARED_PREFIX = "In the beginning the engine computed every key and value of the prompt, "
PROMPTS = [
    "hello world, this is a test of the kvpush connector inside vllm",
    "short",
    "The quick brown fox jumps over the lazy dog. " * 4,
    # Prompts sharing a prefix longer than a block (32 tokens): once one of them moved,
    # the decode server holds those blocks and the next needs only the rest (a partial
    # prefix-cache hit, sender_offset > 0).
    SHARED_PREFIX + "then pushed them to the decoder.",
    SHARED_PREFIX + "and the decoder went on from there, token after token, to the end.",
    SHARED_PREFIX * 3 + "a long one, spanning several blocks of thirty-two tokens each.",
    "0123456789" * 20,
    "x",
]
