"""The diffusion runner: hosts a torch ``nn.Module`` that is conditioned on received KV.

A diffusion stage has no vLLM engine. This runner builds the module its stage config
names (``diffusion.class_path`` + ``kwargs`` + optional safetensors ``weights``),
receives each request's KV cache from the upstream LLM stage through the
:class:`~vllm_kvbridge.kv.manager.KVTransferManager` (with async prefetch of the next
queued request, so the transfer of request ``n+1`` overlaps the denoise loop of ``n``),
and runs a flow-matching Euler loop of ``num_steps`` steps:

    x_1 ~ N(0, I) (seeded per request);  x_{t - 1/n} = x_t - v(x_t, t, KV) / n;  image = decode(x_0)

Module contract (see :mod:`vllm_kvbridge.models.tiny_dit` for the reference one):
``latent_shape``, ``forward(latents, t, kv, payload)`` -> velocity, optional ``decode``.

Failure contract: a KV that does not arrive by ``kv_transfer.recv_timeout`` fails that
request with :class:`~vllm_kvbridge.errors.TransferTimeout` (never "run without KV");
a module that cannot be imported, built or loaded fails the stage at start.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vllm_kvbridge.errors import ConfigError, TransferError
from vllm_kvbridge.runner.mixin import KVBridgeModelRunnerMixin
from vllm_kvbridge.runner.settings import load_dotted

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def build_module(
    class_path: str,
    kwargs: Mapping[str, Any] | None = None,
    weights: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
) -> nn.Module:
    """Build ``class_path(**kwargs)``, load ``weights`` (safetensors, strict), move, eval()."""
    cls = load_dotted(class_path, "diffusion.class_path")
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ConfigError(f"diffusion.class_path: {class_path!r} is not a torch.nn.Module subclass")
    try:
        module = cls(**dict(kwargs or {}))
    except TypeError as exc:
        raise ConfigError(f"diffusion.kwargs: {class_path}({', '.join(kwargs or {})}) failed: {exc}") from exc
    if weights is not None:
        from safetensors.torch import load_file

        path = Path(weights).expanduser()
        if not path.is_file():
            raise ConfigError(f"diffusion.weights: no such file {str(path)!r}")
        state = load_file(str(path))
        missing, unexpected = module.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ConfigError(
                f"diffusion.weights: {path.name} does not match {class_path} "
                f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
            )
    for name in ("latent_shape",):
        if not hasattr(module, name):
            raise ConfigError(f"diffusion.class_path: {class_path} lacks {name!r} (see the runner contract)")
    return module.to(device=device, dtype=_DTYPES[dtype]).eval()


def kv_layers(kv: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A received :class:`KVCacheTransferData` -> ``[(K, V)]`` per layer ([seq, heads, dim])."""
    keys, values = list(kv.key_cache), list(kv.value_cache)
    if not keys or len(keys) != len(values) or any(k is None or v is None for k, v in zip(keys, values)):
        raise TransferError(
            f"received KV of request {kv.request_id!r} is incomplete ({len(keys)} K / {len(values)} V layers)"
        )
    return list(zip(keys, values))


@torch.inference_mode()
def denoise(
    module: nn.Module,
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    num_steps: int,
    seed: int,
    payload: Mapping[str, Any] | None = None,
    batch: int = 1,
) -> torch.Tensor:
    """Run the Euler loop and return the decoded image(s) ``[batch, C, H, W]``."""
    param = next(module.parameters(), None)
    dtype = param.dtype if param is not None else torch.float32
    device = param.device if param is not None else torch.device("cpu")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn((batch, *module.latent_shape), generator=gen, dtype=torch.float32).to(device, dtype)
    kv = [(k.to(device), v.to(device)) for k, v in kv]
    for i in range(num_steps):
        t = torch.full((batch,), 1.0 - i / num_steps, device=device, dtype=dtype)
        x = x - module(x, t, kv, payload) / num_steps
    decode = getattr(module, "decode", None)
    return (decode(x) if callable(decode) else x).float()


@dataclass
class DiffusionRequest:
    """One request as the diffusion stage sees it."""

    request_id: str
    #: The id under which the producer stored the KV (vLLM's internal request id).
    transfer_request_id: str
    from_stage: int
    sender_info: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    num_steps: int | None = None


@dataclass
class DiffusionOutput:
    request_id: str
    image: torch.Tensor  # [C, H, W] float32
    kv_bytes: int
    kv_seconds: float
    seconds: float


