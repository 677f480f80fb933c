"""Helpers for the runner tests: engines with the kvbridge worker, HF references, shm checks."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vllm_kvbridge.config.cpu_kv_cache import with_cpu_kv_cache

VOCAB_LOW, VOCAB_HIGH = 5, 500


def prompt_ids(n: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of exactly ``n`` token ids (no special tokens)."""
    span = VOCAB_HIGH - VOCAB_LOW
    return [VOCAB_LOW + (i * 37 + salt * 101 + 11) % span for i in range(n)]


def kv_params(rid: str, max_tokens: int, **opts: Any) -> Any:
    """Greedy ``SamplingParams`` whose transfers are named ``rid`` (``opts``: the per-request
    kvbridge options, e.g. ``trigger``, ``send_kv``)."""
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        extra_args={"kvbridge": {"request_id": rid, **opts}},
    )


def tokens_prompt(ids: list[int]) -> Any:
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=ids)


def shm_namespace(tag: str) -> str:
    return f"rt{tag}{os.getpid()}"


def shm_entries(namespace: str) -> list[str]:
    """Names in /dev/shm that belong to ``namespace`` (the connector puts it in every name)."""
    return sorted(n for n in os.listdir("/dev/shm") if namespace in n)


def kv_sender_settings(namespace: str) -> dict[str, Any]:
    """Runner settings of a stage 0 that sends KV to stage 1 over shared memory in ``namespace``."""
    return {
        "stage_id": 0,
        "kv_transfer": {
            "need_send_cache": True,
            "to_stage": 1,
            "connector": "SharedMemoryConnector",
            "connector_config": {"namespace": namespace},
        },
    }


def start_engine(
    model_dir: Path,
    settings: dict[str, Any],
    *,
    worker_cls: str | None = None,
    in_process: bool = False,
    **extra: Any,
) -> Any:
    """A vLLM engine on the tiny model set up by ``engine_kwargs(settings)`` (vLLM's stock worker
    for a stage that only sends KV, the kvbridge CPU worker - or ``worker_cls`` - for a payload
    stage).

    ``in_process``: the engine core and its worker run in this process (vLLM's
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the uniprocess executor): the same scheduler, worker,
    model runner and connector, without the two processes that each import vLLM again (an
    engine starts in ~2 s instead of ~30 s here). For tests of what the engine computes (the
    fidelity matrix), not of its processes; stop it with :func:`stop_in_process_engine`."""
    from vllm import LLM

    from vllm_kvbridge.runner.worker import engine_kwargs

    kwargs = {"dtype": "float32", "enforce_eager": True, "max_model_len": 512, "seed": 0, "block_size": 32}
    kwargs.update(extra)
    kwargs = with_cpu_kv_cache(str(model_dir), kwargs, int(kwargs.get("tensor_parallel_size", 1)))
    stage = engine_kwargs(settings, platform="cpu", worker_cls=worker_cls)
    if not in_process:
        return LLM(model=str(model_dir), **kwargs, **stage)
    import torch
    import vllm.envs

    # vLLM's CPU worker, here in this process, changes it for good: it replaces
    # torch.set_num_threads with a no-op (after its thread binding) and sets torch's thread
    # count. Put both back after the start, or every later test of this xdist worker runs
    # with them, and a forked test's child keeps the parent's thread pool (torch then hangs
    # in its first parallel region: conftest._fork_safe_torch could not take it to one).
    saved_env = {k: os.environ.get(k) for k in (IN_PROCESS_ENV, THREADS_BIND_ENV)}
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    os.environ[IN_PROCESS_ENV] = "0"
    os.environ[THREADS_BIND_ENV] = "nobind"  # as stage processes run (never pin this process)
    try:
        return LLM(model=str(model_dir), **kwargs, **stage)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        # vLLM's engine core caches its environment when it starts (enable_envs_cache): in
        # this process, that would keep every later engine in it in-process too.
        vllm.envs.disable_envs_cache()


IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def stop_in_process_engine(llm: Any, settings: dict[str, Any]) -> list[str]:
    """Stop an engine of :func:`start_engine`'s ``in_process``; the names of its stage's edges
    that the stop left (reaped as the next kvbridge process on them would: none expected)."""
    from vllm_kvbridge.runner.stage_runtime import reap_stage_leftovers

    llm.llm_engine.engine_core.shutdown()
    return reap_stage_leftovers(settings)


#: A payload stage's worker that starts in the order vLLM's GPU worker does (below).
GPU_START_ORDER_WORKER = "runner_fixtures.GPUStartOrderCPUWorker"


@functools.cache
def _gpu_start_order_worker() -> type:
    from vllm_kvbridge.runner.worker import KVBridgeCPUWorker

    class GPUStartOrderCPUWorker(KVBridgeCPUWorker):
        """The kvbridge CPU worker, started in the order of vLLM's GPU worker with CUDA graphs on.

        ``GPUWorker.determine_available_memory`` (vllm/v1/worker/gpu_worker.py) calls the
        runner's ``profile_cudagraph_memory()``, which builds a minimal KV cache through
        ``initialize_kv_cache(..., is_profiling=True)`` *before* ``initialize_from_config``
        creates the KV connector, and tears it down again. vLLM's own method runs here (the CPU
        runner inherits it from ``GPUModelRunner``): eager mode captures no graph, so it
        builds the minimal cache, cleans it up and returns 0, the same calls our runner sees
        on a GPU."""

        def determine_available_memory(self) -> int:
            compilation = self.model_runner.compilation_config
            # Eager mode leaves the capture size unset; with CUDA graphs on it is a number
            # (vLLM's default caps it at 512), which the minimal cache's size reads.
            saved, compilation.max_cudagraph_capture_size = compilation.max_cudagraph_capture_size, 512
            try:
                self.model_runner.profile_cudagraph_memory()
            finally:
                compilation.max_cudagraph_capture_size = saved
            return super().determine_available_memory()

    GPUStartOrderCPUWorker.__module__ = __name__
    GPUStartOrderCPUWorker.__qualname__ = "GPUStartOrderCPUWorker"
    return GPUStartOrderCPUWorker


def __getattr__(name: str) -> Any:
    # Built on first use: importing vLLM's worker classes costs seconds that most test
    # modules importing these fixtures do not need.
    if name == "GPUStartOrderCPUWorker":
        return _gpu_start_order_worker()
    raise AttributeError(name)


#: Seconds vLLM's client gives the engine core to stop before it SIGKILLs it (vLLM's
#: default is 5 s, which a loaded CI machine can miss; a test of what a stop leaves
#: behind checks the graceful path, not a kill).
ENGINE_STOP_GRACE_S = 30.0


def stop_engine(llm: Any, timeout_s: float = ENGINE_STOP_GRACE_S) -> None:
    llm.llm_engine.engine_core.shutdown(timeout=timeout_s)


