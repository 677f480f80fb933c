"""Cross-field validation and per-stage resolution of a :class:`PipelineSpec`.

:func:`resolve` turns the user's file into a :class:`ResolvedPipeline`: for every stage
the connector it uses on each edge and in which role, the TP sizes of both ends of each
edge, what each edge carries (KV, payload, chunked payload), the engine arguments and
the runner settings the stage's worker receives. Everything a stage process needs is in
its :class:`ResolvedStage`, which is a msgspec Struct so the orchestrator can hand it to
the stage process as JSON (no pickle).

Every error is one :class:`ConfigError` line starting with the key path.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from vllm_kvbridge.config.engine_support import EngineFeatures, check_engine_supported
from vllm_kvbridge.config.gpu_pairing import CUDA_IPC, pair_cuda_ipc_devices
from vllm_kvbridge.config.loader import load_spec
from vllm_kvbridge.config.platform import (
    CPU,
    CUDA,
    check_platform,
    cpu_thread_env,
    detect_platform,
    platform_engine_args,
    stage_platform,
)
from vllm_kvbridge.config.schema import DiffusionSpec, PipelineSpec, StageSpec, VocoderSpec
from vllm_kvbridge.config.stage_checks import LLM_KINDS, check_stage
from vllm_kvbridge.errors import ConfigError

logger = logging.getLogger(__name__)

#: Worker classes used for LLM stages that move payloads when ``worker_cls`` is not given,
#: per platform (a stage that only sends KV runs vLLM's stock worker: ``worker_cls`` None).
#: What an LLM stage's engine starts from per platform: :mod:`vllm_kvbridge.config.platform`.
DEFAULT_WORKER_CLS = {
    CPU: "vllm_kvbridge.runner.worker.KVBridgeCPUWorker",
    CUDA: "vllm_kvbridge.runner.worker.KVBridgeGPUWorker",
}
_EDGE_KEY = re.compile(r"(from|to)_stage_(\d+)")
#: An edge's connector picked by locality once the stages are placed (config/locality.py).
AUTO_CONNECTOR = "auto"


class ResolvedConnector(msgspec.Struct, frozen=True):
    """A connector instance on one side of one edge."""

    ref: str  # the name used in the file (a key of ``connectors`` or a registry name)
    name: str  # canonical registry name, or AUTO_CONNECTOR until the stages are placed
    config: dict[str, Any] = {}
    #: why this connector, where it was picked by locality (``config/locality.py``)
    reason: str = ""


class ResolvedEdge(msgspec.Struct, frozen=True):
    """One edge as one of its two ends sees it."""

    from_stage: int
    to_stage: int
    role: str  # "sender" | "receiver"
    connector: ResolvedConnector
    kv: bool
    payload_mode: str  # "none" | "full" | "async_chunk"
    from_tp: int
    to_tp: int

    @property
    def peer(self) -> int:
        return self.to_stage if self.role == "sender" else self.from_stage

    @property
    def key(self) -> str:
        return f"to_stage_{self.to_stage}" if self.role == "sender" else f"from_stage_{self.from_stage}"


class ResolvedStage(msgspec.Struct):
    """Everything one stage process needs to start."""

    stage_id: int
    kind: str
    model: str | None
    tensor_parallel_size: int
    worker_cls: str | None
    engine_args: dict[str, Any]
    env: dict[str, str]
    devices: str | None
    default_sampling_params: dict[str, Any]
    kv_transfer: dict[str, Any]
    payload: dict[str, Any]
    inputs: list[ResolvedEdge]
    outputs: list[ResolvedEdge]
    diffusion: dict[str, Any] | None
    start_timeout: float
    debug_dump_dir: str | None = None
    #: Base URL of an external OpenAI-compatible server running this stage (else None).
    url: str | None = None
    #: The custom AR runner class the kvbridge worker builds (else None).
    runner_cls: str | None = None
    #: The streaming module of a vocoder stage (``VocoderSpec`` as a dict; else None).
    vocoder: dict[str, Any] | None = None
    #: Where the Ray backend places it (``PlacementSpec`` as a dict: resources, runtime_env);
    #: with a placement per replica, ``replica_placements`` lists them (:meth:`for_replica`).
    placement: dict[str, Any] = {}
    replica_placements: list[dict[str, Any]] = []
    #: The platform its engine arguments were resolved for (``cpu`` or ``cuda``).
    platform: str = CPU
    #: A diffusion stage receiving KV: where its module's KV geometry came from (the
    #: sender's model, or the stage config's kwargs), see ``config/kv_geometry.py``.
    kv_geometry: dict[str, Any] | None = None
    #: How many independent copies of the stage run (``StageSpec.replicas``), and which one
    #: this is: the plan holds replica 0's view; :meth:`for_replica` gives each process its own.
    replicas: int = 1
    replica: int = 0

    def for_replica(self, k: int) -> ResolvedStage:
        """What replica ``k`` of this stage is started with: its index, its placement, and its
        share of ``devices`` (split evenly in order, checked by ``config/stage_checks.py``)."""
        if not 0 <= k < self.replicas:
            raise ValueError(f"stage {self.stage_id} has {self.replicas} replica(s), no replica {k}")
        devices = self.devices
        if devices is not None and self.replicas > 1:
            listed = devices.split(",")
            per = len(listed) // self.replicas
            devices = ",".join(listed[k * per : (k + 1) * per])
        placement = self.replica_placements[k] if self.replica_placements else self.placement
        return msgspec.structs.replace(self, replica=k, devices=devices, placement=placement)

    @property
    def named_replica(self) -> int | None:
        """This copy's index where the stage has several (logs and errors name it), else None."""
        return self.replica if self.replicas > 1 else None

    @property
    def is_llm(self) -> bool:
        return self.kind in LLM_KINDS

    @property
    def is_external(self) -> bool:
        return self.url is not None


