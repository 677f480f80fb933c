"""Paged-cache gather/scatter against hand-built references, the real CPU kernel and vLLM's own views."""

from __future__ import annotations

import pytest
import torch
from kv_fixtures import ALL_PHYSICAL_ORDERS, reference_gather, vllm_layer_views

from vllm_kvbridge.errors import KVBridgeError
from vllm_kvbridge.kv.layout import (
    KVCacheLayout,
    KVContent,
    KVLayoutError,
    cpu_layout,
    packed_layout,
)
from vllm_kvbridge.kv.layout_vllm import layout_for_backend
from vllm_kvbridge.kv.paged import gather, gather_layers, request_block_index, scatter

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _cpu_cache(
    num_blocks: int, heads: int, block_size: int, head_size: int, dtype: torch.dtype, seed: int = 0
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, heads, block_size, 2 * head_size, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("order", ALL_PHYSICAL_ORDERS)
def test_packed_layouts_match_reference(order: str, dtype: torch.dtype) -> None:
    views = vllm_layer_views(
        order, num_layers=3, num_blocks=7, heads=4, block_size=16, head_size=8, dtype=dtype, seed=1
    )
    layout = packed_layout(4, 8, 16, dtype, physical_order=order)
    block_ids = [5, 0, 3]  # non-contiguous, out of order
    for seq_len in (1, 16, 17, 40, 48):
        needed = block_ids[: -(-seq_len // 16)]
        keys, values = gather_layers(views, layout, block_ids, seq_len)
        for layer, view in enumerate(views):
            ref_k, ref_v = reference_gather(view, layout, needed, seq_len)
            assert torch.equal(keys[layer], ref_k), (order, seq_len, layer)
            assert torch.equal(values[layer], ref_v), (order, seq_len, layer)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_layout_matches_reference_and_head_slice(dtype: torch.dtype) -> None:
    cache = _cpu_cache(6, 4, 32, 16, dtype)
    layout = cpu_layout(4, 16, 32, dtype)
    block_ids = [4, 1, 2]
    for seq_len in (1, 31, 32, 33, 95):
        k, v = gather(cache, layout, block_ids, seq_len)
        ref_k, ref_v = reference_gather(cache, layout, block_ids, seq_len)
        assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
        ks, vs = gather(cache, layout, block_ids, seq_len, head_start=1, head_end=3)
        assert torch.equal(ks, ref_k[:, 1:3]) and torch.equal(vs, ref_v[:, 1:3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "head_size"), [(32, 32), (16, 64), (64, 32)])
def test_cpu_layout_matches_the_real_vllm_kernel(dtype: torch.dtype, block_size: int, head_size: int) -> None:
    """K/V written by vLLM's own ``cpu_attn_reshape_and_cache`` come back exactly."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    heads = 2
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    layout = layout_for_backend(CPUAttentionBackend, spec, model_dtype=dtype)
    # bfloat16 on a CPU with AMX tiles takes the amx page format (this machine has them)
    amx = dtype == torch.bfloat16 and block_size % 32 == 0 and torch.cpu._is_amx_tile_supported()
    assert layout.content is (KVContent.CPU_AMX if amx else KVContent.CPU_VEC)
    _check_cpu_layout_against_the_kernel(layout, dtype, block_size, head_size)


@pytest.mark.parametrize(("block_size", "head_size"), [(32, 32), (32, 64), (64, 32), (32, 128), (96, 64)])
def test_amx_layout_matches_the_real_vllm_kernel(block_size: int, head_size: int) -> None:
    """The amx page format (tiles of 16 tokens x channel pairs for K, 16 channels x token
    pairs for V), written by vLLM's own kernel with the ``amx`` ISA, comes back exactly."""
    layout = cpu_layout(2, head_size, block_size, torch.bfloat16, isa="amx")
    assert layout.content is KVContent.CPU_AMX
    _check_cpu_layout_against_the_kernel(layout, torch.bfloat16, block_size, head_size)


def _check_cpu_layout_against_the_kernel(
    layout: KVCacheLayout, dtype: torch.dtype, block_size: int, head_size: int
) -> None:
    from vllm import _custom_ops as ops

    heads, num_blocks = 2, 5
    cache = torch.zeros(layout.expected_shape(num_blocks), dtype=dtype)
    seq_len = 2 * block_size + 3
    block_ids = [3, 0, 4]
    gen = torch.Generator().manual_seed(7)
    key = torch.randn(seq_len, heads, head_size, generator=gen).to(dtype)
    value = torch.randn(seq_len, heads, head_size, generator=gen).to(dtype)
    slots = torch.tensor([block_ids[t // block_size] * block_size + t % block_size for t in range(seq_len)])
    # The backend's own view: [B, H, 2N, D] chunked into K and V halves (cpu_attn.py).
    kv = cache.view(num_blocks, heads, block_size * 2, -1)
    key_cache, value_cache = kv.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, layout.cpu_isa)
    k, v = gather(cache, layout, block_ids, seq_len)
    assert torch.equal(k, key) and torch.equal(v, value)
    # and scatter writes what the kernel would have written
    other = torch.zeros_like(cache)
    scatter(other, layout, block_ids, key, value)
    assert torch.equal(other, cache)


@pytest.mark.parametrize("content", ["packed", "cpu", "amx"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_is_the_inverse_and_preserves_neighbours(content: str, dtype: torch.dtype) -> None:
    if content == "packed":
        cache = vllm_layer_views("LBNHC", 1, 6, 4, 16, 8, dtype, seed=3)[0]
        layout = packed_layout(4, 8, 16, dtype)
    else:
        cache = _cpu_cache(6, 4, 32, 32, dtype, seed=3)
        layout = cpu_layout(4, 32, 32, dtype, isa="amx" if content == "amx" else "vec")
    before = cache.clone()
    n = layout.block_size
    seq_len = n + 5
    gen = torch.Generator().manual_seed(9)
    k = torch.randn(seq_len, 4, 8 if content == "packed" else 32, generator=gen).to(dtype)
    v = torch.randn_like(k)
    scatter(cache, layout, [4, 2], k, v)
    got_k, got_v = gather(cache, layout, [4, 2], seq_len)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    for b in (0, 1, 3, 5):  # untouched blocks
        assert torch.equal(cache[b], before[b])
    # the tail of the partial block keeps its old tokens
    tail_k, _ = gather(cache, layout, [4, 2], 2 * n)
    old_k, _ = gather(before, layout, [4, 2], 2 * n)
    assert torch.equal(tail_k[seq_len:], old_k[seq_len:])
    # head-sliced scatter writes only those heads
    cache2 = before.clone()
    scatter(cache2, layout, [4, 2], k[:, 1:2].contiguous(), v[:, 1:2].contiguous(), head_start=1, head_end=2)
    full_k, _ = gather(cache2, layout, [4, 2], seq_len)
    assert torch.equal(full_k[:, 1], k[:, 1])
    assert torch.equal(full_k[:, [0, 2, 3]], old_k[:seq_len, [0, 2, 3]])


def test_out_buffers_are_filled_in_place() -> None:
    cache = _cpu_cache(4, 2, 32, 32, torch.float32)
    layout = cpu_layout(2, 32, 32, torch.float32)
    out_k = torch.full((40, 2, 32), 7.0)
    out_v = torch.full((40, 2, 32), 7.0)
    k, v = gather(cache, layout, [1, 3], 40, out_k, out_v)
    assert k is out_k and v is out_v
    ref_k, ref_v = reference_gather(cache, layout, [1, 3], 40)
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)


def test_num_blocks_two_is_not_ambiguous() -> None:
    """With num_blocks == 2 == heads, a shape guess cannot tell the layouts apart; the layout can."""
    dtype = torch.float32
    packed = vllm_layer_views("LBHNC", 1, 2, 2, 32, 32, dtype, seed=5)[0]
    cpu = packed.clone()
    assert packed.shape == cpu.shape == (2, 2, 32, 64)
    pk, _ = gather(packed, packed_layout(2, 32, 32, dtype), [1, 0], 50)
    ck, _ = gather(cpu, cpu_layout(2, 32, 32, dtype), [1, 0], 50)
    assert torch.equal(pk, reference_gather(packed, packed_layout(2, 32, 32, dtype), [1, 0], 50)[0])
    assert torch.equal(ck, reference_gather(cpu, cpu_layout(2, 32, 32, dtype), [1, 0], 50)[0])
    assert not torch.equal(pk, ck)  # same bytes, different meaning: only the layout decides


def test_kernel_blocks_map_from_manager_blocks() -> None:
    """A manager block of 32 tokens split into two 16-token kernel blocks (vLLM kernel block splitting)."""
    cache = vllm_layer_views("LBNHC", 1, 8, 2, 16, 8, torch.float32, seed=2)[0]
    layout = packed_layout(2, 8, 16, torch.float32, blocks_per_block=2)
    k, v = gather(cache, layout, [3, 1], 40)  # manager blocks 3, 1 -> tensor blocks 6, 7, 2
    ref_k, ref_v = reference_gather(cache, packed_layout(2, 8, 16, torch.float32), [6, 7, 2], 40)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


@pytest.mark.parametrize(
    ("block_ids", "seq_len", "match"),
    [
        ([0, 9], 40, "out of range"),
        ([0, -1], 40, "out of range"),
        ([0], 40, "hold at most 32 tokens"),
        ([], 1, "hold at most 0 tokens"),
        ([2, 2], 40, "repeat"),
        ([0, 1], 0, "seq_len must be a positive int"),
        ([0, 1], -3, "seq_len must be a positive int"),
        ([0, 1.0], 40, "must be ints"),
        (torch.tensor([0.0, 1.0]), 40, "1-D integer tensor"),
    ],
)
def test_bad_block_ids_are_refused(block_ids, seq_len, match) -> None:
    cache = _cpu_cache(4, 2, 32, 32, torch.float32)
    layout = cpu_layout(2, 32, 32, torch.float32)
    with pytest.raises(KVLayoutError, match=match):
        gather(cache, layout, block_ids, seq_len)
    assert issubclass(KVLayoutError, KVBridgeError) and issubclass(KVLayoutError, ValueError)


def test_block_index_ignores_extra_blocks_and_accepts_tensors() -> None:
    layout = cpu_layout(2, 32, 32, torch.float32)
    assert request_block_index(torch.tensor([3, 1, 2]), 33, layout, 4).tolist() == [3, 1]
    assert request_block_index([3, 1, 99], 32, layout, 4).tolist() == [3]


def test_mismatches_are_refused() -> None:
    layout = cpu_layout(2, 32, 32, torch.float32)
    cache = _cpu_cache(4, 2, 32, 32, torch.float32)
    with pytest.raises(KVLayoutError, match="dtype"):
        gather(cache.to(torch.float16), layout, [0], 3)
    with pytest.raises(KVLayoutError, match="shape"):
        gather(cache[:, :1], layout, [0], 3)
    with pytest.raises(KVLayoutError, match="shape"):
        gather(cache[0], layout, [0], 3)
    with pytest.raises(KVLayoutError, match=r"torch\.Tensor"):
        gather([cache], layout, [0], 3)  # type: ignore[arg-type]
    with pytest.raises(KVLayoutError, match="head range"):
        gather(cache, layout, [0], 3, head_start=1, head_end=1)
    with pytest.raises(KVLayoutError, match="head range"):
        gather(cache, layout, [0], 3, head_end=3)
    with pytest.raises(KVLayoutError, match="out_k dtype"):
        gather(cache, layout, [0], 3, out_k=torch.empty(3, 2, 32, dtype=torch.float64))
    with pytest.raises(KVLayoutError, match="out_v has shape"):
        gather(cache, layout, [0], 3, out_v=torch.empty(4, 2, 32))
    with pytest.raises(KVLayoutError, match="contiguous"):
        gather(cache, layout, [0], 3, out_k=torch.empty(32, 2, 3).transpose(0, 2))
    with pytest.raises(KVLayoutError, match="dense pages"):
        gather(cache.transpose(1, 2).contiguous().transpose(1, 2), layout, [0], 3)
    with pytest.raises(KVLayoutError, match="k dtype"):
        scatter(cache, layout, [0], torch.zeros(3, 2, 32, dtype=torch.float16), torch.zeros(3, 2, 32))
    with pytest.raises(KVLayoutError, match="v has shape"):
        scatter(cache, layout, [0], torch.zeros(3, 2, 32), torch.zeros(3, 2, 31))
    with pytest.raises(KVLayoutError, match="no KV cache layers"):
        gather_layers([], layout, [0], 3)


def test_layout_construction_errors() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    with pytest.raises(KVLayoutError, match="not supported"):
        layout_for_backend("SOME_MLA_BACKEND", spec)
    with pytest.raises(KVLayoutError, match="quantized"):
        layout_for_backend("FLASH_ATTN", spec, cache_dtype="fp8")
    with pytest.raises(KVLayoutError, match="kernel-private"):
        cpu_layout(2, 32, 32, torch.bfloat16, isa="neon")
    with pytest.raises(KVLayoutError, match="amx page format needs block_size and head_size divisible by 32"):
        cpu_layout(2, 48, 32, torch.bfloat16, isa="amx")
    with pytest.raises(KVLayoutError, match="not an attention KV cache spec"):
        layout_for_backend("FLASH_ATTN", object())
    with pytest.raises(KVLayoutError, match="positive int"):
        packed_layout(0, 32, 32, torch.float32)
    with pytest.raises(KVLayoutError, match="physical order"):
        packed_layout(2, 32, 32, torch.float32, physical_order="NHD")
    flash = layout_for_backend("FLASH_ATTN", spec, kv_cache_layout="LBNHC", kernel_block_size=16)
    assert (flash.content, flash.block_size, flash.blocks_per_block) == (KVContent.PACKED, 16, 2)
    from vllm.v1.kv_cache_layout import KVCacheLayout as VLayout

    assert layout_for_backend("FLASHINFER", spec, kv_cache_layout=VLayout.BLHNC).physical_order == "BLHNC"
