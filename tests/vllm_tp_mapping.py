"""vLLM's own answer for TP shapes: run under the vLLM venv's interpreter, never imported.

Reads a JSON list of cases `[prefill_tp, decode_tp, total_kv_heads, mla]` on stdin and
prints, for each case and each decode rank, what vLLM's NIXL connectors compute with the
decode as the local side (`TransferTopology` + `compute_tp_mapping`, as the decode
worker does at its handshake): one JSON object per line. Only vLLM is imported, so the
answer is vLLM's, not kvpush's.
"""

from __future__ import annotations

import json
import sys

from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import compute_tp_mapping
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec


def main() -> None:
    cases = json.load(sys.stdin)
    for prefill_tp, decode_tp, heads, mla in cases:
        spec = MLAAttentionSpec if mla else FullAttentionSpec
        for rank in range(decode_tp):
            topology = TransferTopology(
                tp_rank=rank,
                tp_size=decode_tp,
                block_size=16,
                engine_id="decode",
                is_mla=bool(mla),
                is_mamba=False,
                total_num_kv_heads=heads,
                attn_backends=[],
            )
            mapping = compute_tp_mapping(topology, prefill_tp, (spec,))
            print(
                json.dumps(
                    {
                        "case": [prefill_tp, decode_tp, heads, mla],
                        "decode_rank": rank,
                        "handshake_target_ranks": topology.handshake_target_ranks(prefill_tp),
                        "source_ranks": list(mapping.source_ranks_per_group[0]),
                        "all_source_ranks": list(mapping.all_source_ranks),
                        "rank_to_attention_slot": {
                            str(k): v for k, v in mapping.rank_to_attention_slot.items()
                        },
                        "rank_offset_factor": mapping.rank_offset_factor,
                        "local_consumers": mapping.local_consumers,
                    }
                )
            )


if __name__ == "__main__":
    main()
