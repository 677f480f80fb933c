"""One edge end that talks to peers on different nodes: a connector per route, picked per request.

A stage with replicas placed through Ray can have, on one ``connector: auto`` edge, a peer
replica on its own node (shared memory) and another on a different node (TCP): the edge is
picked per pair of replicas (:mod:`vllm_kvbridge.config.locality`). That end's connector is
then a :class:`RoutedConnector`: it holds one connector per *route* (``same``: the plan's
``runtime.same_node_connector``, ``cross``: its ``runtime.cross_node_connector``), each
made on first use, and

* sends a request's data over the route the orchestrator picked for it: the consumer
  replica of a request is picked when the request is submitted to the producer, and the
  producer's workers are told its route before the request starts (``kvbridge_route``,
  :data:`ROUTES`); a put of a request with no route is refused, never guessed;
* tags what it puts with the route (``PutResult.metadata["route"]``), so a receiving end
  that is routed too reads each key over the connector it was put with.

Keys are the edge's keys (:mod:`vllm_kvbridge.connectors.keys`): one request is sent to
one consumer replica, over one route, so a key is never on two routes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from vllm_kvbridge.config.locality import ROUTED, routed_config
from vllm_kvbridge.connectors.base import Connector, Meta, PutResult, Reservation, Stage
from vllm_kvbridge.connectors.keys import encode_request_id, parse_key
from vllm_kvbridge.errors import ConfigError, TransferError

#: Routes of requests kept per process at most (the oldest go first; each is a few bytes,
#: set before its request starts and read when its data is put).
MAX_ROUTES = 1 << 16


class RouteTable:
    """Per process: request (its transfer id) -> {consumer stage: route}. Thread-safe."""

    def __init__(self, limit: int = MAX_ROUTES) -> None:
        self._lock = threading.Lock()
        self._routes: OrderedDict[str, dict[str, str]] = OrderedDict()
        self._limit = limit

    def set(self, transfer_id: str, routes: Mapping[Any, str]) -> None:
        rid = encode_request_id(transfer_id)  # as keys spell it
        with self._lock:
            self._routes[rid] = {str(k): str(v) for k, v in routes.items()}
            self._routes.move_to_end(rid)
            while len(self._routes) > self._limit:
                self._routes.popitem(last=False)

    def of_key(self, key: str, to_stage: Stage) -> str | None:
        """The route of the request ``key`` belongs to, towards ``to_stage`` (None: unknown)."""
        rid = parse_key(key)["rid"]
        with self._lock:
            return self._routes.get(str(rid), {}).get(str(to_stage))


#: This process's routes (a vLLM worker's: set by ``KVBridgeWorkerExtension.kvbridge_route``).
ROUTES = RouteTable()


def routes_of(config: Mapping[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Route -> (connector name, config) of a :class:`RoutedConnector`'s config."""
    routes = config.get("routes")
    if not isinstance(routes, Mapping) or not routes:
        raise ConfigError(f"{ROUTED}: config needs 'routes' (route -> {{name, config}}), got {routes!r}")
    return {str(r): (str(v["name"]), dict(v.get("config") or {})) for r, v in routes.items()}


class _RoutedReservation(Reservation):
    """A route's reservation whose publish tags the put with the route."""

    def __init__(self, inner: Reservation, route: str) -> None:
        super().__init__(inner.key, inner.nbytes, inner.buffer)
        self._inner, self._route = inner, route

    def publish(self, **kwargs: Any) -> PutResult:
        return _tagged(self._inner.publish(**kwargs), self._route)

    def release(self) -> None:
        self._inner.release()


def _tagged(result: PutResult, route: str) -> PutResult:
    if not result.ok:
        return result
    return PutResult(True, result.nbytes, {**result.metadata, "route": route}, result.error, result.full)


