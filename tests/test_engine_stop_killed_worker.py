"""A worker that vLLM's executor has to SIGKILL at shutdown leaves nothing on the edge.

vLLM's executor gives a worker ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` to exit, then
SIGTERM and 4 s, then SIGKILL, and returns without waiting for the killed process. Right
after, the engine core's scheduler-side connector reaps the stage's leftovers: until the
kernel has torn the killed worker down it still holds its segments' owner locks, so a
reap that does not wait for it finds them "alive" and leaves their names in /dev/shm.

Here the worker holds a pool segment and a published key (one request's KV that nobody
reads) and is stopped (SIGSTOP) before the engine is, so it can never exit by itself; the
grace is 0 s (the kill comes after SIGTERM's 4 s), and the client gives the engine core
30 s. After the stop nothing of the edge is left, with no reap by this test (see
``ATTEMPTS`` for an engine core the client had to kill).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from runner_fixtures import (
    engine_cores_killed,
    kv_params,
    kv_sender_settings,
    prompt_ids,
    shm_entries,
    shm_namespace,
    start_engine,
    stop_engine,
    tokens_prompt,
)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.long(300, "up to three vLLM engine starts until one's worker is killed at the right moment"),
]

#: An attempt whose engine core the client had to kill proves nothing about the engine
#: core's reap (it never ran), so it is repeated. In full-suite runs the engine core was
#: seen to outlast even a 120 s grace (2 CI runs of 3; alone it stops in ~9 s, on an idle or
#: a loaded machine; the cause was not found): every attempt killed fails the test.
ATTEMPTS = 3
ENGINE_CORE_GRACE_S = 30.0


def _attempt(model_dir: Path, namespace: str) -> tuple[bool, float]:
    """Run the scenario once on ``namespace``; ``(engine core killed, seconds its stop took)``."""
    settings = kv_sender_settings(namespace)
    llm = start_engine(model_dir, settings, num_gpu_blocks_override=32, max_num_seqs=4)
    procs = list(llm.llm_engine.engine_core.resources.engine_manager.processes)
    cores = [psutil.Process(p.pid) for p in procs]
    workers = [c for core in cores for c in core.children(recursive=True)]
    try:
        out = llm.generate([tokens_prompt(prompt_ids(40))], [kv_params("kw0", 2)])[0]
        assert out.kv_transfer_params["kvbridge_kv"] == "submitted"
        # The send is asynchronous, and the engine core steps on until it heard of it: a
        # worker stopped mid-step would hang the engine core, not its shutdown. Wait until
        # the send landed and the engine core is idle (it steps again only on new input).
        status, core = {}, llm.llm_engine.engine_core
        for _ in range(200):
            status = llm.collective_rpc("kvbridge_transfer_status", args=(["kw0"],))[0]
            if status["kw0"]["kv"] == "done" and not core.call_utility("has_work"):
                break
            time.sleep(0.05)
        assert status["kw0"]["kv"] == "done" and not core.call_utility("has_work"), status
        held = shm_entries(namespace)
        assert any(".p." in n for n in held) and any(".k." in n for n in held), held
        assert workers, "no worker process under the engine core"
        for w in workers:
            os.kill(w.pid, signal.SIGSTOP)
    finally:
        stopping = time.monotonic()
        # The executor's kill comes after ~4 s; the engine core is gone ~5 s later.
        stop_engine(llm, timeout_s=ENGINE_CORE_GRACE_S)
        stopped_s = time.monotonic() - stopping
    _, alive = psutil.wait_procs(cores + workers, timeout=60)
    assert not alive, alive
    return engine_cores_killed(procs, cores), stopped_s


def test_a_worker_killed_at_shutdown_leaves_no_names(tiny_model_dir: Path, monkeypatch) -> None:
    from vllm_kvbridge.runner.stage_runtime import reap_stage_leftovers

    # Read by the engine core (spawned with this environment) when it stops its workers.
    monkeypatch.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "0")
    killed_after: list[float] = []
    for attempt in range(ATTEMPTS):
        namespace = shm_namespace(f"killedworker{attempt}")
        killed, stopped_s = _attempt(tiny_model_dir, namespace)
        if not killed:
            assert shm_entries(namespace) == []  # the engine core's own reap, nobody else's
            return
        killed_after.append(round(stopped_s))
        reap_stage_leftovers(kv_sender_settings(namespace))  # only dead processes' names
        assert shm_entries(namespace) == []
    pytest.fail(
        f"the client killed the engine core at its stop grace in every attempt (after {killed_after} s)"
    )
