"""Tiny random-weight causal LMs of the architectures our users run, written offline.

Nothing can be downloaded in CI, yet the tests must run *real* vLLM engines and compare
them against transformers. So we write complete Hugging Face model directories
ourselves, for each architecture in :data:`ARCHS` (Llama, Qwen2, Qwen3, Qwen3-MoE,
Gemma 2/3, Mistral, Phi-3): transformers builds the architecture from a small config
(``from_config``), every weight is drawn from ``torch.Generator(seed)`` in the
model's parameter order, and ``save_pretrained`` writes it; the tokenizer is a real byte-level
BPE trained by ``tokenizers`` on a fixed built-in corpus, the same for every
architecture.

The same arguments give byte-identical ``config.json``, ``generation_config.json``,
``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json`` under one
installed transformers (its version is written into ``config.json``).

Defaults keep the engine quick to start while staying realistic: grouped-query
attention (``num_kv_heads < num_heads``) and ``head_dim == 32``, the smallest head size
vLLM's CPU attention backend supports. The sliding-window architectures (Gemma 2/3) mix
sliding-window and full-attention layers, so vLLM keeps them in two KV cache groups.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

#: vLLM's CPU backend supports head sizes 32, 64, 80, ...; 32 keeps the model tiny.
MIN_HEAD_DIM = 32
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")

_CORPUS = """\
A cute cat sits on the mat and looks at the moon. The quick brown fox jumps over the lazy dog.
Multi-stage pipelines hand key value caches from one model to the next. A diffusion transformer
paints an image conditioned on what a language model understood. The thinker speaks to the
talker, the prefill stage feeds the decode stage, and every byte arrives exactly once.
Once upon a time there was a tiny model with random weights that could say anything at all.
0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' " @ # $ % ^ & _ | ~
"""


#: The sliding window of the tiny sliding-window architectures, in tokens: far below the
#: prompts the tests send, so the window is what their sliding layers keep.
TINY_SLIDING_WINDOW = 48


def _alternating(layers: int) -> list[str]:
    """Sliding first, full last: every sliding-window model ends on full attention."""
    return ["full_attention" if i % 2 else "sliding_attention" for i in range(layers - 1)] + [
        "full_attention"
    ]


@dataclass(frozen=True)
class Arch:
    """One architecture: its transformers ``model_type`` and what its tiny config adds."""

    model_type: str
    architecture: str
    extra: Callable[[TinyLMSpec], dict[str, Any]] = lambda spec: {}
    tie_embeddings: bool = False


def _gemma_extra(spec: TinyLMSpec, **more: Any) -> dict[str, Any]:
    return {
        "sliding_window": TINY_SLIDING_WINDOW,
        "layer_types": _alternating(spec.layers),
        "query_pre_attn_scalar": spec.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        **more,
    }


ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", "LlamaForCausalLM"),
    "qwen2": Arch("qwen2", "Qwen2ForCausalLM", lambda spec: {"use_sliding_window": False}),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM", lambda spec: {"use_sliding_window": False}),
    "qwen3_moe": Arch(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        lambda spec: {
            "use_sliding_window": False,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": spec.intermediate // 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
        },
    ),
    "gemma2": Arch(
        "gemma2",
        "Gemma2ForCausalLM",
        lambda spec: _gemma_extra(spec, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        tie_embeddings=True,
    ),
    "gemma3": Arch(
        "gemma3_text",
        "Gemma3ForCausalLM",
        lambda spec: _gemma_extra(spec, rope_local_base_freq=10000.0, final_logit_softcapping=None),
        tie_embeddings=True,
    ),
    "mistral": Arch("mistral", "MistralForCausalLM", lambda spec: {"sliding_window": None}),
    "phi3": Arch("phi3", "Phi3ForCausalLM", lambda spec: {"sliding_window": None, "pad_token_id": 3}),
}


@dataclass(frozen=True)
class TinyLMSpec:
    """Shape of the generated model. ``hidden = heads * head_dim``."""

    seed: int = 0
    arch: str = "llama"
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 512
    intermediate: int = 256
    max_position: int = 2048
    rope_theta: float = 10000.0

    def validate(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r} (known: {', '.join(ARCHS)})")
        if min(self.layers, self.hidden, self.heads, self.kv_heads, self.vocab, self.intermediate) <= 0:
            raise ValueError(f"every size must be positive: {self}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        head_dim = self.hidden // self.heads
        if head_dim < MIN_HEAD_DIM or head_dim % 16:
            raise ValueError(
                f"head_dim = hidden/heads = {head_dim}; vLLM's CPU backend needs >= {MIN_HEAD_DIM} "
                "and a multiple of 16"
            )
        if self.vocab < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab must be >= {256 + len(SPECIAL_TOKENS)} (byte alphabet + specials)")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def sliding_window(self) -> int | None:
        """The window of the sliding layers, None where every layer attends fully."""
        return ARCHS[self.arch].extra(self).get("sliding_window")


def _config(spec: TinyLMSpec) -> Any:
    from transformers import AutoConfig

    arch = ARCHS[spec.arch]
    fields = {
        "architectures": [arch.architecture],
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "tie_word_embeddings": arch.tie_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "kvbridge_tiny_spec": asdict(spec),
        **arch.extra(spec),
    }
    return AutoConfig.for_model(arch.model_type, **fields)


def _fill_weights(model: Any, seed: int) -> None:
    """Every matrix and bias from ``Generator(seed)`` in the model's parameter (definition)
    order; norm weights keep the constant transformers gives them (1, or 0 where the norm
    scales by ``1 + w``). For Llama that is the draw order of the hand-written generator this
    replaced, so the default model's weights did not change."""
    gen = torch.Generator().manual_seed(seed)
    # Larger-than-usual std keeps logits from being flat, so greedy decoding is not
    # a sequence of near-ties that float reordering could flip.
    std = 0.15
    with torch.no_grad():
        for name, param in model.named_parameters():  # definition order: fixed per architecture
            if param.dim() == 1 and "norm" in name:
                continue
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)


