"""The stage-config schema: what a YAML pipeline file may contain.

Every Struct forbids unknown fields, so a typo (``need_send_cahce``) is an error that
names the key path instead of a silently ignored setting. Values are checked for type by
msgspec and for meaning by :mod:`vllm_kvbridge.config.resolve`.

A pipeline file looks like::

    name: ar_to_dit_shm
    connectors:                       # named transports, referenced by edges and stages
      shm: {name: SharedMemoryConnector, extra: {}}
    stages:
      - stage_id: 0
        kind: llm_ar
        engine_args: {max_model_len: 512}
        kv_transfer: {need_send_cache: true, trigger: on_finish}
      - stage_id: 1
        kind: diffusion
        kv_transfer: {need_recv_cache: true, recv_timeout: 30}
        diffusion: {class_path: vllm_kvbridge.models.tiny_dit.TinyKVDiT}
    edges:
      - {from_stage: 0, to_stage: 1, connector: shm}

Stages may override the edge's connector for their own role with
``output_connectors: {to_stage_1: name}`` (sender side) and
``input_connectors: {from_stage_0: name}`` (receiver side).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

StageKind = Literal["llm_ar", "diffusion", "llm_generation", "vocoder"]
Trigger = Literal["on_finish", "prefill_finished", "special_token"]
PayloadMode = Literal["none", "full", "async_chunk"]


class _Spec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=False):
    """Base of every config Struct: unknown keys are rejected."""


class ConnectorSpec(_Spec):
    """A named transport. ``name`` is a registry name or alias (``shm``, ``zmq``, ``mooncake``)."""

    name: str
    extra: dict[str, Any] = {}


class KVExpectSpec(_Spec):
    """What a receiving stage requires of the KV it gets (any subset); checked against the
    sender's declaration before the KV is used (``vllm_kvbridge.kv.compat``)."""

    model: str | None = None
    dtype: str | None = None
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None


class KVTransferSpec(_Spec):
    """When a stage sends or receives KV caches.

    ``trigger`` (sender): ``on_finish`` sends when the request finishes;
    ``prefill_finished`` sends once the prompt's KV is complete (with
    ``stop_after_transfer`` the request then ends); ``special_token`` sends when the
    sampled token equals ``trigger_token_id``. ``send_timeout`` (sender) is how long a
    finished request's KV may wait for room on a full edge (held in the engine's blocks
    while ``max_send_queue_bytes`` of gathered KV wait for their puts, then for each put)
    before its request fails. ``staging_bytes`` (sender): the host staging pool (pinned on
    GPU) gathered KV waits in for its puts; 0: gather straight into the connector on the
    model thread; unset: 1/8 of host memory (at most 8 GiB, shared by the TP ranks) on GPU, 0 on CPU; when the
    pool is full, finished requests' KV stays in the engine's blocks. ``recv_timeout`` (receiver) is the
    deadline in seconds for a KV cache to arrive; ``prefetch`` lets the receiver start
    pulling the next queued request's KV while the current one runs; ``expect`` (receiver)
    is what the KV must be (``model``, ``dtype``, ``num_layers``, ``num_kv_heads``,
    ``head_dim``), checked against the sender's declaration before it is used.
    """

    need_send_cache: bool = False
    need_recv_cache: bool = False
    trigger: Trigger = "on_finish"
    trigger_token_id: int | None = None
    stop_after_transfer: bool = False
    recv_timeout: float = 30.0
    send_timeout: float = 60.0
    max_send_queue_bytes: int = 1 << 30
    staging_bytes: int | None = None
    prefetch: bool = True
    expect: KVExpectSpec | None = None


