"""``vllm-kvbridge serve`` in front of thinker -> talker (async chunk): text endpoints.

One real server for the module (two vLLM engines); the talker's input is exactly the
thinker's hidden states (thinker_talker_async_chunk_embeds.yaml: the stream becomes the
talker's prompt embeddings, over shm; test_pipeline_thinker_talker checks full payload and
the overlapping per-step feed), completions, chat completions, streaming (SSE,
incremental: the talker reports its text while it generates), a client leaving
mid-stream, text-endpoint errors, and a graceful SIGTERM with requests in flight.

The streaming tests hold the talker (SIGSTOP on its process group) the moment the client
has read the first piece of text, and ask the server, while it is held, whether the request
is still in flight: a server that forwards pieces as they come says yes, one that sends the
text once the request finished says no. The hold takes out the race with a second HTTP
call; one is left: a process stalled on this 2-core machine (seconds, seen under load) can
let the talker finish before the first piece was read, and then the attempt shows nothing.
Such an attempt is repeated (``ATTEMPTS``); a server that does not stream fails every one.
The talker generates ``TALKER_TOKENS`` tokens, ignoring EOS (the shipped config says up to
8), so that it has many steps to go after its first piece.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from pipeline_fixtures import hf_reference, load_dump
from serve_fixtures import ROOT, Server, serve_edited, shm_names, stop, wait_for

from vllm_kvbridge.models.tiny_lm import ensure_tiny_model
from vllm_kvbridge.pipeline.stage_handles import group_alive

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.long(300, "a server of two vLLM engines, started by the module's first test"),
]
CONFIG = ROOT / "stage_configs/thinker_talker_async_chunk_embeds.yaml"
MODEL_NAME = "thinker_talker_async_chunk_embeds"
TALKER_TOKENS = 128
ATTEMPTS = 5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("serve-thinker-talker")

    def edit(spec: dict) -> None:  # type: ignore[type-arg]
        spec["stages"][1]["default_sampling_params"].update(max_tokens=TALKER_TOKENS, ignore_eos=True)
        spec.setdefault("runtime", {})["debug_dump_dir"] = str(tmp / "dump")

    with serve_edited(CONFIG, tmp, ensure_tiny_model(), edit) as srv:
        yield srv


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_talker_input_is_the_thinkers_hidden_states(server: Server) -> None:
    """What the talker received, reassembled from the chunks, equals transformers' final-norm
    hidden states for the prompt and the thinker's generated tokens (all but the last)."""
    from transformers import AutoTokenizer

    model = ensure_tiny_model()
    dump = server.log_path.parent / "dump"  # the fixture's runtime.debug_dump_dir
    prompt = "Once upon a time there was a tiny model"
    before = set(dump.glob("stage1_*_payload.safetensors"))
    _client(server).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    [path] = set(dump.glob("stage1_*_payload.safetensors")) - before
    got = load_dump(path)
    generated = got["token_ids"].tolist()
    assert 0 < len(generated) <= 8  # the thinker's max_tokens
    tokens = AutoTokenizer.from_pretrained(str(model))(prompt).input_ids + generated
    _, hidden = hf_reference(model, tokens[:-1])
    assert got["hidden_states"].shape == hidden.shape
    assert (got["hidden_states"] - hidden).abs().max().item() <= 1e-4


def test_completions_chat_and_streaming(server: Server) -> None:
    client = _client(server)
    res = client.completions.create(model=MODEL_NAME, prompt="Hello, my name is", max_tokens=6)
    text = res.choices[0].text
    assert isinstance(text, str) and text
    assert (
        res.usage is not None
        and res.usage.prompt_tokens > 0
        and 0 < res.usage.completion_tokens <= TALKER_TOKENS
    )
    assert res.choices[0].finish_reason in ("stop", "length")
    # greedy sampling in both stages: the same prompt gives the same text
    again = client.completions.create(model=MODEL_NAME, prompt="Hello, my name is", max_tokens=6)
    assert again.choices[0].text == text

    stream = client.completions.create(
        model=MODEL_NAME, prompt="Hello, my name is", max_tokens=6, stream=True
    )
    chunks = list(stream)
    assert len(chunks) >= 2 and chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].text for c in chunks) == text

    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Say something"}], max_tokens=6
    )
    content = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and isinstance(content, str) and content
    chat_stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Say something"}], max_tokens=6, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in chat_stream]
    assert "".join(pieces) == content

    metrics = httpx.get(server.url + "/metrics").text
    assert 'kvbridge_edge_bytes_total{from_stage="0",to_stage="1",what="payload"}' in metrics


