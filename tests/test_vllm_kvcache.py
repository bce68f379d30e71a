"""The vLLM connector's parts that need no vLLM: KV cache registration from vLLM's packed
per-layer tensors, and `kv_transfer_params`. (The connector itself runs in real vLLM
servers: tests/test_vllm_e2e.py.)"""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvpush.errors import KVLayoutError
from kvpush.integrations.vllm.kvcache import register_vllm_kv_caches
from kvpush.integrations.vllm.params import ConnectorConfig, prefill_answer
from kvpush.transfer_params import BadTransferParams, parse_remote_prefill

BLOCKS, LAYERS, HEADS, TOKENS, C = 6, 3, 2, 32, 64  # C = head_size + head_size_v


def _layers(storage: torch.Tensor, order: str) -> dict[str, torch.Tensor]:
    """Per-layer [B, H, N, C] views of one allocation, as vLLM's layouts make them."""
    if order == "LBHNC":
        return {f"model.layers.{i}.self_attn.attn": storage[i] for i in range(LAYERS)}
    if order == "BLHNC":  # blocks outermost: a layer's blocks are LAYERS blocks apart
        return {f"model.layers.{i}.self_attn.attn": storage[:, i] for i in range(LAYERS)}
    if order == "LBNHC":
        return {
            f"model.layers.{i}.self_attn.attn": storage[i].permute(0, 2, 1, 3)
            for i in range(LAYERS)
        }
    if order == "LHBNC":
        return {
            f"model.layers.{i}.self_attn.attn": storage[i].permute(1, 0, 2, 3)
            for i in range(LAYERS)
        }
    raise AssertionError(order)


def _alloc(order: str) -> torch.Tensor:
    shape = {
        "LBHNC": (LAYERS, BLOCKS, HEADS, TOKENS, C),
        "BLHNC": (BLOCKS, LAYERS, HEADS, TOKENS, C),
        "LBNHC": (LAYERS, BLOCKS, TOKENS, HEADS, C),
        "LHBNC": (LAYERS, HEADS, BLOCKS, TOKENS, C),
    }[order]
    return torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape)


def _region_bytes(base: int, offset: int, n: int) -> bytes:
    return ctypes.string_at(base + offset, n)


@pytest.mark.parametrize("order", ["LBHNC", "BLHNC"])
def test_each_block_of_each_layer_is_one_run_of_the_tensors_own_bytes(order: str) -> None:
    storage = _alloc(order)
    layers = _layers(storage, order)
    geometry = register_vllm_kv_caches(layers, TOKENS)
    assert geometry.layout == "vllm_packed/BHNC"
    assert [r.layer for r in geometry.regions] == list(range(LAYERS))
    block_bytes = HEADS * TOKENS * C * 4
    for region, tensor in zip(geometry.regions, layers.values(), strict=True):
        assert region.block_bytes == block_bytes
        assert region.num_blocks == BLOCKS
        for block in (0, BLOCKS - 1):
            want = tensor[block].contiguous().numpy().tobytes()
            got = _region_bytes(region.base_addr, block * region.block_stride, region.block_bytes)
            assert got == want, f"{region.name} block {block}"
    if order == "BLHNC":
        assert geometry.regions[0].block_stride == LAYERS * block_bytes


def test_the_physical_order_is_part_of_what_peers_must_agree_on() -> None:
    hnd = register_vllm_kv_caches(_layers(_alloc("LBHNC"), "LBHNC"), TOKENS)
    nhd = register_vllm_kv_caches(_layers(_alloc("LBNHC"), "LBNHC"), TOKENS)
    assert nhd.layout == "vllm_packed/BNHC"
    assert hnd.compat_hash() != nhd.compat_hash()


def test_heads_outside_blocks_are_refused_naming_the_layer_and_its_strides() -> None:
    layers = _layers(_alloc("LHBNC"), "LHBNC")
    with pytest.raises(KVLayoutError) as err:
        register_vllm_kv_caches(layers, TOKENS)
    text = str(err.value)
    assert "model.layers.0.self_attn.attn" in text
    assert "non-contiguous block" in text
    assert f"shape ({BLOCKS}, {HEADS}, {TOKENS}, {C})" in text
    assert "strides" in text and "dtype float32" in text