class Link(msgspec.Struct, frozen=True):
    """One pair of replicas of an edge once placed, and the connector between them (an
    ``auto`` edge's: picked for where these two run, ``config/locality.py``)."""

    from_stage: int
    to_stage: int
    from_replica: int
    to_replica: int
    connector: ResolvedConnector
    route: str = ""  # "same" (one node) or "cross"


class ResolvedPipeline(msgspec.Struct):
    """The validated plan of a whole pipeline, stages in execution order."""

    name: str
    description: str
    source: str | None
    stages: list[ResolvedStage]
    request_timeout: float
    shutdown_timeout: float
    debug_dump_dir: str | None
    #: requests in flight at most (``vllm-kvbridge serve`` answers 429 beyond)
    max_in_flight: int = 256
    #: stage supervision (``runtime.*`` of the same names; see ``pipeline/supervision.py``)
    max_restarts: int = 3
    restart_window: float = 600.0
    restart_backoff: float = 1.0
    heartbeat_timeout: float = 30.0
    #: ``local`` or ``ray`` (``runtime.backend``; a ``ray_address`` selects ``ray``)
    backend: str = "local"
    ray_address: str | None = None
    #: the platform the plan was made for (a Ray stage holding a GPU is resolved for cuda)
    platform: str = CPU
    #: what ``connector: auto`` edges become within a node / across nodes
    same_node_connector: ResolvedConnector = msgspec.field(
        default_factory=lambda: ResolvedConnector("shm", "SharedMemoryConnector")
    )
    cross_node_connector: ResolvedConnector = msgspec.field(
        default_factory=lambda: ResolvedConnector("zmq", "ZmqConnector")
    )
    #: Once placed (``config/locality.py``): the copies of each stage with replicas as they
    #: are started, replica by replica (their ``auto`` edges bound per pair), and the
    #: connector of every pair of replicas on every edge.
    replica_stages: dict[int, list[ResolvedStage]] = {}
    links: list[Link] = []

    def copies(self, stage_id: int) -> list[ResolvedStage]:
        """What each replica of ``stage_id`` is started with (:meth:`ResolvedStage.for_replica`
        until the plan is placed)."""
        if stage_id in self.replica_stages:
            return self.replica_stages[stage_id]
        s = self.stage(stage_id)
        return [s.for_replica(k) for k in range(s.replicas)]

    def link(self, a: int, b: int, i: int, j: int) -> Link | None:
        """Replica ``i`` of stage ``a`` and replica ``j`` of ``b`` on their edge, once placed
        (None: not placed yet, or an edge that names its connector)."""
        pair = (a, b, i, j)
        found = [x for x in self.links if (x.from_stage, x.to_stage, x.from_replica, x.to_replica) == pair]
        return found[0] if found else None

    def stage(self, stage_id: int) -> ResolvedStage:
        for s in self.stages:
            if s.stage_id == stage_id:
                return s
        raise KeyError(stage_id)

    @property
    def entry_stage(self) -> ResolvedStage:
        return self.stages[0]

    @property
    def final_stage(self) -> ResolvedStage:
        return self.stages[-1]

    def with_model(self, model: str | None) -> ResolvedPipeline:
        """A copy where every LLM stage without an explicit model uses ``model``; the
        diffusion stages they send KV to take their KV geometry from it (ConfigError when
        it contradicts their kwargs, see :mod:`vllm_kvbridge.config.kv_geometry`)."""
        from vllm_kvbridge.config.kv_geometry import fill_kv_geometry

        stages = [msgspec.structs.replace(s, model=s.model or model) if s.is_llm else s for s in self.stages]
        return fill_kv_geometry(msgspec.structs.replace(self, stages=stages))


