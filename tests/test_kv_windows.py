"""Several KV cache groups: each layer reads its group's block table from the first token
that group still holds (vLLM's hybrid allocator frees a sliding-window layer's blocks
before its window and lists its null block, id 0, in their place)."""

from __future__ import annotations

import pytest
import torch
from kv_fixtures import reference_gather, vllm_layer_views

from vllm_kvbridge.errors import PayloadError
from vllm_kvbridge.kv.layout import KVLayoutError, cpu_layout, packed_layout
from vllm_kvbridge.kv.paged import BlockTable, RequestGather, gather_layers
from vllm_kvbridge.wire import decode_frames, encode
from vllm_kvbridge.wire.kv_format import KVCacheTransferData

NULL = 0  # vLLM's null block: what a sliding group's table lists before its window


def _caches(
    content: str, layers: int, dtype: torch.dtype = torch.float32
) -> tuple[list[torch.Tensor], object]:
    if content == "packed":
        return vllm_layer_views("LBNHC", layers, 9, 2, 16, 32, dtype, seed=4), packed_layout(2, 32, 16, dtype)
    gen = torch.Generator().manual_seed(4)
    caches = [torch.randn(9, 2, 32, 64, generator=gen).to(dtype) for _ in range(layers)]
    return caches, cpu_layout(2, 32, 32, dtype, isa="amx" if content == "amx" else "vec")


@pytest.mark.parametrize("content", ["packed", "cpu", "amx"])
@pytest.mark.parametrize("start", [0, 1, 15, 16, 17, 31, 32, 33, 70])
def test_a_layer_reads_its_groups_table_from_its_window(content: str, start: int) -> None:
    dtype = torch.bfloat16 if content == "amx" else torch.float32
    caches, layout = _caches(content, 3, dtype)
    n = layout.tokens_per_block
    seq_len = 3 * n + 5
    start = min(start, seq_len - 1)  # the last token alone, where blocks are small
    full = [5, 2, 7, 3]
    # the sliding group's blocks before its window went back: vLLM lists its null block there
    sliding = [NULL if (b + 1) * n <= start else x for b, x in enumerate([4, 8, 1, 6])]
    tables = [BlockTable(full), BlockTable(sliding, start)]
    keys, values = gather_layers(caches, layout, tables, seq_len, layer_tables=[1, 0, 1])
    for layer, (group, ids) in enumerate([(1, [4, 8, 1, 6]), (0, full), (1, [4, 8, 1, 6])]):
        if content == "amx":  # the whole table's gather (checked against vLLM's kernel elsewhere)
            ref_k, ref_v = (x[0] for x in gather_layers([caches[layer]], layout, ids, seq_len))
        else:
            ref_k, ref_v = reference_gather(caches[layer], layout, ids, seq_len)
        first = start if group == 1 else 0
        assert keys[layer].shape[0] == seq_len - first
        assert torch.equal(keys[layer], ref_k[first:]), (layer, start)
        assert torch.equal(values[layer], ref_v[first:]), (layer, start)


def test_manager_blocks_split_into_kernel_blocks_keep_the_window() -> None:
    cache = vllm_layer_views("LBNHC", 1, 8, 2, 16, 8, torch.float32, seed=2)[0]
    layout = packed_layout(2, 8, 16, torch.float32, blocks_per_block=2)
    for start in (0, 5, 16, 20, 32, 39):
        request = RequestGather([cache], layout, [BlockTable([NULL if start >= 32 else 3, 1], start)], 40)
        got = request.write(0, 0, request.empty(0, 0))
        ref, _ = reference_gather(cache, packed_layout(2, 8, 16, torch.float32), [6, 7, 2], 40)
        assert torch.equal(got, ref[start:]), start


def test_a_window_past_the_tokens_or_a_freed_block_in_it_is_refused() -> None:
    caches, layout = _caches("cpu", 1)
    with pytest.raises(KVLayoutError, match="start 40 is outside"):
        RequestGather(caches, layout, [BlockTable([1, 2], 40)], 40)
    with pytest.raises(KVLayoutError, match="start must be an int"):
        BlockTable([1], -1)
    with pytest.raises(KVLayoutError, match="layer_tables"):
        RequestGather(caches, layout, [BlockTable([1]), BlockTable([2])], 10)
    with pytest.raises(KVLayoutError, match="do not map"):
        RequestGather(caches, layout, [BlockTable([1])], 10, layer_tables=[1])


def _windowed(layer_starts: list[int] | None, seq_len: int = 40) -> KVCacheTransferData:
    starts = layer_starts or [0, 0]
    k = [
        torch.arange((seq_len - s) * 4, dtype=torch.float32).view(-1, 2, 2) + i for i, s in enumerate(starts)
    ]
    return KVCacheTransferData(
        request_id="r",
        layer_blocks={"key_cache": k, "value_cache": [t + 0.5 for t in k]},
        seq_len=seq_len,
        layer_starts=layer_starts,
    )


def test_layer_starts_travel_in_the_container() -> None:
    data = _windowed([33, 0])
    back = decode_frames(encode(data).frames())
    assert back.equals(data) and back.layer_starts == [33, 0]
    assert [back.layer_start(i) for i in range(2)] == [33, 0]
    assert back.key_cache[0].shape[0] == 7 and back.key_cache[1].shape[0] == 40
    assert decode_frames(encode(_windowed(None)).frames()).layer_starts is None


@pytest.mark.parametrize(
    ("starts", "rows", "match"),
    [
        ([33], None, "layer_starts must be a list of num_layers=2"),
        ([40, 0], None, r"layer_starts\[0\] = 40 is outside"),
        ([-1, 0], None, r"layer_starts\[0\] = -1 is outside"),
        ([30, 0], 7, "key_cache\\[0\\]: 7 tokens, but layer_starts says 10"),
    ],
)
def test_a_container_whose_windows_disagree_with_its_tensors_is_refused(starts, rows, match) -> None:
    good = _windowed([33, 0])
    if rows is None:
        good.layer_starts = starts
        with pytest.raises(PayloadError, match=match):
            encode(good)
    else:  # a forged header: the tensors say 7 tokens, the header says another window
        from vllm_kvbridge.wire.kv_header import KVHeader, validate_header
        from vllm_kvbridge.wire.limits import DEFAULT_LIMITS

        header, _ = good._header(DEFAULT_LIMITS)
        forged = KVHeader(
            **{f: getattr(header, f) for f in KVHeader.__struct_fields__} | {"layer_starts": starts}
        )
        with pytest.raises(PayloadError, match=match):
            validate_header(forged, DEFAULT_LIMITS)
