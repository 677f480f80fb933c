"""The diffusion runner: hosts a torch ``nn.Module`` that is conditioned on received KV.

A diffusion stage has no vLLM engine. This runner builds the module its stage config
names (``diffusion.class_path`` + ``kwargs`` + optional safetensors ``weights``),
receives each request's KV cache from the upstream LLM stage through the
:class:`~vllm_kvbridge.kv.manager.KVTransferManager` (with async prefetch of the queued
requests, so their transfers overlap the denoise loop of the running one), and runs a
flow-matching Euler loop of ``num_steps`` steps:

    x_1 ~ N(0, I) (seeded per request);  x_{t - 1/n} = x_t - v(x_t, t, KV) / n;  image = decode(x_0)

Module contract (see :mod:`vllm_kvbridge.models.tiny_dit` for the reference one):
``latent_shape``, ``forward(latents, t, kv, payload)`` -> velocity, optional ``decode``,
optional ``forward_batch(latents [B, ...], t [B], kvs: one KV per row, payloads)`` whose row
``r`` must equal ``forward`` of row ``r`` alone (a module without it is run row by row).

Batching (``diffusion.max_batch_size`` > 1, single-rank stages): :meth:`DiffusionRunner.execute_batch`
receives the KV of each request of a batch on its own (a failed receive fails that request
alone) and denoises the rest together, each row on its own KV, seed and guidance scale
(:func:`~vllm_kvbridge.runner.diffusion_batch.denoise_batch`; the policy of which requests
form a batch is in :mod:`vllm_kvbridge.runner.diffusion_batch`). Each request gets the
image it gets unbatched (bit-exact on CPU with the tiny DiT). A batch of one runs
:meth:`DiffusionRunner.execute`, the unbatched path, unchanged.

Classifier-free guidance: a request with ``guidance_scale != 1`` names the *purposes* of
its companion caches (``DiffusionRequest.cfg_purposes``, e.g. ``["cfg_neg"]``: the KV of the
negative / unconditional prompt, which the LLM stage computed as its own request and sent
under the primary's request id with that purpose). The hook contract with the KV manager is
:meth:`DiffusionRunner.cfg_kv_collect` (``req -> purposes``), handed to
``consume_and_distribute_kv_cache`` / ``start_prefetch`` as ``cfg_kv_collect_func``: the
manager receives the primary and every companion against **one** deadline and fails the
request naming the companion that did not come; nothing is denoised without it. Each
step then mixes ``forward(.., kv)`` and ``forward(.., companion_kv)`` with
:func:`~vllm_kvbridge.models.guidance.cfg_combine`. On a 2-rank stage
(:mod:`vllm_kvbridge.runner.diffusion_ranks`) each rank computes one branch.

Failure contract: a KV that does not arrive by ``kv_transfer.recv_timeout`` fails that
request with :class:`~vllm_kvbridge.errors.TransferTimeout` (never "run without KV");
a module that cannot be imported, built or loaded fails the stage at start.

Queue order (issue 36): a queued request's KV is prefetched while it waits (the first
``max(max_prefetch_inflight, max_batch_size)`` of the queue, :mod:`~vllm_kvbridge.runner.kv_ready`),
against one deadline, ``recv_timeout`` from that prefetch's start: a prefetch that timed
out fails its request when taken, with no second, synchronous wait. :meth:`DiffusionRunner.kv_ready`
says whether a queued request can be taken without waiting for its KV, so the stage takes
a ready request before a late one (``select_batch``'s ``ready``), and
:meth:`DiffusionRunner.on_kv_ready` wakes it when a prefetch finished.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vllm_kvbridge.errors import ConfigError, RequestCancelled, TransferError
from vllm_kvbridge.models.guidance import CFG_NEGATIVE, cfg_combine, guidance_active
from vllm_kvbridge.runner.payload_flows import StageTransport
from vllm_kvbridge.runner.settings import load_dotted
from vllm_kvbridge.wire.host_staging import pairs_to_device

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


#: The diffusion stage's default module (the tiny DiT that ships for demos and tests).
DEFAULT_DIT = "vllm_kvbridge.models.tiny_dit.TinyKVDiT"


def build_section_module(
    config: Mapping[str, Any] | None, default_class: str = DEFAULT_DIT, **contract: Any
) -> nn.Module:
    """:func:`build_module` from a stage config's section (``diffusion`` / ``vocoder``:
    ``class_path``, ``kwargs``, ``weights``, ``dtype``, ``device``); ``contract``: its
    ``section`` and ``required`` arguments."""
    c = config or {}
    return build_module(
        c.get("class_path", default_class),
        c.get("kwargs"),
        c.get("weights"),
        c.get("dtype", "float32"),
        c.get("device", "cpu"),
        **contract,
    )


def build_module(
    class_path: str,
    kwargs: Mapping[str, Any] | None = None,
    weights: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    *,
    section: str = "diffusion",
    required: tuple[str, ...] = ("latent_shape",),
) -> nn.Module:
    """Build ``class_path(**kwargs)``, load ``weights`` (safetensors, strict), move, eval().

    ``section`` names the stage config's section in errors; ``required``: the attributes
    the stage's runner contract needs of the module."""
    cls = load_dotted(class_path, f"{section}.class_path")
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ConfigError(f"{section}.class_path: {class_path!r} is not a torch.nn.Module subclass")
    try:
        module = cls(**dict(kwargs or {}))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{section}.kwargs: {class_path}({', '.join(kwargs or {})}) failed: {exc}") from exc
    if weights is not None:
        from safetensors.torch import load_file

        path = Path(weights).expanduser()
        if not path.is_file():
            raise ConfigError(f"{section}.weights: no such file {str(path)!r}")
        state = load_file(str(path))
        missing, unexpected = module.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ConfigError(
                f"{section}.weights: {path.name} does not match {class_path} "
                f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
            )
    for name in required:
        if not hasattr(module, name):
            raise ConfigError(f"{section}.class_path: {class_path} lacks {name!r} (see the runner contract)")
    return module.to(device=device, dtype=_DTYPES[dtype]).eval()