def _known_connector_names() -> set[str]:
    from vllm_kvbridge.connectors.registry import available_connectors

    return set(available_connectors())


def _canonical(name: str) -> str:
    from vllm_kvbridge.connectors.registry import canonical_name

    return canonical_name(name)


def _resolve_connector(ref: str, spec: PipelineSpec, path: str) -> ResolvedConnector:
    if ref == AUTO_CONNECTOR and ref not in spec.connectors:
        return ResolvedConnector(ref=ref, name=AUTO_CONNECTOR)
    known = _known_connector_names()
    if ref in spec.connectors:
        c = spec.connectors[ref]
        canonical = _canonical(c.name)
        if canonical not in known:
            raise ConfigError(
                f"connectors.{ref}.name: unknown connector type {c.name!r} "
                f"(known: {', '.join(sorted(known))})"
            )
        return ResolvedConnector(ref=ref, name=canonical, config=dict(c.extra))
    canonical = _canonical(ref)
    if canonical in known:
        return ResolvedConnector(ref=ref, name=canonical, config={})
    named = ", ".join(sorted(spec.connectors)) or "none defined"
    raise ConfigError(
        f"{path}: unknown connector {ref!r} (connectors: {named}; types: {', '.join(sorted(known))})"
    )


def _edges(spec: PipelineSpec) -> list[tuple[int, int, str | None, str]]:
    """(from, to, default connector ref, key path) per edge; a linear chain when omitted.
    An edge naming no connector is ``auto`` (picked by locality at placement)."""
    if spec.edges is None:
        ids = [s.stage_id for s in spec.stages]
        return [(a, b, AUTO_CONNECTOR, "edges") for a, b in itertools.pairwise(ids)]
    return [
        (e.from_stage, e.to_stage, e.connector or AUTO_CONNECTOR, f"edges[{i}]")
        for i, e in enumerate(spec.edges)
    ]


def _check_connector_keys(path: str, s: StageSpec, peers: list[int], *, incoming: bool) -> None:
    """Each key of stage ``s``'s ``input_connectors`` (``incoming``: ``from_stage_<id>``) or
    ``output_connectors`` (``to_stage_<id>``) must name the peer of one of its edges (``peers``)."""
    side, field = ("from", "input_connectors") if incoming else ("to", "output_connectors")
    for key in s.input_connectors if incoming else s.output_connectors:
        m = _EDGE_KEY.fullmatch(key)
        if not m or m.group(1) != side:
            raise ConfigError(f"{path}.{field}.{key}: keys are '{side}_stage_<id>'")
        if int(m.group(2)) not in peers:
            edge = f"{m.group(2)} -> {s.stage_id}" if incoming else f"{s.stage_id} -> {m.group(2)}"
            raise ConfigError(f"{path}.{field}.{key}: no edge {edge}")


