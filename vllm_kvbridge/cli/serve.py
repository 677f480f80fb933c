"""``vllm-kvbridge serve``: serve a pipeline over HTTP (see :mod:`vllm_kvbridge.server.app`).

    vllm-kvbridge serve --stage-config FILE [--host 127.0.0.1] [--port 8000] [--model DIR | --arch ARCH]
                        [--served-model-name NAME] [--output-dir DIR] [--log-dir DIR]
                        [--drain-timeout S]
                        [--api-key KEY] [--unauthenticated-paths P,...] [--max-in-flight N]
                        [--max-body-bytes N] [--debug-endpoints]
                        [--ssl-keyfile PEM --ssl-certfile PEM]

Starts every stage (blocking until all are ready; the port opens only then), then serves
until SIGTERM/SIGINT: uvicorn stops accepting connections, lets in-flight requests finish
for up to ``--drain-timeout`` seconds, aborts the rest (each answered 503), then the pipeline is closed (every
stage process stopped, every shared-memory segment of the run removed). Exit status: 0
after a clean shutdown, 2 for a bad config, 3 when a stage failed to start.

``--arch ARCH`` serves LLM stages that name no model with the tiny offline model of that
architecture (``kvbridge://tiny-ARCH``; default: the tiny Llama).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.models.model_args import add_model_arguments, chosen_model, describe_tiny, tiny_model
from vllm_kvbridge.server.auth import API_KEY_ENV, api_key_from, open_paths_from
from vllm_kvbridge.server.limits import DEFAULT_MAX_BODY_BYTES

#: Seconds uvicorn waits past ``--drain-timeout`` for the aborted requests' 503 answers.
SHUTDOWN_GRACE_S = 5


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a pipeline over an OpenAI-compatible HTTP API",
        description="Serve a multi-stage pipeline over HTTP (OpenAI-compatible endpoints).",
    )
    p.add_argument("--stage-config", required=True, help="stage config YAML (see stage_configs/)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--ray-address",
        help="run the stages on this Ray cluster (auto | HOST:PORT): one actor per stage, placed by"
        " stages[].placement (default: the config's runtime.ray_address, else local processes)",
    )
    add_model_arguments(p)
    p.add_argument("--served-model-name", help="model name clients use (default: the pipeline's name)")
    p.add_argument(
        "--output-dir", help="where images returned as URLs are written (enables response_format=url)"
    )
    p.add_argument(
        "--log-dir",
        help="where the stages' logs go (stage_<id>.log), kept; default: a temporary directory "
        "removed at a clean shutdown",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get on shutdown (%(default)s)",
    )
    p.add_argument(
        "--api-key",
        help=f"require this key (Authorization: Bearer KEY) on every endpoint; default ${API_KEY_ENV}",
    )
    p.add_argument(
        "--unauthenticated-paths",
        help="comma-separated paths open without the key (default: /health,/metrics; '' for none)",
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        help="requests in flight at most; beyond, 429 with Retry-After (default: runtime.max_in_flight, 256)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="request bodies larger than this are answered 413, unread (%(default)s)",
    )
    p.add_argument(
        "--debug-endpoints",
        action="store_true",
        help="without --api-key: serve /debug/state and show the stages' pids in /health (off: "
        "404 / no pids); with a key both need it anyway",
    )
    p.add_argument("--ssl-keyfile", help="serve HTTPS with this private key (PEM)")
    p.add_argument("--ssl-certfile", help="serve HTTPS with this certificate chain (PEM)")
    p.add_argument("--log-level", default="warning")
    p.add_argument(
        "--print-vllm-serve",
        type=int,
        metavar="STAGE_ID",
        help="print the `vllm serve` command that runs this LLM stage as an external server "
        "(with the kvbridge worker) and exit; use it for a stage whose config has `url`",
    )
    p.set_defaults(func=_serve)


def _load_tokenizer(model: str | None) -> Any:
    if not model:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model)
    except Exception as exc:  # the length check is then left to the engine
        print(
            f"[serve] no tokenizer for {model!r} ({exc}); prompt lengths are not pre-checked", file=sys.stderr
        )
        return None


def _print_vllm_serve(args: argparse.Namespace) -> int:
    import shlex
    from urllib.parse import urlparse

    import msgspec

    from vllm_kvbridge.config.locality import bind_auto_edges, local_node
    from vllm_kvbridge.config.resolve import resolve
    from vllm_kvbridge.pipeline.http_engine import vllm_serve_argv

    try:
        plan = resolve(args.stage_config)
        stage = plan.stage(args.print_vllm_serve)
        if stage.is_llm and not stage.model:
            # This one stage's model only: the server may run where the model is, so the
            # DiT geometry check of with_model (it reads the model here) is not for this.
            stage = msgspec.structs.replace(stage, model=chosen_model(args))
            plan = msgspec.structs.replace(
                plan, stages=[stage if s.stage_id == stage.stage_id else s for s in plan.stages]
            )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyError:
        print(f"error: no stage {args.print_vllm_serve} in {args.stage_config}", file=sys.stderr)
        return 2
    if not stage.is_llm or not stage.model:
        print(
            f"error: stage {stage.stage_id} is not an LLM stage with a model (pass --model)", file=sys.stderr
        )
        return 2
    # Printed for a server on this host: an auto edge is what the local backend picks.
    plan = bind_auto_edges(plan, {s.stage_id: local_node() for s in plan.stages})
    stage = plan.stage(stage.stage_id)
    url = urlparse(stage.url or f"http://{args.host}:8001")
    argv = vllm_serve_argv(stage, stage.model, host=url.hostname or args.host, port=url.port or 8001)
    print(shlex.join(argv))
    return 0


class _Stop(BaseException):
    pass


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from vllm_kvbridge.pipeline import Pipeline, StageError
    from vllm_kvbridge.pipeline.service import PipelineService
    from vllm_kvbridge.server.app import ServerState, build_app

    def stop(signum: int, frame: object) -> None:
        raise _Stop()

    if args.print_vllm_serve is not None:
        return _print_vllm_serve(args)
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        print("error: --ssl-keyfile and --ssl-certfile go together", file=sys.stderr)
        return 2
    if args.max_body_bytes < 1:
        print("error: --max-body-bytes must be >= 1", file=sys.stderr)
        return 2
    # Until uvicorn installs its own handlers, SIGTERM stops the stages being started.
    old = signal.signal(signal.SIGTERM, stop)
    model = chosen_model(args)
    if args.arch:
        print(describe_tiny(args.arch, str(model)), flush=True)

    def open_pipeline(model: str | None) -> Pipeline:
        return Pipeline.from_config(
            args.stage_config,
            model=model,
            progress=lambda s: print(s, flush=True),
            ray_address=args.ray_address,
            log_dir=args.log_dir,
        )

    try:
        try:
            pipe = open_pipeline(model)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except Exception as exc:
            if model is None and "no model for LLM stage" in str(exc):
                model = tiny_model(None)
                try:
                    pipe = open_pipeline(model)
                except ConfigError as err:  # e.g. a DiT's kwargs the tiny model contradicts
                    print(f"error: {err}", file=sys.stderr)
                    return 2
            else:
                raise
        if args.max_in_flight is not None and args.max_in_flight < 1:
            print("error: --max-in-flight must be >= 1", file=sys.stderr)
            return 2
        service = PipelineService(pipe, max_in_flight=args.max_in_flight or pipe.plan.max_in_flight)
        try:
            service.start()
        except StageError as exc:
            print(f"error: {exc}\n{exc.log_tail}", file=sys.stderr)
            return 3
    except (_Stop, KeyboardInterrupt):
        return 0
    finally:
        signal.signal(signal.SIGTERM, old)
    entry = pipe.plan.entry_stage
    output_dir = Path(args.output_dir) if args.output_dir else None
    if output_dir is not None:
        output_dir.mkdir(parents=True, exist_ok=True)
    state = ServerState(
        service,
        served_model_name=args.served_model_name or pipe.plan.name,
        tokenizer=_load_tokenizer(entry.model),
        output_dir=output_dir,
        drain_s=args.drain_timeout,
    )
    api_key = api_key_from(args.api_key)
    app = build_app(
        state,
        api_key=api_key,
        open_paths=open_paths_from(args.unauthenticated_paths),
        max_body_bytes=args.max_body_bytes,
        debug_endpoints=args.debug_endpoints,
    )
    scheme = "https" if args.ssl_certfile else "http"
    print(
        f"[serve] {pipe.plan.name} on {scheme}://{args.host}:{args.port} (run {pipe.run_id})"
        + (" (API key required)" if api_key else ""),
        flush=True,
    )
    # uvicorn handles SIGTERM (graceful shutdown), then re-raises it once it has restored the
    # handler found here: make that a no-op so the pipeline is closed below and we exit 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            state.begin_shutdown()  # requests still running after --drain-timeout get 503
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # Past the drain the requests are aborted (503); uvicorn cancels only what still
        # hangs after that (it would answer 500).
        timeout_graceful_shutdown=int(args.drain_timeout) + SHUTDOWN_GRACE_S,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
    )
    try:
        _Server(config).run()
    finally:
        service.close()
    print("[serve] stopped", flush=True)
    return 0
