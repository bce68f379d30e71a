"""KV cache registration: regions point at the real bytes; bad caches are named precisely."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvpush.bench.presets import PRESETS, get_preset, synthetic_kv_cache
from kvpush.errors import ConfigError, KVLayoutError
from kvpush.geometry import CacheGeometry
from kvpush.kvcache import KVLayout, register_kv_cache

pytestmark = pytest.mark.timeout(60)

N, B, H, D = 5, 4, 2, 8  # blocks, tokens per block, heads, head dim


def _bytes_at(addr: int, size: int) -> bytes:
    return ctypes.string_at(addr, size)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _numbered(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Every element different, so a wrong address can never read the right bytes."""
    count = 1
    for n in shape:
        count *= n
    return torch.arange(count, dtype=torch.float32).reshape(shape).to(dtype)


def _block_views(
    layout: KVLayout, value: torch.Tensor | tuple[torch.Tensor, torch.Tensor], b: int
) -> list[torch.Tensor]:
    """What block b of each region of one layer must contain, read through torch."""
    if layout.separate_kv:
        assert isinstance(value, tuple)
        return [value[0][b], value[1][b]]
    assert isinstance(value, torch.Tensor)
    if layout.blocks_first:
        return [value[b]]
    return [value[0][b], value[1][b]]


def _make_layer(
    layout: KVLayout, dtype: torch.dtype = torch.float16
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    inner = (B, H, D) if layout.token_order == "NHD" else (H, B, D)
    if layout.separate_kv:
        return (_numbered(N, *inner, dtype=dtype), _numbered(N, *inner, dtype=dtype) + 7)
    if layout.blocks_first:
        return _numbered(N, 2, *inner, dtype=dtype)
    return _numbered(2, N, *inner, dtype=dtype)


@pytest.mark.parametrize("layout", list(KVLayout))
def test_every_region_block_is_the_bytes_torch_sees(layout: KVLayout) -> None:
    caches = {"l0": _make_layer(layout), "l1": _make_layer(layout)}
    geometry = register_kv_cache(caches, layout, B)

    per_layer = 2 if (layout.separate_kv or not layout.blocks_first) else 1
    assert len(geometry.regions) == 2 * per_layer
    assert [r.layer for r in geometry.regions] == sorted(r.layer for r in geometry.regions)
    assert geometry.layout == layout.value
    assert geometry.dtype == "float16"
    assert geometry.num_blocks == N
    for layer_index, value in enumerate(caches.values()):
        regions = [r for r in geometry.regions if r.layer == layer_index]
        for b in range(N):
            for region, view in zip(regions, _block_views(layout, value, b), strict=True):
                assert region.block_bytes == view.numel() * 2
                addr = region.base_addr + b * region.block_stride
                assert _bytes_at(addr, region.block_bytes) == _raw(view)


def test_blocks_may_be_strided_as_long_as_each_block_is_contiguous() -> None:
    # Every other block of a bigger tensor: the block stride is twice the block size.
    backing = _numbered(2 * N, B, H, D)
    k, v = backing[::2], (backing + 1)[1::2]
    geometry = register_kv_cache({"l0": (k, v)}, KVLayout.KV_SEPARATE_NHD, B)
    region = geometry.regions[0]
    assert region.block_stride == 2 * region.block_bytes
    assert _bytes_at(region.base_addr + 3 * region.block_stride, region.block_bytes) == _raw(k[3])


def test_geometry_travels_as_msgpack_unchanged() -> None:
    import msgspec

    geometry = synthetic_kv_cache(preset="tiny", num_blocks=3).geometry
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(geometry), type=CacheGeometry)
    assert again == geometry
    assert again.compat_hash() == geometry.compat_hash()


def test_presets_have_the_published_kv_sizes() -> None:
    assert get_preset("llama-3.1-8b").kv_bytes_per_token == 128 * 1024
    assert get_preset("Llama-3-70B").kv_bytes_per_token == 320 * 1024
    with pytest.raises(ConfigError, match=r"unknown model preset 'gpt-9'.*llama-3.1-8b"):
        get_preset("gpt-9")


