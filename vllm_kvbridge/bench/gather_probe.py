"""The second ceiling of ``bench kv-path``: the layout's own copy of the same KV.

The one-copy sender cannot beat one pass over the bytes in the order the cache stores them.
Where the cache is token-major (vLLM's GPU backends: ``KVContent.PACKED``) that pass is an
indexed block copy, as fast as a memcpy; vLLM's CPU backend (``vec`` ISAs) stores each K
page *transposed* (``[head_size, block_size]``, see :mod:`vllm_kvbridge.kv.layout`), so the
same bytes come out through a strided transpose, several times slower than a memcpy on
this class of machine. :class:`GatherProbe` times exactly that pass in this process: a
cache of the engine's layout (the layout vLLM picks for the model's dtype and block size
on this platform), the request's blocks in shuffled order, every layer's K and V gathered
by :func:`~vllm_kvbridge.kv.paged.gather_layers_into` into one preallocated dense buffer,
on one thread (as the memcpy ceiling). ``x gather`` in the table is the path's GB/s over
this one: how close the path comes to the copy it cannot avoid on this layout.
"""

from __future__ import annotations

import time

import torch

#: The KV-heavy model's KV heads and head size (:mod:`vllm_kvbridge.bench.kv_model`).
KV_HEADS, HEAD_SIZE = 4, 128


def engine_layout(dtype: torch.dtype, block_size: int, device: torch.device) -> object:
    """The layout vLLM's attention backend uses for the KV-heavy model on ``device``."""
    from vllm_kvbridge.kv.layout import cpu_layout, packed_layout

    if device.type == "cpu":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, block_size, HEAD_SIZE, "auto")
        return cpu_layout(KV_HEADS, HEAD_SIZE, block_size, dtype, isa=isa)
    return packed_layout(KV_HEADS, HEAD_SIZE, block_size, dtype)


class GatherProbe:
    """One gather of ``tokens`` tokens of ``layers`` layers out of a cache of ``layout``."""

    def __init__(self, layout: object, layers: int, tokens: int, device: torch.device) -> None:
        from vllm_kvbridge.kv.layout import KVCacheLayout

        assert isinstance(layout, KVCacheLayout)
        self.layout, self.tokens = layout, tokens
        blocks = -(-tokens // layout.block_size)
        gen = torch.Generator().manual_seed(0)
        self.block_ids = torch.randperm(blocks + 1, generator=gen)[:blocks]  # not in order
        shape = layout.expected_shape(blocks + 1)
        self.caches = [torch.ones(shape, dtype=layout.dtype, device=device) for _ in range(layers)]
        dense = (tokens, KV_HEADS, HEAD_SIZE)
        self.keys = [torch.zeros(dense, dtype=layout.dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(dense, dtype=layout.dtype, device=device) for _ in range(layers)]
        self.nbytes = 2 * sum(k.numel() * k.element_size() for k in self.keys)
        self.samples: list[float] = []

    def sample(self) -> None:
        from vllm_kvbridge.kv.paged import gather_layers_into

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            if self.caches[0].is_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            gather_layers_into(self.caches, self.layout, self.block_ids, self.tokens, self.keys, self.values)
            if self.caches[0].is_cuda:
                torch.cuda.synchronize()
            self.samples.append(time.perf_counter() - start)
        finally:
            torch.set_num_threads(threads)

    def gbps(self) -> float:
        return self.nbytes / min(self.samples) / 1e9
