"""A request's own failure fails that request only, with its reason (issue 11, cases 4 and 16).

One ``vllm-kvbridge run`` of the AR -> DiT shm config with four prompts, the LLM stage on
``kv_fault_fixtures.FaultyKVWorker``: a good prompt, a prompt over ``max_model_len`` (vLLM
rejects it when it is added), a prompt whose KV put the store refuses, and one whose KV is
refused *and* whose first status answer is "unknown" (the stage used to count "unknown" as
sent and report the request done; the DiT then waited its whole recv_timeout and failed
with a timeout that did not say why).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pipeline_fixtures import ROOT, TESTS_DIR, processes_using, shm_segments

from vllm_kvbridge.models.tiny_lm import ensure_tiny_model

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.mark.forked
@pytest.mark.long(400, "`run` through the CLI: a pipeline start and four requests, one of 600 words")
def test_bad_requests_fail_alone_with_their_reason(tmp_path: Path) -> None:
    model = ensure_tiny_model()
    out_dir = tmp_path
    config = yaml.safe_load((ROOT / "stage_configs/ar_to_dit_shm.yaml").read_text())
    config["stages"][0]["worker_cls"] = "kv_fault_fixtures.FaultyKVWorker"
    config["stages"][0]["env"] = {"KVB_TEST_REFUSE_KV": "req-3,req-4", "KVB_TEST_LATE_STATUS": "req-4"}
    config_path = out_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    prompts = ["A cute cat", "word " * 600, "A cute dog", "A cute bird"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])),
    }
    args = [sys.executable, "-m", "vllm_kvbridge.cli.main", "run", "--stage-config", str(config_path)]
    for p in prompts:
        args += ["--prompt", p]
    args += ["--model", str(model), "--output-dir", str(out_dir)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=380, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a request failed, the run did not
    requests = {r["request_id"]: r for r in json.loads((out_dir / "result.json").read_text())["requests"]}
    assert requests["req-1"]["error"] is None and requests["req-1"]["image_shape"] == [3, 32, 32]
    assert Path(requests["req-1"]["outputs"][0]).read_bytes().startswith(b"\x89PNG")
    long_error = requests["req-2"]["error"]
    assert long_error.startswith("stage 0 (llm_ar): invalid request:"), long_error
    assert "maximum context length" in long_error or "max_model_len" in long_error, long_error
    for rid in ("req-3", "req-4"):
        error = requests[rid]["error"]
        assert error is not None and "injected: the store refused the KV" in error, (rid, error)
        assert error.startswith("stage 0 (llm_ar): transfer failed"), (rid, error)
        assert requests[rid]["outputs"] == []
    assert processes_using(out_dir) == []
    run_id = json.loads((out_dir / "result.json").read_text())["run_id"]
    assert shm_segments(f"kvbridge.{run_id}-") == []  # this run's: others on the host do not count
