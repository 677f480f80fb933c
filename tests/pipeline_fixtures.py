"""Helpers of the pipeline tests: stage-process fault injection, references, leak checks.

Fault-injection modules are named by dotted path in stage configs, so the stage processes
must be able to import this file: tests put ``tests/`` on ``PYTHONPATH`` (see
:data:`STAGE_ENV`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vllm_kvbridge import procfs
from vllm_kvbridge.models.tiny_dit import TinyKVDiT

TESTS_DIR = Path(__file__).resolve().parent
ROOT = TESTS_DIR.parent
STAGE_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))}


class CrashOnInit(nn.Module):
    """A diffusion module whose constructor fails (a stage that crashes on start)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        raise RuntimeError("injected start-up failure of the diffusion module")


class DieInForward(TinyKVDiT):
    """Kills its process without a word on the first forward (a stage that dies mid-run)."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        os._exit(17)


class DieOnRank1(TinyKVDiT):
    """Rank 1 of a 2-rank diffusion stage dies without a word on its first forward."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if os.environ.get("KVBRIDGE_DIT_RANK") == "1":
            os._exit(17)
        return super().forward(*args, **kwargs)


class RaiseOnceOnRank1(TinyKVDiT):
    """Rank 1 of a 2-rank diffusion stage raises in its first forward (then works)."""

    raised = False

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if os.environ.get("KVBRIDGE_DIT_RANK") == "1" and not RaiseOnceOnRank1.raised:
            RaiseOnceOnRank1.raised = True
            raise ValueError("injected: rank 1's branch failed")
        return super().forward(*args, **kwargs)


class GatedDiT(TinyKVDiT):
    """A diffusion module tests hold and release through files in ``$KVBRIDGE_TEST_GATES``:
    its forward waits while ``hold`` exists (requests stay in the stage, which keeps sending
    heartbeats), and a restarted one (``started`` exists) is not built until ``open``
    exists (the stage stays ``recovering``). Its first forward touches ``forwarding``: the
    request in it has received its KV. No sleep decides what a test sees."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gates = Path(os.environ["KVBRIDGE_TEST_GATES"])
        if (self.gates / "started").exists():
            while not (self.gates / "open").exists():
                time.sleep(0.05)
        (self.gates / "started").touch()

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        (self.gates / "forwarding").touch()
        while (self.gates / "hold").exists():
            time.sleep(0.05)
        return super().forward(*args, **kwargs)


def shm_segments(prefix: str) -> list[str]:
    """Names in /dev/shm starting with ``prefix`` (``kvbridge.<run id>``: one run's segments)."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


def run_id_in(output: str) -> str:
    """The run id a pipeline says first (``run <id>: stage logs in ...``) in ``output``."""
    import re

    found = re.search(r"^run (r[0-9a-f]+): stage logs in ", output, re.MULTILINE)
    assert found, f"no run id in:\n{output[-3000:]}"
    return found.group(1)


def run_names(run_id: str) -> set[str]:
    """Everything of run ``run_id`` in /dev/shm now: its segments (``kvbridge.<run>-<edge>...``),
    its processes' owner files and the names those recorded (vLLM's ``psm_*`` queues,
    ``sem.mp-*`` semaphores: connectors/shm_owners.py). Never another run's: a test that
    checks this is not failed by other runs on the host."""
    from vllm_kvbridge.connectors.shm_owners import OWNER_PREFIX, owners

    names = set(os.listdir("/dev/shm"))
    own = {n for n in names if n.startswith((f"kvbridge.{run_id}-", f"{OWNER_PREFIX}{run_id}."))}
    for owner in owners(prefix=run_id):
        if owner.file in own:
            own |= set(owner.names)
    return own & names


def descendants(pid: int) -> list[int]:
    """Live descendant pids of ``pid`` (zombies are not; empty when none)."""
    return [p for p in procfs.descendants(pid) if procfs.state(p) not in (None, "Z")]


def hf_reference(
    model_dir: str | Path, token_ids: list[int]
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """transformers' per-layer (K, V) as ``[seq, kv_heads, head_dim]`` and final-norm hidden states."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), use_cache=True, output_hidden_states=True)
    pkv = out.past_key_values
    layers = []
    for i in range(model.config.num_hidden_layers):
        if hasattr(pkv, "layers"):
            k, v = pkv.layers[i].keys, pkv.layers[i].values
        else:
            k, v = pkv[i]
        layers.append((k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()))
    return layers, out.hidden_states[-1][0]


def hf_greedy(
    model_dir: str | Path, prompt_ids: list[int], max_new_tokens: int, *, ignore_eos: bool = False
) -> list[int]:
    """transformers' greedy continuation of ``prompt_ids`` (what vLLM's temperature 0 gives)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        min_new_tokens=max_new_tokens if ignore_eos else 0,
    )
    return out[0, len(prompt_ids) :].tolist()


