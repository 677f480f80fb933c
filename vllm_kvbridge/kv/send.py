"""The send side: gather a finished request's KV on the model thread, publish it off it.

:func:`layout_for` tells the page layout of vLLM's caches. :func:`gather_job` copies one
request's blocks (only the heads each receiver rank needs) **once**, straight into a
destination the connector lends (:meth:`Connector.reserve
<vllm_kvbridge.connectors.base.Connector.reserve>`: a shared-memory segment, a registered
slab, the buffer ZMQ serves from), at the offsets of the packed payload of a
:class:`KVCacheTransferData` (its tensors are :class:`~vllm_kvbridge.wire.fill.TensorFill`
s that gather when packed). :class:`~vllm_kvbridge.kv.send_queue.KVSendQueue` publishes the
filled destinations off the model thread, each request side by side with the others and
against its own deadline, with ``send_retries`` retries and exponential backoff. Where a host
connector's memory is full at the gather, the KV goes to a host buffer whose put waits for
room (:class:`~vllm_kvbridge.connectors.base.HeapReservation`: a second copy, only then).
The gather runs on the caller's thread
because the caller frees the blocks afterwards; nothing else does.

A connector that lends device memory (``device_resident``: CUDA IPC) gets the gather on the
device, straight into its buffer. Where its budget is full, the KV never goes through host
memory on the model thread: a held request (``info["blocks_held"]``) raises
:class:`ReserveFull` and keeps its KV in its blocks, gathered again at a later step (the
backpressure of a full staging pool, below: one mechanism, held past ``send_timeout`` it
fails); a running request's KV (its blocks cannot be held) goes the staged path, copied off
the model thread, and its put waits for room from the pool.

The staged path (a :class:`Stager`, :mod:`vllm_kvbridge.kv.staged`; the default on GPU
caches, ``staging_bytes``): the gather goes into a buffer of a bounded pool of pinned host
memory through a copy stream and its bounded device scratch
(:mod:`vllm_kvbridge.wire.staging`), the job carries the copy's :class:`Fence`, and the
I/O thread waits on it, copies the staged bytes into the connector's destination and
publishes them. A caller that holds the request's blocks (``info["blocks_held"]``) gives
them back only once the send queue's ``copies_in_flight`` no longer names the request;
where the pool has no room it gets :class:`StagingFull` and keeps holding them. A request is reported
``done`` only when every put of it succeeded, otherwise ``failed`` (never both, never
silently dropped); the put metadata of a done request goes to the
:class:`~vllm_kvbridge.kv.sender_info.SentInfoTable`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from vllm_kvbridge.connectors.base import Connector, HeapReservation, PutResult, Reservation
from vllm_kvbridge.connectors.keys import KV
from vllm_kvbridge.errors import ConfigError, TransferRefused
from vllm_kvbridge.kv.config import StageId
from vllm_kvbridge.kv.layout import KVCacheLayout, cpu_layout, packed_layout
from vllm_kvbridge.kv.paged import BlockTable, RequestGather
from vllm_kvbridge.kv.staged import HostGather, ReserveFull, StagedReservation, Stager, StagingFull
from vllm_kvbridge.kv.topology import Route, TPTopology
from vllm_kvbridge.wire import encode
from vllm_kvbridge.wire.codec import Encoded
from vllm_kvbridge.wire.fill import TensorFill
from vllm_kvbridge.wire.kv_format import KEY, VALUE, KVCacheTransferData
from vllm_kvbridge.wire.staging import Fence, StagingBuffer

logger = logging.getLogger(__name__)

__all__ = [
    "ReserveFull",
    "SendJob",
    "StagedReservation",
    "Stager",
    "StagingFull",
    "gather_job",
    "layout_for",
]


@dataclass
class SendJob:
    """One request's gathered KV, ready to publish: one filled destination per route."""

    engine_id: str
    request_id: str
    to_stage: StageId
    parts: list[tuple[str, int, Reservation]]  # (key, from_rank, filled destination)
    num_kv_heads: int = 0
    #: completes once the copy that reads the request's blocks did (None: already done)
    fence: Fence | None = None

    @property
    def nbytes(self) -> int:
        """Bytes the gathered KV holds until its puts complete."""
        return sum(r.nbytes for _, _, r in self.parts)

    def release(self) -> None:
        """Give back every destination not published (a no-op for published ones)."""
        for _, _, reservation in self.parts:
            reservation.release()


