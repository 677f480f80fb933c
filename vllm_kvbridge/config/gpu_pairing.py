"""Which GPUs a stage receiving over CUDA IPC must see (no torch here; the resolver calls
:func:`pair_cuda_ipc_devices`).

A CUDA IPC handle can only be opened on the GPU whose memory it names: the receiver's
process must *see* the sender's GPU (its ``CUDA_VISIBLE_DEVICES``, a stage's ``devices``),
and opening it there gives the receiver's process a CUDA context on that GPU. So a
receiving stage sees its own GPU(s) first - its ``cuda:0`` stays its own, where it
computes - and its sender's GPU(s) after them (:func:`cuda_ipc_visible_devices`). Where that
cannot be done the config is refused when it is resolved, with the fix in the message,
instead of every request failing at the receiver. How the receiver then finds the sender's
GPU among those it sees: :mod:`vllm_kvbridge.connectors.cuda_ipc_devices`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from vllm_kvbridge.errors import ConfigError

if TYPE_CHECKING:
    from vllm_kvbridge.config.resolve import ResolvedStage

#: The connector's canonical name, as resolved edges carry it.
CUDA_IPC = "CudaIpcConnector"


def _entries(devices: str | None) -> list[str] | None:
    """``devices`` as its entries (None: the stage sees every GPU its environment gives)."""
    if devices is None:
        return None
    return [d.strip() for d in devices.split(",") if d.strip()]


def cuda_ipc_visible_devices(
    receiver_devices: str | None,
    sender_devices: str | None,
    *,
    receiver: str = "the receiving stage",
    sender: str = "the sending stage",
) -> str | None:
    """The ``devices`` (``CUDA_VISIBLE_DEVICES``) a stage receiving over CUDA IPC needs:
    its own ``receiver_devices`` first, then those of ``sender_devices`` it lacks. ``None``
    means every GPU (a stage that sets no ``devices``). ``receiver`` and ``sender`` name the
    stages in errors.

    Raises :class:`ConfigError`, naming the fix, where the stages cannot be paired: a
    pinned receiver whose sender is not pinned (which GPU it runs on is not known here),
    ``devices: ""`` on either side, indices on one side and UUIDs on the other (they
    cannot be compared), or two different MIG instances (CUDA shows a process a single
    MIG instance, and IPC does not cross them)."""
    own, theirs = _entries(receiver_devices), _entries(sender_devices)
    for label, entries, raw in ((receiver, own, receiver_devices), (sender, theirs, sender_devices)):
        if entries == []:
            raise ConfigError(
                f"{label}: devices {raw!r} hides every GPU, and a CudaIpcConnector edge needs one on "
                "both of its stages; name the stage's GPU(s) or leave devices unset"
            )
    if own is None:
        return None  # it sees every GPU of the host, the sender's included
    if theirs is None:
        raise ConfigError(
            f"{receiver}: devices {receiver_devices!r} pins it to GPU(s), but {sender}, which sends to it "
            f"over CudaIpcConnector, sets no devices, so which GPU its buffers are on is not known "
            f"here and the receiver cannot be given it (CUDA IPC opens them on their own GPU): set "
            f'devices on {sender} too (e.g. devices: "0"), or unset devices on {receiver}'
        )
    forms = {entry.isdigit() for entry in own + theirs}
    if len(forms) > 1:
        raise ConfigError(
            f"{receiver} and {sender}: devices {receiver_devices!r} and {sender_devices!r} mix GPU "
            "indices with UUIDs, which cannot be compared: write both stages' devices in one form"
        )
    missing = [entry for entry in dict.fromkeys(theirs) if entry not in own]
    if not missing:
        return receiver_devices
    if any(entry.upper().startswith("MIG-") for entry in own + missing):
        raise ConfigError(
            f"{receiver} and {sender}: devices {receiver_devices!r} and {sender_devices!r} are different "
            "MIG instances; CUDA IPC does not cross them (and CUDA shows a process one instance): put "
            "both stages on one instance, or use SharedMemoryConnector on this edge"
        )
    return ",".join(own + missing)


def pair_cuda_ipc_devices(stages: Sequence[ResolvedStage]) -> list[ResolvedStage]:
    """``stages`` where every stage receiving over CUDA IPC also sees its senders' GPUs
    (:func:`cuda_ipc_visible_devices`, from each stage's own ``devices`` as its config
    set them). Idempotent; raises :class:`ConfigError` where two stages cannot be paired."""
    declared = {s.stage_id: s.devices for s in stages}
    paired = []
    for stage in stages:
        devices = stage.devices
        for edge in stage.inputs:
            if edge.role == "receiver" and edge.connector.name == CUDA_IPC and edge.from_stage in declared:
                devices = cuda_ipc_visible_devices(
                    devices,
                    declared[edge.from_stage],
                    receiver=f"stage {stage.stage_id}",
                    sender=f"stage {edge.from_stage}",
                )
        paired.append(stage if devices == stage.devices else msgspec.structs.replace(stage, devices=devices))
    return paired