def load_dump(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def dumped_kv(path: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The per-layer (K, V) of a DiT stage's KV dump (``runtime.debug_dump_dir``)."""
    dumped = load_dump(path)
    layers = len([k for k in dumped if k.endswith(".k")])
    return [(dumped[f"layer{i}.k"], dumped[f"layer{i}.v"]) for i in range(layers)]


def check_kv_is_greedy_transformers_kv(
    model_dir: str | Path, prompt: str, kv: list[tuple[torch.Tensor, torch.Tensor]], max_tokens: int
) -> None:
    """``kv`` (a DiT's consumed KV) is transformers' KV of ``prompt`` and the LLM stage's greedy
    continuation, for callers that see no token ids (a served request, result.json); vLLM's
    greedy equals transformers' (test_foundation_engine.py)."""
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(str(model_dir))(prompt).input_ids
    tokens = prompt_ids + hf_greedy(model_dir, prompt_ids, max_tokens)
    seq = kv[0][0].shape[0]
    assert len(tokens) - 1 <= seq <= len(tokens)  # the last sampled token may have no KV
    ref, _ = hf_reference(model_dir, tokens[:seq])
    assert len(kv) == len(ref)
    for i, ((k, v), (rk, rv)) in enumerate(zip(kv, ref)):
        assert (k - rk).abs().max().item() <= 1e-4, f"layer {i} K"
        assert (v - rv).abs().max().item() <= 1e-4, f"layer {i} V"


def check_dumped_kv_is_transformers_kv(
    model_dir: str | Path, result: Any, dump_dir: Path, dit_kwargs: dict[str, Any], num_steps: int = 8
) -> None:
    """The KV the DiT stage of an AR -> DiT run consumed (its debug dump) is transformers' KV
    of the same tokens, and the image is what the DiT makes from that KV."""
    from vllm_kvbridge.connectors.keys import encode_request_id
    from vllm_kvbridge.runner.diffusion_runner import denoise

    out = result.stages[0].output
    tokens = list(out["prompt_token_ids"]) + list(out["token_ids"])
    dumped = load_dump(dump_dir / f"stage1_{encode_request_id(result.request_id)}_kv.safetensors")
    seq = dumped["layer0.k"].shape[0]
    assert len(tokens) - 1 <= seq <= len(tokens)
    ref, _ = hf_reference(model_dir, tokens[:seq])
    assert len([k for k in dumped if k.endswith(".k")]) == len(ref)
    for i, (k, v) in enumerate(ref):
        assert (dumped[f"layer{i}.k"] - k).abs().max().item() <= 1e-4, f"layer {i} K"
        assert (dumped[f"layer{i}.v"] - v).abs().max().item() <= 1e-4, f"layer {i} V"
    kv = [(dumped[f"layer{i}.k"], dumped[f"layer{i}.v"]) for i in range(len(ref))]
    expected = denoise(TinyKVDiT(**dit_kwargs).eval(), kv, num_steps=num_steps, seed=0)[0]
    assert torch.allclose(torch.from_numpy(result.image), expected, atol=1e-5)


#: The tiny DiT of the ``ar_to_dit_*.yaml`` configs (without its seed).
AR_TO_DIT_KWARGS = {
    "image_size": 32,
    "patch_size": 4,
    "hidden": 64,
    "depth": 2,
    "kv_heads": 2,
    "kv_head_dim": 32,
}


def run_ar_to_dit_over(config: Path, connector: str) -> dict[str, Any]:
    """Run an ``ar_to_dit_*.yaml`` pipeline whose every edge end is a ``connector`` on the tiny
    model and check it: two prompts, KV exact against transformers, different images, no stage
    process left. Returns the plan's connector ends by role (``sender``/``receiver``), for the
    caller's connector-specific checks."""
    import tempfile

    from vllm_kvbridge.models.tiny_lm import ensure_tiny_model

    model = ensure_tiny_model()
    with tempfile.TemporaryDirectory(prefix="kvb-dump-") as dump:
        return _run_ar_to_dit_over(config, connector, model, Path(dump))


def _run_ar_to_dit_over(config: Path, connector: str, model: Path, dump: Path) -> dict[str, Any]:
    import msgspec

    from vllm_kvbridge.pipeline import Pipeline

    prompts = ["A cute cat", "The quick brown fox jumps over the lazy dog. " * 3]
    pipe = Pipeline.from_config(config, model=str(model))
    pipe.plan = msgspec.structs.replace(
        pipe.plan, stages=[msgspec.structs.replace(s, debug_dump_dir=str(dump)) for s in pipe.plan.stages]
    )
    ends = {e.role: e.connector for s in pipe.plan.stages for e in (*s.inputs, *s.outputs)}
    assert {c.name for c in ends.values()} == {connector}
    with pipe:
        pids = pipe.stage_pids()
        results = pipe.generate(prompts)
    assert not pipe.log_dir.exists()  # the run's own log directory goes with a clean run
    for r in results:
        assert r.error is None and r.image.shape == (3, 32, 32)
        kv = [t for t in r.transfers if t.what == "kv"]
        assert kv and all(t.nbytes > 0 for t in kv)
        check_dumped_kv_is_transformers_kv(model, r, dump, {**AR_TO_DIT_KWARGS, "seed": 0})
    assert not torch.equal(torch.from_numpy(results[0].image), torch.from_numpy(results[1].image))
    for pid in pids.values():
        assert not descendants(pid)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"stage process {pid} is still alive")
    return ends


def processes_using(path: str | Path) -> list[int]:
    """Pids of live processes with an open file under ``path`` (stage logs live there)."""
    root = str(Path(path).resolve())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}").startswith(root):
                    found.append(int(entry))
                    break
            except OSError:
                continue
    return found


