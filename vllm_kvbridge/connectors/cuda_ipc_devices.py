"""Which GPUs a CUDA-IPC receiver must see, and how it finds the sender's GPU (no torch here).

A CUDA IPC handle can only be opened on the GPU whose memory it names: the receiver's
process must *see* the sender's GPU (its ``CUDA_VISIBLE_DEVICES``, a stage's ``devices``),
and opening it there gives the receiver's process a CUDA context on that GPU. So a
receiving stage sees its own GPU(s) first - its ``cuda:0`` stays its own, where it
computes - and its sender's GPU(s) after them (the resolver pairs them:
:mod:`vllm_kvbridge.config.gpu_pairing`, which refuses a config where that cannot be done,
with the fix in the message, instead of every request failing at the receiver).

Indices differ between processes with different ``CUDA_VISIBLE_DEVICES`` (``cuda:1`` of
the sender may be ``cuda:0`` or ``cuda:1`` of the receiver), so the control message names
the sender's GPU by UUID and the receiver looks it up among the GPUs it sees
(:func:`local_gpu_index`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from vllm_kvbridge.errors import TransferRefused


def normalize_gpu_uuid(uuid: object) -> str:
    """A GPU UUID as torch prints it (``8932f937-...``), from that or NVML's ``GPU-8932F937-...``."""
    text = str(uuid).strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def local_gpu_index(key: str, uuid: object, visible_uuids: Sequence[object]) -> int:
    """This process's index of the GPU ``uuid`` (the sender's), among ``visible_uuids``
    (this process's GPUs, in index order). Raises :class:`TransferRefused` naming the fix
    where this process does not see it (a receiver started without the pairing)."""
    want = normalize_gpu_uuid(uuid)
    for index, seen in enumerate(visible_uuids):
        if normalize_gpu_uuid(seen) == want:
            return index
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    raise TransferRefused(
        f"{key}: the sender's GPU {uuid} is not visible in this process (CUDA_VISIBLE_DEVICES={env!r}), "
        "and CUDA IPC opens the sender's buffer on the sender's GPU: give the receiving stage the "
        "sender's GPU after its own in its devices (1,0 for a receiver on GPU 1 and a sender on GPU 0; "
        "pipelines do it with cuda_ipc_visible_devices when they are resolved), or use SharedMemoryConnector"
    )