def resolve_spec(
    spec: PipelineSpec, source: str | None = None, platform: str | None = None
) -> ResolvedPipeline:
    """Validate ``spec`` as a whole and compute every stage's plan for ``platform`` (``cpu``
    or ``cuda``; default: what this process sees)."""
    platform = check_platform(platform) if platform is not None else detect_platform()
    if not spec.stages:
        raise ConfigError("stages: at least one stage is required")
    index: dict[int, int] = {}
    for i, s in enumerate(spec.stages):
        check_stage(i, s)
        if s.stage_id in index:
            raise ConfigError(
                f"stages[{i}].stage_id: duplicate stage id {s.stage_id} (also stages[{index[s.stage_id]}])"
            )
        index[s.stage_id] = i
    if spec.stages[0].kind not in LLM_KINDS:
        raise ConfigError(
            f"stages[0].kind: the first stage takes the text prompt and must be an LLM "
            f"stage, got {spec.stages[0].kind!r}"
        )
    for name in spec.connectors:
        if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
            raise ConfigError(f"connectors.{name}: connector names use [A-Za-z0-9_-]")
        _resolve_connector(name, spec, f"connectors.{name}")

    edges = _edges(spec)
    seen_in: dict[int, str] = {}
    seen_out: dict[int, str] = {}
    inputs: dict[int, list[ResolvedEdge]] = {s.stage_id: [] for s in spec.stages}
    outputs: dict[int, list[ResolvedEdge]] = {s.stage_id: [] for s in spec.stages}
    for a, b, default_ref, path in edges:
        for end, sid in (("from_stage", a), ("to_stage", b)):
            if sid not in index:
                raise ConfigError(f"{path}.{end}: no stage with stage_id {sid}")
        if index[b] != index[a] + 1:
            raise ConfigError(
                f"{path}: edges must link a stage to the next one in 'stages' "
                f"(got {a} -> {b}); branching pipelines are not supported yet"
            )
        if a in seen_out:
            raise ConfigError(f"{path}: stage {a} already has an outgoing edge ({seen_out[a]})")
        if b in seen_in:
            raise ConfigError(f"{path}: stage {b} already has an incoming edge ({seen_in[b]})")
        seen_out[a], seen_in[b] = path, path
        src, dst = spec.stages[index[a]], spec.stages[index[b]]
        sp, dp = f"stages[{index[a]}]", f"stages[{index[b]}]"

        kv = src.kv_transfer.need_send_cache
        if kv != dst.kv_transfer.need_recv_cache:
            raise ConfigError(
                f"{dp}.kv_transfer.need_recv_cache: must be {str(kv).lower()} because stage {a} "
                f"{'sends' if kv else 'does not send'} KV on edge {a} -> {b}"
            )
        mode = src.payload.mode
        if dst.payload.mode != mode:
            raise ConfigError(
                f"{dp}.payload.mode: stage {a} sends {mode!r} payloads on edge {a} -> {b} "
                f"but this stage expects {dst.payload.mode!r}"
            )
        if mode != "none" and src.kind in ("diffusion", "vocoder"):
            raise ConfigError(f"{sp}.payload.mode: {src.kind} stages do not produce payloads")
        if dst.kind == "vocoder":
            key = (dst.vocoder or VocoderSpec()).input_key
            if mode == "none" or key not in src.payload.capture:
                raise ConfigError(
                    f"{dp}.vocoder.input_key: the vocoder reads stage {a}'s {key!r}, which edge "
                    f"{a} -> {b} does not carry (set {sp}.payload.mode and its capture to include {key})"
                )
        if not kv and mode == "none":
            raise ConfigError(f"{path}: edge {a} -> {b} carries nothing (no KV, payload mode 'none')")
        if dst.payload.feed == "per_step" and (mode == "none" or "hidden_states" not in src.payload.capture):
            raise ConfigError(
                f"{dp}.payload.feed: per_step conditions the model on stage {a}'s hidden states, "
                f"which edge {a} -> {b} does not carry (set {sp}.payload.capture to include hidden_states)"
            )
        tp_a, tp_b = src.tensor_parallel_size, dst.tensor_parallel_size
        if max(tp_a, tp_b) % min(tp_a, tp_b):
            raise ConfigError(
                f"{dp}.tensor_parallel_size: TP sizes of edge {a} -> {b} must divide one "
                f"another, got {tp_a} and {tp_b}"
            )

        out_key, in_key = f"to_stage_{b}", f"from_stage_{a}"
        out_ref = src.output_connectors.get(out_key, default_ref)
        in_ref = dst.input_connectors.get(in_key, default_ref)
        # One end naming a connector where the edge says auto: the other end follows it.
        if AUTO_CONNECTOR in (out_ref, in_ref) and out_ref != in_ref:
            if out_key in src.output_connectors and in_key not in dst.input_connectors:
                in_ref = out_ref
            elif in_key in dst.input_connectors and out_key not in src.output_connectors:
                out_ref = in_ref
        out_c = _resolve_connector(
            out_ref,
            spec,
            f"{sp}.output_connectors.{out_key}" if out_key in src.output_connectors else f"{path}.connector",
        )
        in_c = _resolve_connector(
            in_ref,
            spec,
            f"{dp}.input_connectors.{in_key}" if in_key in dst.input_connectors else f"{path}.connector",
        )
        if out_c.name != in_c.name:
            raise ConfigError(
                f"{dp}.input_connectors.{in_key}: receiver uses {in_c.name} but stage {a} "
                f"sends with {out_c.name}"
            )
        common = {
            "from_stage": a,
            "to_stage": b,
            "kv": kv,
            "payload_mode": mode,
            "from_tp": tp_a,
            "to_tp": tp_b,
        }
        outputs[a].append(ResolvedEdge(role="sender", connector=out_c, **common))
        inputs[b].append(ResolvedEdge(role="receiver", connector=in_c, **common))

    for i, s in enumerate(spec.stages):
        p = f"stages[{i}]"
        _check_connector_keys(p, s, [e.from_stage for e in inputs[s.stage_id]], incoming=True)
        _check_connector_keys(p, s, [e.to_stage for e in outputs[s.stage_id]], incoming=False)
        if s.url is not None and inputs[s.stage_id]:
            raise ConfigError(
                f"{p}.url: an external stage takes the text prompt; it cannot receive KV or payloads "
                f"(stage {s.stage_id} has an incoming edge)"
            )
        sends = [e.to_stage for e in outputs[s.stage_id] if e.payload_mode != "none"]
        if s.kind in LLM_KINDS:
            check_engine_supported(
                EngineFeatures.from_engine_args(s.engine_args),
                sends_kv=s.kv_transfer.need_send_cache,
                captures=bool(sends),
                where=f"{p}.engine_args",
                fed=s.payload.feed == "per_step" and bool(inputs[s.stage_id]),
            )
        if s.kind == "vocoder" and not inputs[s.stage_id]:
            raise ConfigError(
                f"{p}.kind: a vocoder stage needs an incoming payload edge (stage {s.stage_id} has none)"
            )
        if s.kv_transfer.need_send_cache and not outputs[s.stage_id]:
            raise ConfigError(f"{p}.kv_transfer.need_send_cache: stage {s.stage_id} has no outgoing edge")
        if s.kv_transfer.need_recv_cache and not inputs[s.stage_id]:
            raise ConfigError(f"{p}.kv_transfer.need_recv_cache: stage {s.stage_id} has no incoming edge")

    rt = spec.runtime
    if rt.backend == "local" and rt.ray_address is not None:
        raise ConfigError("runtime.ray_address: only with backend 'ray' (or leave backend unset)")
    backend = rt.backend or ("ray" if rt.ray_address is not None else "local")
    platforms = {
        s.stage_id: stage_platform(s.placements()[0].resources, backend, platform) for s in spec.stages
    }
    # Torch stages beside a vLLM-CPU engine on this host: config/platform.py (cpu_thread_env).
    cpu_llm = backend == "local" and any(
        s.kind in LLM_KINDS and not s.url and platforms[s.stage_id] == CPU for s in spec.stages
    )
    stages = [
        _resolve_stage(
            s,
            inputs[s.stage_id],
            outputs[s.stage_id],
            platforms[s.stage_id],
            rt.debug_dump_dir,
            cpu_llm,
        )
        for s in spec.stages
    ]
    # A stage receiving over CUDA IPC must also see its sender's GPU (config/gpu_pairing.py).
    stages = pair_cuda_ipc_devices(stages)
    for name in (
        "request_timeout",
        "shutdown_timeout",
        "max_in_flight",
        "restart_window",
        "restart_backoff",
        "heartbeat_timeout",
    ):
        if getattr(rt, name) <= 0:
            raise ConfigError(f"runtime.{name}: must be > 0, got {getattr(rt, name)}")
    if rt.max_restarts < 0:
        raise ConfigError(f"runtime.max_restarts: must be >= 0, got {rt.max_restarts}")
    placed = {}
    for key in ("same_node_connector", "cross_node_connector"):
        placed[key] = _resolve_connector(getattr(rt, key), spec, f"runtime.{key}")
        if placed[key].name == AUTO_CONNECTOR:
            raise ConfigError(f"runtime.{key}: must name a connector, not 'auto'")
    for i, s in enumerate(spec.stages):
        _check_replicas(f"stages[{i}]", s, stages[i], placed)
        if backend != "ray" and any(pl.resources or pl.runtime_env for pl in s.placements()):
            logger.info("stages[%d].placement: ignored by the local backend", i)
    return ResolvedPipeline(
        name=spec.name,
        description=spec.description,
        source=source,
        stages=stages,
        request_timeout=rt.request_timeout,
        shutdown_timeout=rt.shutdown_timeout,
        debug_dump_dir=rt.debug_dump_dir,
        max_in_flight=rt.max_in_flight,
        max_restarts=rt.max_restarts,
        restart_window=rt.restart_window,
        restart_backoff=rt.restart_backoff,
        heartbeat_timeout=rt.heartbeat_timeout,
        backend=backend,
        ray_address=rt.ray_address,
        platform=platform,
        **placed,
    ).with_model(spec.model or None)