# -- CFG companion fault injection (AR stage) -------------------------------------------
#: Requests whose id starts with this get their CFG companion's KV put refused.
FAIL_COMPANION_PREFIX = "fail"
#: ... with this one their companion's put is held while the file named by
#: ``$KVBRIDGE_TEST_COMPANION_GATE`` exists (``<gate>.waiting`` / ``<gate>.done`` mark it).
HOLD_COMPANION_PREFIX = "hold"
COMPANION_GATE_ENV = "KVBRIDGE_TEST_COMPANION_GATE"


def _fail_companion_classes() -> dict[str, Any]:
    """Built on first use: importing vLLM's worker classes is slow, most tests never need them."""
    from kv_fault_fixtures import WrappedConnector, WrappedKVConnectorRunner

    from vllm_kvbridge.connectors.base import PutResult
    from vllm_kvbridge.connectors.keys import encode_request_id
    from vllm_kvbridge.runner.worker import KVBridgeCPUWorker

    class FailCompanionPuts(WrappedConnector):
        """The stage's real connector, except that a ``cfg_neg`` put of a ``fail*`` request
        is refused (as a full store or a dead peer would): the KV manager retries, then
        reports that companion's send failed."""

        name = "FailCompanionPuts"

        def put(self, from_stage: Any, to_stage: Any, key: str, payload: Any) -> PutResult:
            if ".cfg_neg." in key and f".{encode_request_id(FAIL_COMPANION_PREFIX)}" in key:
                return PutResult(ok=False, error="injected: the store refused the CFG companion")
            gate = os.environ.get(COMPANION_GATE_ENV)
            held = gate and ".cfg_neg." in key and f".{encode_request_id(HOLD_COMPANION_PREFIX)}" in key
            if held:  # hold the put while the gate file exists (the test aborts meanwhile)
                Path(gate + ".waiting").touch()
                while os.path.exists(gate):
                    time.sleep(0.02)
            result = super().put(from_stage, to_stage, key, payload)
            if held:
                Path(gate + ".done").touch()
            return result

    class FailCompanionRunner(WrappedKVConnectorRunner):
        def wrap(self, inner: Any) -> Any:
            return FailCompanionPuts(inner)

    class FailCompanionWorker(KVBridgeCPUWorker):
        runner_cls = FailCompanionRunner

    return {"FailCompanionPuts": FailCompanionPuts, "FailCompanionWorker": FailCompanionWorker}


