"""RequestBook, the orchestrator's per-request state, without any stage process."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kvbridge.config.resolve import resolve
from vllm_kvbridge.pipeline import messages as m
from vllm_kvbridge.pipeline.request_book import RequestBook
from vllm_kvbridge.pipeline.results import StageRecord

ROOT = Path(__file__).resolve().parents[1]
PLAN = resolve(ROOT / "stage_configs/ar_to_dit_shm.yaml")  # stage 0 (LLM) -> stage 1 (diffusion)


def _begin(book: RequestBook, rid: str, **kw: object) -> m.Submit:
    args: dict = {"sampling_params": None, "stage_params": None, "on_progress": None, "polled": False}
    args.update(kw)
    return book.begin(PLAN, rid, "a cat", **args)


def test_batch_ids_number_on_across_batches() -> None:
    book = RequestBook()
    assert book.batch_ids(2) == ["req-1", "req-2"]
    assert book.batch_ids(1) == ["req-3"]


def test_params_layer_stage_defaults_stage_params_and_own_params() -> None:
    book = RequestBook()
    first = _begin(
        book, "r1", sampling_params={"max_tokens": 3}, stage_params={0: {"temperature": 0.5}, 1: {"seed": 7}}
    )
    assert first.prompt == "a cat" and first.upstream == []
    assert first.sampling_params == {
        **PLAN.stage(0).default_sampling_params,
        "temperature": 0.5,
        "max_tokens": 3,
    }
    up = m.Upstream(0, "r1", {}, {})
    nxt = book.downstream_submit(PLAN.stage(1), "r1", [up])
    assert nxt.prompt is None and nxt.upstream == [up]
    assert nxt.sampling_params == {**PLAN.stage(1).default_sampling_params, "seed": 7}


def test_finish_names_the_stages_to_abort_only_when_it_failed() -> None:
    book = RequestBook()
    for rid in ("ok", "bad"):
        _begin(book, rid)
        book.entered(rid, StageRecord(0, "llm", 0.0))
        book.sent(rid, 0)
    assert book.finish("ok") == set()
    assert book.finish("bad", "boom") == {0}
    assert book.finish("bad", "again") == set()  # once only
    assert book.failed
    with pytest.raises(ValueError, match="already in use"):
        book.check_new("bad")  # until handed back
    book.pop("bad")
    with pytest.raises(ValueError, match="ended in error"):
        book.check_new("bad")  # and for a while after, as its stages drop what comes late
    other = RequestBook()
    _begin(other, "aborted")
    other.sent("aborted", 0)
    assert other.finish("aborted", "aborted", aborted=True) == {0}
    assert not other.failed  # a caller's abort keeps no logs
    assert book.results["ok"].finished and book.results["ok"].error is None


def test_expired_lists_the_stages_not_done() -> None:
    book = RequestBook()
    _begin(book, "r1")
    book.entered("r1", StageRecord(0, "llm", 0.0))
    assert book.expired(0.0) == {}
    assert book.expired(float("inf")) == {"r1": [0]}


def test_only_submitted_requests_are_collected_for_poll() -> None:
    book = RequestBook()
    _begin(book, "polled", polled=True)
    _begin(book, "batch")
    book.finish("polled")
    book.finish("batch")
    book.collect_polled()
    assert [r.request_id for r in book.take_finished()] == ["polled"]
    assert book.take_finished() == []
    assert list(book.results) == ["batch"]  # generate() pops its own
    assert book.in_flight() == []
