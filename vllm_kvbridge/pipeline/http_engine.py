"""The engine of an *external* LLM stage: an OpenAI-compatible server (a stock ``vllm serve``).

A stage whose config has ``url`` is served by a server someone started beforehand, e.g.
a stock vLLM server for a stage that sends KV::

    vllm serve MODEL --port 8001 --kv-transfer-config \\
        '{"kv_connector": "KVBridgeConnector",
          "kv_connector_module_path": "vllm_kvbridge.runner.vllm_connector",
          "kv_role": "kv_producer",
          "kv_connector_extra_config": {"kvbridge": {...runner settings...}}}'

(:func:`vllm_serve_argv` builds exactly this from the stage config; a payload stage adds
``--worker-cls``). The KV connector in that server sends each finished request's KV on
the stage's edges, like an engine the orchestrator started. This engine forwards each
:class:`Submit` as ``POST {url}/v1/completions`` with the orchestrator's request id (``request_id`` in the
body: vLLM names the request ``cmpl-<id>-0``) and reads the transfer id the kvbridge
KV connector reports in the response's ``kv_transfer_params``
(``kvbridge_transfer_id``); that id goes to the next stage, whose receiver finds the KV by
key (the shared-memory and Mooncake-store connectors need no other sender info).

Contract: requests run concurrently on one asyncio loop thread; an HTTP error answer fails
that request (``RequestFailed`` with the server's message); a server that cannot be
reached fails the stage (``StageFailed``: the supervisor fails the requests in it and
restarts it; the restarted engine is ready once the server answers again); ``abort``
cancels the HTTP request, and vLLM aborts a request whose client went away.
"""

from __future__ import annotations

import asyncio
import functools
import json
import queue
import threading
import time
from typing import Any

from vllm_kvbridge.config.resolve import ResolvedStage
from vllm_kvbridge.pipeline import messages as m
from vllm_kvbridge.pipeline.engines import StageEngine, drain_results

#: Sampling parameters the OpenAI completions API accepts under the same name.
_OPENAI_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "min_tokens", "ignore_eos")


class ExternalStageDown(RuntimeError):
    """The stage's server cannot be reached."""


