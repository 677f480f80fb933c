"""``vllm-kvbridge bench kv-path``: a finished request's KV, from vLLM to a receiver's tensors.

A real vLLM engine on the KV-heavy model (:mod:`vllm_kvbridge.bench.kv_model`: 28 layers x
4 KV heads x head_dim 128, random weights) runs as a kvbridge stage (vLLM's stock worker
with the kvbridge KV connector, started inside :func:`~vllm_kvbridge.runner.worker.engine_env`
as a stage is) sending each request's KV on finish through one connector; the receiver is a
:class:`~vllm_kvbridge.kv.manager.KVTransferManager` of "stage 1" in this process. One
engine per connector, prompts of ``--tokens`` tokens, ``max_tokens=1``.

Measured per request: from the moment the engine's output for the request returns to the
caller (``LLM.generate`` returns: vLLM has finished the request) to the moment the
receiver holds usable tensors (``receive_kv_cache_for_request`` returns, tensors on
``--device``). In between: the engine core schedules one more step for the finished
request, whose blocks it holds for the connector; the worker gathers the blocks out of
the paged cache (model thread) and its I/O thread puts them into the connector; the
receiver, asked right after ``generate`` returned, polls until the KV is there, gets and
decodes it and moves it to the device. GB/s is the KV's tensor bytes over that time.

The ceiling, measured in the same run on the same bytes: one single-threaded memcpy
(``np.copyto``) of a same-size buffer in this process (pre-faulted; the best of ``max(3, repeat + 2)`` copies
taken after each point's transfers and ``--settle-s`` idle seconds, because vLLM's worker
keeps spinning for 1 s after its last step and would take a core from the copy):
``ratio = GB/s / memcpy GB/s``. A second ceiling, sampled at the same time: the layout's
own copy of the same KV (:mod:`vllm_kvbridge.bench.gather_probe`: the strided pass out of a
cache of the engine's layout, one thread), which on vLLM's CPU layout (K pages stored
transposed) is far below a memcpy; ``x gather = GB/s / gather GB/s``. A third, right after:
the connector's bare transport moving the same bytes
(:func:`~vllm_kvbridge.bench.connectors.transport_ceiling_times`: shared memory's write,
pipe message and read; one pyzmq message; the transfer engine's and NIXL's write into
registered memory plus a READ; the Mooncake store's own put and get), median of
``max(3, --repeat)``; ``x transp = GB/s / transp GB/s``.

Per token count the first request is an untimed warm-up (it computes the prefill and
warms the connector's pools); the ``--repeat`` timed ones reuse the same prompt, so
their prefill is a prefix-cache hit (the KV gathered and sent is the same). ``put ms`` is,
for where the time goes, the sender connector's own ``put_seconds`` per put, the mean over
the timed transfers (its ``kv_edge`` counters, read over the worker RPC
``kvbridge_debug_state`` outside the timed windows): what the connector counts as its put
(a ``put`` call; for a destination it lent, from the reservation to the publish, so the
gather into it is included). A connector that
cannot run here (no Mooncake) is skipped with its reason; one that fails is reported
(``FAILED``, exit code 1) after the others ran.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_kvbridge.config.platform import detect_platform, platform_engine_args

logger = logging.getLogger(__name__)

#: Short names accepted by ``--connectors`` (the registry's aliases, spelled as the other benches).
CONNECTORS = {
    "shm": "SharedMemoryConnector",
    "zmq": "ZmqConnector",
    "mooncake": "MooncakeStoreConnector",
    "mooncake-te": "MooncakeTransferEngineConnector",
    "nixl": "NixlConnector",
}


class Unavailable(Exception):
    """The connector cannot run on this machine (the reason is printed, the run goes on)."""


@dataclass
class Row:
    connector: str
    tokens: int
    bytes: int
    seconds: float  # median over the repeats
    gbps: float  # bytes / seconds / 1e9
    ratio: float  # gbps / memcpy_gbps
    memcpy_gbps: float  # best of the run's memcpy samples of the same bytes
    seconds_min: float
    seconds_max: float
    gbps_min: float
    gbps_max: float
    put_s: float  # mean of the sender's connector put time per timed transfer (nan if unknown)
    repeats: int
    gather_gbps: float = float("nan")  # best of the run's gathers of the same KV (gather_probe)
    gather_ratio: float = float("nan")  # gbps / gather_gbps
    transport_gbps: float = float("nan")  # median of the bare transport's moves of the same bytes
    transport_ratio: float = float("nan")  # gbps / transport_gbps


def parse_tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--tokens: comma-separated integers, got {text!r}") from None
    if not tokens or min(tokens) < 1:
        raise ValueError(f"--tokens: need token counts >= 1, got {text!r}")
    return tokens


def parse_connectors(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONNECTORS]
    if not names or unknown:
        raise ValueError(f"--connectors: choose from {', '.join(CONNECTORS)}, got {text!r}")
    return names


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def edge_configs(name: str, max_bytes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(sender, receiver) connector configs of one edge; :class:`Unavailable` if it cannot run."""
    if name == "shm":
        cfg = {"namespace": f"kvpath{os.getpid()}"}
        return cfg, cfg
    if name == "zmq":
        port = _free_port()
        return {"host": "127.0.0.1", "port": port}, {"endpoint": f"tcp://127.0.0.1:{port}"}
    if name not in CONNECTORS:
        raise Unavailable(f"unknown connector {name!r}")
    from vllm_kvbridge.bench.connectors import connector_unavailable

    if (why := connector_unavailable(name)) is not None:
        raise Unavailable(why)
    if name == "mooncake":
        from vllm_kvbridge.bench.mooncake import connector_config

        segment = max(1 << 30, 1 << (2 * max_bytes).bit_length())  # room for the payload, twice
        try:
            cfg = connector_config(segment_bytes=segment)
        except Exception as exc:  # no master could be started
            raise Unavailable(f"no mooncake_master: {exc}") from None
        return cfg, {**cfg, "global_segment_size": 0}
    # mooncake-te (P2P handshake) and nixl: the receiver finds the sender in the metadata
    return {}, {}