def layout_for(kv_caches: Sequence[torch.Tensor], block_size: int, cache_dtype: Any) -> KVCacheLayout:
    """The page layout of vLLM's per-layer caches (``[num_blocks, heads, block, C]`` views)."""
    # vLLM 0.32 gives every backend the same logical [B, H, N, C] view; what differs is
    # the page content: the CPU kernel's format on CPU, K|V packed in C on CUDA backends.
    first = kv_caches[0]
    if (
        isinstance(cache_dtype, str)
        and cache_dtype not in ("auto",)
        and "float" not in cache_dtype
        and "half" not in cache_dtype
    ):
        raise ConfigError(f"quantized KV cache dtype {cache_dtype!r} is not supported")
    if first.dim() != 4:
        raise ConfigError(
            f"expected per-layer caches [num_blocks, heads, block, C], got {tuple(first.shape)}"
        )
    heads, n, c = int(first.shape[1]), int(first.shape[2]), int(first.shape[3])
    if first.device.type == "cpu":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(first.dtype, n, c // 2, "auto")
        layout = cpu_layout(heads, c // 2, n, first.dtype, isa=isa)
    else:
        per = block_size // n if block_size and block_size % n == 0 else 1
        layout = packed_layout(heads, c // 2, n, first.dtype, blocks_per_block=per)
    if block_size and layout.tokens_per_block != block_size:
        raise ConfigError(f"block_size {block_size} does not match the cache's blocks of {n} tokens")
    return layout


def gather_job(
    engine_id: str,
    rid: str,
    info: Mapping[str, Any],
    kv_caches: Sequence[torch.Tensor],
    layout: KVCacheLayout,
    topo: TPTopology,
    routes: Sequence[Route],
    from_stage: StageId,
    to_stage: StageId,
    connector: Callable[[], Connector],
    stager: Stager | None = None,
) -> SendJob:
    """Copy one finished request's KV out of the paged caches into destinations reserved
    from ``connector()``, one part per route (see the module docstring); with a ``stager``,
    into its staging pool instead. Where ``info["blocks_held"]`` and there is no room now
    (in the pool, or in a device-resident connector's budget) it raises
    :class:`StagingFull` (:class:`ReserveFull`): the caller keeps the blocks and tries again later.

    ``info`` is ``{"block_ids": [...], "seq_len": int}`` (one block table, every layer from
    token 0) or ``{"block_tables": [BlockTable per KV cache group], "layer_tables": [group
    of each layer], "seq_len": int}`` (vLLM's hybrid allocator: a sliding-window group's
    table starts at its window, kv/paged.py), plus optional ``"purpose"`` (default
    ``"kv"``) and ``"metadata"``.

    A CFG companion that ran as its own request (``rid`` is its own id, e.g.
    ``"<primary>::cfg_neg"``) also sets ``"companion_of"``: the primary's id. Its KV is then
    keyed and labelled with the primary's id and its purpose (what the receiver asks for),
    while its sender info stays filed under its own ids (never over the primary's).
    """
    tables: list[BlockTable] = list(info.get("block_tables") or [BlockTable(info.get("block_ids") or ())])
    layer_tables = info.get("layer_tables")
    seq_len = info.get("seq_len")
    purpose = info.get("purpose", KV)
    key_rid = str(info.get("companion_of") or rid)
    if key_rid != rid and purpose == KV:
        raise ConfigError(f"request {rid!r}: a companion of {key_rid!r} needs its own purpose, not {KV!r}")
    metadata = dict(info.get("metadata") or {})
    metadata.setdefault("purpose", purpose)
    job = SendJob(engine_id, rid, to_stage, [], topo.num_kv_heads)
    held = bool(info.get("blocks_held"))
    gathers = [
        (
            route,
            RequestGather(
                kv_caches,
                layout,
                tables,
                seq_len,
                layer_tables=layer_tables,
                head_start=route.src_heads.start,
                head_end=route.src_heads.end,
            ),
        )
        for route in routes
    ]
    # Host destinations of a CUDA cache are written through the stager's bounded scratch.
    scratch = stager.stream if stager is not None and stager.stream.cuda else None

    def encoded(to_host: bool) -> list[tuple[str, int, Encoded]]:
        out = []
        for route, request in gathers:
            host = HostGather(scratch, request) if to_host and scratch is not None else None
            starts = request.layer_starts
            data = KVCacheTransferData(
                request_id=key_rid,
                layer_blocks={
                    "key_cache": _fills(request, KEY, host),
                    "value_cache": _fills(request, VALUE, host),
                },
                block_ids=[
                    int(b) for b in list(tables[0].block_ids)[: -(-seq_len // layout.tokens_per_block)]
                ],
                metadata=metadata,
                seq_len=seq_len,
                layer_starts=starts if any(starts) else None,
                block_size=layout.tokens_per_block,
                tp_rank=route.from_rank,
                tp_size=topo.sender_tp,
                head_start=route.global_heads.start,
                head_end=route.global_heads.end,
                num_kv_heads_total=topo.num_kv_heads,
            )
            out.append(
                (route.key(key_rid, from_stage, to_stage, purpose=purpose), route.from_rank, encode(data))
            )
        return out

    if _device_resident(connector):
        parts = encoded(to_host=False)
        sizes = [enc.packed_size() for _, _, enc in parts]
        lent = _reserve_lent(connector, from_stage, to_stage, parts, sizes)
        if not isinstance(lent, PutResult):
            return _filled(job, parts, lent)  # the gather: device to device, on the model's stream
        why = f"{engine_id}: no room for {sum(sizes)} bytes in the connector's memory: {lent.error}"
        if stager is not None:
            stager.connector_full(lent.error or "full")
        if held:
            raise ReserveFull(why)  # the KV stays in its blocks: no copy through the host here
        parts = encoded(to_host=True)  # a running request: staged (off the model thread) below
    else:
        parts = encoded(to_host=True)
        sizes = [enc.packed_size() for _, _, enc in parts]
    buffers = None
    if stager is not None and stager.fits(sizes):
        buffers = stager.acquire(sizes)
        if buffers is None and held:
            stager.deferred += 1
            raise StagingFull(f"{engine_id}: no room for {sum(sizes)} bytes in the staging pool")
    if buffers is not None:
        assert stager is not None
        return _staged(job, parts, buffers, stager, held, connector, from_stage, to_stage)
    if stager is not None:
        stager.bypassed += 1  # sent on the direct path: correct, only not off the model thread
    try:
        for (key, rank, enc), nbytes in zip(parts, sizes, strict=True):
            reservation = _reserve(connector, from_stage, to_stage, key, nbytes)
            job.parts.append((key, rank, reservation))
            _pack(enc, reservation)  # the gather: one copy, cache -> destination
    except BaseException:
        job.release()  # the destinations reserved so far
        raise
    return job


def _staged(
    job: SendJob,
    parts: list[tuple[str, int, Encoded]],
    buffers: list[StagingBuffer],
    stager: Stager,
    held: bool,
    connector: Callable[[], Connector],
    from_stage: StageId,
    to_stage: StageId,
) -> SendJob:
    """``job`` with each part gathered into its staging buffer through the copy stream."""
    staged = list(zip(parts, buffers, strict=True))

    def copy() -> None:
        for (_, _, enc), buf in staged:
            enc.pack_into(buf.view)  # the gather: cache -> staging

    try:
        # Blocks the caller frees right away are read before their next use (module docstring).
        job.fence = stager.stream.submit(copy, inline=not held)
    except BaseException:
        for buf in buffers:
            buf.release()
        raise
    for (key, rank, enc), buf in staged:
        # The packed head's size, for a device destination that takes it apart from the bytes.
        head = len(enc._head())
        job.parts.append(
            (key, rank, StagedReservation(buf, job.fence, connector, from_stage, to_stage, key, head))
        )
    return job


def _device_resident(connector: Callable[[], Connector]) -> bool:
    """Whether the connector's reservations are device memory (CUDA IPC)."""
    try:
        return bool(getattr(connector(), "device_resident", False))
    except Exception:  # not up yet: its reserve falls back to a host buffer anyway
        return False


def _reserve_lent(
    connector: Callable[[], Connector],
    from_stage: StageId,
    to_stage: StageId,
    parts: list[tuple[str, int, Encoded]],
    sizes: list[int],
) -> list[Reservation] | PutResult:
    """A destination in the connector's own memory for every part, or (none kept) its
    ``full`` answer; a refusal raises."""
    got: list[Reservation] = []
    try:
        for (key, _, _), nbytes in zip(parts, sizes, strict=True):
            answer = connector().reserve(from_stage, to_stage, key, nbytes)
            if isinstance(answer, Reservation):
                got.append(answer)
                continue
            for reservation in got:
                reservation.release()
            if answer.full:
                return answer
            raise TransferRefused(f"{key}: the connector refused {nbytes} bytes: {answer.error}")
    except BaseException:
        for reservation in got:
            reservation.release()
        raise
    return got


def _filled(job: SendJob, parts: list[tuple[str, int, Encoded]], lent: list[Reservation]) -> SendJob:
    """``job`` with each part packed into its destination (released all, should one fail)."""
    job.parts.extend((key, rank, r) for (key, rank, _), r in zip(parts, lent, strict=True))
    try:
        for (_, _, enc), reservation in zip(parts, lent, strict=True):
            _pack(enc, reservation)
    except BaseException:
        job.release()
        raise
    return job


def _pack(enc: Any, reservation: Reservation) -> None:
    """Pack into the reservation's host buffer, or its device buffer (then mark it filled:
    the publish waits for the copies enqueued on this thread's stream)."""
    if isinstance(reservation.buffer, torch.Tensor):
        from vllm_kvbridge.wire.device_pack import pack_into_device

        reservation.filled(pack_into_device(enc, reservation.buffer))  # type: ignore[attr-defined]
    else:
        enc.pack_into(reservation.buffer)


def _fills(
    request: RequestGather, kind: int, host: HostGather | None = None
) -> list[torch.Tensor | TensorFill | None]:
    """One fill per layer: written by ``request`` into wherever the payload is packed (on its
    device, or a host destination copied from it); by ``host`` where given (host memory
    from a CUDA cache, through the copy stream's bounded scratch)."""
    if host is not None:
        return host.fills(kind)
    return [
        TensorFill(
            request.shape(layer, kind), request.dtype, partial(request.write, layer, kind), request.device
        )
        for layer in range(len(request.kv_caches))
    ]


def _reserve(
    connector: Callable[[], Connector], from_stage: StageId, to_stage: StageId, key: str, nbytes: int
) -> Reservation:
    """The connector's destination for ``nbytes``, or a host buffer where it has no room now
    (or cannot be reached yet): that one's put, on the I/O thread, waits and retries."""
    try:
        got: Reservation | PutResult = connector().reserve(from_stage, to_stage, key, nbytes)
    except Exception as exc:  # e.g. the transport is not up yet: the I/O thread retries it
        logger.warning("KV %s: reserving %d bytes failed (%s); gathering to a host buffer", key, nbytes, exc)
        return HeapReservation(connector, from_stage, to_stage, key, nbytes)
    if isinstance(got, Reservation):
        return got
    if got.full:
        return HeapReservation(connector, from_stage, to_stage, key, nbytes)
    raise TransferRefused(f"{key}: the connector refused {nbytes} bytes: {got.error}")