def kv_layers(kv: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A received :class:`KVCacheTransferData` -> ``[(K, V)]`` per layer ([seq, heads, dim]; a
    sliding-window layer's ``seq`` is its window, ``kv.layer_start(layer)`` its first token)."""
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
    uncond_kv: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    guidance_scale: float = 1.0,
    cfg_group: Any = None,
    cancelled: Callable[[], bool] | None = None,
) -> torch.Tensor:
    """Run the Euler loop and return the decoded image(s) ``[batch, C, H, W]``.

    ``cancelled`` is asked before every step of a single-rank run; when it says True the
    loop stops with :class:`~vllm_kvbridge.errors.RequestCancelled` (an aborted request
    frees the stage within one step, not after all of them). A CFG-parallel run ignores
    it: both ranks must leave at the same step, and the other rank cannot see the abort.

    With ``uncond_kv`` every step is guided: ``cfg_combine(v(kv), v(uncond_kv), scale)``.
    ``cfg_group`` (a 2-rank ``torch.distributed`` group) runs it CFG-parallel: rank 0 of
    the group computes the conditional branch, rank 1 the unconditional one (it passes its
    branch's KV as ``uncond_kv``; ``kv`` is then unused), one ``all_gather`` per step
    shares them, and both ranks mix them identically, so every rank holds the same
    latents as a single-rank run.
    """
    param = next(module.parameters(), None)
    dtype = param.dtype if param is not None else torch.float32
    device = param.device if param is not None else torch.device("cpu")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn((batch, *module.latent_shape), generator=gen, dtype=torch.float32).to(device, dtype)
    kv = pairs_to_device(kv, device)
    if uncond_kv is not None:
        uncond_kv = pairs_to_device(uncond_kv, device)
    rank = -1
    if cfg_group is not None:
        import torch.distributed as dist

        if uncond_kv is None or dist.get_world_size(cfg_group) != 2:
            raise ConfigError("CFG-parallel denoising needs a guided request and a 2-rank group")
        rank = dist.get_rank(cfg_group)
    for i in range(num_steps):
        if cancelled is not None and rank < 0 and cancelled():
            raise RequestCancelled(f"denoising stopped at step {i} of {num_steps}: the request was aborted")
        t = torch.full((batch,), 1.0 - i / num_steps, device=device, dtype=dtype)
        if uncond_kv is None:
            v = module(x, t, kv, payload)
        elif rank < 0:
            v = cfg_combine(module(x, t, kv, payload), module(x, t, uncond_kv, payload), guidance_scale)
        else:
            v = _cfg_parallel_step(
                module, x, t, kv if rank == 0 else uncond_kv, payload, guidance_scale, cfg_group
            )
        x = x - v / num_steps
    decode = getattr(module, "decode", None)
    return (decode(x) if callable(decode) else x).float()


def _cfg_parallel_step(
    module: nn.Module,
    x: torch.Tensor,
    t: torch.Tensor,
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    payload: Mapping[str, Any] | None,
    guidance_scale: float,
    group: Any,
) -> torch.Tensor:
    """This rank's branch, shared with the other rank. Whether each forward succeeded is
    gathered first, so a branch that raises on one rank fails the step on both (the other
    rank never waits in a collective the failed one left; the group stays in step)."""
    import torch.distributed as dist

    error: Exception | None = None
    try:
        mine = module(x, t, kv, payload).contiguous()
    except Exception as exc:
        error, mine = exc, torch.zeros_like(x)
    oks = [torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)]
    dist.all_gather(oks, torch.tensor([0 if error else 1], dtype=torch.int64), group=group)
    if error is not None:
        raise error
    if not all(int(o.item()) for o in oks):
        raise TransferError("the other rank's guidance branch failed in the model's forward (see its log)")
    both = [torch.empty_like(mine), torch.empty_like(mine)]
    dist.all_gather(both, mine, group=group)
    return cfg_combine(both[0], both[1], guidance_scale)


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
    #: None: the stage's ``diffusion.guidance_scale``.
    guidance_scale: float | None = None
    #: Purposes of the companion KV caches this request needs (CFG), e.g. ``["cfg_neg"]``.
    cfg_purposes: list[str] = field(default_factory=list)