class RoutedConnector(Connector):
    """One connector per route, each request's data over its own (see the module docstring)."""

    name = ROUTED
    #: Each instance says: True only when every one of its routes' data outlives its sender.
    data_outlives_sender = False

    def __init__(self, config: Mapping[str, Any] | None = None, table: RouteTable | None = None) -> None:
        super().__init__(config)
        self._specs = routes_of(self.config)
        self._table = table or ROUTES
        self._made: dict[str, Connector] = {}
        self._lock = threading.Lock()
        # Unread data dies with the sender if it does on any route (supervision asks).
        self.data_outlives_sender = all(
            getattr(_factory(n), "data_outlives_sender", True) for n, _ in self._specs.values()
        )

    def route(self, name: str) -> Connector:
        """The connector of route ``name``, made on first use."""
        if name not in self._specs:
            raise TransferError(f"{ROUTED}: no route {name!r} (routes: {sorted(self._specs)})")
        with self._lock:
            self._check_open()
            conn = self._made.get(name)
            if conn is None:
                from vllm_kvbridge.connectors.registry import create_connector

                conn = self._made[name] = create_connector(*self._specs[name])
            return conn

    def _route_of(self, key: str, to_stage: Stage) -> str | None:
        route = self._table.of_key(key, to_stage)
        if route is None and len(self._specs) == 1:
            return next(iter(self._specs))
        return route

    def _no_route(self, key: str, to_stage: Stage) -> PutResult:
        return self._put_failed(
            f"{key}: no route towards stage {to_stage} for its request (the orchestrator names the "
            "consumer replica's route before the request starts)"
        )

    def put(self, from_stage: Stage, to_stage: Stage, key: str, payload: Any) -> PutResult:
        route = self._route_of(key, to_stage)
        if route is None:
            return self._no_route(key, to_stage)
        return _tagged(self.route(route).put(from_stage, to_stage, key, payload), route)

    def reserve(self, from_stage: Stage, to_stage: Stage, key: str, nbytes: int) -> Reservation | PutResult:
        route = self._route_of(key, to_stage)
        if route is None:
            return self._no_route(key, to_stage)
        got = self.route(route).reserve(from_stage, to_stage, key, nbytes)
        if isinstance(got, PutResult):
            return got
        return _RoutedReservation(got, route)

    def _read_route(self, metadata: Meta) -> str:
        route = (metadata or {}).get("route")
        if route is None and len(self._specs) == 1:
            return next(iter(self._specs))
        if route is None:
            raise TransferError(f"{ROUTED}: the sender info names no route (routes: {sorted(self._specs)})")
        return str(route)

    def get(
        self,
        from_stage: Stage,
        to_stage: Stage,
        key: str,
        metadata: Meta = None,
        *,
        deadline: float | None = None,
    ) -> Any | None:
        return self.route(self._read_route(metadata)).get(
            from_stage, to_stage, key, metadata, deadline=deadline
        )

    def renew(self, from_stage: Stage, to_stage: Stage, key: str, metadata: Meta = None) -> bool:
        return self.route(self._read_route(metadata)).renew(from_stage, to_stage, key, metadata)

    def cleanup(self, key: str) -> None:
        # Every route made (a key is on one; cleanup is idempotent and a no-op elsewhere):
        # remembering each key's route would grow with every request never cleaned up.
        with self._lock:
            made = list(self._made.values())
        for conn in made:
            conn.cleanup(key)

    def health(self) -> dict[str, Any]:
        with self._lock:
            made = dict(self._made)
        out = super().health()
        routes = {name: conn.health() for name, conn in made.items()}
        for h in routes.values():  # the edge counters the stage sums (base.EDGE_COUNTERS)
            for counter in ("expired", "put_full", "unreachable"):
                out[counter] = out.get(counter, 0) + float(h.get(counter) or 0)
        out["routes"] = routes
        return out

    def _close(self) -> None:
        with self._lock:
            made, self._made = list(self._made.values()), {}
        for conn in made:
            conn.close()

    @classmethod
    def config_for_rank(cls, config: Mapping[str, Any], rank: int) -> dict[str, Any]:
        routes = {}
        for r, (n, c) in routes_of(config).items():
            for_rank = getattr(_factory(n), "config_for_rank", None)
            routes[r] = (n, for_rank(c, rank) if for_rank is not None else c)
        return routed_config(routes)

    @classmethod
    def reap_dead(cls, config: Mapping[str, Any], from_stage: Stage, to_stage: Stage) -> list[str]:
        removed: list[str] = []
        for name, cfg in routes_of(config).values():
            reap = getattr(_factory(name), "reap_dead", None)
            removed += reap(cfg, from_stage, to_stage) if reap is not None else []
        return removed


def _factory(name: str) -> Any:
    from vllm_kvbridge.connectors.registry import get_connector_factory

    return get_connector_factory(name)
