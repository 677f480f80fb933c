"""The worker side of KVBridgeConnector hands a payload stage's runner each step's ended
requests and capture updates (``take_step_events``): the runner calls the connector, never
the reverse (issue 38). Real objects: the worker side, step metadata, a capture update."""

from __future__ import annotations

from vllm_kvbridge.runner.capture import CaptureUpdate
from vllm_kvbridge.runner.connector_worker import KVBridgeConnectorWorker
from vllm_kvbridge.runner.settings import RunnerSettings
from vllm_kvbridge.runner.vllm_connector import KVBridgeConnectorMetadata

_EDGE = {"connector": "SharedMemoryConnector", "connector_config": {"namespace": "roles"}}


def _worker(settings: dict) -> KVBridgeConnectorWorker:
    return KVBridgeConnectorWorker(RunnerSettings.from_dict(settings), None, None, block_size=16)


def _step(finished: dict, capture: dict) -> KVBridgeConnectorMetadata:
    return KVBridgeConnectorMetadata(finished=finished, capture=capture)


def test_a_payload_stage_keeps_each_steps_events_until_its_runner_takes_them_once() -> None:
    worker = _worker({"stage_id": 0, "payload": {"outputs": [{"to_stage": 1, **_EDGE}]}})
    update = CaptureUpdate("t1", num_prompt_tokens=3, start=0, tokens=(5, 6))
    worker.wait_for_save(_step({}, {"r1": update}))
    worker.wait_for_save(_step({"r1": ("finished", "t1"), "r2": ("aborted", "t2")}, {}))
    worker.wait_for_save(_step({}, {}))  # nothing ended: no event
    assert worker.take_step_events() == [
        ({}, {"r1": update}),
        ({"r1": ("finished", "t1"), "r2": ("aborted", "t2")}, {}),
    ]
    assert worker.take_step_events() == []  # each event once


def test_a_stage_without_payload_outputs_keeps_no_events() -> None:
    """A KV-only stage may run vLLM's stock worker, with no runner to take them: kept, they
    would pile up for the engine's life."""
    worker = _worker({"stage_id": 0})
    for i in range(3):
        worker.wait_for_save(_step({f"r{i}": ("finished", f"t{i}")}, {}))
    assert worker.take_step_events() == []