class _Memcpy:
    """One in-process, single-threaded copy of ``nbytes`` (``np.copyto``, a ``memcpy``, as
    ``bench connectors`` times it): the ceiling of any one-copy transport."""

    def __init__(self, nbytes: int) -> None:
        import numpy as np

        self.src = np.ones(nbytes, dtype=np.uint8)
        self.dst = np.zeros(nbytes, dtype=np.uint8)
        self.dst[:] = 1  # written: faulted in before timing
        self.samples: list[float] = []

    def sample(self) -> None:
        import numpy as np

        start = time.perf_counter()
        np.copyto(self.dst, self.src)
        self.samples.append(time.perf_counter() - start)

    def gbps(self) -> float:
        return self.src.size / min(self.samples) / 1e9


#: Connectors whose receiver reaches the sender at an address only the sender knows
#: (its side channel, its engine's segment): the receiver needs the sender's put metadata.
REACHED_AT_SENDER = ("mooncake-te", "nixl")


def _sender_meta(llm: Any, rid: str, wait_s: float = 30.0) -> dict[str, Any]:
    """The put metadata of ``rid``'s KV send, read from the engine's worker as the pipeline
    reads it (``kvbridge_sender_info``), once the send completed. Transfer engine and NIXL
    put the same address in every key's metadata, so one request's serves every later one."""
    give_up = time.monotonic() + wait_s
    while True:
        got = llm.collective_rpc("kvbridge_sender_info", args=([rid],))[0].get("kv", {}).get(rid)
        if got:
            metas = [*got.get("keys", {}).values(), *got.get("ranks", {}).values()]
            return dict(metas[0]) if metas else dict(got)
        if time.monotonic() > give_up:
            raise RuntimeError(f"the engine never reported the put metadata of {rid!r}")
        time.sleep(0.01)


