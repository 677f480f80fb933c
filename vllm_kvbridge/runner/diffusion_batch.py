"""Denoising several requests together (``diffusion.max_batch_size``), and which ones.

Batching policy (the diffusion stage engine forms batches with :func:`select_batch`):

* requests join a batch only at step 0: a batch runs all its steps with the rows it
  started with (minus those aborted on the way); a request arriving while a batch
  denoises waits for the next one;
* a batch is formed when the worker becomes free, from the first queued request whose KV
  is ready (``ready``: it arrived, or its receive is over; :meth:`DiffusionRunner.kv_ready
  <vllm_kvbridge.runner.diffusion_runner.DiffusionRunner.kv_ready>`), then the ready
  requests after it in arrival order that have its ``num_steps``, up to ``max_batch_size``.
  Others (another step count, or KV still on its way) stay queued in arrival order for a
  later batch: a request whose KV is late never holds up one whose KV is there, and fails
  by its own deadline (issue 36). The worker never waits for a batch to fill (no latency
  is added to a lone request);
* each request's KV (and CFG companion) is received on its own, prefetched while the
  previous batch denoises, and conditions only its own row;
* each row starts from its own request's noise, drawn exactly as the unbatched loop draws
  it (``randn((1, *latent_shape), generator=seeded(seed))``), and rows are concatenated;
* a guided request adds an unconditional row on its companion KV to the same forward; its
  velocity is ``cfg_combine(cond_row, uncond_row, its own guidance_scale)``;
* a request whose KV receive fails fails alone (the others run); a request aborted while
  the batch denoises is asked before every step (``cancelled``) and its row(s) leave the
  batch at the next step, the rest continue. A forward that raises fails every request of
  the batch: the error cannot be attributed to one row.

Exactness: each request's image equals its unbatched :func:`~vllm_kvbridge.runner.diffusion_runner.denoise`
as far as the module's ``forward_batch`` keeps rows apart; the shipped
:class:`~vllm_kvbridge.models.tiny_dit.TinyKVDiT` is bit-exact on CPU (max abs difference
0.0, asserted by the tests). A module without ``forward_batch`` runs row by row through its
``forward``, which is exact by construction (the same calls as unbatched); a batch then
saves nothing but the per-request loop overhead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from vllm_kvbridge.errors import RequestCancelled
from vllm_kvbridge.models.guidance import cfg_combine
from vllm_kvbridge.wire.host_staging import pairs_to_device

KVLayers = Sequence[tuple[torch.Tensor, torch.Tensor]]
T = TypeVar("T")


@dataclass
class BatchRow:
    """One request of a batch, as the denoise loop sees it."""

    request_id: str
    kv: KVLayers
    seed: int
    #: the companion (negative prompt) KV of a guided request, else None
    uncond_kv: KVLayers | None = None
    guidance_scale: float = 1.0
    payload: Mapping[str, Any] | None = None
    #: asked before every step; True: the row leaves the batch (RequestCancelled)
    cancelled: Callable[[], bool] | None = None


def select_batch(
    queue: Sequence[T],
    max_size: int,
    steps_of: Callable[[T], int],
    skip: Callable[[T], bool] = lambda _: False,
    ready: Callable[[T], bool] = lambda _: True,
) -> tuple[list[int], list[int]]:
    """Indices into ``queue`` of the next batch, and of the entries to drop on the way.

    The batch is the first entry ``skip`` does not reject that is ``ready`` and, in arrival
    order, the later ready ones with its step count, up to ``max_size``; entries not ready
    stay (an empty batch: none is ready, the caller waits). ``skip`` (aborted / lost
    requests) marks entries that are never batched: those the scan passes are returned
    second, so the caller drops them now instead of leaving them ahead of the next batch.
    """
    batch: list[int] = []
    skipped: list[int] = []
    steps = None
    for i, item in enumerate(queue):
        if len(batch) >= max_size:
            break
        if skip(item):
            skipped.append(i)
        elif not ready(item):
            continue  # its KV is on its way: the ones behind it go first
        elif steps is None or steps_of(item) == steps:
            steps = steps_of(item) if steps is None else steps
            batch.append(i)
    return batch, skipped


def batch_forward_of(module: nn.Module) -> Callable[..., torch.Tensor] | None:
    """The module's ``forward_batch``, or None when it must be run row by row.

    None also when a subclass overrides ``forward`` below the class that defines
    ``forward_batch`` (e.g. a wrapper of :class:`~vllm_kvbridge.models.tiny_dit.TinyKVDiT`
    that adds behaviour to ``forward``): batching through the inherited ``forward_batch``
    would bypass that override.
    """
    if not callable(getattr(module, "forward_batch", None)):
        return None
    mro = type(module).__mro__
    owner_batch = next((c for c in mro if "forward_batch" in vars(c)), None)
    owner_fwd = next((c for c in mro if "forward" in vars(c)), nn.Module)
    if owner_batch is None or not issubclass(owner_batch, owner_fwd):
        return None
    return module.forward_batch


def forward_rows(
    module: nn.Module,
    x: torch.Tensor,
    t: torch.Tensor,
    kvs: Sequence[KVLayers],
    payloads: Sequence[Mapping[str, Any] | None],
) -> torch.Tensor:
    """Velocity ``[B, C, H, W]`` with row ``r`` conditioned on ``kvs[r]``: one batched
    call when the module supports it, else ``forward`` per row."""
    batched = batch_forward_of(module)
    if batched is not None:
        return batched(x, t, kvs, payloads)
    return torch.cat([module(x[r : r + 1], t[r : r + 1], kvs[r], payloads[r]) for r in range(x.shape[0])])


@torch.inference_mode()
def denoise_batch(
    module: nn.Module, rows: Sequence[BatchRow], *, num_steps: int
) -> list[torch.Tensor | RequestCancelled]:
    """Run the Euler loop of :func:`~vllm_kvbridge.runner.diffusion_runner.denoise` for every
    row at once; per row its decoded image ``[C, H, W]`` (float32) or the
    :class:`RequestCancelled` that made it leave. A forward that raises propagates (it fails
    the whole batch)."""
    param = next(module.parameters(), None)
    dtype = param.dtype if param is not None else torch.float32
    device = param.device if param is not None else torch.device("cpu")
    out: list[torch.Tensor | RequestCancelled | None] = [None] * len(rows)
    noise = [
        torch.randn(
            (1, *module.latent_shape),
            generator=torch.Generator(device="cpu").manual_seed(row.seed),
            dtype=torch.float32,
        )
        for row in rows
    ]
    x = torch.cat(noise).to(device, dtype) if rows else None
    kvs = [pairs_to_device(row.kv, device) for row in rows]
    uncond = [None if row.uncond_kv is None else pairs_to_device(row.uncond_kv, device) for row in rows]
    alive = list(range(len(rows)))  # rows[alive[j]] is row j of x
    for i in range(num_steps):
        keep = [j for j, r in enumerate(alive) if not _cancelled(rows[r])]
        if len(keep) < len(alive):
            for j in set(range(len(alive))) - set(keep):
                out[alive[j]] = RequestCancelled(
                    f"denoising stopped at step {i} of {num_steps}: the request was aborted"
                )
            alive = [alive[j] for j in keep]
            if not alive:
                break
            x = x[keep]
        assert x is not None
        guided = [j for j, r in enumerate(alive) if uncond[r] is not None]
        n = len(alive)
        # The unconditional rows of the guided requests ride in the same forward.
        xs = torch.cat([x, x[guided]]) if guided else x
        t = torch.full((xs.shape[0],), 1.0 - i / num_steps, device=device, dtype=dtype)
        v_all = forward_rows(
            module,
            xs,
            t,
            [kvs[r] for r in alive] + [uncond[alive[j]] for j in guided],
            [rows[r].payload for r in alive] + [rows[alive[j]].payload for j in guided],
        )
        v = v_all[:n]
        if guided:
            mixed = [
                cfg_combine(v[j : j + 1], v_all[n + g : n + g + 1], rows[alive[j]].guidance_scale)
                for g, j in enumerate(guided)
            ]
            v = v.clone()
            v[guided] = torch.cat(mixed)
        x = x - v / num_steps
    if alive and x is not None:
        decode = getattr(module, "decode", None)
        images = (decode(x) if callable(decode) else x).float()
        for j, r in enumerate(alive):
            out[r] = images[j]
    return out  # type: ignore[return-value]


def _cancelled(row: BatchRow) -> bool:
    return row.cancelled is not None and bool(row.cancelled())
