"""The orchestrator's control plane admits only the stage processes it started (issue 36, item 1).

Against a real pipeline (one external stage in a real stage process, answered by a stand-in
OpenAI server: no vLLM engine), an intruder on the control address sends a 1-byte frame, a
multi-frame message, a forged ``StageFailed`` naming the stage's pid and a forged
``StageDone`` for a request in flight; the pipeline keeps serving, the stage is neither
killed nor restarted, the victim gets its own result and the intruder is counted. Then the
control plane itself: what an admitted stage process may say, what a key of its own or a
revoked one gets, and how a stage gets its key (stdin, as the Ray actor's path does).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from pipeline_fixtures import ROOT, FakeOpenAIServer, external_stage_config

from vllm_kvbridge.pipeline import Pipeline
from vllm_kvbridge.pipeline import messages as m
from vllm_kvbridge.pipeline.control_auth import (
    CREDENTIALS_ENV,
    ControlPlane,
    StageCredentials,
    given_to_sender,
    new_request_id,
)
from vllm_kvbridge.pipeline.results import RequestResult, StageRecord
from vllm_kvbridge.pipeline.service import PipelineService

pytestmark = pytest.mark.timeout(120)


def _until(pred: Callable[[], Any], timeout_s: float = 20.0, what: str = "") -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout_s} s: {what}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PipelineService, FakeOpenAIServer]]:
    tmp = tmp_path_factory.mktemp("control-auth")
    with FakeOpenAIServer() as server:
        pipe = Pipeline.from_config(external_stage_config(tmp, server.url), log_dir=tmp / "logs")
        service = PipelineService(pipe)
        service.start()
        try:
            yield service, server
        finally:
            service.close()


@pytest.fixture
def intruder() -> Iterator[Callable[[str], zmq.Socket]]:
    """Plain ZMQ DEALER sockets, as any local user can open, connected to an address."""
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []

    def connect(address: str) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        socks.append(sock)
        return sock

    yield connect
    for sock in socks:
        sock.close(0)
    ctx.term()


def _still_serving(service: PipelineService, pids: dict[int, int]) -> None:
    """The pipeline answers a new request, and its stage is the process it started with."""
    _, fut = service.submit("still there?")
    result = fut.result(timeout=60)
    assert result.error is None and result.text == "echo: still there?", result
    assert service.failure is None
    assert service.pipeline.stage_pids() == pids
    [stage] = service.health()["stages"]
    assert stage["status"] == "ready" and stage["restarts"] == 0, stage


def _stage_pid(service: PipelineService) -> int:
    return service.pipeline.stage_pids()[0]


ATTACKS: dict[str, Callable[[PipelineService], list[bytes]]] = {
    "one byte": lambda service: [b"x"],
    "several frames": lambda service: [b"stage-0", m.encode(m.Heartbeat(0, _stage_pid(service)))],
    "forged StageFailed": lambda service: [
        m.encode(m.StageFailed(0, "forged: please kill me", pid=_stage_pid(service)))
    ],
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_an_intruder_on_the_control_address_is_refused_and_counted(
    served: tuple[PipelineService, FakeOpenAIServer], intruder: Callable[[str], zmq.Socket], attack: str
) -> None:
    service, _ = served
    pipe = service.pipeline
    pids = pipe.stage_pids()
    before = pipe.control_counters()["refused_connections"]
    intruder(pipe.control_address).send_multipart(ATTACKS[attack](service))
    # The intruder's handshake fails: its frames are never read, and it is counted.
    _until(lambda: pipe.control_counters()["refused_connections"] > before, what="the intruder counted")
    _still_serving(service, pids)


def test_a_forged_stage_done_does_not_answer_the_victims_request(
    served: tuple[PipelineService, FakeOpenAIServer], intruder: Callable[[str], zmq.Socket]
) -> None:
    service, server = served
    pipe = service.pipeline
    pids = pipe.stage_pids()
    before = pipe.control_counters()["refused_connections"]
    server.hold()
    try:
        victim, fut = service.submit("the victim's prompt")
        assert server.wait_received(victim, 30)  # in flight: in the stage, waiting for the server
        forged = m.StageDone(victim, 0, output={"text": "the intruder's picture"}, image=None)
        intruder(pipe.control_address).send(m.encode(forged))
        _until(lambda: pipe.control_counters()["refused_connections"] > before, what="the intruder counted")
        assert not fut.done()
    finally:
        server.release()
    result = fut.result(timeout=60)
    assert result.error is None and result.text == "echo: the victim's prompt", result
    _still_serving(service, pids)


def test_a_restarted_stage_process_is_admitted_under_a_key_of_its_own(tmp_path: Path) -> None:
    """The supervisor's restart still works: the new process gets its own key and routing
    id, the killed one's are refused from then on, and nothing is counted as an intruder."""
    with FakeOpenAIServer() as server:
        config = external_stage_config(tmp_path, server.url, runtime={"restart_backoff": 0.1})
        service = PipelineService(Pipeline.from_config(config))
        service.start()
        try:
            pipe = service.pipeline
            old = pipe.stage_pids()[0]
            os.kill(old, signal.SIGKILL)

            def back() -> bool:
                stage = service.health()["stages"][0]
                return stage["status"] == "ready" and stage["pid"] != old

            _until(back, 60, "the stage restarted")
            _, fut = service.submit("after the restart")
            assert fut.result(timeout=60).text == "echo: after the restart"
            assert service.health()["stages"][0]["restarts"] == 1
            assert pipe.control_counters() == {"refused_connections": 0, "dropped_frames": 0}
        finally:
            service.close()


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.long(300, "a pipeline start (vLLM engine + DiT) probed by an intruder socket")
def test_vllm_and_diffusion_stages_serve_through_the_authenticated_control_plane(
    intruder: Callable[[str], zmq.Socket], tmp_path: Path
) -> None:
    """The engine-backed stages (a vLLM engine and its children, a diffusion runner, KV over
    shared memory) work on the keyed control plane, an intruder knocking meanwhile."""
    from vllm_kvbridge.models.tiny_lm import ensure_tiny_model

    config = ROOT / "stage_configs/ar_to_dit_shm.yaml"
    with Pipeline.from_config(config, model=str(ensure_tiny_model()), log_dir=tmp_path / "logs") as pipe:
        pids = pipe.stage_pids()
        intruder(pipe.control_address).send(m.encode(m.StageFailed(1, "forged", pid=pids[1])))
        results = pipe.generate(["A cute cat", "A red cube on a table"])
        # the pipeline reads its control socket only while it pumps: pump until it counted
        _until(lambda: pipe.poll(0.05) == [] and pipe.control_counters()["refused_connections"] > 0)
        assert pipe.stage_pids() == pids
        assert [s["restarts"] for s in pipe.stage_health()] == [0, 0]
        assert pipe.control_counters()["dropped_frames"] == 0
    for r in results:
        assert r.error is None and r.image.shape == (3, 32, 32)
    assert (results[0].image != results[1].image).any()