def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    # Prepend <s> like Llama tokenizers do, so vLLM and transformers see the same ids.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok.to_str(pretty=True)


def make_tiny_model(path: str | Path, spec: TinyLMSpec | None = None, **overrides: Any) -> Path:
    """Write the tiny model into ``path`` (created if missing) and return it.

    ``overrides`` are :class:`TinyLMSpec` fields, e.g. ``make_tiny_model(d, arch="qwen3", seed=1)``.
    """
    from transformers import AutoModelForCausalLM

    spec = spec or TinyLMSpec()
    if overrides:
        spec = TinyLMSpec(**{**asdict(spec), **overrides})
    spec.validate()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    config = _config(spec)
    # Norm constants come from transformers' init; seeding keeps anything else it draws
    # reproducible too, though _fill_weights overwrites every random tensor.
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _fill_weights(model, spec.seed)
    model.generation_config.do_sample = False
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar
    model.save_pretrained(out)

    (out / "tokenizer.json").write_text(_tokenizer_json(spec.vocab))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
                "add_bos_token": True,
                "model_max_length": spec.max_position,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
    return out


def default_cache_dir() -> Path:
    """Where commands keep models they build (``$VLLM_KVBRIDGE_CACHE`` or ~/.cache/vllm-kvbridge)."""
    import os

    root = os.environ.get("VLLM_KVBRIDGE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "vllm-kvbridge"
    )
    return Path(root)


def build_once(target: Path, make: Callable[[Path], object]) -> Path:
    """``target``, built once by ``make(directory)``: written into a temporary sibling and
    renamed into place, so a concurrent or interrupted build never leaves a half-written
    model behind (a build that lost the race to another keeps the winner's)."""
    import shutil
    import tempfile

    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        make(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_tiny_model(seed: int = 0, cache_dir: str | Path | None = None, arch: str = "llama") -> Path:
    """Return the default tiny model of ``arch`` for ``seed``, building it once into the
    cache dir (:func:`build_once`)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r} (known: {', '.join(ARCHS)})")
    target = Path(cache_dir or default_cache_dir()) / f"tiny-{arch}-seed{seed}"
    return build_once(target, lambda tmp: make_tiny_model(tmp, seed=seed, arch=arch))
