"""Stage replicas (issue 41): the routing rule and the bookkeeping it reads, fast (no process).

End to end with real stage processes (2 DiT replicas under concurrent load):
``test_pipeline_ar_to_dit.py::test_dit_replicas_share_concurrent_requests_through_the_cli``."""

from __future__ import annotations

import copy

from test_config_schema import BASE

from vllm_kvbridge.config import resolve_spec, spec_from_dict
from vllm_kvbridge.pipeline import messages as m
from vllm_kvbridge.pipeline.control_auth import given_to_sender
from vllm_kvbridge.pipeline.replicas import StageReplicas
from vllm_kvbridge.pipeline.request_book import RequestBook
from vllm_kvbridge.pipeline.results import StageError, StageRecord, StageRecovering
from vllm_kvbridge.pipeline.supervision import RestartPolicy


def _plan(replicas: int):
    data = copy.deepcopy(BASE)
    data["stages"][1]["replicas"] = replicas
    return resolve_spec(spec_from_dict(data, env={}))


def test_least_outstanding_replica_ties_to_the_lowest_index_and_skips_recovering_ones() -> None:
    reps = StageReplicas(_plan(3).stages[1], RestartPolicy())
    assert [c.replica for c in reps.copies] == [0, 1, 2] and len(reps) == 3
    assert reps.pick([0, 0, 0]) == 0
    assert reps.pick([1, 0, 0]) == 1
    assert reps.pick([1, 1, 0]) == 2
    assert reps.pick([2, 1, 1]) == 1
    err = StageError(1, "diffusion", "process exited", replica=1)
    reps.supervision[1].lost(err, now=1.0)
    assert reps.pick([2, 0, 1]) == 2  # replica 1 is recovering: new requests avoid it
    assert reps.recovering_error() is None  # the stage still serves
    reps.supervision[0].lost(StageError(1, "diffusion", "stalled", replica=0), now=2.0)
    reps.supervision[2].lost(StageError(1, "diffusion", "killed", replica=2), now=3.0)
    # none is up: the request waits for the least loaded one, and the stage says why
    assert reps.pick([2, 0, 1]) == 1
    assert reps.recovering_error() is not None and reps.recovering_error().replica == 2
    assert str(StageRecovering(err)) == "stage 1 (diffusion) replica 1 is restarting after: process exited"
    assert [reps.log_name(k) for k in range(3)] == [f"stage_1.replica{k}.log" for k in range(3)]


def test_a_batching_dit_is_routed_by_load_alone_an_idle_replica_before_batch_room() -> None:
    """No batch-room term for the DiT (docs/architecture.md, "Stage replicas"): a request
    joins a replica's next batch, never its running one, so the idle replica, where it
    starts at once, beats one whose batch "has room" (1 % 8 != 0); among equal loads the
    room is equal too, and the lowest index takes it."""
    data = copy.deepcopy(BASE)
    data["stages"][1].update(replicas=3, diffusion={"max_batch_size": 8})
    reps = StageReplicas(resolve_spec(spec_from_dict(data, env={})).stages[1], RestartPolicy())
    assert reps.stage.diffusion["max_batch_size"] == 8
    assert reps.pick([1, 0, 1]) == 1
    assert reps.pick([8, 9, 9]) == 0  # a full batch running: its next batch is empty
    assert reps.pick([3, 3, 3]) == 0


def test_one_replica_is_the_stage_as_before() -> None:
    reps = StageReplicas(_plan(1).stages[1], RestartPolicy())
    assert reps.pick([5]) == 0 and reps.log_name(0) == "stage_1.log"
    health = reps.health(pipeline_failed=False)
    assert health == {"stage_id": 1, "kind": "diffusion", "restarts": 0, "status": "not_started"}
    assert str(StageError(1, "diffusion", "x")) == "stage 1 (diffusion) failed: x"


def test_outstanding_counts_what_each_replica_holds_and_not_what_it_finished() -> None:
    plan = _plan(2)
    book = RequestBook()
    for rid in ("a", "b", "c", "d"):
        book.begin(plan, rid, "p", None, None, None, polled=False)
    book.entered("a", StageRecord(1, "diffusion", 0.0, replica=0))
    book.entered("b", StageRecord(1, "diffusion", 0.0, replica=1))
    book.entered("c", StageRecord(1, "diffusion", 0.0, replica=1))
    book.entered("d", StageRecord(0, "llm_ar", 0.0))
    assert book.outstanding(1, 2) == [1, 2]
    assert book.outstanding(0, 1) == [1]
    for rid in ("a", "b", "c"):
        book.sent(rid, 1)
    assert book.in_stage(1, 1) == ["b", "c"] and book.in_stage(1, 0) == ["a"]
    assert book.replica_of("c", 1) == 1 and book.replica_of("d", 1) is None
    book.stage_done(m.StageDone("b", 1), last=True)  # replica 1 reported b done
    book.finish("c", "failed")  # c failed: it holds nothing any more
    assert book.outstanding(1, 2) == [1, 0]
    # a replica's word counts only for what was given to it
    assert given_to_sender(m.StageDone("a", 1), book.results, replica=0)
    assert not given_to_sender(m.StageDone("a", 1), book.results, replica=1)


def test_health_lists_every_replica_and_is_ready_while_one_is() -> None:
    reps = StageReplicas(_plan(2).stages[1], RestartPolicy())
    health = reps.health(pipeline_failed=False)
    assert health["status"] == "not_started" and health["restarts"] == 0
    assert [(e["replica"], e["status"]) for e in health["replicas"]] == [
        (0, "not_started"),
        (1, "not_started"),
    ]


def test_check_config_prints_each_replica_and_where_it_goes() -> None:
    from vllm_kvbridge.cli.check_config import format_plan

    data = copy.deepcopy(BASE)
    data["stages"][1].update(replicas=2, devices="0,1")
    text = format_plan(resolve_spec(spec_from_dict(data, env={})))
    assert "  replicas: 2, each its own process; requests go to the least loaded" in text
    assert "    replica 0: a process on this host (local backend), devices 0" in text
    assert "    replica 1: a process on this host (local backend), devices 1" in text
    assert "replica" not in format_plan(_plan(1))  # one copy: nothing new to say


def test_replicas_go_through_ray_and_the_local_backend_stays_local() -> None:
    from vllm_kvbridge.pipeline.placement import LocalBackend, make_backend

    plan = _plan(2)
    assert isinstance(make_backend(plan, "r0"), LocalBackend)
    nodes = LocalBackend().place([c for s in plan.stages for c in plan.copies(s.stage_id)])
    assert sorted(nodes) == [(0, 0), (1, 0), (1, 1)]


def test_health_hides_every_replicas_pid_from_an_untrusted_caller() -> None:
    from vllm_kvbridge.server.introspection import public_stage_entry

    node = {"id": "local", "ip": "127.0.0.1", "host": "h"}
    entry = {
        "stage_id": 1,
        "kind": "diffusion",
        "status": "ready",
        "restarts": 0,
        "replicas": [{"replica": k, "status": "ready", "pid": 100 + k, "node": node} for k in range(2)],
    }
    public = public_stage_entry(entry)
    assert public["replicas"] == [{"replica": k, "status": "ready", "node": node} for k in range(2)]
    assert public_stage_entry({"stage_id": 0, "pid": 7, "node": node}) == {"stage_id": 0, "node": node}
    assert entry["replicas"][0]["pid"] == 100  # the pipeline's own entry is left as it was
