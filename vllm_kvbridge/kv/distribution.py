"""LEADER -> FOLLOWER distribution of received KV over a stage's process group.

With ``distribution: leader`` group rank 0 (the LEADER) receives a request's caches (all
heads, so the edge's ``to_tp`` is 1) and broadcasts them to the other ranks (FOLLOWERs),
which never touch the connector. Each cache travels in the payload codec's packed layout
(the one KV container, :mod:`vllm_kvbridge.wire.codec`), written into one uint8 tensor on
the group's device by :func:`~vllm_kvbridge.wire.device_pack.pack_into_device` and decoded
there, as views, by :func:`~vllm_kvbridge.wire.decode.decode_packed_device`, which reads
the layout's head (prefix, table, skeleton) from the host. So the head travels on its own.

The protocol, per request, over the group (gloo on CPU, NCCL on CUDA), as two
:func:`~vllm_kvbridge.wire.group_broadcast.broadcast_buffers` calls:

1. the number of caches (``-1``: the leader failed, followers raise), the sizes of their
   heads, then one head (uint8) per cache;
2. the number of caches again, their packed sizes, then one packed uint8 tensor per cache.

Both in the same order: the primary first, then the CFG companions (told apart by
``metadata["purpose"]``). A rank is ``local`` when distribution is ``local`` or the group
has one rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_kvbridge.errors import PayloadError, TransferError
from vllm_kvbridge.kv.receive import ReceivedKV
from vllm_kvbridge.wire.codec import encode
from vllm_kvbridge.wire.decode import decode_packed_device
from vllm_kvbridge.wire.device_pack import pack_into_device
from vllm_kvbridge.wire.fill import TensorFill
from vllm_kvbridge.wire.group_broadcast import broadcast_buffers
from vllm_kvbridge.wire.host_staging import tensors_to_device
from vllm_kvbridge.wire.kv_format import KVCacheTransferData

__all__ = ["KVDistributor", "pack_kv", "unpack_kv"]


def _copied_by_the_pack(t: torch.Tensor | TensorFill | None, device: torch.device) -> Any:
    """``t`` as a fill that copies it straight into the packed tensor, wherever it lives.

    The codec's encoder stages a tensor that is not a dense CPU tensor through a host copy
    (right for host destinations); here the destination is ``device``, so a fill makes
    that one copy (device to device on NCCL) instead, as the old KV-only packer did.
    The fill's ``device`` is the destination's, so ``pack_into_device`` calls it on the
    packed tensor itself (no staging tensor); ``copy_`` reads ``src`` wherever it lives.
    """
    if t is None or type(t) is TensorFill:
        return t
    src = t.detach()
    return TensorFill(tuple(src.shape), src.dtype, lambda out: out.copy_(src), device)


def pack_kv(data: KVCacheTransferData, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(head, packed)``: ``data`` in the codec's packed layout as one uint8 tensor on
    ``device``, and that layout's head (what :func:`unpack_kv` needs on the host) as a
    uint8 tensor on ``device`` (collectives move tensors of the group's device)."""
    blocks = {name: [_copied_by_the_pack(t, device) for t in ts] for name, ts in data.layer_blocks.items()}
    # replace() builds through __init__, so the fills are validated as the tensors were.
    enc = encode(dataclasses.replace(data, layer_blocks=blocks))
    packed = torch.empty(enc.packed_size(), dtype=torch.uint8, device=device)
    head = pack_into_device(enc, packed)
    return torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device), packed


def unpack_kv(head: torch.Tensor, packed: torch.Tensor, rid: str) -> KVCacheTransferData:
    """The cache :func:`pack_kv` packed, its tensors views of ``packed`` (on its device).

    Raises :class:`PayloadError` on anything malformed, on a payload that is not one
    cache, or on a cache of a request other than ``rid``.
    """
    data = decode_packed_device(head.cpu().numpy().tobytes(), packed)
    if not isinstance(data, KVCacheTransferData):
        raise PayloadError(f"expected a KV cache, got {type(data).__name__}")
    if data.request_id != rid:
        raise PayloadError(f"request id mismatch: buffer holds {data.request_id!r}, expected {rid!r}")
    return data


def _to_device(data: KVCacheTransferData, device: Any) -> KVCacheTransferData:
    """A copy of ``data`` whose tensors live on ``device`` (owned: no view of the received
    buffer; one copy per buffer, see :func:`~vllm_kvbridge.wire.host_staging.tensors_to_device`)."""
    names = list(data.layer_blocks)
    flat = [t for name in names for t in data.layer_blocks[name]]
    moved = iter(tensors_to_device(flat, device, copy=True))
    blocks = {name: [next(moved) for _ in data.layer_blocks[name]] for name in names}
    # replace() builds through __init__, so the copy is validated as the original was.
    return dataclasses.replace(
        data, layer_blocks=blocks, block_ids=list(data.block_ids), metadata=dict(data.metadata)
    )


class KVDistributor:
    """Broadcasts received KV from group rank 0 to the other ranks of ``process_group``."""

    def __init__(self, distribution: str, process_group: Any = None) -> None:
        self.distribution = distribution
        self.process_group = process_group

    def role(self) -> str:
        """``"local"``, ``"leader"`` or ``"follower"`` for this rank."""
        if self.distribution == "local":
            return "local"
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return "local"
        if dist.get_world_size(self.process_group) == 1:
            return "local"
        return "leader" if dist.get_rank(self.process_group) == 0 else "follower"

    def _device(self) -> torch.device:
        """Where the group's collectives run: gloo on the host, NCCL on this rank's GPU."""
        import torch.distributed as dist

        if dist.get_backend(self.process_group) == "gloo":
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def broadcast_failure(self) -> None:
        """LEADER: tell the followers this request's receive failed (they raise)."""
        device = self._device()
        broadcast_buffers("its receive failed", self.process_group, device=device, what="the KV")

    def send(self, rec: ReceivedKV) -> None:
        """LEADER: broadcast the primary and companion caches of ``rec``."""
        device = self._device()
        # Everything is packed before the first collective, so a packing error leaves the
        # followers waiting exactly as before, never halfway through the protocol.
        pairs = [pack_kv(d, device) for d in (rec.data, *rec.companions.values())]
        broadcast_buffers([h for h, _ in pairs], self.process_group, device=device, what="the KV")
        broadcast_buffers([p for _, p in pairs], self.process_group, device=device, what="the KV")

    def receive(self, rid: str, target_device: Any = None) -> ReceivedKV:
        """FOLLOWER: what the leader broadcasts for ``rid``; raises if the leader failed."""
        device = self._device()
        try:
            heads = broadcast_buffers(None, self.process_group, device=device, what=f"the KV of {rid}")
        except TransferError as exc:
            raise TransferError(f"the leader rank failed to receive the KV of {rid} ({exc})") from None
        bufs = broadcast_buffers(None, self.process_group, device=device, what=f"the KV of {rid}")
        if len(bufs) != len(heads):
            raise TransferError(f"the leader rank sent {len(heads)} heads but {len(bufs)} caches for {rid}")
        items = []
        for head, buf in zip(heads, bufs):
            data = unpack_kv(head, buf, rid)
            if target_device is not None:
                data = _to_device(data, target_device)
            items.append(data)
        if not items:
            raise TransferError(f"the leader rank sent no KV for {rid}")
        companions = {str(d.metadata.get("purpose")): d for d in items[1:]}
        return ReceivedKV(rid, items[0], companions, sum(d.nbytes for d in items))
