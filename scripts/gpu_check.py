#!/usr/bin/env python3
"""The GPU evidence of vllm-kvbridge, in one command (``make gpu-check``; ``make test-gpu``
runs its test part).

Runs on any CUDA machine with Python and torch, without internet, from a checkout of the
repo. What it needs besides torch (msgspec, pyzmq, pytest-forked; pytest and PyYAML where
the machine lacks them) comes as wheels in ``.whl/``: ``make gpu-wheels`` fills that
folder on a machine that reaches PyPI; carry it along. The wheels are installed into a
temporary folder, never into the machine's Python. vLLM is optional.

Each part says PASS, FAIL, or SKIP with a hardware or software reason, and the summary lists
them all. It exits non-zero when CUDA is not visible, when any part failed, or when a test
part ran no test: a GPU check that skipped everything is no evidence.

Parts:

* ``tests/gpu`` (plain torch): the staged KV path, CUDA IPC across processes (and across two
  GPUs where there are two), pinned and device memory bounded over 1,000 sends, the model
  thread's time with a full budget, the gather on every CUDA layout.
* the connector contract suite on the CUDA IPC connector.
* with vLLM installed (``--pipelines``, the default for ``gpu-check``): an AR -> DiT and two
  thinker -> talker pipelines (full payload; async chunks fed per step) at vLLM's GPU
  defaults (bf16, CUDA graphs, Model Runner V2, async scheduling), with
  ``VLLM_GPU_SYNC_CHECK=warn``; the host syncs it reports in kvbridge's own code are counted.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
#: import name -> distribution, for what the GPU tests import besides torch
NEEDED = {
    "msgspec": "msgspec",
    "zmq": "pyzmq",
    "pytest": "pytest",
    "pytest_forked": "pytest-forked",
    "yaml": "pyyaml",
}
#: what torch prints for a host sync under VLLM_GPU_SYNC_CHECK (vllm/utils/gpu_sync_debug.py)
SYNC_WARNING = "called a synchronizing CUDA operation"
#: the pipelines run where vLLM is installed: (name, stage config, prompts)
PIPELINES = (
    ("ar_to_dit", "stage_configs/ar_to_dit_shm.yaml", ["A cute cat", "A red fox"]),
    ("thinker_talker", "stage_configs/thinker_talker_full_payload.yaml", ["Hello there"]),
    # The talker fed per step: its rows go to the model in Model Runner V2's prepare_inputs,
    # before CUDA-graph replays (runner/ar_runner_v2.py).
    ("thinker_talker_per_step", "stage_configs/thinker_talker_async_chunk.yaml", ["Hello there"]),
)


class Report:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def add(self, part: str, outcome: str, detail: str) -> None:
        self.rows.append((part, outcome, detail))
        print(f"gpu-check: {part}: {outcome} {detail}".rstrip(), flush=True)

    def failed(self) -> bool:
        return any(outcome == "FAIL" for _, outcome, _ in self.rows)

    def print(self) -> None:
        width = max(len(part) for part, _, _ in self.rows)
        print("\n== gpu-check summary ==")
        for part, outcome, detail in self.rows:
            print(f"{part:<{width}}  {outcome:<4}  {detail}")


def _cuda_description() -> str | None:
    """The visible devices, or None when CUDA is not visible."""
    import torch

    if not torch.cuda.is_available():
        return None
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"torch {torch.__version__}, CUDA {torch.version.cuda}, {len(names)} device(s): {', '.join(names)}"


def _ensure_packages(env: dict[str, str]) -> list[str]:
    """Make the needed packages importable by the child processes; returns what is missing."""
    missing = [dist for mod, dist in NEEDED.items() if importlib.util.find_spec(mod) is None]
    if not missing:
        return []
    wheels = sorted(WHEELS.glob("*.whl")) if WHEELS.is_dir() else []
    if not wheels:
        return missing
    site = Path(tempfile.mkdtemp(prefix="kvbridge-gpu-site-"))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    subprocess.run([*cmd, "--target", str(site), *map(str, wheels)], check=True)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    return [dist for mod, dist in NEEDED.items() if importlib.util.find_spec(mod) is None]


def _pytest(report: Report, part: str, args: list[str], env: dict[str, str]) -> None:
    """One pytest run; FAIL unless it passed and ran at least one test."""
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *args]
    print(f"gpu-check: running {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    sys.stdout.write(proc.stdout[-20000:])
    sys.stderr.write(proc.stderr[-5000:])
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "(no output)"
    skips = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    if proc.returncode == 5:
        report.add(part, "FAIL", "ran no test (pytest collected nothing)")
    elif proc.returncode != 0:
        report.add(part, "FAIL", tail)
    else:
        report.add(part, "PASS", tail)
    for line in skips:  # each skip names its hardware reason
        report.add(f"{part} skip", "SKIP", line.removeprefix("SKIPPED "))


def _pipelines(report: Report, env: dict[str, str]) -> None:
    if importlib.util.find_spec("vllm") is None:
        report.add("pipelines", "SKIP", "vLLM is not installed (pip install -e '.[gpu]' to run them)")
        return
    import yaml

    for name, config, prompts in PIPELINES:
        out = Path(tempfile.mkdtemp(prefix=f"kvbridge-gpu-{name}-"))
        data = yaml.safe_load((ROOT / config).read_text())
        for stage in data["stages"]:
            if stage.get("kind") in ("llm_ar", "llm_generation"):
                # vLLM's GPU defaults (the resolver adds nothing on cuda) in bf16: the tiny
                # model's files say float32, our users' models say bf16.
                stage["engine_args"] = {**(stage.get("engine_args") or {}), "dtype": "bfloat16"}
        path = out / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        cmd = [sys.executable, "-m", "vllm_kvbridge.cli.main", "run", "--stage-config", str(path)]
        for prompt in prompts:
            cmd += ["--prompt", prompt]
        cmd += ["--output-dir", str(out / "output")]
        run_env = {**env, "VLLM_GPU_SYNC_CHECK": "warn"}
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=420)
        took = time.monotonic() - t0
        logs = "".join(p.read_text(errors="replace") for p in (out / "output" / "logs").glob("*.log"))
        # vLLM arms torch's sync debug mode around execute_model/sample_tokens; each host sync
        # there warns from the Python line that made it: ours are those in vllm_kvbridge.
        syncs = [line for line in logs.splitlines() if SYNC_WARNING in line]
        ours = [line for line in syncs if "vllm_kvbridge" in line]
        sys.stdout.write(proc.stdout[-4000:])
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:] + logs[-8000:])
            report.add(
                f"pipeline {name}", "FAIL", f"exit {proc.returncode} after {took:.0f} s (logs in {out})"
            )
        elif ours:
            print("\n".join(ours[:20]))
            report.add(f"pipeline {name}", "FAIL", f"{len(ours)} host syncs reported in kvbridge code")
        else:
            report.add(
                f"pipeline {name}",
                "PASS",
                f"{took:.0f} s, bf16, vLLM defaults; host syncs: 0 in kvbridge, {len(syncs)} elsewhere",
            )
            shutil.rmtree(out, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-pipelines", action="store_true", help="only the test parts (make test-gpu)")
    args = p.parse_args(argv)
    report = Report()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    # NVML answers "is there CUDA" without initialising it, so forked tests stay fork-safe.
    env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    described = _cuda_description()
    if described is None:
        print(
            "gpu-check: CUDA is not visible (torch.cuda.is_available() is False): nothing here is GPU "
            "evidence; run it on a machine with an NVIDIA GPU",
            file=sys.stderr,
        )
        return 2
    report.add("cuda", "PASS", described)
    missing = _ensure_packages(env)
    if missing:
        report.add(
            "packages",
            "FAIL",
            f"missing {', '.join(missing)}: run `make gpu-wheels` where pip "
            f"reaches PyPI and carry {WHEELS.relative_to(ROOT)}/ with the checkout",
        )
        report.print()
        return 1
    report.add("packages", "PASS", "wheels from .whl/" if WHEELS.is_dir() else "installed")
    _pytest(report, "tests/gpu", ["-m", "cuda", "tests/gpu"], {**env, "KVBRIDGE_GPU_TESTS": "1"})
    _pytest(
        report,
        "contract CudaIpcConnector",
        ["tests/test_connector_contract.py", "-k", "CudaIpcConnector"],
        env,
    )
    if not args.no_pipelines:
        _pipelines(report, env)
    report.print()
    return 1 if report.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