# -- the control plane itself ---------------------------------------------------------------
@pytest.fixture
def control() -> Iterator[ControlPlane]:
    plane = ControlPlane("127.0.0.1")
    yield plane
    plane.close()


def _client(ctx: zmq.Context, creds: StageCredentials, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, creds.route.encode())
    creds.secure(sock)
    sock.connect(address)
    return sock


def _next(control: ControlPlane) -> Any:
    """The next message the control plane lets through (dropped frames are skipped)."""
    end = time.monotonic() + 20
    while time.monotonic() < end:
        control.poll(50)
        got = control.receive()
        if got is not None:
            return got
    raise AssertionError("no message within 20 s")


def test_an_admitted_stage_speaks_only_for_itself_and_bad_frames_are_dropped(control: ControlPlane) -> None:
    zero, one = control.issue(0), control.issue(1)
    assert zero.public != one.public and zero.route != one.route and zero.server == one.server
    ctx = zmq.Context()
    try:
        sock = _client(ctx, zero, control.address)
        sock.send(b"x")  # does not decode
        sock.send_multipart([b"a", m.encode(m.Heartbeat(0, 1))])  # two frames where one is expected
        sock.send(m.encode(m.Heartbeat(1, 1)))  # stage 0's key speaking for stage 1
        sock.send(m.encode(m.Submit("r1")))  # a message only the orchestrator sends
        bad_image = m.Tensor("float32", [2, 2], b"\0" * 4)  # 4 bytes for 16
        sock.send(m.encode(m.StageDone("r1", 0, image=bad_image)))
        sock.send(m.encode(m.Heartbeat(0, 7)))
        got = _next(control)  # a stage's frames arrive in order: the five bad ones came first
        assert (got.stage_id, got.key, got.msg) == (0, zero.public, m.Heartbeat(0, 7))
        assert control.counters() == {"refused_connections": 0, "dropped_frames": 5}
        # the orchestrator reaches the stage under its route
        control.send(zero.route.encode(), m.Shutdown())
        assert sock.poll(10_000) and m.decode_to_stage(sock.recv()) == m.Shutdown()
        sock.close(0)
    finally:
        ctx.term()


