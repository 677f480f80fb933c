"""Rank 1 of a 2-rank diffusion stage (``diffusion.num_ranks: 2``): its process and start-up.

The stage process is rank 0 (the LEADER, which receives the KV). :func:`start_ranks` spawns
``python -m vllm_kvbridge.pipeline.dit_rank --init-method tcp://127.0.0.1:PORT`` with the
resolved stage as JSON on stdin (no pickle), in the stage's process group (so the
orchestrator's last-resort ``killpg`` takes it too), its output into the stage's log, and
joins the 2-rank gloo group with it. Rank 1 runs
:func:`vllm_kvbridge.runner.diffusion_ranks.run_follower` until rank 0 broadcasts stop
(:func:`stop_ranks`), and kills itself when the stage process disappears. See
:mod:`vllm_kvbridge.runner.diffusion_ranks` for why CFG-parallel and the per-request protocol.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import socket
import subprocess
import sys
import threading
import traceback
from typing import Any

import msgspec

from vllm_kvbridge.config.resolve import ResolvedStage

#: Bound on every collective: a rank that stops answering fails the other within this.
GROUP_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init_group(init_method: str, rank: int) -> Any:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    return dist.group.WORLD


def start_ranks(stage: ResolvedStage) -> tuple[subprocess.Popen, Any]:
    """Spawn rank 1 and join the group as rank 0; returns ``(rank 1's process, group)``."""
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_kvbridge.pipeline.dit_rank", "--init-method", init_method],
        stdin=subprocess.PIPE,
        env={**os.environ, "KVBRIDGE_DIT_RANK": "1"},  # lets a model (or a test) tell its rank
    )
    assert proc.stdin is not None
    proc.stdin.write(msgspec.json.encode(stage))
    proc.stdin.close()
    try:
        group = _init_group(init_method, 0)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, group


def stop_ranks(proc: subprocess.Popen, group: Any, timeout_s: float = 5.0) -> None:
    """Tell rank 1 to stop (if it still runs), wait for it, leave the group. Idempotent."""
    import torch.distributed as dist

    from vllm_kvbridge.runner.diffusion_ranks import Control, send_control

    if proc.poll() is None and dist.is_initialized():
        with contextlib.suppress(Exception):
            send_control(Control("stop"), group)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="rank 1 of a 2-rank diffusion stage (started by rank 0)")
    parser.add_argument("--init-method", required=True)
    args = parser.parse_args(argv)
    from vllm_kvbridge.pipeline.stage_process import _watch_parent

    threading.Thread(
        target=_watch_parent, args=(os.getppid(),), name="kvbridge-parent-watch", daemon=True
    ).start()
    stage = msgspec.json.decode(sys.stdin.buffer.read(), type=ResolvedStage)
    group = _init_group(args.init_method, 1)
    from vllm_kvbridge.runner.diffusion_ranks import run_follower

    try:
        served = run_follower(stage, group)
        print(f"[stage {stage.stage_id} rank 1] stopped after {served} request(s)", flush=True)
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from vllm_kvbridge.runner.diffusion_ranks import exit_rank_process

    try:
        exit_code = main()
    except SystemExit as exc:  # argparse
        exit_code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        exit_code = 1
    exit_rank_process(exit_code)
