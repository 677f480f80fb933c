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
  [seq, kv_heads, head_dim], payload: dict | None) -> velocity [B, C, H, W]``: one branch,
* optional ``decode(latents) -> image [B, 3, H', W']`` with values in [0, 1].

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

    def forward(self, x: torch.Tensor, temb: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        s1, b1, s2, b2, s3, b3 = self.modulation(temb).unsqueeze(1).chunk(6, dim=-1)
        y = self.norm1(x) * (1 + s1) + b1
        q, kk, vv = self.qkv(y).view(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, kk, vv).transpose(1, 2).reshape(b, n, h))
        y = self.norm2(x) * (1 + s2) + b2
        cq = self.cross_q(y).view(b, n, self.kv_heads, self.kv_head_dim).transpose(1, 2)
        # K/V: [seq, kv_heads, head_dim] -> [B, kv_heads, seq, head_dim], shared by the batch.
        ck = k.permute(1, 0, 2).unsqueeze(0).expand(b, -1, -1, -1).to(cq.dtype)
        cv = v.permute(1, 0, 2).unsqueeze(0).expand(b, -1, -1, -1).to(cq.dtype)
        cross = F.scaled_dot_product_attention(cq, ck, cv).transpose(1, 2).reshape(b, n, -1)
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
        b, c, hgt, wid = latents.shape
        p, g = self.patch_size, self.grid
        patches = latents.reshape(b, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, c * p * p)
        x = self.patch_in(patches) + self.pos
        temb = self.time_mlp(self._timestep_embedding(t).to(x.dtype))
        for i, block in enumerate(self.blocks):
            k, v = kv[i % len(kv)]
            x = block(x, temb, k, v)
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