def stop_engine_and_reap(
    llm: Any, settings: dict[str, Any], timeout_s: float = 60.0
) -> tuple[bool, list[str]]:
    """Stop ``llm``, wait until its processes are gone, then reap its stage's edges as the
    next kvbridge process on them would; ``(whether a signal ended the engine core, names
    reaped)``.

    The engine core reaps what a killed worker left in its connector's shutdown, but that
    is best effort: the client SIGKILLs an engine core that outlives ``stop_engine``'s
    grace, and an engine core that is already shutting down after a fatal error has
    SIGTERM at its default action, so the client's stop can end it before it got there.
    What is left then belongs to no live process, and any later start on the edges
    removes it (only names of dead processes).
    """
    import psutil

    from vllm_kvbridge.runner.stage_runtime import reap_stage_leftovers

    procs = list(llm.llm_engine.engine_core.resources.engine_manager.processes)
    cores: list[psutil.Process] = []
    tree: list[psutil.Process] = []
    for p in procs:
        # An engine core that failed may exit by itself at any moment, also between the
        # looks below: one that is gone has nothing left to wait for.
        try:
            proc = psutil.Process(p.pid)
            cores.append(proc)
            tree += [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    stop_engine(llm)
    _, alive = psutil.wait_procs(tree, timeout=timeout_s)
    assert not alive, f"engine processes still running after {timeout_s:g} s: {alive}"
    return engine_cores_killed(procs, cores), reap_stage_leftovers(settings)


def engine_cores_killed(procs: list[Any], cores: list[Any]) -> bool:
    """Whether a signal (SIGKILL, or SIGTERM at its default action) ended an engine core
    (a child of this process) before its own shutdown finished.

    Whoever waits for a child first gets its status: multiprocessing's ``exitcode`` when
    vLLM joined it, else psutil's ``returncode`` (``wait_procs`` reaped it, and then
    multiprocessing reads None).
    """
    import signal

    codes = [p.exitcode for p in procs] + [getattr(c, "returncode", None) for c in cores]
    return -signal.SIGKILL in codes or -signal.SIGTERM in codes


class HFReference:
    """transformers' view of the same model: past_key_values and final hidden states
    (computed in ``dtype``: float32 unless the engine it is compared with runs in another)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        # transformers' default attention (sdpa) silently leaves out attention logit
        # soft-capping (Gemma 2): its reference differed from vLLM, which applies it, by
        # 0.02 from the second position on. Only eager attention computes the model.
        softcap = getattr(AutoConfig.from_pretrained(model_dir), "attn_logit_softcapping", None)
        attn = {"attn_implementation": "eager"} if softcap else {}
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **attn).eval()

    @torch.no_grad()
    def kv(self, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) as ``[seq, kv_heads, head_dim]`` (keys post-RoPE)."""
        return _kv_layers(self.model(torch.tensor([ids]), use_cache=True).past_key_values)

    @torch.no_grad()
    def hidden(self, ids: list[int]) -> torch.Tensor:
        """Final-norm hidden states ``[seq, hidden]`` (what feeds lm_head)."""
        out = self.model(torch.tensor([ids]), output_hidden_states=True)
        return out.hidden_states[-1][0]

    @torch.no_grad()
    def kv_and_hidden(self, ids: list[int]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """:meth:`kv` and :meth:`hidden` from one forward. A sliding-window layer's cache
        holds only the positions transformers keeps (the last ``window - 1``)."""
        out = self.model(torch.tensor([ids]), use_cache=True, output_hidden_states=True)
        return _kv_layers(out.past_key_values), out.hidden_states[-1][0]

    @torch.no_grad()
    def routing_margins(self, ids: list[int]) -> torch.Tensor | None:
        """Per position, the smallest gap over the layers between the router probabilities
        of the last expert chosen and the first left out (``[seq]``); None for a dense model.
        A small gap is a near-tie: rounding can flip which experts the position runs."""
        k = getattr(self.model.config, "num_experts_per_tok", None)
        if not k:
            return None
        out = self.model(torch.tensor([ids]), output_router_logits=True)
        gaps = []
        for logits in out.router_logits:  # per layer, [seq, experts]
            probs = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True).values
            gaps.append(probs[:, k - 1] - probs[:, k])
        return torch.stack(gaps).amin(dim=0)


def _kv_layers(pkv: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A transformers cache as per layer (K, V) ``[seq, kv_heads, head_dim]``."""
    return [
        (layer.keys[0].permute(1, 0, 2).contiguous(), layer.values[0].permute(1, 0, 2).contiguous())
        for layer in pkv.layers
    ]


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


def settled_status(
    status: Callable[[list[str]], dict[str, dict[str, str]]], request_ids: list[str], timeout_s: float = 30.0
) -> dict[str, dict[str, str]]:
    """``status(request_ids)`` once none of them is pending (or at the deadline). A receiver
    can read a send's last part before the sender's I/O thread settles it (its sender info is
    written after the put): a test waits for the settle instead of for who wins that race."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = status(request_ids)
        if time.monotonic() > deadline or all(s["kv"] != "pending" for s in got.values()):
            return got
        time.sleep(0.05)


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
    # No num_kv_heads: the receiver takes the count from what the sender sent.
    return KVTransferManager(cfg)


# -- TP fan-out of received payloads (spawned gloo ranks) -------------------------------------
FANOUT_CHUNKS = 3


def fanout_reference() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The full payload and the async chunks the producer sends (deterministic, mixed types)."""
    gen = torch.Generator().manual_seed(7)
    full = {
        "hidden_states": torch.randn(7, 16, generator=gen),
        "token_ids": torch.arange(100, 107, dtype=torch.int64),
        "half": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "ids": [1, 2, 3],
        "meta": {"n": 3, "name": "x", "scale": 0.5},
    }
    chunks = [
        {"h": torch.randn(2, 8, generator=gen), "tok": torch.tensor([i, i + 1], dtype=torch.int32)}
        for i in range(FANOUT_CHUNKS)
    ]
    return full, chunks


def same_payload(a: Any, b: Any) -> bool:
    """Bit-exact equality of payload trees (tensor dtype, shape and bytes; plain values ==)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_payload(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same_payload(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def fanout_worker(rank: int, world: int, port: int, ns: str, results: Any) -> None:
    """Ranks [0, world-1) are the TP ranks of stage 1; rank world-1 is the producer.

    Stage 1 receives a full payload from stage 0 and an async-chunk stream from stage 2
    (both sent by the producer rank); every TP rank calls ``kvbridge_get_payload`` and
    must get what TP rank 0 received, bit-exact; a failed receive on rank 0 (timeout,
    sender abort) must reach every rank as an error. ``results[rank]`` is the outcome.
    """
    import torch.distributed as dist

    from vllm_kvbridge.connectors.registry import create_connector
    from vllm_kvbridge.errors import TransferError, TransferTimeout
    from vllm_kvbridge.runner.mixin import KVBridgeModelRunnerMixin
    from vllm_kvbridge.runner.payload_stream import PayloadAborted, PayloadSender

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tp = world - 1
    group = dist.new_group(list(range(tp)))
    full, chunks = fanout_reference()
    ns_full, ns_chunk = f"{ns}f", f"{ns}c"
    outcome: dict[str, Any] = {}
    try:
        if rank == tp:  # producer: stage 0 (full) and stage 2 (async chunk)
            conns = [create_connector("SharedMemoryConnector", {"namespace": n}) for n in (ns_full, ns_chunk)]
            full_tx = PayloadSender(conns[0], 0, 1)
            chunk_tx = PayloadSender(conns[1], 2, 1)
            full_tx.send_full("r-full", full)
            for i, part in enumerate(chunks):
                chunk_tx.send_chunk("r-chunk", part, final=i == len(chunks) - 1)
            chunk_tx.send_chunk("r-abort", chunks[0])
            chunk_tx.abort("r-abort", "producer gave up", chunked=True)
            dist.barrier()  # every rank has what it needs: the segments may go
            full_tx.close()
            chunk_tx.close()
            for c in conns:
                c.close()
            outcome["sent"] = True
        else:
            host = KVBridgeModelRunnerMixin()
            edge = {"connector": "SharedMemoryConnector"}
            settings = {
                "stage_id": 1,
                "payload": {
                    "inputs": [
                        {
                            "from_stage": 0,
                            "mode": "full",
                            "recv_timeout_s": 2,
                            **edge,
                            "connector_config": {"namespace": ns_full},
                        },
                        {
                            "from_stage": 2,
                            "mode": "async_chunk",
                            "recv_timeout_s": 30,
                            **edge,
                            "connector_config": {"namespace": ns_chunk},
                        },
                    ]
                },
            }
            host.kvbridge_init(settings, tp_rank=rank, tp_size=tp, tp_group=group)
            try:
                for rid, stage in (("r-full", 0), ("r-chunk", 2), ("r-missing", 0), ("r-abort", 2)):
                    host.kvbridge_expect_payload(rid, stage)  # a no-op on ranks > 0
                got_full = host.kvbridge_get_payload("r-full", 0, timeout=30)
                got_chunk = host.kvbridge_get_payload("r-chunk", 2, timeout=30)
                outcome["full_exact"] = same_payload(got_full, full)
                outcome["chunk_exact"] = same_payload(got_chunk, merge_reference(chunks))
                for rid, stage in (("r-missing", 0), ("r-abort", 2)):
                    try:
                        host.kvbridge_get_payload(rid, stage, timeout=30)
                        outcome[rid] = "no error"
                    except PayloadAborted as exc:
                        outcome[rid] = f"aborted: {exc}"
                    except TransferTimeout as exc:
                        outcome[rid] = f"timeout: {exc}"
                    except TransferError as exc:
                        outcome[rid] = f"error: {exc}"
            finally:
                dist.barrier()
                host.kvbridge_shutdown()
            outcome["threads"] = host.kvbridge_payloads.threads_alive()
    except BaseException as exc:
        outcome["exception"] = repr(exc)
        raise
    finally:
        results[rank] = outcome
        dist.destroy_process_group()


def merge_reference(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    from vllm_kvbridge.runner.payload_stream import merge_payloads

    return merge_payloads(chunks)


# -- process-exit children (spawned) ----------------------------------------------------------
def payload_producer_settings(ns: str) -> dict[str, Any]:
    edge = {"connector": "SharedMemoryConnector", "connector_config": {"namespace": ns}}
    return {"stage_id": 0, "payload": {"outputs": [{"to_stage": 1, "mode": "full", **edge}]}}


def exit_without_shutdown_child(ns: str, report: Any) -> None:
    """A producer runtime that puts a payload and returns without ``kvbridge_shutdown``."""
    import time

    from vllm_kvbridge.runner.mixin import KVBridgeModelRunnerMixin

    host = KVBridgeModelRunnerMixin()
    host.kvbridge_init(payload_producer_settings(ns))
    host.kvbridge_runtime.register("e", "unclaimed", capture=True)
    host.kvbridge_add_step_output("e", {"h": torch.ones(4, 8)})
    host.kvbridge_mark_finished("e")
    end = time.monotonic() + 20
    while host.kvbridge_transfer_status(["unclaimed"])["unclaimed"]["payload"] != "done":
        assert time.monotonic() < end, "payload was not put"
        time.sleep(0.01)
    report.put((os.getpid(), shm_entries(ns)))
    # Returning ends the process the way a vLLM worker ends: multiprocessing's exit path.


def killed_sender_child(ns: str, report: Any) -> None:
    """Puts a payload on a shm edge, then dies by SIGKILL (no clean-up of any kind)."""
    import signal

    from vllm_kvbridge.connectors.registry import create_connector

    conn = create_connector("SharedMemoryConnector", {"namespace": ns})
    assert conn.put(0, 1, "orphan", {"h": torch.ones(3)}).ok
    report.put((os.getpid(), shm_entries(ns)))
    report.close()
    report.join_thread()
    os.kill(os.getpid(), signal.SIGKILL)


# -- 2-rank diffusion stage (CFG-parallel), run in spawned processes ----------------------------
def cfg_stage(
    namespace: str,
    *,
    num_ranks: int = 1,
    recv_timeout: float = 10.0,
    guidance: float = 3.0,
    from_tp: int = 1,
    class_path: str = "vllm_kvbridge.models.tiny_dit.TinyKVDiT",
) -> Any:
    """The resolved diffusion stage of a tiny AR (TP ``from_tp``) -> DiT config over shm."""
    from vllm_kvbridge.config import resolve_spec, spec_from_dict

    cfg = {
        "connectors": {"shm": {"name": "shm", "extra": {"namespace": namespace}}},
        "stages": [
            {
                "stage_id": 0,
                "kind": "llm_ar",
                "model": "m",
                "tensor_parallel_size": from_tp,
                "kv_transfer": {"need_send_cache": True},
            },
            {
                "stage_id": 1,
                "kind": "diffusion",
                "kv_transfer": {"need_recv_cache": True, "recv_timeout": recv_timeout, "prefetch": True},
                "diffusion": {
                    "class_path": class_path,
                    # model "m" is a placeholder: the fake caches' KV geometry is given here
                    "kwargs": {"image_size": 16, "kv_heads": 2, "kv_head_dim": 32},
                    "num_steps": 3,
                    "guidance_scale": guidance,
                    "num_ranks": num_ranks,
                },
            },
        ],
        "edges": [{"from_stage": 0, "to_stage": 1, "connector": "shm"}],
    }
    return resolve_spec(spec_from_dict(cfg)).stage(1)


def send_cfg_kv(
    namespace: str, caches: list[torch.Tensor], plans: dict[str, Any], *, tp_rank: int = 0, from_tp: int = 1
) -> Any:
    """A sender-side KV manager (TP rank ``tp_rank`` of ``from_tp``, 2 KV heads in all) that
    sent ``plans`` (engine id -> plan with optional ``purpose`` / ``companion_of``) from
    ``caches`` (this rank's heads); returned open (the caller closes it: segments stay
    published until consumed)."""
    import time

    from kv_fixtures import BLOCK

    from vllm_kvbridge.kv.config import KVTransferConfig
    from vllm_kvbridge.kv.manager import KVTransferManager

    cfg = KVTransferConfig(
        need_send_cache=True,
        stage_id=0,
        to_stage=1,
        connector="SharedMemoryConnector",
        connector_config={"namespace": namespace},
        from_tp=from_tp,
        tp_rank=tp_rank,
    )
    sender = KVTransferManager(cfg, num_kv_heads=2)
    sender.handle_finished_requests_kv_transfer(plans, caches, BLOCK, "auto", request_id_resolver=lambda i: i)
    done: set[str] = set()
    deadline = time.monotonic() + 10
    while len(done) < len(plans) and time.monotonic() < deadline:
        d, f = sender.get_finished()
        assert not f, f
        done |= d
        time.sleep(0.01)
    assert done == set(plans)
    return sender


def _shm_maps() -> list[str]:
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-1] for line in f if "/dev/shm/kvbridge" in line})


def dit_rank_worker(
    rank: int,
    port: int,
    namespace: str,
    jobs: list[dict[str, Any]],
    out_dir: str,
    from_tp: int = 1,
    class_path: str = "vllm_kvbridge.models.tiny_dit.TinyKVDiT",
) -> None:
    """Rank 0: the stage's DiffusionRunner (LEADER) executing ``jobs``; rank 1: run_follower.

    Writes ``rank<r>.json`` (outcomes, the follower's /dev/shm mappings) and rank 0's images
    as ``<request>.safetensors``.
    """
    import json

    import torch.distributed as dist
    from safetensors.torch import save_file

    from vllm_kvbridge.runner.diffusion_ranks import Control, exit_rank_process, run_follower, send_control
    from vllm_kvbridge.runner.diffusion_runner import DiffusionRequest, DiffusionRunner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.group.WORLD
    os.environ["KVBRIDGE_DIT_RANK"] = str(rank)  # as pipeline/dit_rank.py sets it for rank 1
    stage = cfg_stage(namespace, num_ranks=2, recv_timeout=2.0, from_tp=from_tp, class_path=class_path)
    report: dict[str, Any] = {}
    try:
        if rank == 1:
            report["served"] = run_follower(stage, group)
            report["shm_maps"] = _shm_maps()
        else:
            runner = DiffusionRunner(stage, cfg_group=group)
            try:
                for job in jobs:
                    req = DiffusionRequest(
                        job["id"],
                        job["id"],
                        0,
                        job["sender_info"],
                        guidance_scale=job["scale"],
                        cfg_purposes=job["purposes"],
                    )
                    try:
                        out = runner.execute(req)
                        save_file({"image": out.image.contiguous()}, f"{out_dir}/{job['id']}.safetensors")
                        report[job["id"]] = {"ok": True, "transfers": out.kv_transfers}
                    except Exception as exc:
                        report[job["id"]] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                report["shm_maps"] = _shm_maps()  # the leader maps what it received
            finally:
                send_control(Control("stop"), group)
                runner.close()
    except BaseException as exc:
        report["exception"] = repr(exc)
        raise
    finally:
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()
    exit_rank_process(0)  # as pipeline/dit_rank.py ends (no abort at interpreter exit)