@pytest.mark.parametrize("layout", list(KVLayout))
def test_synthetic_cache_of_a_preset_has_its_shape(layout: KVLayout) -> None:
    cache = synthetic_kv_cache(preset="llama-3.1-8b", num_layers=2, num_blocks=3, layout=layout)
    g = cache.geometry
    assert g.num_layers == 2
    assert g.block_size_tokens == 16
    assert g.bytes_per_block == 2 * PRESETS["llama-3.1-8b"].layer_block_bytes
    assert g.total_bytes == 3 * 2 * 16 * 4096


def test_synthetic_cache_from_block_bytes() -> None:
    cache = synthetic_kv_cache(3, 4, block_bytes=4096, dtype="float32", fill=0xAB)
    g = cache.geometry
    assert (g.num_layers, g.num_blocks, g.bytes_per_block) == (3, 4, 3 * 4096)
    region = g.regions[0]
    assert _bytes_at(region.base_addr, region.block_bytes) == b"\xab" * 2048
    with pytest.raises(ConfigError, match="block_bytes 1000 must be a positive multiple of 64"):
        synthetic_kv_cache(3, 4, block_bytes=1000)
    with pytest.raises(ConfigError, match="either a preset or block_bytes"):
        synthetic_kv_cache(3, 4, block_bytes=4096, preset="tiny")


def test_layout_names_parse_both_ways() -> None:
    assert KVLayout.parse("kv_first/HND") is KVLayout.KV_FIRST_HND
    assert KVLayout.parse("BLOCKS_FIRST_NHD") is KVLayout.BLOCKS_FIRST_NHD
    with pytest.raises(ConfigError, match=r"unknown KV layout 'NDH'.*kv_separate/NHD"):
        KVLayout.parse("NDH")


# --- every KVLayoutError names what the user needs to fix it -----------------------------


def _assert_diagnostic(
    exc: pytest.ExceptionInfo[KVLayoutError],
    *,
    layer: str,
    expected_blocks: int,
    actual_blocks: int | str,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: str,
    layout: KVLayout,
    problem: str,
) -> None:
    message = str(exc.value)
    assert f"layer '{layer}'" in message
    assert problem in message
    assert f"expected blocks {expected_blocks}, actual blocks {actual_blocks}" in message
    assert f"shape {shape}" in message
    assert f"strides {strides}" in message
    assert f"dtype {dtype}" in message
    assert f"declared layout {layout.value}" in message
    assert f"blocks first: {'yes' if layout.blocks_first else 'no'}" in message


def test_different_block_counts_name_both_layers() -> None:
    layout = KVLayout.KV_FIRST_NHD
    short = torch.zeros(2, N - 2, B, H, D, dtype=torch.float16)
    with pytest.raises(KVLayoutError) as exc:
        register_kv_cache({"l0": _make_layer(layout), "l1": short}, layout, B)
    _assert_diagnostic(
        exc,
        layer="l1",
        expected_blocks=N,
        actual_blocks=N - 2,
        shape=(2, N - 2, B, H, D),
        strides=tuple(short.stride()),
        dtype="float16",
        layout=layout,
        problem=f"different block count: expected {N} blocks (as in layer 'l0'",
    )


def test_non_contiguous_block() -> None:
    layout = KVLayout.KV_SEPARATE_HND
    k = torch.zeros(N, B, H, D, dtype=torch.float16).transpose(1, 2)  # [N, H, B, D], strided
    v = torch.zeros(N, H, B, D, dtype=torch.float16)
    with pytest.raises(KVLayoutError) as exc:
        register_kv_cache({"l0": (k, v)}, layout, B)
    _assert_diagnostic(
        exc,
        layer="l0",
        expected_blocks=N,
        actual_blocks=N,
        shape=(N, H, B, D),
        strides=tuple(k.stride()),
        dtype="float16",
        layout=layout,
        problem="non-contiguous block: axis 2 has stride",
    )
    assert "tensor K" in str(exc.value)