def _put_counters(llm: Any, at_least: float = math.nan, wait_s: float = 10.0) -> tuple[float, float]:
    """(puts, put seconds) of the engine worker's connector, once it counts ``at_least`` puts
    (its I/O thread counts a put after publishing it, so the receiver may be faster; waits
    up to ``wait_s``); NaNs when the worker does not say."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            edge = llm.collective_rpc("kvbridge_debug_state")[0].get("kv_edge") or {}
            puts, seconds = float(edge["puts"]), float(edge["put_seconds"])
        except Exception:
            return math.nan, math.nan
        if not puts < at_least or time.monotonic() > deadline:
            return puts, seconds
        time.sleep(0.01)


def _measure(
    name: str, args: argparse.Namespace, model: str, layers: int, tokens_list: list[int], kv_cache_gib: int
) -> list[Row]:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_kvbridge.bench.connectors import transport_ceiling_times
    from vllm_kvbridge.bench.gather_probe import GatherProbe, engine_layout
    from vllm_kvbridge.bench.kv_model import cpu_kv_cache_args, kv_bytes
    from vllm_kvbridge.kv.config import KVTransferConfig
    from vllm_kvbridge.kv.manager import KVTransferManager
    from vllm_kvbridge.runner.worker import engine_env, engine_kwargs

    max_bytes = kv_bytes(max(tokens_list), layers, args.dtype)
    send_cfg, recv_cfg = edge_configs(name, max_bytes)
    connector = CONNECTORS[name]
    settings = {
        "stage_id": 0,
        "kv_transfer": {
            "need_send_cache": True,
            "to_stage": 1,
            "connector": connector,
            "connector_config": send_cfg,
        },
    }
    device = torch.device(args.device)
    receiver = KVTransferManager(
        KVTransferConfig.from_dict(
            {
                "need_recv_cache": True,
                "from_stage": 0,
                "stage_id": 1,
                "recv_timeout": args.recv_timeout,
                "connector": connector,
                "connector_config": recv_cfg,
            }
        )
    )
    llm = None
    rows = []
    try:
        with engine_env():
            # The platform's defaults as a stage gets them (eager on CPU only), under the
            # bench's own dtype and sizes.
            own = {"dtype": args.dtype, "max_model_len": max(tokens_list) + 16, "block_size": args.block_size}
            llm = LLM(
                model=model,
                **platform_engine_args(detect_platform(), own),
                **cpu_kv_cache_args(kv_cache_gib),
                **engine_kwargs(settings),
            )
        for tokens in tokens_list:
            expected = kv_bytes(tokens, layers, args.dtype)
            prompt = TokensPrompt(prompt_token_ids=[5 + (j * 37 + tokens) % 490 for j in range(tokens)])
            seconds: list[float] = []
            counted = _put_counters(llm)
            for r in range(args.repeat + 1):  # r == 0: the warm-up
                if r == 1:  # the sender's put counters once the warm-up's put is counted
                    counted = _put_counters(llm, at_least=counted[0] + 1)
                rid = f"kvpath-{name}-{tokens}-{r}"
                params = SamplingParams(
                    max_tokens=1,
                    temperature=0.0,
                    ignore_eos=True,
                    extra_args={"kvbridge": {"request_id": rid}},
                )
                llm.generate([prompt], params, use_tqdm=False)
                finished = time.perf_counter()
                if r == 0 and name in REACHED_AT_SENDER:  # untimed: as a pipeline forwards it
                    receiver.update_sender_info(_sender_meta(llm, rid), 0)
                data, nbytes = receiver.receive_kv_cache_for_request(rid, device)
                held = time.perf_counter()
                if nbytes != expected or data.key_cache[0].device.type != device.type:
                    raise RuntimeError(
                        f"{name}: received {nbytes} bytes on {data.key_cache[0].device}, expected "
                        f"{expected} on {device} ({tokens} tokens x {layers} layers, {args.dtype})"
                    )
                del data  # a real consumer releases it: shm segments go back to the pool
                if r:
                    seconds.append(held - finished)
            puts, put_seconds = _put_counters(llm, at_least=counted[0] + args.repeat)
            put_s = (put_seconds - counted[1]) / (puts - counted[0]) if puts > counted[0] else math.nan
            time.sleep(args.settle_s)
            memcpy = _Memcpy(expected)
            probe = GatherProbe(
                engine_layout(getattr(torch, args.dtype), args.block_size, device), layers, tokens, device
            )
            for _ in range(max(3, args.repeat + 2)):  # interleaved: the same conditions for both
                memcpy.sample()
                probe.sample()
            ceiling, gather_gbps = memcpy.gbps(), probe.gbps()
            del memcpy, probe
            transport = transport_ceiling_times(connector, expected, max(3, args.repeat))
            transport_gbps = expected / statistics.median(transport) / 1e9 if transport else math.nan
            median = statistics.median(seconds)
            gbps = expected / median / 1e9
            rows.append(
                Row(
                    connector=name,
                    tokens=tokens,
                    bytes=expected,
                    seconds=median,
                    gbps=gbps,
                    ratio=gbps / ceiling,
                    memcpy_gbps=ceiling,
                    seconds_min=min(seconds),
                    seconds_max=max(seconds),
                    gbps_min=expected / max(seconds) / 1e9,
                    gbps_max=expected / min(seconds) / 1e9,
                    put_s=put_s,
                    repeats=len(seconds),
                    gather_gbps=gather_gbps,
                    gather_ratio=gbps / gather_gbps,
                    transport_gbps=transport_gbps,
                    transport_ratio=gbps / transport_gbps,
                )
            )
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        receiver.shutdown()
        _reap(settings)
    return rows


def _reap(settings: dict[str, Any]) -> None:
    """Remove what the engine's (now dead) worker may have left on the edge: vLLM SIGKILLs an
    engine core that does not stop within 5 s, before its connector released its segments."""
    from vllm_kvbridge.runner.stage_runtime import reap_stage_leftovers

    try:
        reap_stage_leftovers(settings)
    except Exception:  # best effort: the next kvbridge process on the edge reaps them too
        logger.debug("kv-path: reaping leftovers failed", exc_info=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every connector at every token count: ``{"rows": [Row dicts], "skipped": {name: reason}, ...}``."""
    from vllm_kvbridge.bench.kv_model import ensure_kv_heavy_model, kv_bytes, model_layers

    tokens_list = parse_tokens(args.tokens) if isinstance(args.tokens, str) else list(args.tokens)
    connectors = (
        parse_connectors(args.connectors) if isinstance(args.connectors, str) else list(args.connectors)
    )
    if args.repeat < 1:
        raise ValueError("--repeat must be >= 1")
    max_position = max(16384, 1 << (max(tokens_list) + 16).bit_length())
    model = args.model or str(ensure_kv_heavy_model(args.layers, max_position, cache_dir=args.cache_dir))
    layers = model_layers(model)
    # The engine's paged cache holds the largest prompt, kept for its repeats, with room.
    need = 1.5 * kv_bytes(max(tokens_list), layers, args.dtype) / (1 << 30)
    kv_cache_gib = args.kv_cache_gib or max(1, math.ceil(need))
    rows: list[Row] = []
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    for name in connectors:
        try:
            rows += _measure(name, args, model, layers, tokens_list, kv_cache_gib)
        except Unavailable as exc:
            skipped[name] = str(exc)
        except Exception as exc:  # reported (and the exit code says so); the others still run
            logger.exception("kv-path: connector %s failed", name)
            failed[name] = f"{type(exc).__name__}: {exc}"
    return {
        "model": model,
        "layers": layers,
        "dtype": args.dtype,
        "device": args.device,
        "repeat": args.repeat,
        "rows": [asdict(r) for r in rows],
        "skipped": skipped,
        "failed": failed,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--connectors",
        default="shm,zmq",
        help=f"comma-separated, of {', '.join(CONNECTORS)} (default: shm,zmq)",
    )
    p.add_argument("--tokens", default="512,2048,8192", help="prompt lengths (default: 512,2048,8192)")
    p.add_argument(
        "--repeat", type=int, default=3, help="timed requests per point after a warm-up (default 3)"
    )
    p.add_argument("--device", default="cpu", help="device the receiver asks for (default: cpu)")
    p.add_argument("--model", help="model dir (default: the KV-heavy model, built into --cache-dir)")
    p.add_argument("--cache-dir", help="where the KV-heavy model is built (default: the kvbridge cache dir)")
    p.add_argument("--layers", type=int, default=28, help="layers of the KV-heavy model (default 28)")
    p.add_argument("--dtype", default="float32", help="model and KV dtype (default float32)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--recv-timeout", type=float, default=120.0)
    p.add_argument(
        "--settle-s", type=float, default=1.5, help="idle seconds before the memcpy samples (default 1.5)"
    )
    p.add_argument("--kv-cache-gib", type=int, help="KV cache on CPU, GiB (default: fits the largest prompt)")
    p.add_argument("--json", metavar="OUT", help="also write the rows as JSON to OUT")


