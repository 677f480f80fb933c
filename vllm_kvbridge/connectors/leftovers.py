"""What connectors leave in the operating system, seen from above the connector layer.

:func:`reap_dead_leftovers` is the one entry point for removing what processes that are
gone left behind on a set of edges (a stage at start-up, the engine core after its workers
exited, the orchestrator after its stages stopped). Each connector says what that means for
it through :meth:`Connector.reap_dead <vllm_kvbridge.connectors.base.Connector.reap_dead>`:
shared-memory names whose owner pid is gone for
:class:`~vllm_kvbridge.connectors.shm.SharedMemoryConnector`, nothing for connectors whose
resources die with their process (sockets, registrations). Live processes' names are never
touched, so it is safe at any time. :func:`shared_memory_names` lists names for operators
(``/debug/state``) without callers knowing how they are spelt.

Edges are scoped to a run (their namespaces are ``<run id>-<edge>``), so a restarted run never
sees what an earlier, killed run left. :func:`reap_dead_runs` is the host-wide counterpart:
every run's processes hold an owner lock (:func:`hold_owner`), and it removes what any dead
owner left, our segments and the vLLM / multiprocessing names (``psm_*``, ``sem.mp-*``) it
recorded (:mod:`vllm_kvbridge.connectors.shm_owners`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from vllm_kvbridge.connectors import shm_segments
from vllm_kvbridge.connectors.base import Connector
from vllm_kvbridge.connectors.registry import get_connector_factory
from vllm_kvbridge.connectors.shm_owners import RUN_ID_ENV, ShmOwner, hold_owner, reap_dead_runs

logger = logging.getLogger(__name__)

__all__ = [
    "RUN_ID_ENV",
    "Edge",
    "ShmOwner",
    "hold_owner",
    "reap_dead_leftovers",
    "reap_dead_runs",
    "shared_memory_names",
]

#: ``(from_stage, to_stage, connector name, connector config)`` of one edge.
Edge = tuple[int | str, int | str, str, Mapping[str, Any]]


def reap_dead_leftovers(edges: Iterable[Edge]) -> list[str]:
    """Remove what dead processes left on ``edges``; return the names removed.

    An edge listed twice (as one stage's output and the next one's input) is reaped once.
    A connector name that is not registered is skipped (it cannot have leftovers of ours);
    an OS error on one edge is logged and the other edges are still reaped.
    """
    removed: list[str] = []
    seen: set[str] = set()
    for from_stage, to_stage, name, config in edges:
        ident = json.dumps([from_stage, to_stage, name, config], sort_keys=True, default=str)
        if ident in seen:
            continue
        seen.add(ident)
        try:
            factory = get_connector_factory(name)
        except Exception:
            continue
        if not (isinstance(factory, type) and issubclass(factory, Connector)):
            continue  # a plain factory function: no class-level hook to ask
        try:
            removed += factory.reap_dead(dict(config), from_stage, to_stage)
        except OSError as exc:
            logger.warning("kvbridge: reaping edge %s -> %s (%s) failed: %s", from_stage, to_stage, name, exc)
    return removed


def shared_memory_names(namespace_prefix: str = "") -> list[str]:
    """Shared-memory names of namespaces starting with ``namespace_prefix`` (sorted)."""
    return shm_segments.list_names(namespace_prefix)
