"""Classifier-free guidance (CFG): the one formula every denoise path uses.

A guided velocity mixes a conditional branch (the model conditioned on the prompt's KV)
with an unconditional / negative branch (conditioned on the companion prompt's KV):

    v = v_uncond + guidance_scale * (v_cond - v_uncond)

``guidance_scale == 1`` is exactly ``v_cond`` (no guidance, the unconditional branch is
not computed at all); larger scales push away from the companion. The single-rank loop,
the CFG-parallel loop of a 2-rank diffusion stage and :class:`~vllm_kvbridge.models.tiny_dit.TinyKVDiT`
all call :func:`cfg_combine`, so they compute the same floats in the same order.
"""

from __future__ import annotations

import torch

#: Purpose (transfer-key field) of the unconditional / negative-prompt companion KV.
CFG_NEGATIVE = "cfg_neg"


def guidance_active(guidance_scale: float) -> bool:
    """Whether a request with this scale needs the unconditional branch (and its KV)."""
    return float(guidance_scale) != 1.0


def cfg_combine(v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """``v_uncond + guidance_scale * (v_cond - v_uncond)``."""
    return v_uncond + float(guidance_scale) * (v_cond - v_uncond)
