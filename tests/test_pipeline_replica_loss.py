"""A replica lost under load (issue 41): AR -> DiT with 2 DiT replicas, real processes.

The DiT module is :class:`pipeline_fixtures.GatedDiT`: while the ``hold`` gate exists no
request leaves a replica, so 4 requests split 2 and 2 (least outstanding, ties to replica 0:
nothing finishes meanwhile), and a restarted replica is not built until ``open`` exists (it
stays ``recovering`` while the test looks). Replica 1's process group is SIGKILLed: exactly
its 2 requests fail, naming the stage and the replica; the stage is never ``recovering`` as
a whole (a new request is admitted and goes to replica 0); replica 1 comes back under a new
process and serves again; nothing of the run is left in /dev/shm.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from pipeline_fixtures import ROOT, STAGE_ENV, poll_until, shm_segments

from vllm_kvbridge.models.tiny_lm import ensure_tiny_model
from vllm_kvbridge.pipeline import Pipeline
from vllm_kvbridge.pipeline.results import RequestResult

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def _config(tmp: Path, gates: Path) -> Path:
    import yaml

    config = yaml.safe_load((ROOT / "stage_configs/ar_to_dit_shm.yaml").read_text())
    dit = config["stages"][1]
    dit.update(replicas=2, env={"KVBRIDGE_TEST_GATES": str(gates)})
    dit["diffusion"]["class_path"] = "pipeline_fixtures.GatedDiT"
    config["runtime"] = {"max_restarts": 2, "restart_backoff": 0.2}
    path = tmp / "ar_to_dit_replicas.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.forked
@pytest.mark.long(400, "a pipeline of a vLLM engine and two DiT replicas, one killed and restarted")
def test_a_killed_replica_fails_only_its_requests_while_the_other_serves(tmp_path: Path) -> None:
    gates = tmp_path / "gates"
    gates.mkdir()
    (gates / "open").touch()  # both replicas build their module at the start
    config, model = _config(tmp_path, gates), str(ensure_tiny_model())
    # its own log directory: a run that lost a process keeps the one it made itself
    pipe = Pipeline.from_config(config, model=model, env=STAGE_ENV, log_dir=tmp_path / "logs")
    finished: dict[str, RequestResult] = {}
    with pipe:
        (gates / "open").unlink()  # from now on a restarted replica waits at its gate
        (gates / "hold").touch()
        rids = [pipe.submit(f"A cute cat number {i}", request_id=f"a{i}") for i in range(4)]
        routed = lambda: {r: s.get(1) for r, s in pipe.request_replicas().items()}  # noqa: E731
        poll_until(lambda: None not in routed().values() and len(routed()) == 4, 180, pipe, finished)
        on = routed()
        assert sorted(on.values()) == [0, 0, 1, 1], on  # held: nothing left a replica meanwhile
        victim = pipe.replica_pids()[1, 1]
        survivor = pipe.replica_pids()[1, 0]
        os.killpg(victim, signal.SIGKILL)
        lost = {r for r, k in on.items() if k == 1}
        poll_until(lambda: lost <= set(finished), 30, pipe, finished)
        assert set(finished) == lost, finished  # only the killed replica's requests
        for rid in lost:
            err = finished[rid].error or ""
            assert (
                finished[rid].lost_stage == 1
                and "stage 1 (diffusion) replica 1 failed: process exited" in err
            )
        # replica 1 recovers (held at its gate) but the stage serves: nothing is refused
        [dit] = [s for s in pipe.stage_health() if s["stage_id"] == 1]
        assert dit["status"] == "ready", dit
        assert [r["status"] for r in dit["replicas"]] == ["ready", "recovering"], dit
        assert pipe.recovering() == []
        late = pipe.submit("A dog", request_id="late")
        poll_until(lambda: pipe.request_replicas().get(late, {}).get(1) is not None, 120, pipe, finished)
        assert pipe.request_replicas()[late][1] == 0  # the recovering replica is avoided
        (gates / "hold").unlink()
        kept = {r for r in rids if r not in lost} | {late}
        poll_until(lambda: kept <= set(finished), 120, pipe, finished)
        for rid in kept:
            r = finished[rid]
            assert r.error is None and r.image.shape == (3, 32, 32), r
            assert [s.replica for s in r.stages] == [0, 0]
        # replica 1 comes back as a new process and takes requests again
        (gates / "open").touch()

        def back() -> bool:
            [d] = [s for s in pipe.stage_health() if s["stage_id"] == 1]
            return [r["status"] for r in d["replicas"]] == ["ready", "ready"]

        poll_until(back, 120, pipe, finished)
        assert pipe.replica_pids()[1, 1] != victim and pipe.replica_pids()[1, 0] == survivor
        (gates / "hold").touch()
        again = [pipe.submit(f"A bird {i}", request_id=f"b{i}") for i in range(2)]
        poll_until(
            lambda: all(pipe.request_replicas().get(r, {}).get(1) is not None for r in again),
            120,
            pipe,
            finished,
        )
        assert sorted(pipe.request_replicas()[r][1] for r in again) == [0, 1]
        (gates / "hold").unlink()
        poll_until(lambda: set(again) <= set(finished), 120, pipe, finished)
        assert all(finished[r].error is None for r in again), [finished[r].error for r in again]
    assert shm_segments(f"kvbridge.{pipe.run_id}") == []
