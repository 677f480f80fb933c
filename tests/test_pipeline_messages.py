"""Control messages: the streaming additions (``Submit.stream``, ``StageProgress``) round-trip
through msgpack, and malformed progress frames are rejected rather than guessed."""

from __future__ import annotations

import msgspec
import pytest

from vllm_kvbridge.pipeline import messages as m


def test_submit_stream_flag_round_trips_and_defaults_off() -> None:
    assert m.decode_to_stage(m.encode(m.Submit("r1", prompt="hi"))).stream is False
    got = m.decode_to_stage(m.encode(m.Submit("r1", prompt="hi", stream=True)))
    assert isinstance(got, m.Submit) and got.stream is True


def test_stage_progress_round_trips() -> None:
    msg = m.StageProgress("r1", 1, " wor", [1917, 42])
    got = m.decode_from_stage(m.encode(msg))
    assert got == msg
    assert m.decode_from_stage(m.encode(m.StageProgress("r2", 0))) == m.StageProgress("r2", 0, "", [])


def test_malformed_progress_is_rejected() -> None:
    enc = msgspec.msgpack.Encoder()
    with pytest.raises(msgspec.DecodeError):  # token ids must be ints
        m.decode_from_stage(
            enc.encode({"type": "progress", "request_id": "r", "stage_id": 0, "token_ids_delta": ["x"]})
        )
    with pytest.raises(msgspec.DecodeError):  # unknown field
        m.decode_from_stage(enc.encode({"type": "progress", "request_id": "r", "stage_id": 0, "extra": 1}))
    with pytest.raises(msgspec.DecodeError):  # progress only travels stage -> orchestrator
        m.decode_to_stage(m.encode(m.StageProgress("r", 0, "x")))
