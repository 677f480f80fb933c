"""Tensor-parallel topology of a KV edge: which sender rank feeds which receiver rank.

Each TP rank of a vLLM stage holds a contiguous range of the model's KV heads, the way
vLLM's ``QKVParallelLinear`` shards them:

* ``num_kv_heads >= tp``: rank ``r`` holds heads ``[r*h, (r+1)*h)`` with ``h = num_kv_heads // tp``;
* ``num_kv_heads <  tp`` (GQA with few KV heads): heads are *replicated*; each rank holds
  one head, ``r // (tp // num_kv_heads)``.

Either ``num_kv_heads % tp == 0`` or ``tp % num_kv_heads == 0`` (vLLM's own requirement),
and the sender TP ``s`` and receiver TP ``t`` must divide one another.

A :class:`Route` is one transfer: a head range taken out of the sender rank's local
cache (the sender slices before it copies, so only the needed heads travel) and the
place it lands in the receiver rank's local heads (the receiver concatenates when
several sender ranks feed it). When several sender ranks hold the same heads
(replication), exactly one of them sends, chosen so the load spreads over replicas.
Everything here is a pure function of ``(s, t, num_kv_heads)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from vllm_kvbridge.connectors.keys import KV, kv_key
from vllm_kvbridge.errors import ConfigError, KVBridgeError

__all__ = ["HeadRange", "Route", "TPTopology", "merge_head_parts", "rank_heads"]


@dataclass(frozen=True, order=True)
class HeadRange:
    """Half-open range ``[start, end)`` of KV heads."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not (0 <= self.start < self.end):
            raise ConfigError(f"invalid head range [{self.start}, {self.end})")

    @property
    def size(self) -> int:
        return self.end - self.start

    def intersect(self, other: HeadRange) -> HeadRange | None:
        lo, hi = max(self.start, other.start), min(self.end, other.end)
        return HeadRange(lo, hi) if lo < hi else None

    def shift(self, offset: int) -> HeadRange:
        """The same heads counted from ``offset`` (global -> local)."""
        return HeadRange(self.start - offset, self.end - offset)


@dataclass(frozen=True)
class Route:
    """One sender-rank -> receiver-rank transfer of a head range (local coordinates)."""

    from_rank: int
    to_rank: int
    src_heads: HeadRange
    dst_heads: HeadRange
    global_heads: HeadRange

    def key(self, request_id: str, from_stage: int | str, to_stage: int | str, *, purpose: str = KV) -> str:
        """The transfer key of this route (rank-aware, built by :func:`kv_key`)."""
        return kv_key(
            request_id, from_stage, to_stage, from_rank=self.from_rank, to_rank=self.to_rank, purpose=purpose
        )


