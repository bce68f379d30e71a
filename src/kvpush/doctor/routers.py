"""Step 3's verdict on the routers a compatible pair works behind.

Routers that speak vLLM's push dialect (vllm-router, llm-d's routing sidecar, Dynamo's
frontend) name neither the transfer nor the decode's shape in the decode leg: each side
names the transfer from the request itself, and a prefill learns the decode's TP size
from its registrations (docs/vllm.md, "Behind routers"). The one thing that dialect
cannot carry is the prefill's block size: a decode of other blocks registers in its own,
and the prefill refuses every such registration. `kvpush proxy` names it, and the
example proxy's verbatim forward of the prefill's answer carries it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.doctor.report import Verdict
from kvpush.geometry import CacheGeometry

ROUTERS = "vllm-router, llm-d's routing sidecar and Dynamo (vLLM's push dialect)"


@dataclass(frozen=True, slots=True)
class RouterVerdict:
    verdict: Verdict
    text: str
    next_action: str | None = None


def behind_routers(prefill: CacheGeometry, decode: CacheGeometry) -> RouterVerdict:
    """Whether a pair whose caches are compatible also works behind routers that speak
    vLLM's push dialect, and if not, the refusal each request would meet there."""
    p_block, d_block = prefill.block_size_tokens, decode.block_size_tokens
    if p_block == d_block:
        return RouterVerdict(
            Verdict.OK,
            f"works behind kvpush proxy, vLLM's example proxy and {ROUTERS}: nothing "
            "kvpush-specific is needed in the requests",
        )
    return RouterVerdict(
        Verdict.WARN,
        f"behind {ROUTERS} every request would fail: the decode would register in its "
        f"own {d_block}-token blocks, and the prefill refuses a registration that does not "
        f"count in its {p_block}-token blocks (those routers drop the block_size the "
        "prefill answers with); behind kvpush proxy or vLLM's example proxy it works",
        next_action="give both servers one --block-size, or route through kvpush proxy",
    )


__all__ = ["ROUTERS", "RouterVerdict", "behind_routers"]
