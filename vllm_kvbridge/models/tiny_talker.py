"""A tiny *talker* model: a Llama whose every position is conditioned on a row of floats.

In a thinker -> talker pipeline the thinker (the tiny Llama of
:mod:`vllm_kvbridge.models.tiny_lm`) streams its per-position final hidden states
(``[n, 128]`` float32 rows) to the talker. The talker adds a projection of position
``p``'s row to the embedding of its token ``p``::

    inputs_embeds[p] = embed_tokens(token_p) + cond_proj(condition_row_p)

and runs a standard Llama decoder on that. This module ships the vLLM model
(architecture ``KVBridgeTinyTalkerForCausalLM``, class :class:`TinyTalkerForCausalLM`, a
subclass of vLLM's ``LlamaForCausalLM``), the checkpoint writer
(:func:`make_tiny_talker`, :func:`ensure_tiny_talker`) and a plain transformers
reference (:func:`reference_greedy`).

The hook contract (what the kvbridge runner relies on)
------------------------------------------------------

* ``model.kvbridge_conditioning_dim: int``: the width of the conditioning rows (the talker
  config's ``kvbridge_conditioning_dim``; default 128, the thinker's hidden size). A class
  attribute (the default) and an instance attribute (the configured width).
* Before every forward the runner calls ``model.kvbridge_set_conditioning(rows)`` with
  ``rows`` of shape ``[num_scheduled_tokens, kvbridge_conditioning_dim]``, any floating
  dtype (it is cast to the model dtype), on the model's device: one row per scheduled
  token, in the order of the step's flattened ``input_ids`` (vLLM's token order). Rows of
  requests without conditioning, and of positions past the end of the producer's stream,
  are zeros (the runner writes them). Fewer rows than tokens is allowed: the missing ones
  are zeros.
* The rows are copied into ``model.kvbridge_conditioning.rows``, a buffer of shape
  ``[scheduler_config.max_num_batched_tokens, dim]`` allocated once at init; the rest of
  the buffer's previously used prefix is zeroed. ``forward`` reads
  ``rows[:num_tokens]`` where ``num_tokens`` is the forward's token count (which may be
  padded beyond ``num_scheduled_tokens``, e.g. to a CUDA-graph size: those rows are
  zeros), and **zeroes that prefix after use**. So a step whose runner did not call
  ``kvbridge_set_conditioning`` (a plain vLLM run without kvbridge, or a step the runner
  skipped) sees zeros, and a stale row never leaks into a later step. Nothing may read
  the rows back after the forward.
* Why a fixed buffer: under CUDA graphs (vLLM's FULL mode wraps the whole model forward,
  and the breakable PIECEWISE wrapper does too) the captured kernels read the addresses
  they saw at capture time; replay does not re-run this Python code. So the rows must be
  *copied into* a tensor whose address never changes, never passed as a fresh tensor.
  For the same reason the sum ``embed + cond_proj(rows)`` is written into a second fixed
  buffer (``[max_num_batched_tokens, hidden]``) before it is handed to the inner
  ``LlamaModel`` as ``inputs_embeds`` (the piecewise-compiled graph's input, like the
  runner's own ``inputs_embeds`` buffer for multimodal models).
* ``cond_proj`` is a bias-free ``ReplicatedLinear(dim, hidden)``: under tensor
  parallelism every rank holds the full weight, because the rows arrive full-width on
  every rank and ``VocabParallelEmbedding``'s output is already all-reduced to the full
  hidden size, so the sum needs no communication (the weight is dim x hidden, tiny). The
  vLLM layer (not ``nn.Linear``) gets vLLM's weight loader and CPU GEMM dispatch; with
  ``quant_config=None`` it is never quantized. Under pipeline parallelism only the first
  rank (the one with the embedding) conditions.
* Prefix caching: the KV of a position depends on its conditioning row, not only on its
  token, so a talker stage must run with prefix caching off (``enable_prefix_caching=
  False``), or two requests with equal tokens but different rows would share blocks.

Registration: :func:`vllm_kvbridge.models.register_vllm_models` (the package's
``vllm.general_plugins`` entry point ``kvbridge_models``, so every vLLM process registers
it; a ``VLLM_PLUGINS`` list must then name ``kvbridge_models``).

The vLLM class is built on first access (a module ``__getattr__``), so writing a
checkpoint or running the reference does not import vLLM's model code (about 15 s);
``vllm_kvbridge.models.tiny_talker:TinyTalkerForCausalLM`` resolves as usual.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from vllm_kvbridge.models.tiny_lm import TinyLMSpec, build_once, default_cache_dir, make_tiny_model

ARCHITECTURE = "KVBridgeTinyTalkerForCausalLM"
MODEL_CLASS = "vllm_kvbridge.models.tiny_talker:TinyTalkerForCausalLM"
#: The thinker's hidden size (the tiny Llama's default): the default conditioning width.
DEFAULT_CONDITIONING_DIM = TinyLMSpec().hidden
#: The talker of seed ``s`` takes its Llama weights from tiny-Llama seed ``s + BASE_SEED_OFFSET``
#: (so the talker is never the thinker of the same seed) and its ``cond_proj`` from a
#: generator seeded ``s + COND_SEED_OFFSET``.
BASE_SEED_OFFSET = 1_000_000
COND_SEED_OFFSET = 2_000_000
#: ``cond_proj`` weight std: rows of RMS ~1 (the thinker's final RMSNorm output) project to
#: std ~0.23, of the order of the embeddings' 0.15, so the conditioning clearly matters.
COND_STD = 0.02
#: Bumped when the checkpoint's content changes for the same arguments (rewrites the cache).
FORMAT_VERSION = 1


class ConditioningBuffer(nn.Module):
    """The persistent per-token conditioning rows of a talker (plain torch; see the module doc).

    ``rows`` (``[max_tokens, dim]``, a non-persistent buffer: not in the state dict) keeps
    its address for the model's lifetime. :meth:`write` is called between steps (eager
    Python); :meth:`take` and :meth:`clear` run inside the forward and use only tensor
    ops on a slice of static size, so they are safe to capture in a CUDA graph.
    """

    def __init__(self, max_tokens: int, dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if max_tokens <= 0 or dim <= 0:
            raise ValueError(f"max_tokens ({max_tokens}) and dim ({dim}) must be positive")
        self.max_tokens = int(max_tokens)
        self.dim = int(dim)
        self.register_buffer("rows", torch.zeros(self.max_tokens, self.dim, dtype=dtype), persistent=False)
        #: rows ``[extent:]`` are zero (bookkeeping of :meth:`write`; the forward's clear
        #: only makes more of them zero).
        self.extent = 0

    def write(self, rows: torch.Tensor) -> None:
        """Copy ``rows`` (``[n, dim]``, any float dtype) into ``rows[:n]`` and zero the tail of
        the previously written prefix, so exactly ``rows[:n]`` may be non-zero."""
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[1] != self.dim:
            got = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise ValueError(f"conditioning rows must be [num_tokens, {self.dim}], got {got}")
        if not rows.is_floating_point():
            raise TypeError(f"conditioning rows must be a float tensor, got {rows.dtype}")
        n = rows.shape[0]
        if n > self.max_tokens:
            raise ValueError(f"{n} conditioning rows exceed max_num_batched_tokens ({self.max_tokens})")
        # inference_mode: the buffer may be an inference tensor (created under vLLM's
        # inference mode), which may only be updated in place inside inference mode.
        with torch.inference_mode():
            if n:
                self.rows[:n].copy_(rows)
            if self.extent > n:
                self.rows[n : self.extent].zero_()
        self.extent = n

    def take(self, num_tokens: int) -> torch.Tensor:
        """The rows of a forward of ``num_tokens`` tokens (a view; zeros past the written rows)."""
        if num_tokens > self.max_tokens:
            raise ValueError(
                f"forward of {num_tokens} tokens exceeds max_num_batched_tokens ({self.max_tokens})"
            )
        return self.rows[:num_tokens]

    def clear(self, num_tokens: int) -> None:
        """Zero the rows a forward consumed (so a step without :meth:`write` sees zeros)."""
        self.rows[:num_tokens].zero_()


# --------------------------------------------------------------------------------------
# The vLLM model (built lazily: importing this module does not import vLLM)
# --------------------------------------------------------------------------------------

_class_lock = threading.Lock()


def _define_model_class() -> type:
    from vllm.config import VllmConfig
    from vllm.distributed import get_pp_group
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.utils import maybe_prefix
    from vllm.sequence import IntermediateTensors

    class TinyTalkerForCausalLM(LlamaForCausalLM):
        """``LlamaForCausalLM`` + ``cond_proj``: see the module docstring for the hook contract."""

        kvbridge_conditioning_dim: int = DEFAULT_CONDITIONING_DIM

        def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **kwargs: Any) -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
            config = vllm_config.model_config.hf_config
            dim = int(getattr(config, "kvbridge_conditioning_dim", None) or DEFAULT_CONDITIONING_DIM)
            self.kvbridge_conditioning_dim = dim
            dtype = vllm_config.model_config.dtype
            max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
            self.cond_proj = ReplicatedLinear(
                dim,
                config.hidden_size,
                bias=False,
                params_dtype=dtype,
                quant_config=None,
                prefix=maybe_prefix(prefix, "cond_proj"),
                return_bias=False,
            )
            # Created under vLLM's device context: both live on the model's device.
            self.kvbridge_conditioning = ConditioningBuffer(max_tokens, dim, dtype=dtype)
            self.register_buffer(
                "kvbridge_inputs_embeds",
                torch.zeros(max_tokens, config.hidden_size, dtype=dtype),
                persistent=False,
            )

        def kvbridge_set_conditioning(self, rows: torch.Tensor) -> None:
            """The next forward's conditioning: ``rows[i]`` belongs to the step's token ``i``."""
            self.kvbridge_conditioning.write(rows)

        def forward(
            self,
            input_ids: torch.Tensor | None,
            positions: torch.Tensor,
            intermediate_tensors: IntermediateTensors | None = None,
            inputs_embeds: torch.Tensor | None = None,
            **kwargs: Any,
        ) -> torch.Tensor | IntermediateTensors:
            # ``kwargs``: LlamaForCausalLM.forward takes none; the text runner passes none.
            if get_pp_group().is_first_rank:
                if inputs_embeds is None:
                    inputs_embeds = self.embed_input_ids(input_ids)
                num_tokens = inputs_embeds.shape[0]
                cond = self.cond_proj(self.kvbridge_conditioning.take(num_tokens))
                out = self.kvbridge_inputs_embeds[:num_tokens]
                torch.add(inputs_embeds, cond.to(out.dtype), out=out)
                self.kvbridge_conditioning.clear(num_tokens)
                inputs_embeds = out
            return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            """``cond_proj.weight`` here, everything else through Llama's loader."""
            own = dict(self.cond_proj.named_parameters(prefix="cond_proj"))
            loaded: set[str] = set()

            def llama_weights() -> Iterable[tuple[str, torch.Tensor]]:
                for name, tensor in weights:
                    if name.startswith("cond_proj."):
                        if name not in own:
                            raise ValueError(f"unexpected talker weight {name!r} (have {sorted(own)})")
                        param = own[name]
                        getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                        loaded.add(name)
                    else:
                        yield name, tensor

            loaded |= super().load_weights(llama_weights())
            return loaded

    TinyTalkerForCausalLM.__module__ = __name__
    TinyTalkerForCausalLM.__qualname__ = "TinyTalkerForCausalLM"
    return TinyTalkerForCausalLM


