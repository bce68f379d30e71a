"""The reference engine: paged attention, prefix caching, speculation, checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvpush.errors import ConfigError
from kvpush.serving.checkpoint import LoadedModel, load_model, make_model
from kvpush.serving.engine import Engine
from kvpush.serving.model import SeqSlice
from kvpush.serving.paged import BlockAllocator, OutOfBlocks, PagedKVCache
from kvpush.serving.sampling import InvalidRequest, SamplingParams, SpecConfig

TEXTS = [
    "Hello world, this is kvpush.",
    "The quick brown fox jumps over the lazy dog. " * 2,
    "a",
    "Disaggregated serving moves KV caches from prefill to decode.",
    "0123456789" * 5,
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = tmp_path_factory.mktemp("tiny-llama")
    make_model(path, seed=7)
    return load_model(path)


def prompts(tiny: LoadedModel) -> list[list[int]]:
    return [tiny.tokenizer.encode(t) for t in TEXTS]


def dense_greedy(tiny: LoadedModel, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(tiny.model.forward_dense(torch.tensor(seq))[-1].argmax()))
    return seq[len(prompt) :]


def test_paged_forward_matches_dense_forward(tiny: LoadedModel) -> None:
    cfg = tiny.config
    tokens = prompts(tiny)[1][:30]
    cache = PagedKVCache(
        num_layers=cfg.num_hidden_layers,
        num_blocks=16,
        block_size=4,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
    )
    # A scattered, non-monotonic block table: attention must follow it, not block order.
    table = [9, 2, 15, 0, 7, 11, 3, 12]
    dense = tiny.model.forward_dense(torch.tensor(tokens))
    first = tiny.model.forward(torch.tensor(tokens[:13]), [SeqSlice(table, 0, 13)], cache.layers)
    torch.testing.assert_close(first, dense[:13], rtol=1e-4, atol=1e-4)
    for pos in range(13, len(tokens)):
        row = tiny.model.forward(
            torch.tensor([tokens[pos]]), [SeqSlice(table, pos, 1)], cache.layers
        )
        torch.testing.assert_close(row[0], dense[pos], rtol=1e-4, atol=1e-4)


def test_greedy_batch_equals_dense_reference(tiny: LoadedModel) -> None:
    engine = Engine(tiny.model, num_blocks=128, block_size=4)
    ps = [prompts(tiny)[0], prompts(tiny)[2], prompts(tiny)[3]]
    outs = engine.generate(ps, SamplingParams(max_tokens=12, ignore_eos=True))
    for p, out in zip(ps, outs, strict=True):
        assert out == dense_greedy(tiny, p, 12)
    stats = engine.statistics()
    assert stats.num_free_blocks == stats.num_blocks  # everything freed


def test_speculative_output_equals_greedy_and_accepts_drafts(tiny: LoadedModel) -> None:
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    greedy_engine = Engine(tiny.model, num_blocks=256, block_size=4)
    greedy = greedy_engine.generate(prompts(tiny), params)
    spec_engine = Engine(tiny.model, num_blocks=256, block_size=4, spec=SpecConfig())
    for i, p in enumerate(prompts(tiny)):
        spec_engine.add_request(f"r{i}", p, params)
    while spec_engine.has_work:
        spec_engine.step()
    assert [spec_engine.output_token_ids(f"r{i}") for i in range(len(TEXTS))] == greedy
    per_request = [spec_engine.request_stats(f"r{i}") for i in range(len(TEXTS))]
    stats = spec_engine.statistics()
    assert stats.num_drafts == sum(r.num_drafts for r in per_request) > 0
    assert stats.num_accepted_tokens == sum(r.num_accepted_tokens for r in per_request) > 0
    assert stats.mean_acceptance_length > 1.0
    # Accepted drafts save forward passes: fewer steps than tokens, summed over requests.
    assert sum(r.num_steps for r in per_request) == 24 * len(TEXTS) - stats.num_accepted_tokens


def test_prefix_cache_hit_gives_the_same_tokens(tiny: LoadedModel) -> None:
    base = prompts(tiny)[1]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    cold = Engine(tiny.model, num_blocks=64, block_size=4, enable_prefix_caching=False)
    expected = cold.generate([base, [*base[:20], 5, 6, 7]], params)

    warm = Engine(tiny.model, num_blocks=64, block_size=4)
    assert warm.generate([base], params) == expected[:1]
    hits_before = warm.statistics().prefix_hits
    warm.add_request("again", base, params)
    warm.add_request("shared-head", [*base[:20], 5, 6, 7], params)
    while warm.has_work:
        warm.step()
    assert warm.request_stats("again").num_cached_tokens == ((len(base) - 1) // 4) * 4
    assert warm.request_stats("shared-head").num_cached_tokens == 20
    assert warm.statistics().prefix_hits > hits_before
    assert warm.output_token_ids("again") == expected[0]
    assert warm.output_token_ids("shared-head") == expected[1]


def test_requests_wait_for_blocks_and_still_match(tiny: LoadedModel) -> None:
    ps = prompts(tiny)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    roomy = Engine(tiny.model, num_blocks=256, block_size=4).generate(ps, params)
    # Room for about one request at a time: the others queue, nothing is dropped.
    tight = Engine(tiny.model, num_blocks=40, block_size=4, spec=SpecConfig())
    assert tight.generate(ps, params) == roomy
    assert tight.statistics().num_free_blocks == 40


def test_prefill_hold_and_remote_decode_continue_the_same_sequence(tiny: LoadedModel) -> None:
    """The two halves of disaggregated serving, in process: copy blocks, then decode."""
    prompt = prompts(tiny)[3]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    spec_alone = Engine(tiny.model, block_size=4, spec=SpecConfig())
    spec_alone.add_request("alone", prompt, params)
    while spec_alone.has_work:
        spec_alone.step()
    expected = spec_alone.output_token_ids("alone")

    prefill = Engine(tiny.model, num_blocks=64, block_size=4)
    prefill.add_request("r", prompt, SamplingParams(max_tokens=1), hold_blocks=True)
    while prefill.has_work:
        prefill.step()
    assert prefill.output_token_ids("r") == expected[:1]
    src = prefill.held_blocks("r")

    decode = Engine(tiny.model, num_blocks=40, block_size=4, spec=SpecConfig())
    decode.add_request("busy", prompts(tiny)[0], params)  # shares the batch
    decode.step()
    dst = decode.add_remote_request("r", prompt, params)
    assert dst is not None and dst.sender_offset == 0
    need = decode.transfer_block_count(len(prompt))
    assert len(dst.blocks) == need <= len(src)
    decode.kv_cache.write_blocks(dst.blocks, prefill.kv_cache.read_blocks(src[:need]))
    prefill.release("r")
    assert prefill.statistics().num_free_blocks == 64
    decode.kv_arrived("r")
    while decode.has_work:
        decode.step()
    assert decode.output_token_ids("r") == expected
    assert decode.request_stats("r").mean_acceptance_length == (
        spec_alone.request_stats("alone").mean_acceptance_length
    )

    # Again, on a decode engine that has the prompt's head in its prefix cache: only the
    # tail is received, from the sender block where the cached run ends.
    again = decode.add_remote_request("r2", prompt, params)
    assert again is not None
    assert again.sender_offset == (len(prompt) - 1) // 4 > 0
    assert len(again.blocks) == need - again.sender_offset
    decode.kv_cache.write_blocks(
        again.blocks, fresh_prefill_blocks(tiny, prompt, range(again.sender_offset, need))
    )
    decode.kv_arrived("r2")
    while decode.has_work:
        decode.step()
    assert decode.output_token_ids("r2") == expected


def fresh_prefill_blocks(
    tiny: LoadedModel, prompt: list[int], which: range
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    engine = Engine(tiny.model, num_blocks=64, block_size=4)
    engine.add_request("p", prompt, SamplingParams(max_tokens=1), hold_blocks=True)
    while engine.has_work:
        engine.step()
    held = engine.held_blocks("p")
    return engine.kv_cache.read_blocks([held[i] for i in which])


def test_bad_requests_are_rejected_with_reasons(tiny: LoadedModel) -> None:
    engine = Engine(tiny.model, num_blocks=8, block_size=4)
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(InvalidRequest, match="out of range"):
        engine.add_request("b", [1, 100000], SamplingParams())
    with pytest.raises(InvalidRequest, match="KV blocks"):
        engine.add_request("c", [1] * 30, SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequest, match="max_tokens"):
        SamplingParams(max_tokens=0)
    engine.add_request("d", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request("d", [1, 2], SamplingParams())


def test_allocator_evicts_least_recently_freed_cached_blocks() -> None:
    alloc = BlockAllocator(3)
    a = alloc.allocate(2)
    alloc.mark_cached(a[0], b"h0")
    alloc.mark_cached(a[1], b"h1")
    alloc.free(a)
    assert alloc.lookup_prefix([b"h0", b"h1"]) == a
    alloc.free(a)
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free([2])
    taken = alloc.allocate(3)
    assert sorted(taken) == [0, 1, 2]
    assert alloc.lookup_prefix([b"h0"]) == []
    with pytest.raises(OutOfBlocks, match="need 1 free KV blocks, have 0"):
        alloc.allocate(1)


def test_checkpoint_round_trip_and_errors(tiny: LoadedModel, tmp_path: Path) -> None:
    make_model(tmp_path / "again", seed=7)
    again = load_model(tmp_path / "again")
    assert again.config == tiny.config
    for name, tensor in tiny.model.weights.items():
        assert torch.equal(tensor, again.model.weights[name]), name
    make_model(tmp_path / "other", seed=8)
    other = load_model(tmp_path / "other")
    assert not torch.equal(
        other.model.weights["model.embed_tokens.weight"],
        tiny.model.weights["model.embed_tokens.weight"],
    )
    text = "round trip: héllo ✓"
    ids = tiny.tokenizer.encode(text)
    assert ids[0] == tiny.config.bos_token_id
    assert tiny.tokenizer.decode(ids) == text

    with pytest.raises(ConfigError, match=r"no config\.json"):
        load_model(tmp_path / "missing")
    broken = tmp_path / "broken"
    make_model(broken, seed=1)
    raw = json.loads((broken / "config.json").read_text())
    raw["hidden_size"] = 96
    (broken / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="expected"):
        load_model(broken)
