"""Issue 15 item 3: an expired lease is a counted metric (real stage processes and engines).

AR -> DiT over shared memory with a short lease (``lease_s: 2``; ``ttl_s: 30`` covers the
hand-over before the first renewal). The diffusion stage (:class:`pipeline_fixtures.GatedDiT`)
is held in the forward of ``a`` while ``x`` waits in its queue, its KV renewed every
``lease_s / 6``. Then the diffusion stage is stopped (SIGSTOP; its heartbeat timeout is
long, so it is not taken for lost): nobody renews ``x``'s KV, the LLM stage's sender drops
it one lease later, and that stage reports it (``StageStats``) until ``stage_health`` and
``serve``'s Prometheus series ``kvbridge_leases_expired_total`` count one expired lease.
Resumed, the stage fails ``x`` at its ``recv_timeout`` (its KV is gone) and finishes ``a``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from pipeline_fixtures import ROOT, STAGE_ENV, poll_until

from vllm_kvbridge.models.tiny_llama import ensure_tiny_model
from vllm_kvbridge.pipeline import Pipeline
from vllm_kvbridge.pipeline.results import RequestResult
from vllm_kvbridge.server.metrics import ServerMetrics

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def _config(tmp: Path, gates: Path) -> Path:
    text = (ROOT / "stage_configs" / "ar_to_dit_shm.yaml").read_text()
    replacements = {
        "class_path: vllm_kvbridge.models.tiny_dit.TinyKVDiT": "class_path: pipeline_fixtures.GatedDiT",
        "    kind: diffusion\n": f"    kind: diffusion\n    env: {{KVBRIDGE_TEST_GATES: '{gates}'}}\n",
        "      recv_timeout: 30\n      prefetch: true\n": "      recv_timeout: 10\n      prefetch: false\n",
        "extra: {ttl_s: 120}": "extra: {ttl_s: 30, lease_s: 2}",
    }
    for old, new in replacements.items():
        assert old in text, old
        text = text.replace(old, new)
    text += "runtime: {heartbeat_timeout: 300}\n"
    path = tmp / "ar_to_dit_shm.yaml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def pipe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pipeline, Path]]:
    tmp = tmp_path_factory.mktemp("lease-metrics")
    gates = tmp / "gates"
    gates.mkdir()
    pipeline = Pipeline.from_config(_config(tmp, gates), model=str(ensure_tiny_model()), env=STAGE_ENV)
    pipeline.start()
    try:
        yield pipeline, gates
    finally:
        pipeline.close()


def _expired(pipe: Pipeline) -> float:
    return pipe.stage_health()[0].get("counters", {}).get("leases_expired", 0.0)


def test_a_kv_nobody_renews_expires_and_is_counted(pipe) -> None:  # type: ignore[no-untyped-def]
    pipe, gates = pipe
    finished: dict[str, RequestResult] = {}
    metrics = ServerMetrics(lambda: 0.0, pipe.stage_health)
    (gates / "hold").touch()
    pipe.submit("A cute cat", request_id="a")
    poll_until(lambda: (gates / "forwarding").exists(), 120, pipe, finished)  # a's KV was read
    pipe.submit("The quick brown fox", request_id="x")
    poll_until(lambda: pipe.request_stages() == {"a": [1], "x": [1]}, 120, pipe, finished)
    assert _expired(pipe) == 0.0
    assert 'kvbridge_leases_expired_total{kind="llm_ar",stage="0"} 0.0' in metrics.render().decode()

    dit = pipe.stage_pids()[1]
    os.killpg(dit, signal.SIGSTOP)
    try:
        poll_until(lambda: _expired(pipe) >= 1, 60, pipe, finished)
    finally:
        os.killpg(dit, signal.SIGCONT)
    assert _expired(pipe) == 1.0  # x's only: a's was read before
    text = metrics.render().decode()
    assert 'kvbridge_leases_expired_total{kind="llm_ar",stage="0"} 1.0' in text, text

    (gates / "hold").unlink()
    poll_until(lambda: {"a", "x"} <= set(finished), 120, pipe, finished)
    assert finished["a"].error is None and finished["a"].image.shape == (3, 32, 32)
    x = finished["x"]
    assert x.error is not None and "did not arrive within 10" in x.error, x
    assert pipe.stage_pids()[1] == dit, "the stopped stage was not taken for lost"
    # A later scrape adds nothing for the same process.
    assert 'kvbridge_leases_expired_total{kind="llm_ar",stage="0"} 1.0' in metrics.render().decode()


def test_the_metric_follows_a_restarted_process_from_zero() -> None:
    """A restarted stage process counts from 0 again: the series keeps growing."""
    health = [{"stage_id": 0, "kind": "llm_ar", "status": "ready", "restarts": 0, "pid": 10}]
    metrics = ServerMetrics(lambda: 0.0, lambda: health)
    series = 'kvbridge_leases_expired_total{kind="llm_ar",stage="0"}'
    for pid, value, total in ((10, 2.0, 2.0), (10, 5.0, 5.0), (11, 1.0, 6.0), (11, 1.0, 6.0)):
        health[0].update(pid=pid, counters={"leases_expired": value, "puts_full": 0.0})
        assert f"{series} {total}" in metrics.render().decode()