def __getattr__(name: str) -> Any:
    if name == "TinyTalkerForCausalLM":
        with _class_lock:
            cls = globals().get(name)
            if cls is None:
                cls = _define_model_class()
                globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------
# The checkpoint
# --------------------------------------------------------------------------------------


def talker_spec(seed: int = 0, conditioning_dim: int = DEFAULT_CONDITIONING_DIM, **overrides: int) -> dict:
    """Everything the talker checkpoint is made from (its cache key and its config entry)."""
    if conditioning_dim <= 0:
        raise ValueError(f"conditioning_dim must be positive, got {conditioning_dim}")
    base = TinyLMSpec(**{**asdict(TinyLMSpec()), **overrides, "seed": seed + BASE_SEED_OFFSET})
    base.validate()
    return {
        "version": FORMAT_VERSION,
        "seed": seed,
        "conditioning_dim": conditioning_dim,
        "cond_seed": seed + COND_SEED_OFFSET,
        "cond_std": COND_STD,
        "llama": asdict(base),
    }


def make_tiny_talker(
    path: str | Path, seed: int = 0, conditioning_dim: int = DEFAULT_CONDITIONING_DIM, **overrides: int
) -> Path:
    """Write the tiny talker into ``path`` (created if missing) and return it.

    A tiny Llama (``make_tiny_model``: same tokenizer as the thinker, weights of seed
    ``seed + BASE_SEED_OFFSET``) whose ``config.json`` names ``KVBridgeTinyTalkerForCausalLM``
    and carries ``kvbridge_conditioning_dim`` (``model_type`` stays ``llama`` so
    transformers and vLLM parse it), plus a seeded ``cond_proj.weight``
    (``[hidden, conditioning_dim]``) in ``model.safetensors``. ``overrides`` are
    :class:`~vllm_kvbridge.models.tiny_lm.TinyLMSpec` fields other than ``seed``.
    The same arguments give byte-identical files.
    """
    if "seed" in overrides:
        raise TypeError("pass the talker's seed as seed=")
    spec = talker_spec(seed, conditioning_dim, **overrides)
    base = TinyLMSpec(**spec["llama"])
    out = make_tiny_model(path, base)

    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = [ARCHITECTURE]
    config["kvbridge_conditioning_dim"] = conditioning_dim
    config["kvbridge_tiny_talker_spec"] = spec
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    weights_path = out / "model.safetensors"
    weights = load_file(str(weights_path))
    gen = torch.Generator().manual_seed(spec["cond_seed"])
    weights["cond_proj.weight"] = (
        torch.randn(base.hidden, conditioning_dim, generator=gen, dtype=torch.float32) * COND_STD
    )
    save_file({k: weights[k] for k in sorted(weights)}, str(weights_path), metadata={"format": "pt"})
    return out