@dataclass
class KVJob:
    """What the KV manager sees of a request: its transfer id and companion purposes.

    The manager attaches ``kv_transfer_data`` / ``cfg_kv_transfer_data`` to it.
    """

    request_id: str  # the transfer id
    cfg_purposes: list[str] = field(default_factory=list)


@dataclass
class ReceivedKVLayers:
    """One request's KV as the denoise loop consumes it."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    companions: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]
    nbytes: dict[str, int]  # purpose ("kv" for the primary) -> bytes
    seconds: float


@dataclass
class DiffusionOutput:
    request_id: str
    image: torch.Tensor  # [C, H, W] float32
    kv_bytes: int
    kv_seconds: float
    seconds: float
    #: bytes per received cache: ``"kv"`` (primary) and each companion purpose
    kv_transfers: dict[str, int] = field(default_factory=dict)
    #: requests denoised together with this one (itself included)
    batch_size: int = 1


def cfg_kv_collect(req: Any) -> list[str]:
    """The manager's CFG hook (``cfg_kv_collect_func``): the companion purposes of ``req``."""
    return list(getattr(req, "cfg_purposes", None) or [])


def check_cfg_request(guidance_scale: float, purposes: Sequence[str]) -> None:
    """A guided request needs exactly the negative companion, an unguided one none."""
    if guidance_active(guidance_scale) and list(purposes) != [CFG_NEGATIVE]:
        raise ConfigError(
            f"guidance_scale {guidance_scale} needs the {CFG_NEGATIVE!r} companion KV, "
            f"the request names {list(purposes)}"
        )
    if not guidance_active(guidance_scale) and purposes:
        raise ConfigError(f"companion KV {list(purposes)} sent for a request without guidance")