class PayloadSpec(_Spec):
    """Stage payloads (hidden states, token ids, ...) sent to or received from a neighbour.

    ``mode``: ``none``, ``full`` (one payload per request, sent on finish) or
    ``async_chunk`` (ordered chunks of ``chunk_size`` tokens while generating). A sender
    and its receiver must use the same mode. ``capture`` lists what the producer puts in
    the payload. ``custom_process_next_stage_input_func`` is a dotted path to a function
    that turns a producer's outputs into the next stage's inputs. ``send_timeout`` (sender):
    how long one put waits for room on a full edge before its request fails.

    ``feed`` (a receiving LLM stage): ``prompt_embeds`` waits for the whole payload and
    makes its hidden states the request's prompt embeddings; ``per_step`` starts the request
    at once and conditions each position on the producer's row for it as the stream arrives
    (the model needs the hook of ``vllm_kvbridge.runner.conditioning``, e.g. the built-in
    ``kvbridge://tiny-talker``), so the two stages overlap.
    """

    mode: PayloadMode = "none"
    chunk_size: int = 16
    stall_timeout: float = 30.0
    recv_timeout: float = 30.0
    send_timeout: float = 60.0
    capture: list[Literal["hidden_states", "token_ids"]] = msgspec.field(
        default_factory=lambda: ["hidden_states", "token_ids"]
    )
    custom_process_next_stage_input_func: str | None = None
    feed: Literal["prompt_embeds", "per_step"] = "prompt_embeds"


class DiffusionSpec(_Spec):
    """The torch ``nn.Module`` a diffusion stage hosts.

    ``class_path`` is ``package.module.Class`` (or ``package.module:Class``), built as
    ``Class(**kwargs)``; ``weights`` is an optional safetensors file loaded strictly.

    ``guidance_scale`` (classifier-free guidance; 1 = off) and ``negative_prompt`` are the
    defaults of every request (the image API overrides them per request): with guidance on,
    the LLM stage also runs ``negative_prompt`` as its own request and sends its KV as the
    ``cfg_neg`` companion. ``num_ranks: 2`` runs the stage on two ranks, CFG-parallel (gloo;
    rank 0 receives the KV and distributes it to rank 1).

    ``max_batch_size`` (default 1: one request at a time) lets the stage denoise up to that
    many queued requests of the same ``num_steps`` together, each on its own KV, seed and
    guidance; batches form only at step 0, from the queue head, when the stage becomes free
    (see :mod:`vllm_kvbridge.runner.diffusion_batch`). Single-rank stages only.
    """

    class_path: str = "vllm_kvbridge.models.tiny_dit.TinyKVDiT"
    kwargs: dict[str, Any] = {}
    weights: str | None = None
    num_steps: int = 8
    seed: int = 0
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    device: str = "cpu"
    guidance_scale: float = 1.0
    negative_prompt: str = ""
    num_ranks: int = 1
    max_batch_size: int = 1


class VocoderSpec(_Spec):
    """The streaming torch ``nn.Module`` a vocoder stage hosts (``kind: vocoder``).

    A vocoder stage is a last stage fed by an async-chunk (or full) payload edge: each
    chunk's ``input_key`` rows (the producer's captured ``token_ids``: a talker's codes, or
    its ``hidden_states``) are turned into waveform samples as the chunk arrives, so audio
    streams out while the producer still generates. ``class_path`` / ``kwargs`` /
    ``weights`` as for diffusion; the module contract (``sample_rate``, ``hop_length``,
    ``init_state``, ``forward_chunk``) is in :mod:`vllm_kvbridge.models.tiny_vocoder`, the
    built-in reference.
    """

    class_path: str = "vllm_kvbridge.models.tiny_vocoder.TinyVocoder"
    kwargs: dict[str, Any] = {}
    weights: str | None = None
    input_key: Literal["token_ids", "hidden_states"] = "token_ids"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    device: str = "cpu"


class PlacementSpec(_Spec):
    """Where the Ray backend places a stage (ignored by the local backend).

    ``resources`` are Ray resources the stage's actor holds while the stage runs: ``GPU``
    and ``CPU`` counts, and custom node resources such as ``{node_a: 1}`` that pin it to
    the nodes started with them. ``runtime_env`` is passed to Ray as the actor's
    ``runtime_env`` (``env_vars``, ``working_dir``, ...).
    """

    resources: dict[str, float] = {}
    runtime_env: dict[str, Any] = {}


