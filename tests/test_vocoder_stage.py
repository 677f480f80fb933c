"""The vocoder stage (``kind: vocoder``): the tiny vocoder's streaming contract, and the
stage engine fed by a real :class:`PayloadSender` over shared memory (no vLLM needed).

What the engine must do: turn each chunk into audio as soon as it lands (a streaming
request gets that chunk's samples before its producer sent the next chunk), in order, the
pieces adding up to the request's whole audio, which equals the module run over all its
codes at once (within the module's stated tolerance); fail a request whose stream stalls,
is aborted by its producer, or carries chunks the module cannot take, with the reason,
while the other requests finish; leave nothing in /dev/shm.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch
from runner_fixtures import shm_entries, shm_namespace

from vllm_kvbridge.config import resolve_spec, spec_from_dict
from vllm_kvbridge.connectors.registry import create_connector
from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.models.tiny_vocoder import TinyVocoder
from vllm_kvbridge.pipeline import messages as m
from vllm_kvbridge.pipeline.audio import encode_pcm16, encode_wav
from vllm_kvbridge.runner.payload_stream import PayloadSender

NS = shm_namespace("voc")
STALL_S = 1.0
ATOL = 1e-6  # the module's stated streaming tolerance (models/tiny_vocoder.py)


def _config(vocoder: dict[str, Any] | None = None, **stage: Any) -> dict[str, Any]:
    return {
        "connectors": {"shm": {"name": "shm", "extra": {"namespace": NS}}},
        "stages": [
            {
                "stage_id": 0,
                "kind": "llm_generation",
                "model": "m",
                "payload": {"mode": "async_chunk", "chunk_size": 4, "capture": ["token_ids"]},
            },
            {
                "stage_id": 1,
                "kind": "vocoder",
                "vocoder": {"kwargs": {"hop_length": 64}, **(vocoder or {})},
                "payload": {"mode": "async_chunk", "stall_timeout": STALL_S, "recv_timeout": 30},
                **stage,
            },
        ],
        "edges": [{"from_stage": 0, "to_stage": 1, "connector": "shm"}],
    }


def _codes(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


# -- the module -------------------------------------------------------------------------
def test_same_seed_same_weights_and_chunked_audio_equals_the_whole() -> None:
    a, b, c = TinyVocoder(seed=0), TinyVocoder(seed=0), TinyVocoder(seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.embed.weight, c.embed.weight)
    codes = _codes(0, 23)
    whole = a(codes)
    assert whole.shape == (23 * a.hop_length,) and whole.abs().max() <= 1.0
    for sizes in ([23], [4] * 5 + [3], [1] * 23, [7, 1, 15]):
        state, pieces, at = a.init_state(), [], 0
        for n in sizes:
            piece, state = a.forward_chunk(codes[at : at + n], state)
            assert piece.shape == (n * a.hop_length,)
            pieces.append(piece)
            at += n
        assert torch.allclose(torch.cat(pieces), whole, atol=ATOL, rtol=0), sizes
    # The context makes a code's audio depend on the codes before it.
    other = codes.clone()
    other[10] = (other[10] + 1) % 512
    diff = (a(other) - whole).abs().reshape(23, -1).amax(dim=1)
    assert diff[:10].max() == 0 and (diff[10:13] > 0).all() and diff[13:].max() == 0


def test_the_module_refuses_what_is_not_a_code() -> None:
    voc = TinyVocoder()
    with pytest.raises(ValueError, match="code 512 is outside"):
        voc.forward_chunk(torch.tensor([1, 512]), voc.init_state())
    with pytest.raises(ValueError, match="integers"):
        voc.forward_chunk(torch.zeros(3), voc.init_state())


def test_wav_and_pcm_encoding() -> None:
    import io
    import wave

    samples = np.array([0.0, 0.5, -1.0, 2.0], dtype=np.float32)
    pcm = encode_pcm16(samples)
    assert np.frombuffer(pcm, "<i2").tolist() == [0, 16384, -32767, 32767]  # clipped to [-1, 1]
    with wave.open(io.BytesIO(encode_wav(samples, 24_000))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, 24_000, 4)
        assert w.readframes(4) == pcm


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"vocoder": {"input_key": "hidden_states"}}, r"stages\[1\]\.vocoder\.input_key: .*'hidden_states'"),
        ({"model": "m"}, r"stages\[1\]\.model: vocoder stages host the module"),
        ({"kv_transfer": {"need_recv_cache": True}}, r"stages\[1\]\.kv_transfer\.need_recv_cache: .*not KV"),
        ({"engine_args": {"seed": 1}}, r"stages\[1\]\.engine_args: vocoder stages run no vLLM engine"),
        ({"vocoder": {"class_path": "nodots"}}, r"stages\[1\]\.vocoder\.class_path"),
    ],
)
def test_config_errors_name_the_key(change: dict[str, Any], match: str) -> None:
    vocoder = change.pop("vocoder", None)
    with pytest.raises(ConfigError, match=match):
        resolve_spec(spec_from_dict(_config(vocoder, **change)))


def test_a_vocoder_needs_an_input_and_makes_no_payloads() -> None:
    cfg = _config()
    cfg["stages"].append({"stage_id": 2, "kind": "vocoder", "payload": {"mode": "async_chunk"}})
    cfg["edges"].append({"from_stage": 1, "to_stage": 2, "connector": "shm"})
    with pytest.raises(ConfigError, match=r"stages\[1\]\.payload\.mode: vocoder stages do not produce"):
        resolve_spec(spec_from_dict(cfg))
    cfg = _config()
    cfg["edges"] = []
    cfg["stages"][0]["payload"] = {}
    cfg["stages"][1]["payload"] = {}
    with pytest.raises(ConfigError, match=r"stages\[1\]\.kind: a vocoder stage needs an incoming payload"):
        resolve_spec(spec_from_dict(cfg))


# -- the stage engine -------------------------------------------------------------------
@pytest.fixture(scope="module")
def stage():  # type: ignore[no-untyped-def]
    from vllm_kvbridge.pipeline.engines import build_engine

    engine = build_engine(resolve_spec(spec_from_dict(_config())).stage(1))
    conn = create_connector("SharedMemoryConnector", {"namespace": NS})
    sender = PayloadSender(conn, 0, 1)
    try:
        yield engine, sender
    finally:
        engine.close()
        sender.close()
        conn.close()
    assert shm_entries(NS) == []


def _submit(engine: Any, rid: str, *, stream: bool) -> None:
    engine.submit(m.Submit(rid, upstream=[m.Upstream(0, rid)], stream=stream))


def _collect(engine: Any, out: dict[str, list[Any]], until: Any, timeout_s: float = 30.0) -> None:
    """Step the engine, filing its messages by request, until ``until(out)``."""
    end = time.monotonic() + timeout_s
    while not until(out):
        assert time.monotonic() < end, f"the engine did not get there in {timeout_s} s: {out}"
        for msg in engine.step():
            out.setdefault(msg.request_id, []).append(msg)
        time.sleep(0.002)


def _ended(out: dict[str, list[Any]], rid: str) -> bool:
    return any(isinstance(x, m.StageDone | m.RequestFailed) for x in out.get(rid, []))


def test_each_chunk_is_vocoded_as_it_lands_and_the_pieces_make_the_whole(stage) -> None:  # type: ignore[no-untyped-def]
    engine, sender = stage
    voc = engine.runner.module
    codes = {"a": _codes(1, 10), "b": _codes(2, 6)}
    _submit(engine, "a", stream=True)
    _submit(engine, "b", stream=False)
    sender.send_chunk("a", {"token_ids": codes["a"][:4]})
    sender.send_chunk("b", {"token_ids": codes["b"]}, final=True)
    out: dict[str, list[Any]] = {}
    # "a"'s first chunk becomes audio while its producer has not sent the second one yet.
    _collect(engine, out, lambda o: any(isinstance(x, m.StageProgress) for x in o.get("a", [])))
    assert not _ended(out, "a")
    first = m.tensor_from_msg(out["a"][0].audio_delta)
    assert first.shape == (4 * voc.hop_length,)
    sender.send_chunk("a", {"token_ids": codes["a"][4:8]})
    sender.send_chunk("a", {"token_ids": codes["a"][8:]})
    sender.send_chunk("a", None, final=True)
    _collect(engine, out, lambda o: _ended(o, "a") and _ended(o, "b"))
    for rid in ("a", "b"):
        *progress, done = out[rid]
        assert isinstance(done, m.StageDone), done
        audio = m.tensor_from_msg(done.audio)
        expected = voc(codes[rid]).numpy()
        assert np.allclose(audio, expected, atol=ATOL, rtol=0)
        assert done.output["sample_rate"] == voc.sample_rate
        assert done.output["rows"] == len(codes[rid]) and done.output["num_samples"] == len(expected)
        assert 0 < done.first_token_at <= done.last_token_at <= done.finished
        [t] = done.transfers
        assert (t.from_stage, t.to_stage, t.what, t.side) == (0, 1, "chunks", "receiver") and t.nbytes > 0
        if rid == "a":  # streamed: one piece per chunk, in order, adding up to the audio
            assert [len(m.tensor_from_msg(p.audio_delta)) // voc.hop_length for p in progress] == [4, 4, 2]
            assert np.array_equal(np.concatenate([m.tensor_from_msg(p.audio_delta) for p in progress]), audio)
        else:
            assert progress == []  # not streamed: no progress messages
    assert engine.runner.active() == [] and sender.in_flight() == 0


def test_a_stalled_aborted_or_unusable_stream_fails_its_request_alone(stage) -> None:  # type: ignore[no-untyped-def]
    engine, sender = stage
    rids = ("ok", "stalls", "aborted", "bad_code", "no_codes")
    for rid in rids:
        _submit(engine, rid, stream=False)
    t0 = time.monotonic()
    sender.send_chunk("stalls", {"token_ids": _codes(3, 4)})
    sender.send_chunk("aborted", {"token_ids": _codes(4, 4)})
    sender.abort("aborted", "the talker was aborted", chunked=True)
    sender.send_chunk("bad_code", {"token_ids": torch.tensor([1, 2, 999])})
    sender.send_chunk("no_codes", {"hidden_states": torch.zeros(2, 8)})
    sender.send_chunk("ok", {"token_ids": _codes(5, 4)})
    sender.send_chunk("ok", {"token_ids": _codes(6, 4)}, final=True)
    out: dict[str, list[Any]] = {}
    _collect(engine, out, lambda o: all(_ended(o, r) for r in rids))
    assert isinstance(out["ok"][-1], m.StageDone)
    errors = {rid: out[rid][-1].error for rid in rids[1:]}
    assert all(isinstance(out[rid][-1], m.RequestFailed) for rid in rids[1:]), out
    assert "chunk 1" in errors["stalls"] and "stalled" in errors["stalls"], errors
    assert time.monotonic() - t0 >= STALL_S
    assert "the talker was aborted" in errors["aborted"]
    assert "code 999 is outside" in errors["bad_code"] and "chunk 0" in errors["bad_code"]
    assert "'token_ids'" in errors["no_codes"] and "hidden_states" in errors["no_codes"]
    assert engine.runner.active() == []
    # Nothing left: every chunk put was read (the bad ones too) or never published.
    assert sender.in_flight() == 0 and sender.connector.health()["published"] == 0


def test_an_aborted_request_reports_nothing_more(stage) -> None:  # type: ignore[no-untyped-def]
    engine, sender = stage
    _submit(engine, "gone", stream=True)
    _submit(engine, "stays", stream=False)
    sender.send_chunk("gone", {"token_ids": _codes(7, 4)})
    out: dict[str, list[Any]] = {}
    _collect(engine, out, lambda o: "gone" in o)  # its first piece
    engine.abort(["gone"])
    assert "gone" not in engine.runner.active()
    sender.send_chunk("stays", {"token_ids": _codes(8, 4)}, final=True)
    _collect(engine, out, lambda o: _ended(o, "stays"))
    assert [type(x) for x in out["gone"]] == [m.StageProgress]


def test_a_stage_fed_per_step_may_send_payloads_of_its_own() -> None:
    """Issue 40, item 1: a talker fed per step that streams its codes to a vocoder resolves
    (it was refused while its requests were conditioned on wrong rows: the pipeline's
    skip_reading_prefix_cache made vLLM ignore the feed's "not yet", see
    test_runner_fed_capture), as does the shipped vocoder config's talker."""
    cfg = _config()
    cfg["stages"].insert(
        0,
        {
            "stage_id": 9,
            "kind": "llm_ar",
            "model": "m",
            "payload": {"mode": "async_chunk", "chunk_size": 4, "capture": ["hidden_states", "token_ids"]},
        },
    )
    cfg["stages"][1]["payload"]["feed"] = "per_step"
    cfg["edges"].insert(0, {"from_stage": 9, "to_stage": 0, "connector": "shm"})
    talker = resolve_spec(spec_from_dict(cfg)).stage(0)
    assert talker.payload["feed"] == "per_step"
    assert [e.to_stage for e in talker.outputs] == [1] and [e.from_stage for e in talker.inputs] == [9]
    cfg["stages"][1]["payload"]["feed"] = "prompt_embeds"  # the shipped vocoder config's talker
    assert resolve_spec(spec_from_dict(cfg)).stage(0).payload["feed"] == "prompt_embeds"
