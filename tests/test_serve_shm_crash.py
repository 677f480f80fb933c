"""A SIGKILLed server leaves nothing in /dev/shm for good (issue 36, item 4): its successor
reaps what the killed run left - our pool and published segments, vLLM's ``psm_*`` message
queues and the ``sem.mp-*`` semaphores its stages mapped - because every process of a run
held an owner lock (``connectors/shm_owners.py``) that the kernel dropped when it died.

A real ``vllm-kvbridge serve`` (AR -> DiT over shared memory, real engine) serves one image
and is SIGKILLed (its stage processes then kill their own groups: their parent is gone);
the successor is the lightest real pipeline (one external stage, no vLLM), started and
closed the way ``serve`` starts and stops one."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from pipeline_fixtures import FakeOpenAIServer, descendants, external_stage_config, run_names
from serve_fixtures import start_serve, wait_for

from vllm_kvbridge.models.tiny_lm import ensure_tiny_model
from vllm_kvbridge.pipeline import Pipeline

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.long(300, "a server (vLLM engine + DiT) SIGKILLed, then a successor pipeline"),
]

ROOT = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_sigkilled_servers_successor_leaves_dev_shm_as_it_found_it(tmp_path: Path) -> None:
    """Only the two runs' own names are looked at (their segments, owner files and what those
    recorded: ``run_names``), so other runs on the host cannot fail it."""
    (tmp_path / "killed").mkdir()
    srv = start_serve(ROOT / "stage_configs/ar_to_dit_shm.yaml", tmp_path / "killed", ensure_tiny_model())
    with srv.http() as client:
        answer = client.post("/v1/images/generations", json={"prompt": "a cat", "n": 1})
        run_id = client.get("/debug/state").json()["run_id"]
    assert answer.status_code == 200, answer.text
    tree = set(descendants(srv.proc.pid))  # the stage processes and their vLLM engines
    assert tree
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(timeout=30)
    # The stages see their parent gone and kill their own groups (engines included).
    assert wait_for(lambda: not any(_alive(p) for p in tree), timeout_s=60), "the run's processes outlived it"
    left = run_names(run_id)
    assert any(n.startswith("psm_") for n in left), left  # what a SIGKILL used to leave for good
    assert any(n.startswith("kvbridge.") for n in left), left

    with FakeOpenAIServer() as server:  # the successor: its start reaps dead runs
        successor = Pipeline.from_config(external_stage_config(tmp_path, server.url))
        successor.start()
        successor.close()
    assert left & set(os.listdir("/dev/shm")) == set()  # every name the killed run left
    assert run_names(run_id) == set() and run_names(successor.run_id) == set()  # the successor's too