def format_result(r: dict[str, Any]) -> str:
    lines = [
        f"kv-path: {Path(r['model']).name} ({r['layers']} layers x 4 KV heads x 128, {r['dtype']}), "
        f"receiver on {r['device']}, {r['repeat']} timed requests per point; time from the engine's "
        "output to the receiver's tensors",
    ]
    header = (
        f"{'connector':<9} {'tokens':>6} {'bytes':>11} {'p50 ms':>9} {'min ms':>9} {'max ms':>9} "
        f"{'GB/s':>6} {'min-max':>11} {'memcpy':>7} {'ratio':>6} {'gather':>7} {'x gather':>8} "
        f"{'transp':>7} {'x transp':>8} {'put ms':>8}"
    )
    lines += [header, "-" * len(header)]
    for row in r["rows"]:
        spread = f"{row['gbps_min']:.2f}-{row['gbps_max']:.2f}"
        lines.append(
            f"{row['connector']:<9} {row['tokens']:>6} {row['bytes']:>11} {row['seconds'] * 1e3:>9.1f} "
            f"{row['seconds_min'] * 1e3:>9.1f} {row['seconds_max'] * 1e3:>9.1f} {row['gbps']:>6.2f} "
            f"{spread:>11} {row['memcpy_gbps']:>7.2f} {row['ratio']:>6.3f} {row['gather_gbps']:>7.2f} "
            f"{row['gather_ratio']:>8.3f} {row.get('transport_gbps', math.nan):>7.2f} "
            f"{row.get('transport_ratio', math.nan):>8.3f} {row['put_s'] * 1e3:>8.1f}"
        )
    for name, reason in r["skipped"].items():
        lines.append(f"{name}: skipped: {reason}")
    for name, reason in r.get("failed", {}).items():
        lines.append(f"{name}: FAILED: {reason}")
    return "\n".join(lines)


def write_json(r: dict[str, Any], path: str) -> None:
    Path(path).write_text(json.dumps(r["rows"], indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        parse_tokens(args.tokens)
        parse_connectors(args.connectors)
    except ValueError as exc:
        p.error(str(exc))
    result = run(args)
    print(format_result(result))
    if args.json:
        write_json(result, args.json)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