#: Connectors whose config may fix a port one process binds (TP rank r: port + r).
_PORT_OPTIONS = ("port", "control_port")


def _check_replicas(
    path: str, s: StageSpec, stage: ResolvedStage, runtime: dict[str, ResolvedConnector]
) -> None:
    """What replicas of a stage cannot do (issue 41): share a fixed port (Ray may place them
    on one node too), or pair their GPUs with a CUDA IPC peer. An ``auto`` edge may become
    either runtime connector, so both are checked for it."""
    if s.replicas == 1:
        return
    for e in (*stage.inputs, *stage.outputs):
        ends = list(runtime.values()) if e.connector.name == AUTO_CONNECTOR else [e.connector]
        for c in ends:
            fixed = [k for k in _PORT_OPTIONS if c.config.get(k)]
            if fixed:
                raise ConfigError(
                    f"{path}.replicas: edge {e.from_stage} -> {e.to_stage} ({c.ref}) fixes "
                    f"{fixed[0]} {c.config[fixed[0]]}, which {s.replicas} replicas on one host "
                    "cannot all bind (leave it 0: each picks a free one)"
                )
            if c.name == CUDA_IPC:
                raise ConfigError(
                    f"{path}.replicas: edge {e.from_stage} -> {e.to_stage} is (or may become) CUDA IPC, "
                    "whose GPU pairing is per stage; replicas cannot use it yet"
                )