@functools.cache
def _vllm_negatable_flags() -> frozenset[str]:
    """The ``--no-<name>`` flags vLLM's engine arguments accept (its BooleanOptionalAction)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    flags = EngineArgs.add_cli_args(FlexibleArgumentParser())._option_string_actions
    return frozenset(f for f in flags if f.startswith("--no-"))


def _engine_arg_flags(key: str, value: Any) -> list[str]:
    flag = "--" + key.replace("_", "-")
    if value is None:
        return []
    if value is True:
        return [flag]
    if value is False:
        # Left out, a False would be vLLM's default, which for many flags is True (e.g.
        # enable_prefix_caching): say --no-<name>. A plain store_true flag defaults to False.
        negated = "--no-" + flag[2:]
        return [negated] if negated in _vllm_negatable_flags() else []
    return [flag, json.dumps(value) if isinstance(value, dict | list) else str(value)]


def vllm_serve_argv(stage: ResolvedStage, model: str, *, port: int, host: str = "127.0.0.1") -> list[str]:
    """The ``vllm serve`` command line that runs ``stage`` with the kvbridge worker."""
    from vllm_kvbridge.config.runner_settings import runner_settings
    from vllm_kvbridge.runner.worker import engine_kwargs

    kw = engine_kwargs(runner_settings(stage), worker_cls=stage.worker_cls)
    argv = ["vllm", "serve", model, "--host", host, "--port", str(port)]
    if "worker_cls" in kw:  # a payload stage; one that only sends KV runs the stock worker
        argv += ["--worker-cls", kw["worker_cls"]]
    argv += ["--kv-transfer-config", json.dumps(kw["kv_transfer_config"], separators=(",", ":"))]
    if stage.tensor_parallel_size != 1:
        argv += ["--tensor-parallel-size", str(stage.tensor_parallel_size)]
    for key, value in stage.engine_args.items():
        argv += _engine_arg_flags(key, value)
    return argv


class HTTPStageEngine(StageEngine):
    def __init__(self, stage: ResolvedStage) -> None:
        super().__init__(stage)
        import httpx

        assert stage.url is not None
        self.url = stage.url
        self._httpx = httpx
        self._done: queue.SimpleQueue[m.StageDone | m.RequestFailed | BaseException] = queue.SimpleQueue()
        self._tasks: dict[str, asyncio.Task] = {}
        self._pending = 0
        self._lock = threading.Lock()
        # Wait for the server even when the model is named: a stage restarted after its
        # server went away (pipeline/supervision.py) is ready only once the server is back.
        served = self._served_model(stage.start_timeout)
        self.model = stage.model or served
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvbridge-http-stage", daemon=True
        )
        self._thread.start()
        self._client: Any = asyncio.run_coroutine_threadsafe(self._make_client(), self._loop).result()

    async def _make_client(self) -> Any:
        timeout = self._httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)
        return self._httpx.AsyncClient(base_url=self.url, timeout=timeout)

    def _served_model(self, timeout_s: float) -> str:
        """The served model name (waits for the server up to ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                r = self._httpx.get(self.url + "/v1/models", timeout=5)
                r.raise_for_status()
                return str(r.json()["data"][0]["id"])
            except (self._httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                if time.monotonic() > deadline:
                    raise ExternalStageDown(f"no OpenAI server at {self.url}: {exc}") from None
                time.sleep(1.0)

    def info(self) -> dict[str, Any]:
        return {"kind": self.stage.kind, "model": self.model, "url": self.url}

    # -- requests --------------------------------------------------------------------------
    def submit(self, msg: m.Submit) -> None:
        if msg.prompt is None:
            raise ValueError(f"external stage {self.stage.stage_id} needs a text prompt ({msg.request_id!r})")
        if msg.companions:
            # An external server cannot key a companion's KV under the primary's id: fail now
            # rather than let the DiT wait its deadline for a companion that never comes.
            why = f"CFG companions {sorted(msg.companions)} need a kvbridge LLM stage, not an external server"
            self._done.put(m.RequestFailed(msg.request_id, self.stage.stage_id, why))
            return
        params = {**self.stage.default_sampling_params, **msg.sampling_params}
        body: dict[str, Any] = {k: params[k] for k in _OPENAI_PARAMS if k in params}
        body.update(model=self.model, prompt=msg.prompt, request_id=msg.request_id, return_token_ids=True)
        with self._lock:
            self._pending += 1
        fut = asyncio.run_coroutine_threadsafe(self._run(msg.request_id, body), self._loop)
        fut.add_done_callback(lambda f: None)

    async def _run(self, rid: str, body: dict[str, Any]) -> None:
        self._tasks[rid] = asyncio.current_task()  # type: ignore[assignment]
        started = time.time()
        try:
            r = await self._client.post("/v1/completions", json=body, headers={"X-Request-Id": rid})
        except asyncio.CancelledError:
            return  # aborted: the closed connection makes vLLM abort it too
        except self._httpx.HTTPError as exc:
            self._done.put(ExternalStageDown(f"{self.url} unreachable: {type(exc).__name__}: {exc}"))
            return
        finally:
            self._tasks.pop(rid, None)
            with self._lock:
                self._pending -= 1
        if r.status_code != 200:
            try:
                why = r.json()["error"]["message"]
            except Exception:
                why = r.text[:500]
            self._done.put(
                m.RequestFailed(rid, self.stage.stage_id, f"HTTP {r.status_code} from {self.url}: {why}")
            )
            return
        data = r.json()
        choice = data["choices"][0]
        params = data.get("kv_transfer_params") or {}
        transfer_id = str(params.get("kvbridge_transfer_id") or f"cmpl-{rid}-0")
        self._done.put(
            m.StageDone(
                rid,
                self.stage.stage_id,
                output={
                    "text": choice.get("text", ""),
                    "token_ids": list(choice.get("token_ids") or []),
                    "prompt_token_ids": list(choice.get("prompt_token_ids") or []),
                },
                transfer_request_id=transfer_id,
                sender_info={},
                started=started,
                finished=time.time(),
            )
        )

    def abort(self, request_ids: list[str]) -> None:
        def cancel() -> None:
            for rid in request_ids:
                task = self._tasks.get(rid)
                if task is not None:
                    task.cancel()

        self._loop.call_soon_threadsafe(cancel)

    def busy(self) -> bool:
        return not self._done.empty()

    def step(self) -> list[m.StageDone | m.RequestFailed]:
        return drain_results(self._done)

    def close(self) -> None:
        async def shutdown() -> None:
            for task in list(self._tasks.values()):
                task.cancel()
            await self._client.aclose()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