class _Talker:
    """The talker's (the last stage's) process group: SIGSTOP there holds its generation."""

    def __init__(self, server: Server) -> None:
        self.pgid = int(httpx.get(server.url + "/health").json()["stages"][-1]["pid"])
        self.held = False

    def hold(self) -> None:
        os.killpg(self.pgid, signal.SIGSTOP)
        self.held = True

    def release(self) -> None:
        if self.held:
            os.killpg(self.pgid, signal.SIGCONT)
            self.held = False


def _held_at_first_piece(
    server: Server,
    talker: _Talker,
    body: dict,
    leave: bool,  # type: ignore[type-arg]
) -> tuple[list[tuple[float, object]], int | None]:
    """Stream ``body`` to /v1/completions; at the first piece of text hold the talker and read
    the server's ``in_flight`` (returned; None when no text came). ``leave``: close the
    connection there, the talker still held (the caller releases it); otherwise release
    it and read the stream to its end."""
    debug = httpx.Client(base_url=server.url, timeout=30)
    in_flight: list[int] = []

    def on_event(event: object) -> bool:
        if not in_flight and isinstance(event, dict) and event["choices"][0]["text"]:
            talker.hold()
            try:
                in_flight.append(debug.get("/debug/state").json()["in_flight"])
            finally:
                if not leave:
                    talker.release()
        return leave and bool(in_flight)

    try:
        events = _sse(server, "/v1/completions", body, on_event)
    finally:
        debug.close()
    return events, in_flight[0] if in_flight else None


def _sse(server: Server, path: str, body: dict, on_event=None) -> list[tuple[float, object]]:  # type: ignore[no-untyped-def, type-arg]
    """POST a streaming request; (arrival time, parsed event) per ``data:`` line, ``[DONE]`` as
    the string. ``on_event(event)`` runs as each event arrives; returning True closes the
    connection there (the client leaves)."""
    events: list[tuple[float, object]] = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: ") :]
            event: object = data if data == "[DONE]" else json.loads(data)
            events.append((time.monotonic(), event))
            if on_event is not None and on_event(event):
                break
    return events


def test_streaming_is_incremental(server: Server) -> None:
    client = _client(server)
    prompt = "The quick brown fox jumps over"
    full = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=32)
    text = full.choices[0].text
    assert full.usage is not None and full.usage.completion_tokens >= 8, full  # long enough to stream

    # The first piece arrived while the request was still generating (see the module
    # docstring): in flight while the talker is held there. 0 means it had finished, so
    # the attempt showed nothing (a stall) or the server does not stream: try again.
    talker = _Talker(server)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 32}
    for _ in range(ATTEMPTS):
        try:
            events, in_flight = _held_at_first_piece(server, talker, body, leave=False)
        finally:
            talker.release()
        if in_flight != 0:
            break
    assert in_flight == 1, f"in flight at the first piece: {in_flight} (in {ATTEMPTS} attempts)"
    assert events[-1][1] == "[DONE]"
    chunks = [e for _, e in events[:-1]]
    assert all(isinstance(c, dict) and c["object"] == "text_completion" for c in chunks)
    pieces = [c["choices"][0]["text"] for c in chunks if c["choices"][0]["text"]]  # type: ignore[index]
    # several pieces, concatenating to the non-streaming answer (greedy: the same text)
    assert len(pieces) > 1 and "".join(pieces) == text, (pieces, text)
    finish = [c["choices"][0]["finish_reason"] for c in chunks]  # type: ignore[index]
    assert finish[:-1] == [None] * (len(finish) - 1) and finish[-1] == full.choices[0].finish_reason

    # chat, through the openai client: role first, content pieces, finish_reason last
    messages = [{"role": "user", "content": "Tell me a story"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=32)  # type: ignore[arg-type]
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=32, stream=True)  # type: ignore[arg-type]
    got = list(stream)
    assert got[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in got if c.choices[0].delta.content]
    assert len(content) > 1 and "".join(content) == chat.choices[0].message.content
    assert got[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in got[:-1])