def test_a_layer_with_other_block_count_is_named_with_expected_and_actual() -> None:
    layers = _layers(_alloc("LBHNC"), "LBHNC")
    name = "model.layers.2.self_attn.attn"
    layers[name] = layers[name][: BLOCKS - 1]
    with pytest.raises(KVLayoutError) as err:
        register_vllm_kv_caches(layers, TOKENS)
    text = str(err.value)
    assert name in text and "(index 2)" in text
    assert f"expected blocks {BLOCKS}, actual blocks {BLOCKS - 1}" in text


def test_a_block_size_other_than_the_engines_is_refused() -> None:
    with pytest.raises(
        KVLayoutError, match="holds 32 tokens per block, expected block_size_tokens=16"
    ):
        register_vllm_kv_caches(_layers(_alloc("LBHNC"), "LBHNC"), 16)


def test_split_kv_tensors_go_through_kvpush_layouts() -> None:
    layers = {f"l{i}": torch.zeros(2, BLOCKS, TOKENS, HEADS, 32) for i in range(2)}
    geometry = register_vllm_kv_caches(layers, TOKENS)
    assert geometry.layout == "kv_first/NHD"
    assert len(geometry.regions) == 4  # K and V of each layer


def _config(tp_size: int = 1) -> ConnectorConfig:
    from kvpush.config import TimingConfig

    return ConnectorConfig(
        engine_id="e1",
        role="sender",
        side_channel_host="::1",
        side_channel_port=5600,
        token=None,
        timing=TimingConfig(),
        tp_size=tp_size,
        total_kv_heads=HEADS,
        use_mla=False,
        pp_size=1,
        dcp_size=1,
        block_size_tokens=32,
    )


def test_the_prefill_answer_keeps_every_nixl_field_and_adds_the_transfer_id() -> None:
    answer = prefill_answer(
        _config(),
        transfer_id="t-1",
        request_id="r-1",
        block_ids=[3, 4],
        num_tokens=40,
        decode_tp_size=2,
    )
    nixl_fields = {
        "do_remote_prefill",
        "do_remote_decode",
        "remote_block_ids",
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "dcp_size",
        "pp_size",
        "remote_num_tokens",
        "transfer_mode",
    }
    assert nixl_fields <= set(answer)
    assert answer["transfer_id"] == "t-1"
    assert answer["do_remote_prefill"] is True and answer["do_remote_decode"] is False
    # and a decode server reads back exactly where to register
    remote = parse_remote_prefill(answer)
    assert (remote.transfer_id, remote.remote_host, remote.remote_port) == ("t-1", "::1", 5600)
    # and which TP sizes the transfer was split between, and the prefill's block size
    assert (remote.tp_size, remote.decode_tp_size, remote.block_size) == (1, 2, 32)


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"remote_host": "h", "remote_port": 1}, "transfer_id"),
        ({"transfer_id": "t", "remote_port": 1}, "remote_host"),
        ({"transfer_id": "t", "remote_host": "h", "remote_port": 70000}, "remote_port"),
        (
            {"transfer_id": "t", "remote_host": "h", "remote_port": 1, "tp_size": 0},
            r"tp_size must be an integer in 1\.\.1024 \(the prefill's tensor-parallel size\), "
            "got int 0",
        ),
    ],
)
def test_unusable_decode_params_say_which_field(params: dict[str, object], words: str) -> None:
    with pytest.raises(BadTransferParams, match=words):
        parse_remote_prefill(params)


def test_a_bracketed_ipv6_remote_host_is_used_bare() -> None:
    remote = parse_remote_prefill(
        {"transfer_id": "t", "remote_host": "[::1]", "remote_port": "5600"}
    )
    assert (remote.remote_host, remote.remote_port) == ("::1", 5600)


def test_layerwise_push_is_the_default_and_off_where_vllm_could_free_blocks_first() -> None:
    from dataclasses import replace

    base = _config()
    assert base.push == "layerwise" and base.layerwise and base.layerwise_refused() is None
    async_on = replace(base, async_scheduling=True)
    assert not async_on.layerwise
    assert async_on.layerwise_refused() == "vLLM's async scheduling is on"
    stages = replace(base, pp_size=2)
    assert not stages.layerwise and "pipeline parallel size is 2" in str(stages.layerwise_refused())
    # Asked for whole, or a decode-only engine: nothing to refuse.
    for cfg in (replace(base, push="whole"), replace(base, role="receiver")):
        assert not cfg.layerwise and cfg.layerwise_refused() is None