class DiffusionRunner:
    """Build the module, receive KV per request (prefetching the next), denoise.

    Holds the same composed object as the AR runners' facade (:attr:`transport`, a
    :class:`~vllm_kvbridge.runner.payload_flows.StageTransport`): the stage's connectors,
    its :class:`~vllm_kvbridge.kv.manager.KVTransferManager` and their shutdown. Only the
    receive side is used, so none of the facade's host hooks (paged caches) are needed.
    """

    def __init__(self, stage: Any, *, cfg_group: Any = None) -> None:
        """``cfg_group``: the stage's 2-rank gloo group when ``diffusion.num_ranks`` is 2
        (this runner is rank 0, the LEADER; see :mod:`vllm_kvbridge.runner.diffusion_ranks`)."""
        from vllm_kvbridge.config.runner_settings import runner_settings

        self.stage = stage
        d = stage.diffusion or {}
        self.num_steps = int(d.get("num_steps", 8))
        self.seed = int(d.get("seed", 0))
        self.guidance_scale = float(d.get("guidance_scale", 1.0))
        self.num_ranks = int(d.get("num_ranks", 1))
        self.max_batch_size = int(d.get("max_batch_size", 1))
        self.cfg_group: Any = cfg_group
        self.module = build_section_module(d)
        self.dump_dir = Path(stage.debug_dump_dir) if stage.debug_dump_dir else None
        settings = runner_settings(stage)
        if settings.get("kv_transfer", {}).get("need_recv_cache"):
            # The handshake (kv/compat.py): the KV must have the heads and head dim the module
            # attends with, unless the config says otherwise.
            expect = dict(settings["kv_transfer"].get("expect_kv") or {})
            for field_name, attr in (("num_kv_heads", "kv_heads"), ("head_dim", "kv_head_dim")):
                if getattr(self.module, attr, None) is not None:
                    expect.setdefault(field_name, int(getattr(self.module, attr)))
            settings["kv_transfer"]["expect_kv"] = expect or None
        # The module knows how many KV heads it consumes (the TP routing needs it).
        heads = getattr(self.module, "kv_heads", None)
        kv_options: dict[str, Any] = {"num_kv_heads": int(heads) if heads else None}
        if self.cfg_group is not None:
            kv_options["process_group"] = self.cfg_group  # LEADER of distribution: leader
        #: the stage's connectors and KV manager (runner/payload_flows.py)
        self.transport = StageTransport.create(settings, kv_manager_options=kv_options)
        self.need_kv = self.transport.runtime.settings.receives_kv
        self.prefetch_enabled = bool(stage.kv_transfer.get("prefetch", True))
        # Created now, not on first request: a bad connector config fails the stage at start.
        self._kv = self.transport.runtime.kv_manager if self.need_kv else None
        self._ready: Any = None  # KVReadiness of the queue, when its KV is prefetched
        if self._kv is not None and self.prefetch_enabled:
            from vllm_kvbridge.runner.kv_ready import KVReadiness

            window = max(self._kv.config.max_prefetch_inflight, self.max_batch_size)
            self._ready = KVReadiness(self._start_prefetch, self._kv.prefetcher, window)

    # -- KV ------------------------------------------------------------------------------
    def kv_job(self, req: DiffusionRequest) -> KVJob:
        return KVJob(req.transfer_request_id, list(req.cfg_purposes))

    def hold_kv(self, req: DiffusionRequest) -> None:
        """``req`` joined this stage's queue: keep its KV at the sender past the TTL while it
        waits (the manager renews every announced key until :meth:`release_kv`), and
        prefetch it if it is among the first queued (:meth:`kv_ready`)."""
        if self._kv is not None and req.from_stage >= 0:
            self._kv.hold_leases(req.transfer_request_id, req.sender_info)
            if self._ready is not None:
                self._ready.hold(req.transfer_request_id, req)

    def release_kv(self, req: DiffusionRequest) -> None:
        """``req`` left the queue (it is received now, or dropped): stop renewing its KV; the
        next queued request's prefetch may start."""
        if self._kv is not None:
            self._kv.release_leases(req.transfer_request_id)
            if self._ready is not None:
                self._ready.leave(req.transfer_request_id)

    def kv_ready(self, req: DiffusionRequest) -> bool:
        """Whether taking ``req`` now waits for nothing: its KV arrived (prefetched), or its
        prefetch failed (it fails at once), or it gets no prefetch (received when taken).
        A queued request whose KV is still on its way is not ready: the stage takes ready
        ones first (``select_batch``'s ``ready``), and this one fails by its own deadline."""
        if self._ready is None or req.from_stage < 0:
            return True
        return self._ready.ready(req.transfer_request_id)

    def on_kv_ready(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (from a prefetch thread) when a queued request's prefetch
        finished: a worker that found nothing ready waits for it."""
        if self._ready is not None:
            self._ready.listen(callback)

    def withdraw_lost_kv(self, req: DiffusionRequest) -> bool:
        """``req``'s producer process was lost: True when its KV died with it unread (the
        edge's connector serves unread KV from the sender's process, see
        ``Connector.data_outlives_sender``) and its receive, prefetch and leases are now
        withdrawn, so ``req`` cannot be served. False when it was read already, or when the
        connector keeps unread KV after its sender is gone (it can still be read)."""
        if self._kv is None or req.from_stage < 0:
            return False
        if getattr(self._kv.connector, "data_outlives_sender", True):
            return False
        return self._kv.withdraw_receive(req.transfer_request_id)

    def forget_kv(self, req: DiffusionRequest) -> None:
        """``req`` left the stage (done, failed, dropped): forget its read/withdrawn mark."""
        if self._kv is not None:
            self._kv.forget_receive(req.transfer_request_id)

    def prefetch(self, req: DiffusionRequest) -> None:
        """Start pulling ``req``'s KV (and companions) in the background (no-op when disabled)."""
        if self.need_kv and self.prefetch_enabled:
            self._start_prefetch(req)

    def _start_prefetch(self, req: DiffusionRequest) -> bool:
        """Start ``req``'s prefetch; whether it started (not: in flight already, or skipped)."""
        started = self._kv.start_prefetch(
            [(self.kv_job(req), dict(req.sender_info))], cfg_kv_collect_func=cfg_kv_collect
        )
        return bool(started)

    def receive_kv(self, req: DiffusionRequest, *, denoise: bool = False) -> ReceivedKVLayers:
        """The request's per-layer KV and companions, bytes per cache, seconds waited.

        Uses the prefetched KV when there is one, else receives within ``recv_timeout``
        (raises :class:`~vllm_kvbridge.errors.TransferTimeout` naming the missing cache). A
        prefetch that timed out raises its timeout: the request's deadline is over, it is
        not waited for again.
        On a 2-rank stage the leader first tells rank 1 about the request (``denoise``:
        whether it will take part in the denoise loop), then distributes the KV to it.
        """
        t0 = time.perf_counter()
        job = self.kv_job(req)
        if self.cfg_group is not None:
            from vllm_kvbridge.runner.diffusion_ranks import Control, send_control

            scale = self.guidance_scale if req.guidance_scale is None else float(req.guidance_scale)
            ctl = Control(
                "run",
                job.request_id,
                list(job.cfg_purposes),
                denoise,
                self.seed if req.seed is None else req.seed,
                req.num_steps or self.num_steps,
                scale,
            )
            send_control(ctl, self.cfg_group)
        self._kv.update_sender_info(req.sender_info, req.from_stage)
        self._kv.consume_and_distribute_kv_cache(job, cfg_kv_collect, sender_info=dict(req.sender_info))
        rec = self._kv.pop_received(job.request_id)
        seconds = time.perf_counter() - t0
        if rec is None:
            raise TransferError(f"no KV cache arrived for request {req.request_id!r}")
        missing = [p for p in job.cfg_purposes if p not in rec.companions]
        if missing:
            raise TransferError(f"request {req.request_id!r}: CFG companion KV {missing} did not arrive")
        return ReceivedKVLayers(
            kv_layers(rec.data),
            {p: kv_layers(d) for p, d in rec.companions.items()},
            {"kv": int(rec.data.nbytes), **{p: int(d.nbytes) for p, d in rec.companions.items()}},
            seconds,
        )

    # -- execution -----------------------------------------------------------------------
    def steps_of(self, req: DiffusionRequest) -> int:
        """The number of denoise steps ``req`` runs (its own, else the stage's)."""
        return req.num_steps or self.num_steps

    def _scale_of(self, req: DiffusionRequest) -> float:
        return self.guidance_scale if req.guidance_scale is None else float(req.guidance_scale)

    def _take_kv(self, req: DiffusionRequest) -> ReceivedKVLayers:
        """Check ``req``'s guidance, receive (and dump) its KV and companions."""
        check_cfg_request(self._scale_of(req), req.cfg_purposes)
        got = ReceivedKVLayers([], {}, {}, 0.0)
        if self.need_kv:
            got = self.receive_kv(req, denoise=True)
            if self.dump_dir is not None:
                self._dump(req, got.kv)
                for purpose, layers in got.companions.items():
                    self._dump(req, layers, purpose)
        elif req.cfg_purposes:
            raise ConfigError("a guided request needs a stage that receives KV")
        return got

    def execute(self, req: DiffusionRequest, cancelled: Callable[[], bool] | None = None) -> DiffusionOutput:
        """Receive ``req``'s KV and denoise; ``cancelled`` as for :func:`denoise`."""
        t0 = time.perf_counter()
        got = self._take_kv(req)
        uncond = got.companions.get(CFG_NEGATIVE)
        image = denoise(
            self.module,
            got.kv,
            num_steps=self.steps_of(req),
            seed=self.seed if req.seed is None else req.seed,
            uncond_kv=uncond,
            guidance_scale=self._scale_of(req),
            cfg_group=self.cfg_group if uncond is not None else None,
            cancelled=cancelled,
        )[0]
        return DiffusionOutput(
            req.request_id,
            image,
            sum(got.nbytes.values()),
            got.seconds,
            time.perf_counter() - t0,
            dict(got.nbytes),
        )

    def execute_batch(
        self,
        reqs: Sequence[DiffusionRequest],
        cancelled: Sequence[Callable[[], bool] | None] | None = None,
    ) -> list[DiffusionOutput | Exception]:
        """Receive the KV of each of ``reqs`` (one ``num_steps``) and denoise them together.

        Per request, in order: its :class:`DiffusionOutput`, or the exception that ended it
        (a failed receive or guidance check: that request alone; :class:`RequestCancelled`
        when ``cancelled[i]`` said so before a step; a forward that raised: every request
        that got that far). One request runs :meth:`execute` (the unbatched path, also the
        only one of a 2-rank stage).
        """
        from vllm_kvbridge.runner.diffusion_batch import BatchRow, denoise_batch

        cancels = list(cancelled) if cancelled is not None else [None] * len(reqs)
        if len(reqs) == 1:
            try:
                return [self.execute(reqs[0], cancels[0])]
            except Exception as exc:
                return [exc]
        if self.cfg_group is not None:
            raise ConfigError("a 2-rank (CFG-parallel) diffusion stage denoises one request at a time")
        steps = {self.steps_of(r) for r in reqs}
        if len(steps) > 1:
            raise ConfigError(f"one batch runs one number of steps, got {sorted(steps)}")
        t0 = time.perf_counter()
        out: list[DiffusionOutput | Exception | None] = [None] * len(reqs)
        rows, got_of = [], {}
        for i, (req, cancel) in enumerate(zip(reqs, cancels)):
            try:
                got = self._take_kv(req)
            except Exception as exc:
                out[i] = exc
                continue
            got_of[i] = got
            rows.append(
                BatchRow(
                    req.request_id,
                    got.kv,
                    self.seed if req.seed is None else req.seed,
                    got.companions.get(CFG_NEGATIVE),
                    self._scale_of(req),
                    cancelled=cancel,
                )
            )
        idx = list(got_of)
        if rows:
            try:
                images: list[Any] = denoise_batch(self.module, rows, num_steps=steps.pop())
            except Exception as exc:
                images = [exc] * len(rows)
            for i, image in zip(idx, images):
                got = got_of[i]
                out[i] = (
                    image
                    if isinstance(image, Exception)
                    else DiffusionOutput(
                        reqs[i].request_id,
                        image,
                        sum(got.nbytes.values()),
                        got.seconds,
                        time.perf_counter() - t0,
                        dict(got.nbytes),
                        len(rows),
                    )
                )
        return out  # type: ignore[return-value]

    def _dump(
        self, req: DiffusionRequest, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], purpose: str = "kv"
    ) -> None:
        """Write the consumed KV for tests and debugging (``runtime.debug_dump_dir``):
        ``stage<N>_<request>_kv.safetensors``, companions ``..._<purpose>.safetensors``."""
        from safetensors.torch import save_file

        from vllm_kvbridge.connectors.keys import encode_request_id

        assert self.dump_dir is not None
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for i, (k, v) in enumerate(kv):
            tensors[f"layer{i}.k"] = k.detach().to("cpu", torch.float32).contiguous().clone()
            tensors[f"layer{i}.v"] = v.detach().to("cpu", torch.float32).contiguous().clone()
        name = f"stage{self.stage.stage_id}_{encode_request_id(req.request_id)}_{purpose}.safetensors"
        save_file(tensors, str(self.dump_dir / name))

    def close(self) -> None:
        """Stop prefetches and close every connector (idempotent)."""
        self._kv = None
        self.transport.shutdown()
