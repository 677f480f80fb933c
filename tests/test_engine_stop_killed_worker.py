"""A worker that vLLM's executor has to SIGKILL at shutdown leaves nothing on the edge.

vLLM's executor gives a worker ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` to exit, then
SIGTERM and 4 s, then SIGKILL, and returns without waiting for the killed process. Right
after, the engine core's scheduler-side connector reaps the stage's leftovers: until the
kernel has torn the killed worker down it still holds its segments' owner locks, so a
reap that does not wait for it finds them "alive" and leaves their names in /dev/shm.

Here the worker holds a pool segment and a published key (one request's KV that nobody
reads) and is stopped (SIGSTOP) before the engine is, so it can never exit by itself; the
grace is 0 s (the kill comes after SIGTERM's 4 s), and the client gives the engine core
120 s, so the engine core is not killed. After the stop nothing of the edge is left, with
no reap by this test.
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

pytestmark = [pytest.mark.engine, pytest.mark.slow]

NAMESPACE = shm_namespace("killedworker")
ENGINE_CORE_GRACE_S = 120.0


def test_a_worker_killed_at_shutdown_leaves_no_names(tiny_model_dir: Path, monkeypatch) -> None:
    # Read by the engine core (spawned with this environment) when it stops its workers.
    monkeypatch.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "0")
    settings = kv_sender_settings(NAMESPACE)
    llm = start_engine(tiny_model_dir, settings, num_gpu_blocks_override=32, max_num_seqs=4)
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
        held = shm_entries(NAMESPACE)
        assert any(".p." in n for n in held) and any(".k." in n for n in held), held
        assert workers, "no worker process under the engine core"
        for w in workers:
            os.kill(w.pid, signal.SIGSTOP)
    finally:
        stopping = time.monotonic()
        # The executor's kill comes after ~4 s and the engine core is gone ~5 s later on an
        # idle machine; the grace is generous because a kill here would end the test's
        # premise (the engine core's own reap), not show a leak.
        stop_engine(llm, timeout_s=ENGINE_CORE_GRACE_S)
        stopped_s = time.monotonic() - stopping
    _, alive = psutil.wait_procs(cores + workers, timeout=60)
    assert not alive, alive
    assert not engine_cores_killed(procs, cores), f"engine core killed {stopped_s:.0f} s into its stop"
    assert shm_entries(NAMESPACE) == []