def _check_tp(tp: int, num_kv_heads: int, what: str) -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp <= 0:
        raise ConfigError(f"{what} must be a positive int, got {tp!r}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ConfigError(f"{what}={tp} does not fit num_kv_heads={num_kv_heads}: one must divide the other")


def rank_heads(rank: int, tp: int, num_kv_heads: int) -> HeadRange:
    """Global KV heads held by TP rank ``rank`` of ``tp`` (vLLM's sharding)."""
    if not isinstance(num_kv_heads, int) or num_kv_heads <= 0:
        raise ConfigError(f"num_kv_heads must be a positive int, got {num_kv_heads!r}")
    _check_tp(tp, num_kv_heads, "tp")
    if not (isinstance(rank, int) and 0 <= rank < tp):
        raise ConfigError(f"rank {rank!r} outside [0, {tp})")
    if num_kv_heads >= tp:
        per = num_kv_heads // tp
        return HeadRange(rank * per, (rank + 1) * per)
    head = rank // (tp // num_kv_heads)
    return HeadRange(head, head + 1)


@dataclass(frozen=True)
class TPTopology:
    """TP topology of one KV edge (sender TP ``sender_tp``, receiver TP ``receiver_tp``)."""

    sender_tp: int
    receiver_tp: int
    num_kv_heads: int

    def __post_init__(self) -> None:
        if (
            not isinstance(self.num_kv_heads, int)
            or isinstance(self.num_kv_heads, bool)
            or self.num_kv_heads <= 0
        ):
            raise ConfigError(f"num_kv_heads must be a positive int, got {self.num_kv_heads!r}")
        _check_tp(self.sender_tp, self.num_kv_heads, "sender tp (from_tp)")
        _check_tp(self.receiver_tp, self.num_kv_heads, "receiver tp (to_tp)")
        s, t = self.sender_tp, self.receiver_tp
        if s % t and t % s:
            raise ConfigError(f"sender tp {s} and receiver tp {t} must divide one another")

    def sender_heads(self, rank: int) -> HeadRange:
        return rank_heads(rank, self.sender_tp, self.num_kv_heads)

    def receiver_heads(self, rank: int) -> HeadRange:
        return rank_heads(rank, self.receiver_tp, self.num_kv_heads)

    @cached_property
    def routes(self) -> tuple[Route, ...]:
        """Every transfer of the edge, ordered by (receiver rank, destination heads)."""
        out: list[Route] = []
        for j in range(self.receiver_tp):
            want = self.receiver_heads(j)
            # Sender ranks grouped by the head range they hold (replicas share a range).
            holders: dict[HeadRange, list[int]] = {}
            for i in range(self.sender_tp):
                holders.setdefault(self.sender_heads(i), []).append(i)
            for held, ranks in sorted(holders.items()):
                part = held.intersect(want)
                if part is None:
                    continue
                sender = ranks[j % len(ranks)]  # spread receivers over replicas
                out.append(Route(sender, j, part.shift(held.start), part.shift(want.start), part))
        return tuple(out)

    def routes_to(self, receiver_rank: int) -> tuple[Route, ...]:
        """The transfers receiver rank ``receiver_rank`` waits for (they cover its heads)."""
        if not 0 <= receiver_rank < self.receiver_tp:
            raise ConfigError(f"receiver rank {receiver_rank} outside [0, {self.receiver_tp})")
        return tuple(r for r in self.routes if r.to_rank == receiver_rank)

    def routes_from(self, sender_rank: int) -> tuple[Route, ...]:
        """The transfers sender rank ``sender_rank`` makes (possibly none, when it is a replica)."""
        if not 0 <= sender_rank < self.sender_tp:
            raise ConfigError(f"sender rank {sender_rank} outside [0, {self.sender_tp})")
        return tuple(r for r in self.routes if r.from_rank == sender_rank)

    def local_heads(self, rank: int, *, side: str) -> int:
        """Number of heads a rank holds locally (``side``: ``"sender"`` or ``"receiver"``)."""
        if side == "sender":
            return self.sender_heads(rank).size
        if side == "receiver":
            return self.receiver_heads(rank).size
        raise ConfigError(f"side must be 'sender' or 'receiver', got {side!r}")


def merge_head_parts(
    parts: Sequence[tuple[HeadRange, torch.Tensor]], num_heads: int, *, dim: int = 1
) -> torch.Tensor:
    """Concatenate tensors holding head ranges into one covering ``[0, num_heads)``.

    ``parts`` are ``(dst_heads, tensor)`` with the heads along ``dim``; they must tile
    the range exactly (no gap, no overlap), else :class:`KVBridgeError`.
    """
    if not parts:
        raise KVBridgeError("no head parts to merge")
    ordered = sorted(parts, key=lambda p: p[0].start)
    pos = 0
    for heads, tensor in ordered:
        if heads.start != pos:
            raise KVBridgeError(f"head parts do not tile [0, {num_heads}): gap or overlap at head {pos}")
        if tensor.shape[dim] != heads.size:
            raise KVBridgeError(f"part for heads [{heads.start}, {heads.end}) has {tensor.shape[dim]} heads")
        pos = heads.end
    if pos != num_heads:
        raise KVBridgeError(f"head parts cover [0, {pos}), expected [0, {num_heads})")
    if len(ordered) == 1:
        return ordered[0][1]
    return torch.cat([t for _, t in ordered], dim=dim)
