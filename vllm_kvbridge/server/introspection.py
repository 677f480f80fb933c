"""``GET /health``, ``/v1/models``, ``/metrics`` and ``/debug/state``, and what each shows to whom.

``/health`` (open by default, for probes):

* 200 ``"status": "ok"``: every stage is ready.
* 200 ``"status": "degraded"``: a lost stage is being restarted (``stages`` says which, and
  ``down`` why); the server still answers, new requests get 503 with ``Retry-After`` until it
  is back. 200 so that a liveness probe does not kill a pod that is healing itself. Also
  while a stage's connector cannot reach its edge's service (a Mooncake master down): the
  requests over that edge fail, and restarting this server would not help. Also while a
  replica of a stage with ``replicas: N`` is restarted and another one is up: nothing is
  refused (its stage takes new requests on the others), ``down`` names the replica.

Every stage entry says where its process runs (``node``: id, ip, host); a stage with
replicas lists each replica under ``replicas``, with its own ``status``, ``node`` and
``restarts``.
* 503 ``"status": "down"``: a stage is down for good (its restarts are spent); only a
  restart of the server helps. 503 ``"status": "unavailable"``: the server is shutting down.

The stages' (and their replicas') pids are shown only to a caller that presented the API key (without
``--api-key``: only with ``--debug-endpoints``): a pid tells an attacker on the host which
process to signal. ``/debug/state`` (in-flight request ids, shared-memory names) is
likewise behind the key; without a key configured it is off (404) unless
``--debug-endpoints`` turns it on.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from vllm_kvbridge.server.auth import SCOPE_KEY
from vllm_kvbridge.server.errors import ApiError
from vllm_kvbridge.server.state import ServerState

#: Stage fields only a caller with the key sees (see the module docstring).
PRIVATE_STAGE_FIELDS = ("pid",)


def public_stage_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """A ``/health`` stage entry without :data:`PRIVATE_STAGE_FIELDS`, its replicas' too."""
    out = {k: v for k, v in entry.items() if k not in PRIVATE_STAGE_FIELDS}
    if "replicas" in out:
        out["replicas"] = [public_stage_entry(r) for r in out["replicas"]]
    return out


def add_introspection_routes(
    app: FastAPI, state: ServerState, *, api_key: str | None, debug_endpoints: bool = False
) -> None:
    """Add the introspection endpoints to ``app`` (exposure as in the module docstring)."""

    def trusted(request: Request) -> bool:
        """Whether ``request`` may see internals: it presented the key (the auth middleware
        checked it), or no key is configured and ``--debug-endpoints`` opened them."""
        if api_key:
            return bool(request.scope.get(SCOPE_KEY, {}).get("authenticated"))
        return debug_endpoints

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        h = state.service.health()
        stages = h["stages"]
        if not trusted(request):
            stages = [public_stage_entry(s) for s in stages]
        if h["ok"]:
            status, code = "ok", 200
        elif h["recovering"] or h["cut_off"] or h["replicas_down"]:  # empty once the pipeline failed
            status, code = "degraded", 200
        else:
            status, code = ("down" if h["error"] is not None else "unavailable"), 503
        body: dict[str, Any] = {"status": status, "pipeline": state.plan.name, "stages": stages}
        body["error"] = h["error"]
        down = [
            f"stage {s['stage_id']} ({s['kind']}): {s.get('error', s['status'])}"
            for s in stages
            if s["status"] != "ready"
        ]
        down += [
            f"stage {s['stage_id']} ({s['kind']}): {s['counters']['edges_unreachable']:g} of its connectors"
            " cannot reach their edge's service (a Mooncake master down?): requests over it fail"
            for s in stages
            if s["stage_id"] in h["cut_off"]
        ]
        down += [
            f"stage {s['stage_id']} ({s['kind']}) replica {r['replica']}: {r.get('error', r['status'])}"
            " (the stage serves on its other replicas)"
            for s in stages
            for r in s.get("replicas", [])
            if (s["stage_id"], r["replica"]) in h["replicas_down"]
        ]
        if down:
            body["down"] = down
        return JSONResponse(body, status_code=code)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.served_model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "vllm-kvbridge",
                    "max_model_len": state.max_model_len,
                    "kvbridge": {
                        "pipeline": state.plan.name,
                        "output": state.output_kind,
                        "stages": [{"stage_id": s.stage_id, "kind": s.kind} for s in state.plan.stages],
                    },
                }
            ],
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/state")
    async def debug_state(request: Request) -> dict[str, Any]:
        from vllm_kvbridge.connectors.leftovers import shared_memory_names

        if api_key and not trusted(request):  # also where --unauthenticated-paths names it
            raise ApiError(401, "Unauthorized: /debug/state needs the API key", "authentication_error")
        if not trusted(request):
            raise ApiError(404, "Not Found (/debug/state is off: serve --debug-endpoints)", "NotFoundError")
        run = state.service.pipeline.run_id
        names = shared_memory_names(run)
        return {
            "run_id": run,
            # where the stages reach the orchestrator (CURVE: only the keys it issued get in)
            "control_address": state.service.pipeline.control_address,
            "in_flight": state.service.in_flight(),
            "in_flight_high_water": state.service.high_water,
            "max_in_flight": state.service.max_in_flight,
            # requests handed to the pipeline since the start (a refused one adds none)
            "submitted": state.submitted,
            "shm_segments": names,
            # published and not yet consumed payloads/KV caches (pool segments are reused)
            "shm_published": [n for n in names if ".k." in n],
            # request id -> the stages working on it (waiting for a recovering one: absent)
            "requests": state.service.pipeline.request_stages(),
            # request id -> {stage id: the replica it was routed to} (every stage it entered)
            "replicas": state.service.pipeline.request_replicas(),
        }


__all__ = ["PRIVATE_STAGE_FIELDS", "add_introspection_routes", "public_stage_entry"]
