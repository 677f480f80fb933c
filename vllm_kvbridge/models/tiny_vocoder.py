"""A tiny streaming vocoder: codes (token ids) -> waveform samples, chunk by chunk.

It is the smallest model that makes the third stage of a thinker -> talker -> vocoder
pipeline real: the talker's codes arrive in chunks while it generates, and each chunk is
turned into audio at once. Every code becomes ``hop_length`` samples computed from the
embeddings of that code and the ``context`` codes before it (a causal convolution, the
shape of a real streaming vocoder's receptive field), so a chunk needs only the last
``context`` embeddings of the previous one. Weights are random from ``seed``: two
processes that build ``TinyVocoder(seed=0)`` hold identical models with no files.

Contract the vocoder stage relies on (users replace this class by dotted path, the
stage config's ``vocoder.class_path``):

* ``sample_rate: int`` (Hz) and ``hop_length: int`` (samples per input row);
* ``init_state() -> state``: the streaming state of a new request (opaque to the stage);
* ``forward_chunk(codes [n] int64, state) -> (samples [n * hop_length] float32 in [-1, 1],
  state)``: the samples of the next ``n`` rows, and the state after them.

Streaming exactness: the samples of a request vocoded chunk by chunk equal those of
``forward`` over all its codes at once up to float rounding: the linears run in float64
(over a chunk's rows and over all rows they round differently in the last bits) and the
samples are float32, so the stated tolerance, atol 1e-6, holds with a wide margin; the
tests check it for every chunking.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["TinyVocoder"]


class TinyVocoder(nn.Module):
    def __init__(
        self,
        vocab_size: int = 512,
        dim: int = 64,
        hop_length: int = 240,
        context: int = 2,
        sample_rate: int = 24_000,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if min(vocab_size, dim, hop_length, sample_rate) <= 0 or context < 0:
            raise ValueError("vocab_size, dim, hop_length and sample_rate must be > 0, context >= 0")
        self.vocab_size, self.dim, self.context = vocab_size, dim, context
        self.hop_length, self.sample_rate = hop_length, sample_rate
        self.embed = nn.Embedding(vocab_size, dim)
        self.mix = nn.Linear((context + 1) * dim, dim)
        self.out = nn.Linear(dim, hop_length)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5))

    def init_state(self) -> torch.Tensor:
        """The embeddings of the ``context`` codes before the first one (zeros)."""
        return torch.zeros(self.context, self.dim, dtype=self.embed.weight.dtype)

    @torch.inference_mode()
    def forward_chunk(self, codes: torch.Tensor, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.as_tensor(codes).reshape(-1)
        if codes.dtype.is_floating_point or codes.dtype == torch.bool:
            raise ValueError(f"codes must be integers, got {codes.dtype}")
        codes = codes.to(torch.int64)
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.vocab_size):
            bad = codes[(codes < 0) | (codes >= self.vocab_size)][0]
            raise ValueError(f"code {int(bad)} is outside this vocoder's vocabulary [0, {self.vocab_size})")
        emb = torch.cat([state, self.embed(codes)])  # [context + n, dim]
        n = codes.numel()
        # Row p sees the embeddings of codes p - context .. p (a causal window).
        windows = torch.cat([emb[i : i + n] for i in range(self.context + 1)], dim=-1)
        # In float64: the CPU GEMM kernels round differently with the number of rows and
        # even the memory alignment (float32 runs were seen over 1e-6 apart), float64 keeps
        # every chunking within the stated tolerance of the whole.
        f = torch.nn.functional
        mixed = f.gelu(f.linear(windows.double(), self.mix.weight.double(), self.mix.bias.double()))
        frames = torch.tanh(f.linear(mixed, self.out.weight.double(), self.out.bias.double()))  # [n, hop]
        return frames.reshape(-1).float(), emb[emb.shape[0] - self.context :].clone()

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """All samples of ``codes`` at once (the reference the streamed chunks add up to)."""
        return self.forward_chunk(codes, self.init_state())[0]
