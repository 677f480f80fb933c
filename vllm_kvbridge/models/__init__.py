"""Small models that ship with the package so pipelines run offline (tiny Llama, tiny DiT, tiny talker)."""

from __future__ import annotations

#: The vLLM architectures this package adds, and where their classes live (lazy: vLLM imports
#: the module only when a model of that architecture is built or inspected).
VLLM_MODELS = {
    "KVBridgeTinyTalkerForCausalLM": "vllm_kvbridge.models.tiny_talker:TinyTalkerForCausalLM",
}


def register_vllm_models() -> None:
    """Register the package's models with vLLM's ``ModelRegistry`` (idempotent).

    The ``vllm.general_plugins`` entry point ``kvbridge_models`` (pyproject.toml) calls this in
    every vLLM process (front end, engine core, workers). With ``VLLM_PLUGINS`` set, vLLM
    loads only the plugins it names: include ``kvbridge_models`` there.
    """
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for arch, cls in VLLM_MODELS.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, cls)