def test_keys_of_its_own_or_revoked_ones_get_nothing_in(control: ControlPlane) -> None:
    ctx = zmq.Context()
    try:
        own = StageCredentials(0, "stage-0", *(k.decode() for k in zmq.curve_keypair()), control.server_key)
        stranger = _client(ctx, own, control.address)  # the right server key, a key of its own
        stranger.send(m.encode(m.Heartbeat(0, 1)))
        _until(lambda: control.receive() is None and control.counters()["refused_connections"] >= 1)
        old = control.issue(0)
        control.revoke(old.public)  # the process it was for was given up
        refused = control.counters()["refused_connections"]
        late = _client(ctx, old, control.address)
        late.send(m.encode(m.Heartbeat(0, 1)))
        _until(lambda: control.receive() is None and control.counters()["refused_connections"] > refused)
        new = control.issue(0)
        fresh = _client(ctx, new, control.address)
        fresh.send(m.encode(m.Heartbeat(0, 2)))
        got = _next(control)
        assert (got.key, got.msg) == (new.public, m.Heartbeat(0, 2))
        assert control.counters()["dropped_frames"] == 0
        for sock in (stranger, late, fresh):
            sock.close(0)
    finally:
        ctx.term()


def test_a_stage_speaks_only_about_requests_it_was_given() -> None:
    results = {"a": RequestResult("a", "p", stages=[StageRecord(0, "llm_ar", 0.0)])}
    assert given_to_sender(m.StageDone("a", 0), results)
    assert not given_to_sender(m.StageDone("a", 1), results)  # never submitted to stage 1
    assert not given_to_sender(m.StageProgress("a", 1), results)
    assert not given_to_sender(m.RequestFailed("a", 1, "forged"), results)
    assert given_to_sender(m.StageDone("gone", 1), results)  # unknown (finished, forgotten): ignored
    assert given_to_sender(m.Heartbeat(1, 5), results)  # about no request


def test_the_stage_process_gets_its_key_on_stdin_through_the_ray_actors_path(
    control: ControlPlane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``StageHost.start`` is what the Ray actor runs on its node (here without Ray): the key
    travels in the ``env`` of that call and reaches the process on stdin, not in its
    environment or command line."""
    from vllm_kvbridge.config.resolve import resolve
    from vllm_kvbridge.pipeline.ray_backend import StageHost

    # the host keeps its stage's log under $RAY_TMPDIR/kvbridge-<run> (the node's): here, ours
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))

    with FakeOpenAIServer() as server:
        [stage] = resolve(external_stage_config(tmp_path, server.url)).stages
        creds = control.issue(0)
        host = StageHost("rtest", "stage_0.log")
        pid, _ = host.start(
            msgspec.json.encode(stage), control.address, {CREDENTIALS_ENV: creds.encode()}, 0.2
        )
        try:
            seen: list[Any] = []
            _until(lambda: seen.append(_next(control)) or isinstance(seen[-1].msg, m.Ready), 60, "Ready")
            assert {(g.stage_id, g.key) for g in seen} == {(0, creds.public)}
            assert seen[-1].msg.pid == pid
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert creds.secret.encode() not in environ and CREDENTIALS_ENV.encode() not in environ
            assert creds.secret.encode() not in cmdline
            control.send(creds.route.encode(), m.Shutdown())
            assert host.wait() == 0
        finally:
            host.kill([])
    assert control.counters()["dropped_frames"] == 0


def test_request_ids_the_pipeline_hands_out_are_not_guessable(tmp_path: Path) -> None:
    assert re.fullmatch(r"img-[0-9a-f]{16}", new_request_id("img"))
    finished: dict[str, RequestResult] = {}
    with (
        FakeOpenAIServer() as server,
        Pipeline.from_config(external_stage_config(tmp_path, server.url)) as pipe,
    ):
        ids = [pipe.submit("a"), pipe.submit("b"), pipe.submit("c", request_id="mine")]
        _until(lambda: finished.update({r.request_id: r for r in pipe.poll(0.05)}) or len(finished) == 3)
    assert all(re.fullmatch(r"req-[0-9a-f]{16}", rid) for rid in ids[:2]) and ids[0] != ids[1]
    assert ids[2] == "mine" and {finished[rid].text for rid in ids} == {"echo: a", "echo: b", "echo: c"}
    assert os.environ.get(CREDENTIALS_ENV) is None  # the orchestrator's own environment is untouched


def test_sending_to_a_stage_whose_connection_is_gone_raises_stage_unreachable(control: ControlPlane) -> None:
    """Found by the soak: a stage killed while the orchestrator hands it a request (before it
    noticed the loss) made the send raise zmq's EHOSTUNREACH out of the event loop, which took
    the server down (500s, then 503s). The plane says StageUnreachable, which the orchestrator
    turns into that one request's failure."""
    from vllm_kvbridge.pipeline.control_auth import StageUnreachable

    creds = control.issue(1)
    ctx = zmq.Context()
    try:
        sock = _client(ctx, creds, control.address)
        sock.send(m.encode(m.Heartbeat(1, 1)))
        _next(control)  # connected and admitted: the route is known
        sock.close(0)
        give_up = time.monotonic() + 10
        with pytest.raises(StageUnreachable, match="stage"):
            while time.monotonic() < give_up:  # until the plane has seen the disconnect
                control.send(creds.route.encode(), m.Submit("r1"))
                time.sleep(0.01)
    finally:
        ctx.term()
