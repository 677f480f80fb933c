"""A producer lost after it handed requests on (AR -> DiT): real stage processes and engines.

The LLM stage finishes request ``a`` and ``x`` and hands both to the diffusion stage, whose
module is :class:`pipeline_fixtures.GatedDiT` held in the forward of ``a`` (so ``a``'s KV was
read: it is denoising) while ``x`` waits in the queue unread (prefetch off). Then the LLM
stage's process group is SIGKILLed:

* over ZMQ p2p the unread KV of ``x`` lived in the dead sender's process: ``x`` fails at once
  (well within its ``recv_timeout`` of 120 s) naming the lost stage, ``lost_stage == 0``;
  ``a`` (read already) still succeeds; the restarted LLM stage serves new requests;
* over shared memory the segment outlives its sender: ``x`` is not failed, and succeeds once
  the diffusion stage is released.

What the diffusion stage decided is read from its log line for the ``ProducerLost`` notice,
so no sleep decides what the tests see.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pipeline_fixtures import ROOT, STAGE_ENV, poll_until

from vllm_kvbridge.models.tiny_lm import ensure_tiny_model
from vllm_kvbridge.pipeline import Pipeline
from vllm_kvbridge.pipeline.results import RequestResult

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.long(
        300,
        "two pipelines (ZMQ, shm), started in the module's first tests, one LLM stage killed and restarted",
    ),
]
RECV_TIMEOUT_S = 120
PROMPT_FAIL_WITHIN_S = 20


def _config(tmp: Path, base: str, gates: Path, backoff: float) -> Path:
    text = (ROOT / "stage_configs" / base).read_text()
    text = text.replace(
        "class_path: vllm_kvbridge.models.tiny_dit.TinyKVDiT", "class_path: pipeline_fixtures.GatedDiT"
    )
    text = text.replace(
        "    kind: diffusion\n", f"    kind: diffusion\n    env: {{KVBRIDGE_TEST_GATES: '{gates}'}}\n"
    )
    # Both spellings of the diffusion stage's kv_transfer (flow and block style).
    text = text.replace(
        "recv_timeout: 30, prefetch: true", f"recv_timeout: {RECV_TIMEOUT_S}, prefetch: false"
    )
    text = text.replace(
        "      recv_timeout: 30\n      prefetch: true\n",
        f"      recv_timeout: {RECV_TIMEOUT_S}\n      prefetch: false\n",
    )
    assert f"recv_timeout: {RECV_TIMEOUT_S}" in text and "GatedDiT" in text
    text += f"runtime: {{max_restarts: 2, restart_backoff: {backoff}, heartbeat_timeout: 30}}\n"
    path = tmp / base
    path.write_text(text)
    return path


def _notice_logged(pipe: Pipeline) -> str | None:
    log = (pipe.log_dir / "stage_1.log").read_text(errors="replace")
    lines = [line for line in log.splitlines() if "kvbridge: producer stage 0" in line]
    return lines[-1] if lines else None


def _hold_a_and_queue_x(pipe: Pipeline, gates: Path, finished: dict[str, RequestResult]) -> None:
    (gates / "hold").touch()
    pipe.submit("A cute cat", request_id="a")
    # a is denoising (its KV was received: GatedDiT's forward marked it) before x exists, so
    # x is the one in the queue.
    poll_until(lambda: (gates / "forwarding").exists(), 120, pipe, finished)
    pipe.submit("The quick brown fox", request_id="x")
    poll_until(lambda: pipe.request_stages() == {"a": [1], "x": [1]}, 120, pipe, finished)
    assert not finished


def _start(tmp: Path, base: str, backoff: float) -> tuple[Pipeline, Path]:
    gates = tmp / "gates"
    gates.mkdir()
    pipe = Pipeline.from_config(
        _config(tmp, base, gates, backoff), model=str(ensure_tiny_model()), env=STAGE_ENV
    )
    pipe.start()
    return pipe, gates


@pytest.fixture(scope="module")
def zmq_pipe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pipeline, Path]]:
    pipe, gates = _start(tmp_path_factory.mktemp("producer-lost-zmq"), "ar_to_dit_zmq.yaml", 0.2)
    try:
        yield pipe, gates
    finally:
        pipe.close()
        # A stage was lost: the run's own log directory stays for the post-mortem.
        kept = (pipe.log_dir / "stage_0.log").exists()
        shutil.rmtree(pipe.log_dir, ignore_errors=True)
        assert kept


def test_zmq_request_whose_kv_died_with_its_producer_fails_at_once(zmq_pipe) -> None:  # type: ignore[no-untyped-def]
    pipe, gates = zmq_pipe
    finished: dict[str, RequestResult] = {}
    _hold_a_and_queue_x(pipe, gates, finished)
    llm_pid = pipe.stage_pids()[0]
    os.killpg(llm_pid, signal.SIGKILL)
    t0 = time.monotonic()
    poll_until(lambda: "x" in finished, PROMPT_FAIL_WITHIN_S, pipe, finished)
    took = time.monotonic() - t0
    x = finished["x"]
    assert x.error is not None and x.lost_stage == 0, x
    assert "stage 0 (llm_ar) was lost before stage 1 read its KV" in x.error, x.error
    assert "ZmqConnector" in x.error
    print(f"\nx failed {took:.1f} s after its producer was killed (recv_timeout {RECV_TIMEOUT_S} s)")
    notice = poll_until(lambda: _notice_logged(pipe), 10, pipe, finished)
    assert "gave up 1 of the 2 request(s)" in notice, notice  # a was read: kept
    # a had read its KV before the loss: it is not failed, and finishes once released
    assert "a" not in finished
    (gates / "hold").unlink()
    poll_until(lambda: "a" in finished, 120, pipe, finished)
    assert finished["a"].error is None and finished["a"].image.shape == (3, 32, 32), finished["a"]
    # the restarted LLM stage's requests are served as before
    poll_until(lambda: not pipe.recovering(), 300, pipe, finished)
    assert pipe.stage_pids()[0] != llm_pid
    (ok,) = pipe.generate(["A dog"], request_ids=["after"])
    assert ok.error is None and ok.image.shape == (3, 32, 32)


@pytest.fixture(scope="module")
def shm_pipe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pipeline, Path]]:
    # The longest backoff: the restarted LLM stage would reap the dead sender's segments,
    # and the test reads x long before it starts.
    pipe, gates = _start(tmp_path_factory.mktemp("producer-lost-shm"), "ar_to_dit_shm.yaml", 30)
    try:
        yield pipe, gates
    finally:
        pipe.close()
        # A stage was lost: the run's own log directory stays for the post-mortem.
        kept = (pipe.log_dir / "stage_0.log").exists()
        shutil.rmtree(pipe.log_dir, ignore_errors=True)
        assert kept


def test_shm_request_whose_kv_outlives_its_producer_still_succeeds(shm_pipe) -> None:  # type: ignore[no-untyped-def]
    pipe, gates = shm_pipe
    finished: dict[str, RequestResult] = {}
    _hold_a_and_queue_x(pipe, gates, finished)
    os.killpg(pipe.stage_pids()[0], signal.SIGKILL)
    poll_until(lambda: pipe.recovering(), 10, pipe, finished)
    # the diffusion stage was told, and kept both (the segment of x outlives its sender)
    notice = poll_until(lambda: _notice_logged(pipe), 10, pipe, finished)
    assert "gave up 0 of the 2 request(s)" in notice, notice
    assert not finished, finished
    (gates / "hold").unlink()
    poll_until(lambda: {"a", "x"} <= set(finished), 120, pipe, finished)
    for rid in ("a", "x"):
        r = finished[rid]
        assert r.error is None and r.lost_stage is None and r.image.shape == (3, 32, 32), r