def test_client_leaving_mid_stream_aborts_the_request(server: Server) -> None:
    def disconnects() -> float:
        metrics = httpx.get(server.url + "/metrics").text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("kvbridge_request_failures_total{") and 'reason="client_disconnect"' in line
        )

    # Leave at the first piece of text, the talker held there: the request is still in
    # flight when the server sees the client leave (it polls for that while it waits for
    # the next piece). As in test_streaming_is_incremental, an attempt whose request had
    # finished before the hold shows nothing and is repeated.
    talker = _Talker(server)
    body = {"model": MODEL_NAME, "prompt": "A long walk along the river", "max_tokens": 32}
    for _ in range(ATTEMPTS):
        before = disconnects()
        try:
            events, in_flight = _held_at_first_piece(server, talker, body, leave=True)
            if in_flight == 1:
                assert events[-1][1] != "[DONE]"
                counted = lambda n=before + 1: disconnects() == n  # noqa: E731
                assert wait_for(counted, 10), (before, disconnects())
        finally:
            talker.release()
        assert wait_for(lambda: httpx.get(server.url + "/debug/state").json()["in_flight"] == 0, 10)
        if in_flight != 0:
            break
    assert in_flight == 1, f"in flight at the first piece: {in_flight} (in {ATTEMPTS} attempts)"
    # the stages dropped it and still serve
    res = _client(server).completions.create(model=MODEL_NAME, prompt="Still there?", max_tokens=4)
    assert res.choices[0].text


def test_text_endpoint_errors(server: Server) -> None:
    client = _client(server)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="davinci-002", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512"):
        client.completions.create(model=MODEL_NAME, prompt="word " * 600)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL_NAME, prompt="hi", temperature=-1)
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL_NAME, "messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/images/generations", json={"prompt": "a cat"})
    assert r.status_code == 400 and "completions" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_sigterm_finishes_or_aborts_in_flight_requests(server: Server) -> None:
    health = httpx.get(server.url + "/health").json()
    run_id = httpx.get(server.url + "/debug/state").json()["run_id"]
    statuses: list[object] = [None] * 6
    started = threading.Barrier(7)

    def one(i: int) -> None:
        started.wait()
        try:
            r = httpx.post(
                server.url + "/v1/completions",
                json={"model": MODEL_NAME, "prompt": f"request {i}", "max_tokens": 8},
                timeout=60,
            )
            statuses[i] = r.status_code
        except httpx.HTTPError as exc:
            statuses[i] = type(exc).__name__

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    started.wait()

    # SIGTERM once the server has had every request (a connection still in the listen
    # backlog when uvicorn closes its socket is refused, which is not what this test is
    # about). Answered ones are counted before the in-flight ones are read, so none is
    # counted twice; waiting for all 6 in flight at once would be a race with the answers.
    def all_reached() -> bool:
        answered = sum(s is not None for s in statuses)
        return answered + httpx.get(server.url + "/debug/state").json()["in_flight"] == 6

    assert wait_for(all_reached, 30, 0.02), statuses
    os.kill(server.proc.pid, signal.SIGTERM)
    for t in threads:
        t.join(timeout=60)
    code = stop(server, signal.SIGTERM, timeout_s=60)
    assert code == 0, server.log()
    # each request was either served or answered 503 (never left hanging)
    assert all(s in (200, 503) for s in statuses), statuses
    for s in health["stages"]:  # every stage's process group is gone (zombies aside)
        assert wait_for(lambda pid=s["pid"]: not group_alive(pid), 10), group_alive(s["pid"])
    assert shm_names(run_id) == []