def ensure_tiny_talker(
    seed: int = 0, cache_dir: str | Path | None = None, conditioning_dim: int = DEFAULT_CONDITIONING_DIM
) -> Path:
    """Return the tiny talker for ``seed``, building it once into the cache dir.

    The directory name carries a digest of :func:`talker_spec`, so a changed spec (or
    :data:`FORMAT_VERSION`) builds a new one. Written into a temporary sibling and
    renamed into place, like ``ensure_tiny_model``.
    """
    spec = talker_spec(seed, conditioning_dim)
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    target = Path(cache_dir or default_cache_dir()) / f"tiny-talker-seed{seed}-{digest}"
    return build_once(target, lambda tmp: make_tiny_talker(tmp, seed=seed, conditioning_dim=conditioning_dim))


# --------------------------------------------------------------------------------------
# The reference
# --------------------------------------------------------------------------------------


def reference_greedy(
    model_dir: str | Path, rows: torch.Tensor, prompt_token_ids: list[int], max_tokens: int
) -> list[int]:
    """transformers' greedy decode of the talker: ``max_tokens`` new token ids (EOS ignored).

    Position ``p`` (prompt and generated tokens alike) gets
    ``embed(token_p) + cond_proj(rows[p] if p < len(rows) else 0)``; float32 throughout,
    the whole sequence recomputed each step (the model is tiny). Needs ``transformers``
    (the ``test`` extra).
    """
    from safetensors import safe_open
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    model_dir = Path(model_dir)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # cond_proj.weight is an "unexpected" key to transformers
    try:
        model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        cond_w = f.get_tensor("cond_proj.weight").to(torch.float32)
    dim = cond_w.shape[1]
    rows = torch.as_tensor(rows).to(torch.float32)
    if rows.dim() != 2 or rows.shape[1] != dim:
        raise ValueError(f"rows must be [R, {dim}], got {tuple(rows.shape)}")

    ids = list(prompt_token_ids)
    out: list[int] = []
    embed = model.get_input_embeddings()
    with torch.no_grad():
        for _ in range(max_tokens):
            n = len(ids)
            cond = torch.zeros(n, dim)
            r = min(n, rows.shape[0])
            cond[:r] = rows[:r]
            x = embed(torch.tensor([ids])) + torch.nn.functional.linear(cond, cond_w)[None]
            logits = model(inputs_embeds=x).logits[0, -1]
            token = int(torch.argmax(logits).item())
            ids.append(token)
            out.append(token)
    return out


__all__ = [
    "ARCHITECTURE",
    "DEFAULT_CONDITIONING_DIM",
    "MODEL_CLASS",
    "ConditioningBuffer",
    "ensure_tiny_talker",
    "make_tiny_talker",
    "reference_greedy",
    "talker_spec",
]