def _resolve_stage(
    s: StageSpec,
    inputs: list[ResolvedEdge],
    outputs: list[ResolvedEdge],
    platform: str,
    debug_dump_dir: str | None,
    cpu_llm_in_plan: bool = False,
) -> ResolvedStage:
    kv = msgspec.structs.asdict(s.kv_transfer)
    if s.kv_transfer.expect is not None:
        kv["expect"] = msgspec.structs.asdict(s.kv_transfer.expect)
    payload = msgspec.structs.asdict(s.payload)
    engine_args: dict[str, Any] = {}
    env = {k: str(v) for k, v in s.env.items()}
    env.update(cpu_thread_env(s.kind, platform, env, cpu_llm_in_plan))
    worker_cls = None
    if s.kind in LLM_KINDS:
        engine_args = platform_engine_args(platform, s.engine_args)
        if any(e.payload_mode != "none" for e in inputs) and s.payload.feed == "prompt_embeds":
            # The received hidden states become the prompt (vLLM's prompt-embeds input).
            engine_args["enable_prompt_embeds"] = True
        worker_cls = s.worker_cls
        captures = any(e.payload_mode != "none" for e in outputs)
        if worker_cls is None and (s.runner_cls or captures or any(e.payload_mode != "none" for e in inputs)):
            # Payload capture hooks the model runner; KV alone runs on vLLM's stock worker.
            worker_cls = DEFAULT_WORKER_CLS[platform]
    diffusion = vocoder = None
    if s.kind == "diffusion":
        diffusion = msgspec.structs.asdict(s.diffusion or DiffusionSpec())
    if s.kind == "vocoder":
        vocoder = msgspec.structs.asdict(s.vocoder or VocoderSpec())
    return ResolvedStage(
        stage_id=s.stage_id,
        kind=s.kind,
        model=s.model,
        tensor_parallel_size=s.tensor_parallel_size,
        worker_cls=worker_cls,
        engine_args=engine_args,
        env=env,
        devices=s.devices,
        default_sampling_params=dict(s.default_sampling_params),
        kv_transfer=kv,
        payload=payload,
        inputs=inputs,
        outputs=outputs,
        diffusion=diffusion,
        start_timeout=s.start_timeout,
        debug_dump_dir=debug_dump_dir,
        url=s.url.rstrip("/") if s.url else None,
        runner_cls=s.runner_cls,
        vocoder=vocoder,
        placement=msgspec.structs.asdict(s.placements()[0]),
        replica_placements=[msgspec.structs.asdict(pl) for pl in s.placement]
        if isinstance(s.placement, list)
        else [],
        platform=platform,
        replicas=s.replicas,
    )


def resolve(
    path: str | Path, env: Mapping[str, str] | None = None, platform: str | None = None
) -> ResolvedPipeline:
    """Load, validate and resolve a YAML stage config (for ``platform``, see :func:`resolve_spec`)."""
    return resolve_spec(load_spec(path, env), source=str(path), platform=platform)
