"""The real CPU backend: gather a request's KV out of a live vLLM engine and compare with transformers."""

from __future__ import annotations

import os

import kv_fixtures  # noqa: F401  (worker extension + pytest-forked fix)
import pytest
import torch

from vllm_kvbridge.config.cpu_kv_cache import cpu_kv_cache_bytes


@pytest.mark.engine
@pytest.mark.long(300, "a vLLM engine start")
@pytest.mark.forked
def test_gather_from_real_engine_matches_transformers(tiny_model_dir) -> None:
    tests_dir = os.path.dirname(__file__)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = [(7 * i + 3) % 500 + 4 for i in range(200)]  # crosses a 128-token block boundary
    llm = LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        worker_extension_cls="kv_fixtures.KVProbeExtension",
        seed=0,
        kv_cache_memory_bytes=cpu_kv_cache_bytes(str(tiny_model_dir), {"max_model_len": 512}),
    )
    try:
        info = llm.collective_rpc("kvb_layout")[0]
        # vLLM 0.32 CPU: one tensor per layer [num_blocks, kv_heads, block_size, 2*head_size]
        assert info["backend"] == "CPU_ATTN" and info["content"] == "cpu_vec" and info["order"] == "LBHNC"
        assert info["shape"][1:] == [info["heads"], info["block_size"], 2 * info["head_size"]]
        llm.collective_rpc("kvb_record_block_ids")
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=1, temperature=0))
        recorded = llm.collective_rpc("kvb_recorded_block_ids")[0]
        assert len(recorded) == 1
        block_ids = next(iter(recorded.values()))
        keys, values = llm.collective_rpc("kvb_gather_blocks", args=(block_ids, len(prompt)))[0]
    finally:
        del llm
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
    cache = out.past_key_values
    for layer in range(info["num_layers"]):
        if hasattr(cache, "layers"):
            ref_k, ref_v = cache.layers[layer].keys, cache.layers[layer].values
        else:
            ref_k, ref_v = cache[layer]
        ref_k = ref_k[0].transpose(0, 1)  # [seq, heads, dim]
        ref_v = ref_v[0].transpose(0, 1)
        got_k = torch.tensor(keys[layer]).view(ref_k.shape)
        got_v = torch.tensor(values[layer]).view(ref_v.shape)
        assert (got_k - ref_k).abs().max().item() <= 1e-4, layer
        assert (got_v - ref_v).abs().max().item() <= 1e-4, layer
