"""Classifier-free guidance (CFG) companions of a request, across the pipeline.

A request to an AR -> DiT pipeline with ``guidance_scale != 1`` needs two KV caches on the
DiT: the prompt's (the primary) and the negative / unconditional prompt's (the
``cfg_neg`` *companion*). The flow:

1. the orchestrator decides per request (:func:`companions_for`: the diffusion stage's
   ``guidance_scale`` / ``negative_prompt``, overridden by the request's stage params) and
   sets ``Submit.companions = {"cfg_neg": negative_prompt}`` on the request's submits;
2. the LLM stage that sends KV runs each companion prompt as its own vLLM request, id
   :func:`companion_request_id` (``<primary>::<purpose>``; primary ids may not contain
   ``::`` (:func:`check_request_id`), so the mapping is one to one), prefill only
   (``trigger: prefill_finished`` + ``stop_after_transfer``: its KV is exactly the
   prompt's). Its KV goes out under the *primary's* id with the companion's purpose in the
   transfer key (``kvb.<edge>.cfg_neg.<primary>...``), so the receiver asks for
   ``(primary, purpose)`` and a mis-keyed cache cannot be mistaken for another. The stage
   reports the primary done only when every companion's send is done too (one
   ``StageDone`` whose sender info covers all keys), and fails the primary naming the
   companion when a companion's send failed or never happened (:class:`CompanionGroups`);
3. the diffusion stage receives the primary and all companions through the KV manager's
   ``cfg_kv_collect_func`` hook against one deadline and denoises with guidance.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_kvbridge.models.guidance import CFG_NEGATIVE, guidance_active
from vllm_kvbridge.pipeline.engines import ExpiringIds

#: Separator between a primary request id and a companion purpose (never in primary ids).
COMPANION_SEP = "::"


def companion_request_id(request_id: str, purpose: str) -> str:
    """The LLM stage's id of ``request_id``'s companion ``purpose``."""
    return f"{request_id}{COMPANION_SEP}{purpose}"


def check_request_id(request_id: str) -> None:
    """Refuse primary ids that could collide with a companion id."""
    if COMPANION_SEP in request_id:
        raise ValueError(f"request id {request_id!r}: {COMPANION_SEP!r} is reserved for CFG companions")


def companions_for(plan: Any, stage_params: Mapping[int, Mapping[str, Any]] | None) -> dict[str, str]:
    """``{purpose: prompt}`` of the companions one request needs (empty: no guidance).

    The diffusion stage that receives KV decides: its ``guidance_scale`` /
    ``negative_prompt`` from ``diffusion``, overridden by the request's stage params.
    Raises ``ValueError`` for a scale below 0.
    """
    for stage in plan.stages:
        if stage.kind != "diffusion" or not stage.kv_transfer.get("need_recv_cache"):
            continue
        d = stage.diffusion or {}
        own = dict((stage_params or {}).get(stage.stage_id) or {})
        scale = float(own.get("guidance_scale", d.get("guidance_scale", 1.0)))
        if not scale >= 0:
            raise ValueError(f"guidance_scale must be >= 0, got {scale}")
        if guidance_active(scale):
            return {CFG_NEGATIVE: str(own.get("negative_prompt", d.get("negative_prompt", "")))}
    return {}


@dataclass
class _Group:
    companions: dict[str, str]  # companion id -> purpose
    done: dict[str, dict[str, Any]] = field(default_factory=dict)  # companion id -> sender info
    primary: Any = None  # the primary's finished output, once its send is done


class CompanionGroups:
    """An LLM stage's view of primaries and their companions (no vLLM, no I/O).

    ``add`` registers a primary's companions; ``companion_done`` / ``primary_done`` record
    finished sends; ``complete`` returns a primary whose whole group is done (and forgets
    it); ``fail`` forgets the group and returns every member id still to be aborted, or
    whose KV is to be withdrawn.

    A group reported done is not quite forgotten: an Abort of its primary can cross the
    ``StageDone`` (the orchestrator drops that late report), and then the companions' KV is
    out with nobody to consume it. So ``fail`` of a primary reported in the last
    ``ABORTED_KEEP_S`` still names its companions.
    """

    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}
        self._owner: dict[str, tuple[str, str]] = {}  # companion id -> (primary, purpose)
        self._reported = ExpiringIds()  # companion ids of groups reported done
        self._purposes: set[str] = set()  # every purpose seen (to name a reported group's ids)

    def add(self, request_id: str, companions: Mapping[str, str]) -> dict[str, str]:
        """Register; returns ``{companion id: prompt}`` to submit."""
        self._purposes.update(companions)
        ids = {companion_request_id(request_id, p): p for p in companions}
        self._groups[request_id] = _Group(dict(ids))
        for cid, purpose in ids.items():
            self._owner[cid] = (request_id, purpose)
        return {cid: companions[p] for cid, p in ids.items()}

    def owner(self, request_id: str) -> tuple[str, str] | None:
        """``(primary, purpose)`` when ``request_id`` is a companion."""
        return self._owner.get(request_id)

    def has(self, request_id: str) -> bool:
        return request_id in self._groups

    def companion_done(self, companion_id: str, sender_info: dict[str, Any]) -> None:
        primary, _ = self._owner[companion_id]
        self._groups[primary].done[companion_id] = sender_info

    def primary_done(self, request_id: str, finished: Any) -> None:
        self._groups[request_id].primary = finished

    def complete(self, request_id: str) -> tuple[Any, list[dict[str, Any]]] | None:
        """``(primary's finished output, companions' sender infos)`` once all are done."""
        g = self._groups.get(request_id)
        if g is None or g.primary is None or len(g.done) < len(g.companions):
            return None
        self._forget(request_id)
        self._reported.update(g.companions)
        return g.primary, list(g.done.values())

    def fail(self, request_id: str) -> list[str]:
        """Forget ``request_id``'s group (primary or companion id); the ids to abort. For a
        primary whose group was reported done already: its companions (their KV is out)."""
        owner = self._owner.get(request_id)
        primary = owner[0] if owner else request_id
        g = self._groups.get(primary)
        if g is None:
            late = [
                cid
                for purpose in sorted(self._purposes)
                if (cid := companion_request_id(primary, purpose)) in self._reported
            ]
            for cid in late:
                self._reported.discard(cid)
            return late
        self._forget(primary)
        return [primary, *g.companions]

    def _forget(self, primary: str) -> None:
        g = self._groups.pop(primary)
        for cid in g.companions:
            self._owner.pop(cid, None)
