"""A tiny random-weight Llama model, written offline and deterministic from a seed.

Nothing can be downloaded in CI, yet the tests must run a *real* vLLM engine and
compare it against transformers. So we write a complete Hugging Face model
directory ourselves: ``config.json``, ``generation_config.json``,
``model.safetensors`` (random weights from ``torch.Generator(seed)``) and a real
byte-level BPE tokenizer trained by ``tokenizers`` on a fixed built-in corpus.

The same arguments give byte-identical files: weights come from a seeded generator
in a fixed tensor order, safetensors is written with sorted keys and fixed
metadata, and JSON is dumped with sorted keys.

Defaults keep the engine quick to start while staying realistic: grouped-query
attention (``num_kv_heads < num_heads``) and ``head_dim == 32``, the smallest
head size vLLM's CPU attention backend supports.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

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


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of the generated model. ``hidden = heads * head_dim``."""

    seed: int = 0
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 512
    intermediate: int = 256
    max_position: int = 2048
    rope_theta: float = 10000.0

    def validate(self) -> None:
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


def _config(spec: TinyLlamaSpec) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": 1e-5,
        "rope_theta": spec.rope_theta,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "initializer_range": 0.02,
        "kvbridge_tiny_spec": asdict(spec),
    }


def _weights(spec: TinyLlamaSpec) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(spec.seed)
    # Larger-than-usual std keeps logits from being flat, so greedy decoding is not
    # a sequence of near-ties that float reordering could flip.
    std = 0.15

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    kv_dim = spec.kv_heads * spec.head_dim
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(spec.vocab, spec.hidden)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = rand(spec.hidden, spec.hidden)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv_dim, spec.hidden)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv_dim, spec.hidden)
        tensors[p + "self_attn.o_proj.weight"] = rand(spec.hidden, spec.hidden)
        tensors[p + "mlp.gate_proj.weight"] = rand(spec.intermediate, spec.hidden)
        tensors[p + "mlp.up_proj.weight"] = rand(spec.intermediate, spec.hidden)
        tensors[p + "mlp.down_proj.weight"] = rand(spec.hidden, spec.intermediate)
        tensors[p + "input_layernorm.weight"] = torch.ones(spec.hidden)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(spec.hidden)
    tensors["model.norm.weight"] = torch.ones(spec.hidden)
    tensors["lm_head.weight"] = rand(spec.vocab, spec.hidden)
    return tensors


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


def make_tiny_model(path: str | Path, spec: TinyLlamaSpec | None = None, **overrides: int) -> Path:
    """Write the tiny model into ``path`` (created if missing) and return it.

    ``overrides`` are :class:`TinyLlamaSpec` fields, e.g. ``make_tiny_model(d, seed=1, layers=4)``.
    """
    spec = spec or TinyLlamaSpec()
    if overrides:
        spec = TinyLlamaSpec(**{**asdict(spec), **overrides})
    spec.validate()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    def dump(name: str, obj: dict) -> None:
        (out / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")

    dump("config.json", _config(spec))
    dump(
        "generation_config.json",
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "do_sample": False},
    )
    weights = _weights(spec)
    save_file(
        {k: weights[k] for k in sorted(weights)}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    (out / "tokenizer.json").write_text(_tokenizer_json(spec.vocab))
    dump(
        "tokenizer_config.json",
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


def ensure_tiny_model(seed: int = 0, cache_dir: str | Path | None = None) -> Path:
    """Return the default tiny model for ``seed``, building it once into the cache dir
    (:func:`build_once`)."""
    target = Path(cache_dir or default_cache_dir()) / f"tiny-llama-seed{seed}"
    return build_once(target, lambda tmp: make_tiny_model(tmp, seed=seed))
