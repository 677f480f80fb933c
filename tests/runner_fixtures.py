"""Helpers for the runner tests: engines with the kvbridge worker, HF references, shm checks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

VOCAB_LOW, VOCAB_HIGH = 5, 500


def prompt_ids(n: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of exactly ``n`` token ids (no special tokens)."""
    span = VOCAB_HIGH - VOCAB_LOW
    return [VOCAB_LOW + (i * 37 + salt * 101 + 11) % span for i in range(n)]


def shm_namespace(tag: str) -> str:
    return f"rt{tag}{os.getpid()}"


def shm_entries(namespace: str) -> list[str]:
    """Names in /dev/shm that belong to ``namespace`` (the connector puts it in every name)."""
    return sorted(n for n in os.listdir("/dev/shm") if namespace in n)


def start_engine(model_dir: Path, settings: dict[str, Any], **extra: Any) -> Any:
    """A vLLM engine on the tiny model with the kvbridge CPU worker and ``settings``."""
    from vllm import LLM

    from vllm_kvbridge.runner.worker import engine_kwargs

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    kwargs = {"dtype": "float32", "enforce_eager": True, "max_model_len": 512, "seed": 0, "block_size": 32}
    kwargs.update(extra)
    return LLM(model=str(model_dir), **kwargs, **engine_kwargs(settings, platform="cpu"))


def stop_engine(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()


class HFReference:
    """transformers' view of the same model: past_key_values and final hidden states."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def kv(self, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) as ``[seq, kv_heads, head_dim]`` (keys post-RoPE)."""
        pkv = self.model(torch.tensor([ids]), use_cache=True).past_key_values
        out = []
        for layer in pkv.layers:
            out.append(
                (layer.keys[0].permute(1, 0, 2).contiguous(), layer.values[0].permute(1, 0, 2).contiguous())
            )
        return out

    @torch.no_grad()
    def hidden(self, ids: list[int]) -> torch.Tensor:
        """Final-norm hidden states ``[seq, hidden]`` (what feeds lm_head)."""
        out = self.model(torch.tensor([ids]), output_hidden_states=True)
        return out.hidden_states[-1][0]


def assert_kv_equal(data: Any, ref: list[tuple[torch.Tensor, torch.Tensor]], tol: float = 1e-4) -> None:
    assert data.seq_len == ref[0][0].shape[0], (data.seq_len, ref[0][0].shape)
    assert len(data.key_cache) == len(ref)
    for layer, (k, v) in enumerate(ref):
        got_k, got_v = data.key_cache[layer], data.value_cache[layer]
        assert got_k.shape == k.shape, (layer, got_k.shape, k.shape)
        assert got_v.shape == v.shape, (layer, got_v.shape, v.shape)
        dk = (got_k.float() - k).abs().max().item()
        dv = (got_v.float() - v).abs().max().item()
        assert dk <= tol and dv <= tol, f"layer {layer}: max |dK| {dk}, max |dV| {dv}"


def kv_receiver(namespace: str, timeout: float = 30.0) -> Any:
    """A receiving-stage KV manager (stage 1) on the shm edge 0 -> 1 of ``namespace``."""
    from vllm_kvbridge.kv.config import KVTransferConfig
    from vllm_kvbridge.kv.manager import KVTransferManager

    cfg = KVTransferConfig.from_dict(
        {
            "need_recv_cache": True,
            "from_stage": 0,
            "stage_id": 1,
            "recv_timeout": timeout,
            "connector": "SharedMemoryConnector",
            "connector_config": {"namespace": namespace},
        }
    )
    return KVTransferManager(cfg, num_kv_heads=2)
