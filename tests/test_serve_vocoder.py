"""``vllm-kvbridge serve`` in front of thinker -> talker -> vocoder: ``POST /v1/audio/speech``.

One real server for the module (two vLLM engines and the vocoder stage, the shipped
thinker_talker_vocoder.yaml as it is, more tokens only: streaming end to end, the talker
fed the thinker's rows per step): WAV, raw PCM and the SSE stream of one input carry the
same audio (greedy in both LLM stages), through OpenAI's client too; the stream's first
piece of audio reaches the client while the thinker and the talker still generate; the
other endpoints answer 400 naming this one.

The streaming test holds the thinker and the talker (SIGSTOP on their process groups) the
moment the client has read the first piece of audio, and asks the server, while they are
held, which stages still work on the request: a server that streams audio as the vocoder
makes it still has both on it (the thinker generates ``THINKER_TOKENS``, the talker
``TALKER_TOKENS``; the first piece needs 4 of the talker's codes, which need the thinker's
first chunk), one that sends the audio once the request finished has nobody. The server
exposes no per-stage times to its client; which stages are still on the request while
they are held is what it can say, and a held stage cannot finish while it is asked. A
process stalled on this 2-core machine can let the thinker finish before the first piece
was read; such an attempt shows nothing and is repeated (``ATTEMPTS``); a server that does
not stream fails every one.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import wave

import httpx
import openai
import pytest
from serve_fixtures import ROOT, Server, serve_edited

from vllm_kvbridge.models.tiny_lm import ensure_tiny_model

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.long(300, "a server of two vLLM engines and a vocoder, started by the module's first test"),
]
CONFIG = ROOT / "stage_configs/thinker_talker_vocoder.yaml"
MODEL_NAME = "thinker_talker_vocoder"
THINKER_TOKENS, TALKER_TOKENS = 256, 64
HOP, RATE = 240, 24_000  # the tiny vocoder's defaults
ATTEMPTS = 5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("serve-vocoder")

    def edit(spec: dict) -> None:  # type: ignore[type-arg]
        spec["stages"][0]["default_sampling_params"].update(max_tokens=THINKER_TOKENS, ignore_eos=True)
        spec["stages"][1]["default_sampling_params"].update(max_tokens=TALKER_TOKENS, ignore_eos=True)

    with serve_edited(CONFIG, tmp, ensure_tiny_model(), edit) as srv:
        yield srv


def _speech(server: Server, **body: object) -> httpx.Response:
    return httpx.post(server.url + "/v1/audio/speech", json={"model": MODEL_NAME, **body}, timeout=120)


def _sse(server: Server, body: dict, on_delta=None) -> list[dict]:  # type: ignore[no-untyped-def, type-arg]
    """Stream ``body`` as SSE; the parsed events. ``on_delta(event)`` runs at each audio piece."""
    events: list[dict] = []  # type: ignore[type-arg]
    body = {"model": MODEL_NAME, **body, "stream_format": "sse"}
    with httpx.stream("POST", server.url + "/v1/audio/speech", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            events.append(json.loads(line[len("data: ") :]))
            if on_delta is not None and events[-1]["type"] == "speech.audio.delta":
                on_delta(events[-1])
    return events


def test_wav_pcm_sse_and_openai_client_carry_the_same_audio(server: Server) -> None:
    text = "Hello there, little model"
    wav = _speech(server, input=text)
    assert wav.status_code == 200 and wav.headers["content-type"] == "audio/wav", wav.text
    with wave.open(io.BytesIO(wav.content)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, RATE)
        frames = w.readframes(w.getnframes())
    assert len(frames) == TALKER_TOKENS * HOP * 2
    pcm = _speech(server, input=text, response_format="pcm")
    assert pcm.status_code == 200 and pcm.headers["x-sample-rate"] == str(RATE)
    assert pcm.content == frames  # greedy in both LLM stages: the same codes, the same audio

    events = _sse(server, {"input": text})
    *deltas, done = events
    assert [e["type"] for e in deltas] == ["speech.audio.delta"] * len(deltas) and len(deltas) > 1
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == frames
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] == TALKER_TOKENS
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    res = client.audio.speech.create(model=MODEL_NAME, voice="alloy", input=text, response_format="wav")
    assert res.content == wav.content


def test_audio_streams_while_the_thinker_and_the_talker_still_generate(server: Server) -> None:
    stages = httpx.get(server.url + "/health").json()["stages"]
    pgids = [int(stages[0]["pid"]), int(stages[1]["pid"])]  # the thinker's and the talker's
    assert [s["kind"] for s in stages[:2]] == ["llm_ar", "llm_generation"]
    seen: list[list[int]] = []  # the stages working on the request at its first piece of audio

    def at_first_piece(event: dict) -> None:  # type: ignore[type-arg]
        if seen:
            return
        for pgid in pgids:
            os.killpg(pgid, signal.SIGSTOP)
        try:
            requests = httpx.get(server.url + "/debug/state", timeout=30).json()["requests"]
            seen.append(sorted(next(iter(requests.values()), [])))
        finally:
            for pgid in pgids:
                os.killpg(pgid, signal.SIGCONT)

    for _ in range(ATTEMPTS):
        seen.clear()
        events = _sse(server, {"input": "Once upon a time"}, at_first_piece)
        assert events[-1]["type"] == "speech.audio.done", events[-1]
        if seen and {0, 1} <= set(seen[0]):
            break
    assert seen and {0, 1} <= set(seen[0]), f"stages on it at its first audio: {seen} ({ATTEMPTS} tries)"


def test_other_endpoints_name_this_one_and_bad_requests_are_400(server: Server) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 400 and "/v1/audio/speech" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/images/generations", json={"prompt": "hi"})
    assert r.status_code == 400 and "produces audio" in r.json()["error"]["message"]
    r = _speech(server, input="hi", response_format="mp3")
    assert r.status_code == 400 and "response_format" in r.json()["error"]["message"]
    r = _speech(server, input="")
    assert r.status_code == 400 and "input" in r.json()["error"]["message"]
    r = _speech(server, input="hi", model="other")
    assert r.status_code == 404
    [model] = httpx.get(server.url + "/v1/models").json()["data"]
    assert model["kvbridge"]["output"] == "audio"
    assert [s["kind"] for s in model["kvbridge"]["stages"]] == ["llm_ar", "llm_generation", "vocoder"]
