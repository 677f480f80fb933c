"""A tiny KV-conditioned diffusion transformer (DiT) for demos and tests.

It is the smallest model that makes an AR -> DiT pipeline real: the image it paints
depends on the per-layer K/V the LLM stage computed for the prompt. Each DiT block
self-attends over image patches, then *cross-attends to one LLM layer's received K/V*
(block ``i`` reads LLM layer ``i % num_llm_layers``), then runs an MLP; the timestep
modulates every block (adaLN-style scale/shift). Weights are random from ``seed``, so two
processes that build ``TinyKVDiT(seed=0)`` hold identical models with no files at all.

Contract the diffusion runner relies on (users replace this class by dotted path):

* ``latent_shape`` -> ``(channels, height, width)`` of the latent the loop starts from,
* ``forward(latents [B, C, H, W], t [B] in [0, 1], kv: list of (K, V) per LLM layer, each
  [seq, kv_heads, head_dim], payload: dict | None) -> velocity [B, C, H, W]``: one branch;
  ``seq`` may differ between layers (a sliding-window layer of the LLM sends only its
  window, ``KVCacheTransferData.layer_starts``), so attend per layer, never stack them,
* optional ``decode(latents) -> image [B, 3, H', W']`` with values in [0, 1],
* optional ``forward_batch(latents [B, C, H, W], t [B], kvs, payloads) -> velocity [B, C, H, W]``:
  several requests at once, ``kvs`` one KV per row (each a list of (K, V) per LLM layer; the
  rows' prompt lengths differ), ``payloads`` one per row or None. Row ``r`` must be what
  ``forward(latents[r:r+1], t[r:r+1], kvs[r], payloads[r])`` returns: the runner batches
  requests (``diffusion.max_batch_size``) only through it, and promises each request the
  image it gets alone. A module without it, or a subclass that overrides ``forward`` but not
  ``forward_batch``, is run row by row through ``forward`` (see
  :func:`vllm_kvbridge.runner.diffusion_batch.batch_forward_of`).

Batched exactness here: every row is bit-exact with its batch-1 forward on CPU (measured
max abs difference 0.0; the tests assert equality). Two things make it so. The
cross-attention runs per row on that row's own unpadded K/V: padding to the longest row
with a mask would be one kernel call, but the masked kernel rounds differently (measured
7e-7) for ~10 % less time at batch 8. And the timestep embedding and each block's
modulation, linears over one row per request, are computed once per *distinct* t on a
one-row input: a linear over one row (a GEMV) rounds differently from the same rows in a
GEMM (measured 6e-7); the runner batches requests of one step count only, so all rows
share t and this is one small linear per block instead of B. The large linears (patches x
batch rows) and attention over patches are row-invariant with PyTorch's CPU kernels; on a
backend whose GEMMs are not (other BLAS, GPU), rows differ by rounding only (~1e-6): the
stated tolerance there is atol 1e-5. Speed (CPU, in the stage): a batch of 7 takes ~4 ms
per step, 7 single-row forwards ~11 ms.

Guidance (classifier-free): :meth:`TinyKVDiT.guided_forward` runs the conditional branch on
the prompt's KV and the unconditional branch on the companion's KV (the negative prompt's,
computed by the LLM stage as its own request) and mixes them with
:func:`~vllm_kvbridge.models.guidance.cfg_combine`. The diffusion runner calls ``forward``
per branch (so a 2-rank stage can run one branch per rank) and mixes with the same function.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from vllm_kvbridge.models.guidance import cfg_combine


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, kv_head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.kv_head_dim = heads, kv_heads, kv_head_dim
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False)
        # Cross-attention queries live in the LLM's K/V space (kv_heads x kv_head_dim).
        self.cross_q = nn.Linear(hidden, kv_heads * kv_head_dim)
        self.cross_out = nn.Linear(kv_heads * kv_head_dim, hidden)
        self.norm3 = nn.LayerNorm(hidden, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.modulation = nn.Linear(hidden, 6 * hidden)

    def forward(
        self, x: torch.Tensor, mod: torch.Tensor, kv_rows: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """``mod``: ``self.modulation(temb)`` [B, 6 * hidden]; ``kv_rows``: one LLM layer's
        (K, V) per row, or a single pair that every row cross-attends to."""
        b, n, h = x.shape
        s1, b1, s2, b2, s3, b3 = mod.unsqueeze(1).chunk(6, dim=-1)
        y = self.norm1(x) * (1 + s1) + b1
        q, kk, vv = self.qkv(y).view(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, kk, vv).transpose(1, 2).reshape(b, n, h))
        y = self.norm2(x) * (1 + s2) + b2
        cq = self.cross_q(y).view(b, n, self.kv_heads, self.kv_head_dim).transpose(1, 2)
        if len(kv_rows) == 1:
            # K/V: [seq, kv_heads, head_dim] -> [B, kv_heads, seq, head_dim], shared by the batch.
            k, v = kv_rows[0]
            ck = k.permute(1, 0, 2).unsqueeze(0).expand(b, -1, -1, -1).to(cq.dtype)
            cv = v.permute(1, 0, 2).unsqueeze(0).expand(b, -1, -1, -1).to(cq.dtype)
            cross = F.scaled_dot_product_attention(cq, ck, cv)
        else:
            # Per row on its own unpadded K/V: exactly the batch-1 kernel call (see the
            # module docstring for why not padded + masked).
            cross = torch.cat(
                [
                    F.scaled_dot_product_attention(
                        cq[r : r + 1],
                        k.permute(1, 0, 2).unsqueeze(0).to(cq.dtype),
                        v.permute(1, 0, 2).unsqueeze(0).to(cq.dtype),
                    )
                    for r, (k, v) in enumerate(kv_rows)
                ]
            )
        cross = cross.transpose(1, 2).reshape(b, n, -1)
        x = x + self.cross_out(cross)
        y = self.norm3(x) * (1 + s3) + b3
        return x + self.mlp(y)


class TinyKVDiT(nn.Module):
    """A few DiT blocks over ``image_size``² patches that cross-attend to received LLM K/V.

    ``kv_heads`` / ``kv_head_dim`` must match the LLM stage's KV (the defaults match the
    tiny Llama: 2 KV heads of 32). ``seed`` fixes the random weights.
    """

    def __init__(
        self,
        image_size: int = 32,
        channels: int = 3,
        patch_size: int = 4,
        hidden: int = 64,
        heads: int = 4,
        depth: int = 2,
        kv_heads: int = 2,
        kv_head_dim: int = 32,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size ({image_size}) must be a multiple of patch_size ({patch_size})")
        if hidden % heads or hidden % 2:
            raise ValueError(f"hidden ({hidden}) must be even and a multiple of heads ({heads})")
        self.image_size, self.channels, self.patch_size, self.hidden = (
            image_size,
            channels,
            patch_size,
            hidden,
        )
        self.kv_heads, self.kv_head_dim = kv_heads, kv_head_dim
        self.grid = image_size // patch_size
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.patch_in = nn.Linear(channels * patch_size * patch_size, hidden)
            self.pos = nn.Parameter(torch.randn(1, self.grid * self.grid, hidden) * 0.02)
            self.time_mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
            self.blocks = nn.ModuleList(_Block(hidden, heads, kv_heads, kv_head_dim) for _ in range(depth))
            self.norm_out = nn.LayerNorm(hidden, elementwise_affine=False)
            self.patch_out = nn.Linear(hidden, channels * patch_size * patch_size)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        return (self.channels, self.image_size, self.image_size)

    def _timestep_embedding(self, t: torch.Tensor) -> torch.Tensor:
        half = self.hidden // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
        args = (t.float() * 1000.0)[:, None] * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def _check_kv(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not kv:
            raise ValueError("TinyKVDiT needs the LLM's KV cache (got no layers)")
        for i, (k, v) in enumerate(kv):
            want = (self.kv_heads, self.kv_head_dim)
            if k.dim() != 3 or tuple(k.shape[1:]) != want or k.shape != v.shape:
                raise ValueError(
                    f"KV layer {i}: expected K and V of shape [seq, {want[0]}, {want[1]}], "
                    f"got {tuple(k.shape)} and {tuple(v.shape)}"
                )

    def forward(
        self,
        latents: torch.Tensor,
        t: torch.Tensor,
        kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        payload: Mapping[str, Any] | None = None,
    ) -> torch.Tensor:
        self._check_kv(kv)
        x = self._patchify(latents)
        temb = self.time_mlp(self._timestep_embedding(t).to(x.dtype))
        for i, block in enumerate(self.blocks):
            x = block(x, block.modulation(temb), [kv[i % len(kv)]])
        return self._unpatchify(x, latents.shape)

    def forward_batch(
        self,
        latents: torch.Tensor,
        t: torch.Tensor,
        kvs: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
        payloads: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> torch.Tensor:
        """Velocity of B requests at once, row ``r`` conditioned on ``kvs[r]`` alone
        (bit-exact with ``forward`` of that row: see the module docstring)."""
        b = latents.shape[0]
        if len(kvs) != b:
            raise ValueError(f"forward_batch needs one KV per row: {b} rows, {len(kvs)} KVs")
        for r, kv in enumerate(kvs):
            try:
                self._check_kv(kv)
            except ValueError as exc:
                raise ValueError(f"row {r}: {exc}") from None
        x = self._patchify(latents)
        # Embedding and modulation on a one-row input per distinct t (as forward computes
        # them for one request), then gathered to the rows.
        distinct, row_of = torch.unique(t, return_inverse=True)
        temb = [
            self.time_mlp(self._timestep_embedding(distinct[j : j + 1]).to(x.dtype))
            for j in range(len(distinct))
        ]
        for i, block in enumerate(self.blocks):
            mod = torch.cat([block.modulation(e) for e in temb])[row_of]
            x = block(x, mod, [kv[i % len(kv)] for kv in kvs])
        return self._unpatchify(x, latents.shape)

    def _patchify(self, latents: torch.Tensor) -> torch.Tensor:
        b, c, _, _ = latents.shape
        p, g = self.patch_size, self.grid
        patches = latents.reshape(b, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, c * p * p)
        return self.patch_in(patches) + self.pos

    def _unpatchify(self, x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        b, c, hgt, wid = shape
        p, g = self.patch_size, self.grid
        out = self.patch_out(self.norm_out(x))
        return out.reshape(b, g, g, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, hgt, wid)

    def guided_forward(
        self,
        latents: torch.Tensor,
        t: torch.Tensor,
        kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        uncond_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        guidance_scale: float,
        payload: Mapping[str, Any] | None = None,
    ) -> torch.Tensor:
        """Classifier-free guided velocity: conditional branch on ``kv``, unconditional on
        ``uncond_kv`` (the two prompts may have different lengths), mixed by ``guidance_scale``."""
        return cfg_combine(
            self(latents, t, kv, payload), self(latents, t, uncond_kv, payload), guidance_scale
        )

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents in roughly [-1, 1] -> image in [0, 1] (the latent space is pixel space here)."""
        return ((latents.clamp(-1.0, 1.0) + 1.0) / 2.0)[:, :3]