class DiffusionRunner(KVBridgeModelRunnerMixin):
    """Build the module, receive KV per request (prefetching the next), denoise.

    Composes the same facade as the AR runner (:class:`KVBridgeModelRunnerMixin`): the
    stage's connectors, its :class:`~vllm_kvbridge.kv.manager.KVTransferManager`, payload
    receivers and their shutdown all come from the runtime layer. Only the receive side
    is used, so none of the host hooks (paged caches) are needed.
    """

    def __init__(self, stage: Any) -> None:
        from vllm_kvbridge.config.runner_settings import runner_settings

        self.stage = stage
        d = stage.diffusion or {}
        self.num_steps = int(d.get("num_steps", 8))
        self.seed = int(d.get("seed", 0))
        self.module = build_module(
            d.get("class_path", "vllm_kvbridge.models.tiny_dit.TinyKVDiT"),
            d.get("kwargs"),
            d.get("weights"),
            d.get("dtype", "float32"),
            d.get("device", "cpu"),
        )
        self.dump_dir = Path(stage.debug_dump_dir) if stage.debug_dump_dir else None
        self.kvbridge_init(runner_settings(stage))
        self.need_kv = self.kvbridge_settings.receives_kv
        self.prefetch_enabled = bool(stage.kv_transfer.get("prefetch", True))
        # Created now, not on first request: a bad connector config fails the stage at start.
        self._kv = self.kvbridge_kv_manager if self.need_kv else None

    def kvbridge_kv_manager_kwargs(self) -> dict[str, Any]:
        # The module knows how many KV heads it consumes (the TP routing needs it).
        heads = getattr(self.module, "kv_heads", None)
        return {**super().kvbridge_kv_manager_kwargs(), "num_kv_heads": int(heads) if heads else None}

    # -- KV ------------------------------------------------------------------------------
    def prefetch(self, req: DiffusionRequest) -> None:
        """Start pulling ``req``'s KV in the background (no-op when disabled or not needed)."""
        if not (self.need_kv and self.prefetch_enabled):
            return
        self._kv.start_prefetch([(req.transfer_request_id, dict(req.sender_info))])

    def receive_kv(self, req: DiffusionRequest) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int, float]:
        """The request's per-layer KV, its bytes and the seconds spent waiting for it.

        Uses the prefetched KV when there is one, else receives within ``recv_timeout``
        (raises :class:`~vllm_kvbridge.errors.TransferTimeout` when it does not come).
        """
        t0 = time.perf_counter()
        rid = req.transfer_request_id
        self._kv.update_sender_info(req.sender_info, req.from_stage)
        self._kv.consume_and_distribute_kv_cache(rid, sender_info=dict(req.sender_info))
        rec = self._kv.pop_received(rid)
        seconds = time.perf_counter() - t0
        if rec is None:
            raise TransferError(f"no KV cache arrived for request {req.request_id!r}")
        return kv_layers(rec.data), int(rec.nbytes or rec.data.nbytes), seconds

    # -- execution -----------------------------------------------------------------------
    def execute(self, req: DiffusionRequest) -> DiffusionOutput:
        t0 = time.perf_counter()
        kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        nbytes, kv_s = 0, 0.0
        if self.need_kv:
            kv, nbytes, kv_s = self.receive_kv(req)
            if self.dump_dir is not None:
                self._dump(req, kv)
        image = denoise(
            self.module,
            kv,
            num_steps=req.num_steps or self.num_steps,
            seed=self.seed if req.seed is None else req.seed,
        )[0]
        return DiffusionOutput(req.request_id, image, nbytes, kv_s, time.perf_counter() - t0)

    def _dump(self, req: DiffusionRequest, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write the consumed KV for tests and debugging (``runtime.debug_dump_dir``)."""
        from safetensors.torch import save_file

        from vllm_kvbridge.connectors.keys import encode_request_id

        assert self.dump_dir is not None
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for i, (k, v) in enumerate(kv):
            tensors[f"layer{i}.k"] = k.detach().to("cpu", torch.float32).contiguous().clone()
            tensors[f"layer{i}.v"] = v.detach().to("cpu", torch.float32).contiguous().clone()
        name = f"stage{self.stage.stage_id}_{encode_request_id(req.request_id)}_kv.safetensors"
        save_file(tensors, str(self.dump_dir / name))

    def close(self) -> None:
        """Stop prefetches and close every connector (idempotent)."""
        self._kv = None
        self.kvbridge_shutdown()
