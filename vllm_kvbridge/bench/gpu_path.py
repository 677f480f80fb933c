"""``vllm-kvbridge bench gpu-path``: the KV send path on a GPU against the copies it is made of.

Plain torch, no vLLM: it runs on any CUDA machine. Per KV size (``--tokens`` tokens of the
KV-heavy shape, 28 layers x 4 KV heads x head_dim 128, bf16, in per-layer paged caches of a
CUDA backend's layout, blocks shuffled), the send path's gather
(:func:`~vllm_kvbridge.kv.send.gather_job`) is timed two ways:

* ``staged`` (the GPU default, ``staging_bytes``): the gather on the device, a
  ``non_blocking`` copy into the pinned staging pool on the side stream, a fence.
  ``caller ms`` is the model thread's time until ``gather_job`` returned; ``done ms`` until
  the fence completed (the blocks could go back to vLLM).
* ``direct`` (``staging_bytes: 0``): the gather copied straight into a shared-memory
  segment of the real :class:`~vllm_kvbridge.connectors.shm.SharedMemoryConnector`
  (pageable memory: the copy blocks the model thread).
* ``ipc`` (CUDA only): the gather into a device buffer lent by the real
  :class:`~vllm_kvbridge.connectors.cuda_ipc.CudaIpcConnector` (what a same-host GPU
  stage's receiver then copies device to device); its ratio is to ``D2D``.

Ceilings, measured in the same run on the same bytes: ``pinned D2H``, one copy of a
contiguous device buffer into pinned host memory (what ``cudaMemcpy`` can do), and ``D2D``,
one device-to-device copy of it (what a same-host GPU-to-GPU handoff is measured
against). ``ratio = GB/s / ceiling GB/s``, the ceiling named in the ``vs`` column
(pinned D2H; D2D for ``ipc``). ``--repeat`` timed runs after one warm-up; the median
and the min-max spread are printed, and the rows go to ``--json``.

With ``--device cpu`` the same code paths run on CPU tensors (the copy thread, pageable
buffers; the ceilings are then host memcpys): a check that the bench runs, not a GPU figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

LAYERS, HEADS, HEAD_DIM, BLOCK = 28, 4, 128, 16


@dataclass
class Row:
    path: str
    tokens: int
    bytes: int
    caller_ms: float  # median: until the call returned on the caller's thread
    done_ms: float  # median: until the copy completed
    done_ms_min: float
    done_ms_max: float
    gbps: float  # bytes / done (median)
    ratio: float  # gbps / the ceiling's gbps of the same run
    ceiling: str  # "pinned_d2h" or "d2d"
    repeats: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kv(tokens: int, device: torch.device) -> tuple[list[torch.Tensor], Any, list[int]]:
    from vllm_kvbridge.kv.layout import packed_layout

    blocks = -(-tokens // BLOCK)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(blocks + 8, generator=gen)[:blocks].tolist()  # scattered, as in a busy cache
    caches = [
        torch.randn(blocks + 8, HEADS, BLOCK, 2 * HEAD_DIM, generator=gen).to(torch.bfloat16).to(device)
        for _ in range(LAYERS)
    ]
    return caches, packed_layout(HEADS, HEAD_DIM, BLOCK, torch.bfloat16, physical_order="LBHNC"), order


def _ceiling(nbytes: int, device: torch.device, repeat: int) -> tuple[float, float]:
    """Best GB/s of a pinned device-to-host copy and of a device-to-device copy of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty_like(src)
    d2h, d2d = [], []
    for _ in range(repeat + 1):
        _sync(device)
        t0 = time.perf_counter()
        host.copy_(src, non_blocking=True)
        _sync(device)
        t1 = time.perf_counter()
        dev.copy_(src)
        _sync(device)
        t2 = time.perf_counter()
        d2h.append(t1 - t0)
        d2d.append(t2 - t1)
    return nbytes / min(d2h[1:]) / 1e9, nbytes / min(d2d[1:]) / 1e9


