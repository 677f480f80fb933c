"""A diffusion stage on 2 ranks: CFG-parallel denoising, KV received once on rank 0.

Why CFG-parallel (and not sequence-parallel): a guided request runs the model twice per
step on inputs that differ only in the KV they cross-attend to (the prompt's and the
negative prompt's). Giving each rank one branch needs one ``all_gather`` of a velocity per
step and no change to the model; both ranks then mix the two branches with the same
:func:`~vllm_kvbridge.models.guidance.cfg_combine` and hold the same latents, so the image
equals the single-rank run (bit-exact with equal thread counts: the same ops on the same
inputs). Sequence parallelism would have to split the model's attention over patches,
which every user model would have to support. Unguided requests run on rank 0 alone (the
other rank still takes part in the KV distribution, then idles).

Roles (``kv_transfer.distribution: leader``):

* rank 0 (the stage process, :class:`~vllm_kvbridge.runner.diffusion_runner.DiffusionRunner`)
  is the LEADER: it receives the primary and companion KV through the connector (with
  prefetch) and hands them to rank 1 with the KV manager's ``distribute_kv_cache`` (one
  packed uint8 tensor per cache over the gloo group);
* rank 1 (:func:`run_follower`, its own process) is the FOLLOWER: it never touches the
  connector. Its manager is built with :class:`NoTransport`, which raises on every use,
  so a code path that would reach a transport fails loudly instead of opening one.

Per request the leader first broadcasts a small control message (msgspec JSON bytes in a
uint8 tensor, never pickle: request id, companion purposes, seed, steps, scale, whether
to denoise); ``{"op": "stop"}`` ends the follower. A failed receive on the leader is
broadcast as a failure (the follower skips the request); the leader reports the error.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, NoReturn

import msgspec
import torch

from vllm_kvbridge.connectors.base import Connector, PutResult
from vllm_kvbridge.errors import TransferError
from vllm_kvbridge.models.guidance import CFG_NEGATIVE
from vllm_kvbridge.wire.group_broadcast import broadcast_buffers

logger = logging.getLogger(__name__)

#: Largest control message accepted (a request id, a few purposes and numbers).
MAX_CONTROL_BYTES = 64 * 1024


def exit_rank_process(code: int) -> NoReturn:
    """End a process that took part in a gloo group, skipping interpreter finalization.

    A gloo worker thread drops its reference to a finished collective (and so to its
    tensors, which takes the GIL) a moment after the collective returned. When the process
    exits right after its last collective (rank 1 after "stop"), that thread may ask for the
    GIL while the interpreter is finalizing; CPython then ends the thread, which C++
    treats as fatal: SIGABRT, "terminate called without an active exception" (a known
    PyTorch issue). Logs and standard streams are flushed first; nothing else of ours
    needs an ``atexit`` hook in such a process (the group was destroyed by the caller).
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class Control(msgspec.Struct, forbid_unknown_fields=True):
    """What rank 0 tells rank 1 before each request (or ``op="stop"``)."""

    op: str  # "run" | "stop"
    request_id: str = ""  # the transfer id (the manager's request id)
    cfg_purposes: list[str] = []
    denoise: bool = False  # False: take part in the distribution only (aborted request)
    seed: int = 0
    num_steps: int = 1
    guidance_scale: float = 1.0


def send_control(ctl: Control, group: Any = None) -> None:
    """Broadcast ``ctl`` from group rank 0."""
    data = msgspec.json.encode(ctl)
    broadcast_buffers([torch.frombuffer(bytearray(data), dtype=torch.uint8)], group, what="control message")


def recv_control(group: Any = None) -> Control:
    """Receive the control message rank 0 broadcast (validated: size bound, schema)."""
    bufs = broadcast_buffers(None, group, max_bytes=MAX_CONTROL_BYTES, what="control message")
    if len(bufs) != 1 or not bufs[0].numel():
        raise TransferError(f"control message from rank 0: {len(bufs)} buffers, expected one non-empty")
    return msgspec.json.decode(bufs[0].numpy().tobytes(), type=Control)


class NoTransport(Connector):
    """The follower's connector: any use is a bug (the KV comes from the leader)."""

    name = "NoTransport"

    def _refuse(self, what: str) -> TransferError:
        return TransferError(f"{what} on a FOLLOWER rank of a diffusion stage: it gets its KV from rank 0")

    def put(self, from_stage: int | str, to_stage: int | str, key: str, payload: Any) -> PutResult:
        raise self._refuse(f"put({key})")

    def get(
        self, from_stage: Any, to_stage: Any, key: str, metadata: Any = None, *, deadline: Any = None
    ) -> Any:
        raise self._refuse(f"get({key})")

    def cleanup(self, key: str) -> None:
        raise self._refuse(f"cleanup({key})")

    def _close(self) -> None:
        pass  # nothing was ever opened


def run_follower(stage: Any, group: Any = None) -> int:
    """Rank 1's loop: take each request's KV from rank 0, denoise the unconditional branch.

    Returns the number of requests served when rank 0 says stop. Errors of one request
    (the leader failed to receive, a branch's forward raised on either rank) skip that
    request; anything else propagates.
    """
    from vllm_kvbridge.config.runner_settings import kv_transfer_config_dict
    from vllm_kvbridge.kv.config import KVTransferConfig
    from vllm_kvbridge.kv.manager import KVTransferManager
    from vllm_kvbridge.runner.diffusion_runner import (
        KVJob,
        build_section_module,
        cfg_kv_collect,
        denoise,
        kv_layers,
    )

    d = stage.diffusion or {}
    module = build_section_module(d)
    heads = getattr(module, "kv_heads", None)
    config = KVTransferConfig.from_dict(kv_transfer_config_dict(stage))
    served = 0
    with KVTransferManager(
        config, num_kv_heads=int(heads) if heads else None, process_group=group, connector=NoTransport()
    ) as manager:
        if manager.role() != "follower":
            raise TransferError(
                f"rank 1 of diffusion stage {stage.stage_id} is not a follower ({manager.role()})"
            )
        while True:
            ctl = recv_control(group)
            if ctl.op == "stop":
                return served
            job = KVJob(ctl.request_id, list(ctl.cfg_purposes))
            try:
                manager.distribute_kv_cache(job, received=False)
            except TransferError as exc:
                logger.info("rank 1: request %s skipped: %s", ctl.request_id, exc)
                continue
            rec = manager.pop_received(ctl.request_id)
            missing = [p for p in cfg_kv_collect(job) if rec is None or p not in rec.companions]
            if rec is None or missing:
                raise TransferError(f"rank 1: KV of {ctl.request_id} distributed without {missing or 'data'}")
            served += 1
            if not ctl.denoise or CFG_NEGATIVE not in rec.companions:
                continue  # unguided: rank 0 denoises alone
            try:
                denoise(
                    module,
                    kv_layers(rec.data),
                    num_steps=ctl.num_steps,
                    seed=ctl.seed,
                    uncond_kv=kv_layers(rec.companions[CFG_NEGATIVE]),
                    guidance_scale=ctl.guidance_scale,
                    cfg_group=group,
                )
            except Exception:
                # Both ranks left the loop at the same step (see _cfg_parallel_step): rank 0
                # fails the request; this rank logs why and serves the next one.
                logger.exception("rank 1: denoising request %s failed", ctl.request_id)