def __getattr__(name: str) -> Any:
    # ``worker_cls: pipeline_fixtures.FailCompanionWorker`` in a stage config lands here.
    if name in ("FailCompanionPuts", "FailCompanionWorker"):
        globals().update(_fail_companion_classes())  # built once, then plain attributes
        return globals()[name]
    raise AttributeError(name)


def poll_until(pred: Any, timeout_s: float, pipe: Any, finished: dict[str, Any]) -> Any:
    """Poll ``pipe`` (a :class:`~vllm_kvbridge.pipeline.Pipeline`) until ``pred()`` is truthy,
    collecting finished results into ``finished``; its value, or an AssertionError."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for r in pipe.poll(0.05):
            finished[r.request_id] = r
        got = pred()
        if got:
            return got
    raise AssertionError(f"timed out after {timeout_s} s; finished so far: {finished}")


# -- the lightest real pipeline: one external stage, a stand-in OpenAI server ------------
class FakeOpenAIServer:
    """A stand-in for the OpenAI server of an external (``url``) LLM stage, on loopback in
    the test's process: with it, a pipeline is one real stage process (the HTTP stage
    engine, no vLLM) driven by a real orchestrator. A completion answers ``echo: <prompt>``.
    While :meth:`hold` is in force, completions wait for :meth:`release` (the requests stay
    in flight, in the stage); :meth:`wait_received` says when the server holds a request, so
    a test knows a request is in flight without sleeping."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self._released = threading.Event()
        self._released.set()
        self._cond = threading.Condition()
        self._received: set[str] = set()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer({"data": [{"id": "fake"}]})

            def do_POST(self) -> None:
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer._cond:
                    outer._received.add(str(req.get("request_id")))
                    outer._cond.notify_all()
                outer._released.wait(timeout=120)  # never a thread left behind for good
                self._answer({"choices": [{"text": f"echo: {req['prompt']}", "token_ids": [1, 2]}]})

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-openai", daemon=True)
        self._thread.start()

    def hold(self) -> None:
        self._released.clear()

    def release(self) -> None:
        self._released.set()

    def wait_received(self, request_id: str, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: request_id in self._received, timeout=timeout_s)

    def close(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FakeOpenAIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def external_stage_config(directory: Path, url: str, runtime: dict[str, Any] | None = None) -> Path:
    """A one-stage pipeline config: an external LLM stage served at ``url`` (``runtime``: its
    ``runtime:`` section)."""
    import yaml

    stage = {"stage_id": 0, "kind": "llm_ar", "url": url, "model": "fake"}
    spec: dict[str, Any] = {"name": "external_only", "stages": [stage]}
    if runtime:
        spec["runtime"] = runtime
    path = directory / "external_only.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path