class StageSpec(_Spec):
    """One stage: an engine in its own process (or group of TP ranks).

    ``url`` (LLM stages only) makes the stage an *external* OpenAI-compatible server, e.g.
    a stock ``vllm serve`` started with the kvbridge worker (``vllm-kvbridge serve
    --stage-config FILE --print-vllm-serve STAGE_ID`` prints its command line): the
    orchestrator sends requests to ``{url}/v1/completions`` instead of starting an engine.
    ``model`` is then the served model name (default: the first one ``/v1/models`` lists).
    """

    stage_id: int
    kind: StageKind
    model: str | None = None
    worker_cls: str | None = None
    #: A custom model runner (``pkg.mod.Class``, a subclass of kvbridge's AR runner for the
    #: runner class in use) that the kvbridge worker builds; see runner/ar_runner.py.
    runner_cls: str | None = None
    engine_args: dict[str, Any] = {}
    tensor_parallel_size: int = 1
    devices: str | None = None
    env: dict[str, str | int | float | bool] = {}
    default_sampling_params: dict[str, Any] = {}
    input_connectors: dict[str, str] = {}
    output_connectors: dict[str, str] = {}
    kv_transfer: KVTransferSpec = msgspec.field(default_factory=KVTransferSpec)
    payload: PayloadSpec = msgspec.field(default_factory=PayloadSpec)
    diffusion: DiffusionSpec | None = None
    vocoder: VocoderSpec | None = None
    start_timeout: float = 300.0
    url: str | None = None
    #: Where the Ray backend places the stage: one placement for every replica, or a list
    #: of one per replica (in order: replica k gets the k-th); see ``pipeline/ray_backend.py``.
    placement: PlacementSpec | list[PlacementSpec] = msgspec.field(default_factory=PlacementSpec)
    #: Independent copies of the stage, each its own process (engine, TP group; through Ray
    #: its own actor, on the node its placement picks); the orchestrator routes each request
    #: to one of them (``pipeline/replicas.py``). With ``devices``, the list is split evenly
    #: among them in order (``"0,1"`` for 2: one GPU each).
    replicas: int = 1

    def placements(self) -> list[PlacementSpec]:
        """Each replica's placement (the one ``placement`` repeated, or its list)."""
        if isinstance(self.placement, list):
            return list(self.placement)
        return [self.placement] * self.replicas


class EdgeSpec(_Spec):
    """A directed link between two stages and the connector both roles use by default.

    ``connector: auto`` (also what an edge naming none gets) picks by locality once the
    stages are placed: ``runtime.same_node_connector`` when both ends run on one node (one
    Ray node id, one /dev/shm), ``runtime.cross_node_connector`` otherwise.
    """

    from_stage: int
    to_stage: int
    connector: str | None = None


class RuntimeSpec(_Spec):
    """Orchestrator settings."""

    request_timeout: float = 300.0
    shutdown_timeout: float = 10.0
    debug_dump_dir: str | None = None
    #: requests in flight at most; ``serve`` answers 429 (with Retry-After) beyond
    max_in_flight: int = 256
    #: restarts of one stage allowed within ``restart_window`` seconds (0: a lost stage
    #: ends the pipeline); see ``pipeline/supervision.py``
    max_restarts: int = 3
    restart_window: float = 600.0
    #: seconds before the first restart of a lost stage, doubled for each further one
    restart_backoff: float = 1.0
    #: a ready stage silent (no heartbeat) this long is stalled: killed and restarted
    heartbeat_timeout: float = 30.0
    #: where stages run: ``local`` (processes on this host) or ``ray`` (one Ray actor per
    #: stage, placed by ``stages[].placement``; see ``pipeline/ray_backend.py``)
    backend: Literal["local", "ray"] | None = None
    #: the Ray cluster (``auto``, ``HOST:PORT`` or ``ray://...``); setting it selects ``ray``
    ray_address: str | None = None
    #: what ``connector: auto`` edges use within one node, and across nodes (connector
    #: names: a key of ``connectors`` or a registry name)
    same_node_connector: str = "shm"
    cross_node_connector: str = "zmq"


class PipelineSpec(_Spec):
    """A whole pipeline file."""

    stages: list[StageSpec]
    name: str = "pipeline"
    description: str = ""
    model: str | None = None
    connectors: dict[str, ConnectorSpec] = {}
    edges: list[EdgeSpec] | None = None
    runtime: RuntimeSpec = msgspec.field(default_factory=RuntimeSpec)