def test_mixed_dtypes() -> None:
    layout = KVLayout.BLOCKS_FIRST_NHD
    other = _make_layer(layout, dtype=torch.bfloat16)
    assert isinstance(other, torch.Tensor)
    with pytest.raises(KVLayoutError) as exc:
        register_kv_cache({"l0": _make_layer(layout), "l1": other}, layout, B)
    _assert_diagnostic(
        exc,
        layer="l1",
        expected_blocks=N,
        actual_blocks=N,
        shape=tuple(other.shape),
        strides=tuple(other.stride()),
        dtype="bfloat16",
        layout=layout,
        problem="mixed dtypes: expected float16 (as in layer 'l0' (index 0)), got bfloat16",
    )


def test_mixed_devices() -> None:
    layout = KVLayout.KV_SEPARATE_NHD
    k = torch.zeros(N, B, H, D, dtype=torch.float16)
    v = torch.zeros(N, B, H, D, dtype=torch.float16, device="meta")
    with pytest.raises(KVLayoutError) as exc:
        register_kv_cache({"l0": (k, v)}, layout, B)
    _assert_diagnostic(
        exc,
        layer="l0",
        expected_blocks=N,
        actual_blocks=N,
        shape=(N, B, H, D),
        strides=tuple(v.stride()),
        dtype="float16",
        layout=layout,
        problem="mixed devices: expected cpu",
    )
    assert "device meta" in str(exc.value)


def test_tensor_too_small_for_its_block_size() -> None:
    layout = KVLayout.KV_FIRST_HND
    t = torch.zeros(2, N, H, B, D, dtype=torch.float16)
    with pytest.raises(KVLayoutError) as exc:
        register_kv_cache({"l0": t}, layout, 2 * B)
    _assert_diagnostic(
        exc,
        layer="l0",
        expected_blocks=N,
        actual_blocks=N,
        shape=(2, N, H, B, D),
        strides=tuple(t.stride()),
        dtype="float16",
        layout=layout,
        problem=f"tensor too small for its declared geometry: the token axis (axis 3) holds {B}",
    )


def test_wrong_rank() -> None:
    layout = KVLayout.BLOCKS_FIRST_HND
    t = torch.zeros(N, H, B, D, dtype=torch.float16)  # K and V axis missing
    with pytest.raises(KVLayoutError) as exc:
        register_kv_cache({"l0": t}, layout, B)
    _assert_diagnostic(
        exc,
        layer="l0",
        expected_blocks=N,
        actual_blocks=N,
        shape=(N, H, B, D),
        strides=tuple(t.stride()),
        dtype="float16",
        layout=layout,
        problem="wrong rank: expected 5 dimensions [N, 2, H, B, D], got 4",
    )


def test_kv_axis_of_the_wrong_size() -> None:
    layout = KVLayout.KV_FIRST_NHD
    t = torch.zeros(3, N, B, H, D, dtype=torch.float16)
    with pytest.raises(KVLayoutError, match=r"the K/V axis \(axis 0\) must have size 2, got 3"):
        register_kv_cache({"l0": t}, layout, B)


def test_overlapping_blocks() -> None:
    t = torch.zeros(B, H, D, dtype=torch.float16).expand(N, B, H, D)  # every block aliased
    with pytest.raises(KVLayoutError, match=r"blocks overlap: the block axis \(axis 0\)"):
        register_kv_cache({"l0": (t, t)}, KVLayout.KV_SEPARATE_NHD, B)


def test_wrong_container_for_the_layout() -> None:
    with pytest.raises(KVLayoutError, match=r"expects a \(K, V\) pair.*got a Tensor"):
        register_kv_cache({"l0": torch.zeros(N, B, H, D)}, KVLayout.KV_SEPARATE_NHD, B)
    with pytest.raises(KVLayoutError, match=r"expects one tensor .*got a sequence of 2"):
        t = torch.zeros(2, N, B, H, D)
        register_kv_cache({"l0": (t, t)}, KVLayout.KV_FIRST_NHD, B)
    with pytest.raises(KVLayoutError, match=r"tensor V: expected a torch.Tensor.*got a list"):
        register_kv_cache({"l0": (torch.zeros(N, B, H, D), [1])}, "kv_separate/NHD", B)  # type: ignore[dict-item]
    with pytest.raises(KVLayoutError, match="empty"):
        register_kv_cache({}, KVLayout.KV_SEPARATE_NHD, B)
