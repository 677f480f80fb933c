"""Prometheus metrics of ``vllm-kvbridge serve`` (served at ``GET /metrics``).

One private :class:`prometheus_client.CollectorRegistry` per server, so two servers in one
process (tests) never share counters. Names start with ``kvbridge_``:

* ``kvbridge_http_requests_total{endpoint,status}``: HTTP requests by final status code;
* ``kvbridge_request_failures_total{reason}``: ``bad_request``, ``stage_down``, ``stage_error``,
  ``stage_lost`` (its stage crashed or stalled), ``stage_recovering`` (refused meanwhile),
  ``timeout``, ``client_disconnect``, ``shutdown``, ``overloaded``;
* ``kvbridge_requests_in_flight``: pipeline requests not finished yet;
* ``kvbridge_request_latency_seconds{endpoint}``: end-to-end latency of successful requests;
* ``kvbridge_stage_latency_seconds{stage,kind,replica}``: per-stage wall time (orchestrator view);
* ``kvbridge_edge_bytes_total`` / ``kvbridge_edge_transfer_seconds_total{from_stage,to_stage,what}``:
  bytes and seconds moved per edge (the receiving side's measurement when it reported one);
* ``kvbridge_stage_up{stage,kind,replica}``: 1 while the stage's replica is ready;
* ``kvbridge_stage_restarts_total{stage,kind,replica}``: restarts of a lost stage replica
  (supervision); ``kvbridge_stage_recovering{stage,kind,replica}`` is 1 while one is under way;
* ``kvbridge_leases_expired_total{stage,kind,replica}``: payloads a stage's senders dropped unread
  because no receiver renewed their lease (its consumer died or gave up);
  ``kvbridge_edge_puts_full_total{stage,kind,replica}``: puts a stage's senders found its edge full
  for (the sender waited for room: docs/serving.md, "Backpressure on the edges");
* ``kvbridge_edge_unreachable{stage,kind,replica}``: its connectors that cannot reach their
  edge's service.

``replica`` is the stage replica's index (``replicas: N``, issue 41): every series of a
stage process has one, ``"0"`` for a stage without replicas, so a query by ``stage`` alone
(``sum by (stage)``, ``max by (stage)``) reads as before. A request's latency in a stage
counts towards the replica that served it. The edge series are per edge, summed over the
replicas on either side.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vllm_kvbridge.pipeline.orchestrator import RequestResult

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    def __init__(
        self,
        in_flight: Callable[[], float],
        stage_health: Callable[[], list[dict[str, Any]]],
        control_counters: Callable[[], dict[str, int]] = dict,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            "kvbridge_http_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.failures = Counter(
            "kvbridge_request_failures", "Failed or aborted requests by reason", ["reason"], registry=r
        )
        self.in_flight = Gauge("kvbridge_requests_in_flight", "Pipeline requests in flight", registry=r)
        self.in_flight.set_function(in_flight)
        self.latency = Histogram(
            "kvbridge_request_latency_seconds",
            "End-to-end latency of successful requests",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.stage_latency = Histogram(
            "kvbridge_stage_latency_seconds",
            "Per-stage wall time seen by the orchestrator",
            ["stage", "kind", "replica"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.edge_bytes = Counter(
            "kvbridge_edge_bytes", "Bytes moved per edge", ["from_stage", "to_stage", "what"], registry=r
        )
        self.edge_seconds = Counter(
            "kvbridge_edge_transfer_seconds",
            "Transfer seconds per edge",
            ["from_stage", "to_stage", "what"],
            registry=r,
        )
        per_replica = ["stage", "kind", "replica"]  # a stage process: one replica of its stage
        self.stage_up = Gauge(
            "kvbridge_stage_up", "1 while the stage replica is ready", per_replica, registry=r
        )
        self.stage_restarts = Counter(
            "kvbridge_stage_restarts", "Restarts of lost stage replicas", per_replica, registry=r
        )
        self.stage_recovering = Gauge(
            "kvbridge_stage_recovering", "1 while a lost stage replica is restarted", per_replica, registry=r
        )
        self.leases_expired = Counter(
            "kvbridge_leases_expired",
            "Payloads dropped unread when their lease expired",
            per_replica,
            registry=r,
        )
        self.puts_full = Counter(
            "kvbridge_edge_puts_full", "Puts that found their edge full", per_replica, registry=r
        )
        self.edge_unreachable = Gauge(
            "kvbridge_edge_unreachable",
            "Connectors of the stage that cannot reach their edge's service (a Mooncake master)",
            per_replica,
            registry=r,
        )
        self.control_rejected = Counter(
            "kvbridge_control_rejected",
            "Control-plane peers refused (refused_connections) and frames dropped (dropped_frames)",
            ["what"],
            registry=r,
        )
        self._control_counters = control_counters
        self._control_seen: dict[str, int] = {}
        self._restarts_seen: dict[tuple[str, str], int] = {}  # (stage, replica) -> restarts
        # (stage, replica, counter) -> (pid, value) last seen: a restarted process counts from 0
        self._counters_seen: dict[tuple[str, str, str], tuple[int, float]] = {}
        self._stage_health = stage_health

    def observe_result(self, r: RequestResult) -> None:
        """Per-stage latency and per-edge transfer figures of one finished request."""
        for rec in r.stages:
            if rec.done:
                self.stage_latency.labels(str(rec.stage_id), rec.kind, str(rec.replica)).observe(rec.wall_s)
        # CFG companions' KV counts towards its edge's "kv" figures (purpose is not a label).
        for (a, b, what, _purpose), (nbytes, seconds) in r.edge_totals().items():
            self.edge_bytes.labels(str(a), str(b), what).inc(nbytes)
            self.edge_seconds.labels(str(a), str(b), what).inc(seconds)

    def render(self) -> bytes:
        for stage in self._stage_health():
            # a stage with replicas lists each under "replicas"; one without is its own entry
            for s in stage.get("replicas") or [stage]:
                self._follow_replica(str(stage["stage_id"]), stage["kind"], s)
        # The orchestrator counts what its control plane refused; the counter follows it.
        for what, value in self._control_counters().items():
            if value > self._control_seen.get(what, 0):
                self.control_rejected.labels(what).inc(value - self._control_seen.get(what, 0))
                self._control_seen[what] = value
        return generate_latest(self.registry)

    def _follow_replica(self, sid: str, kind: str, s: dict[str, Any]) -> None:
        """The series of one stage replica from its ``/health`` entry ``s``."""
        k = str(s.get("replica", 0))
        labels = (sid, kind, k)
        self.stage_up.labels(*labels).set(1.0 if s["status"] == "ready" else 0.0)
        self.stage_recovering.labels(*labels).set(1.0 if s["status"] == "recovering" else 0.0)
        # The pipeline counts restarts; the counter follows it at each scrape.
        new = s.get("restarts", 0) - self._restarts_seen.get((sid, k), 0)
        if new > 0:
            self.stage_restarts.labels(*labels).inc(new)
            self._restarts_seen[sid, k] = s["restarts"]
        counters, pid = s.get("counters", {}), s.get("pid", 0)
        self.edge_unreachable.labels(*labels).set(float(counters.get("edges_unreachable", 0)))
        for name, counter in (("leases_expired", self.leases_expired), ("puts_full", self.puts_full)):
            self._follow(counter.labels(*labels), (sid, k, name), pid, counters)

    def _follow(self, child: Any, key: tuple[str, str, str], pid: int, counters: dict[str, float]) -> None:
        """Add what a stage process's counter grew by since the last scrape (all of it for
        a new process)."""
        if key[-1] not in counters:
            return
        value = float(counters[key[-1]])
        seen_pid, seen = self._counters_seen.get(key, (pid, 0.0))
        grown = value - seen if seen_pid == pid else value
        if grown > 0:
            child.inc(grown)
        self._counters_seen[key] = (pid, value)