def _time_path(path: str, tokens: int, device: torch.device, repeat: int, ns: str) -> tuple[int, list, list]:
    from vllm_kvbridge.connectors.registry import create_connector
    from vllm_kvbridge.kv.send import Stager, gather_job
    from vllm_kvbridge.kv.topology import TPTopology

    caches, layout, order = _kv(tokens, device)
    topo = TPTopology(1, 1, HEADS)
    if path == "ipc":
        conn = create_connector("CudaIpcConnector", {"namespace": ns, "pool_bytes": 1 << 40})
    else:
        conn = create_connector("SharedMemoryConnector", {"namespace": ns, "max_held_bytes": 1 << 40})
    # A pool of a few requests' bytes: a CUDA pool is pinned up front (Stager), 16 GiB would
    # take seconds of every run.
    request_bytes = LAYERS * 2 * HEADS * tokens * HEAD_DIM * 2  # K and V, bf16
    stager = Stager(max(4 * request_bytes, 64 << 20), device) if path == "staged" else None
    info = {"block_ids": order, "seq_len": tokens, "blocks_held": True}
    caller, done, nbytes = [], [], 0
    try:
        for i in range(repeat + 1):
            _sync(device)
            t0 = time.perf_counter()
            routes = topo.routes_from(0)
            job = gather_job(f"e{i}", f"r{i}", info, caches, layout, topo, routes, 0, 1, lambda: conn, stager)
            t1 = time.perf_counter()
            if job.fence is not None:
                job.fence.wait()
            _sync(device)
            t2 = time.perf_counter()
            nbytes = job.nbytes
            job.release()
            if i:  # the first run warms the pools and the allocator
                caller.append(t1 - t0)
                done.append(t2 - t0)
    finally:
        if stager is not None:
            stager.close()
        conn.close()
    return nbytes, caller, done


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "needs a CUDA device (torch.cuda.is_available() is False); --device cpu runs the code"
        )
    tokens = [int(t) for t in str(args.tokens).split(",") if t.strip()]
    if not tokens or min(tokens) < 1 or args.repeat < 1:
        raise ValueError("need --tokens >= 1 and --repeat >= 1")
    rows: list[Row] = []
    ceilings: dict[int, dict[str, float]] = {}
    for n in tokens:
        for path in ("staged", "direct", "ipc") if device.type == "cuda" else ("staged", "direct"):
            nbytes, caller, done = _time_path(path, n, device, args.repeat, f"benchgpu{os.getpid()}")
            if n not in ceilings:  # the same bytes, right after the first path's runs
                d2h, d2d = _ceiling(nbytes, device, args.repeat)
                ceilings[n] = {"bytes": nbytes, "pinned_d2h_gbps": d2h, "d2d_gbps": d2d}
            median = statistics.median(done)
            gbps = nbytes / median / 1e9
            ceiling = "d2d" if path == "ipc" else "pinned_d2h"
            rows.append(
                Row(
                    path=path,
                    tokens=n,
                    bytes=nbytes,
                    caller_ms=statistics.median(caller) * 1e3,
                    done_ms=median * 1e3,
                    done_ms_min=min(done) * 1e3,
                    done_ms_max=max(done) * 1e3,
                    gbps=gbps,
                    ratio=gbps / ceilings[n][f"{ceiling}_gbps"],
                    ceiling=ceiling,
                    repeats=len(done),
                )
            )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "rows": [asdict(r) for r in rows], "ceilings": ceilings}


def format_result(r: dict[str, Any]) -> str:
    lines = [
        f"gpu-path on {r['device']}: KV of {LAYERS} layers x {HEADS} heads x {HEAD_DIM} bf16, "
        f"blocks of {BLOCK}",
        f"{'path':<7} {'tokens':>6} {'MB':>8} {'caller ms':>9} {'done ms':>9} {'min-max ms':>15} "
        f"{'GB/s':>7} {'ratio':>6} {'vs':<10}",
    ]
    for row in r["rows"]:
        spread = f"{row['done_ms_min']:.2f}-{row['done_ms_max']:.2f}"
        lines.append(
            f"{row['path']:<7} {row['tokens']:>6} {row['bytes'] / 1e6:>8.1f} {row['caller_ms']:>9.2f} "
            f"{row['done_ms']:>9.2f} {spread:>15} {row['gbps']:>7.2f} {row['ratio']:>6.3f} "
            f"{row['ceiling']:<10}"
        )
    for n, c in r["ceilings"].items():
        lines.append(
            f"ceilings ({n} tokens, {c['bytes'] / 1e6:.1f} MB): pinned D2H {c['pinned_d2h_gbps']:.2f} GB/s, "
            f"D2D {c['d2d_gbps']:.2f} GB/s"
        )
    lines.append("ratio = GB/s over the ceiling named in vs (the same bytes, measured in the same run)")
    return "\n".join(lines)


def write_json(r: dict[str, Any], path: str) -> None:
    Path(path).write_text(json.dumps(r, indent=2) + "\n")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", default="1024,8192", help="comma-separated KV lengths (default: 1024,8192)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per point after a warm-up (default 5)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (runs the code path only)")
    p.add_argument("--json", metavar="OUT", help="also write the rows as JSON to OUT")
