"""LEADER -> FOLLOWER distribution of received KV over a stage's process group.

With ``distribution: leader`` group rank 0 (the LEADER) receives a request's caches (all
heads, so the edge's ``to_tp`` is 1) and broadcasts them to the other ranks (FOLLOWERs),
which never touch the connector. The protocol, per request, over the group (gloo on CPU,
NCCL on CUDA): the number of caches (``-1``: the leader failed, followers raise), their
packed sizes, then one packed uint8 tensor per cache (``KVCacheTransferData.to_gpu_tensor``),
the primary first, then the CFG companions (told apart by ``metadata["purpose"]``).
A rank is ``local`` when distribution is ``local`` or the group has one rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_kvbridge.errors import TransferError
from vllm_kvbridge.kv.receive import ReceivedKV
from vllm_kvbridge.wire.group_broadcast import broadcast_buffers
from vllm_kvbridge.wire.host_staging import tensors_to_device
from vllm_kvbridge.wire.kv_format import KVCacheTransferData

__all__ = ["KVDistributor"]


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
        packed = [d.to_gpu_tensor(device) for d in (rec.data, *rec.companions.values())]
        broadcast_buffers(packed, self.process_group, device=device, what="the KV")

    def receive(self, rid: str, target_device: Any = None) -> ReceivedKV:
        """FOLLOWER: what the leader broadcasts for ``rid``; raises if the leader failed."""
        device = self._device()
        try:
            bufs = broadcast_buffers(None, self.process_group, device=device, what=f"the KV of {rid}")
        except TransferError as exc:
            raise TransferError(f"the leader rank failed to receive the KV of {rid} ({exc})") from None
        items = []
        for buf in bufs:
            data = KVCacheTransferData.from_bytes_device(buf, expected_request_id=rid)
            if target_device is not None:
                data = _to_device(data, target_device)
            items.append(data)
        if not items:
            raise TransferError(f"the leader rank sent no KV for {rid}")
        companions = {str(d.metadata.get("purpose")): d for d in items[1:]}
        return ReceivedKV(rid, items[0], companions, sum(d.nbytes for d in items))
