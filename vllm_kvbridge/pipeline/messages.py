"""Control messages between the orchestrator and its stage processes.

Carried over one ZMQ ROUTER (orchestrator) / DEALER (stage) pair per stage, encoded
with msgspec msgpack as a tagged union (the ``type`` tag names the Struct), so a frame
either decodes to one of these classes or is rejected: no pickle, no guessing. The socket
is CURVE-authenticated with a key per stage process (:mod:`vllm_kvbridge.pipeline.control_auth`):
a stage's message is believed only when its ``stage_id`` (and ``pid``) are the sender's own,
and one about a request only when that request was submitted to that stage; anything else
is dropped and counted, never fatal to the orchestrator.

Flow of one request through ``A -> B``::

    orchestrator -> A : Submit(request_id, prompt)
    A -> orchestrator : StageDone(request_id, output, sender_info)       # KV/payload put
    orchestrator -> B : Submit(request_id, upstream=[Upstream(A, sender_info)])
    B -> orchestrator : StageProgress(request_id, text_delta, ...)       # streaming only
    B -> orchestrator : StageDone(request_id, output)                    # final output

A stage lost after it handed requests on is named to their consumer in ``ProducerLost``
(see there). A stage reports ``Ready`` once its engine is up, ``RequestFailed`` for one failed request
(the stage keeps running) and ``StageFailed`` before it exits on a fatal error. From its
start it sends a ``Heartbeat`` every ``--heartbeat-s`` seconds from a thread of its own
(on a second socket), so a stage whose process is stopped or starved is told from one that
is merely busy in a long step. A
``Submit`` with ``stream`` set (the orchestrator sets it on the last stage of a request
whose caller streams) makes an LLM stage report ``StageProgress`` as it generates, in
order and before its ``StageDone``; requests that do not stream get no progress messages.
"""

from __future__ import annotations

from typing import Any

import msgspec


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True):
    pass


class Ready(_Msg, tag="ready"):
    stage_id: int
    pid: int
    info: dict[str, Any] = {}


class Upstream(msgspec.Struct, forbid_unknown_fields=True):
    """What a stage learns about one of its producers for one request."""

    from_stage: int
    #: The id the producer's runner used in its transfer keys (vLLM makes internal ids).
    transfer_request_id: str
    #: Connector metadata the producer reported (``PutResult.metadata`` and friends).
    sender_info: dict[str, Any] = {}
    #: The producer's output (token ids etc.), for stages that build inputs from it.
    output: dict[str, Any] = {}
    #: Which replica of the producer stage made it (``sender_info`` is that process's).
    replica: int = 0


class Submit(_Msg, tag="submit"):
    request_id: str
    prompt: str | None = None
    sampling_params: dict[str, Any] = {}
    upstream: list[Upstream] = []
    #: Report partial output (:class:`StageProgress`) while generating. Stages that cannot
    #: (diffusion, external servers) ignore it and report only ``StageDone``.
    stream: bool = False
    #: Classifier-free guidance companions of this request, purpose -> prompt (e.g.
    #: ``{"cfg_neg": negative_prompt}``): an LLM stage that sends KV runs each prompt as its
    #: own request and sends its KV under this request's id with that purpose; a diffusion
    #: stage receives them all (see :mod:`vllm_kvbridge.pipeline.cfg`).
    companions: dict[str, str] = {}
    #: Consumer stage -> the route this request's data takes to it (``same`` / ``cross``),
    #: where this replica's end of the edge is routed (``connectors/routed.py``): the
    #: orchestrator picked the consumer replica already, and the stage tells its workers
    #: before the request starts.
    routes: dict[int, str] = {}


class Abort(_Msg, tag="abort"):
    request_ids: list[str]


class Shutdown(_Msg, tag="shutdown"):
    pass


class ProducerLost(_Msg, tag="producer_lost"):
    """Stage ``stage_id`` (``kind``) was lost after it handed ``request_ids`` to this stage.

    The consumer decides, because only it knows what it has read: each of those requests
    whose data from that stage it has not read yet, over a connector whose unread data
    died with its sender (``Connector.data_outlives_sender`` False), is given up (its
    receive withdrawn) and reported as :class:`RequestFailed` with ``lost_stage``; the
    others go on (read already, or still readable: shared memory, a store)."""

    stage_id: int
    kind: str
    request_ids: list[str]


class TransferStat(msgspec.Struct, forbid_unknown_fields=True):
    """Bytes and seconds of one transfer as one end of the edge measured it.

    For payloads (``payload``, ``chunks``) ``seconds`` is the transfer itself: the
    receiver's connector gets that returned data (reading and decoding every piece), and
    ``waited_s`` the whole wait, from the receiver starting to expect the payload to its
    last piece, which for a stream includes the producer generating it. For KV (``kv``)
    ``seconds`` is the receiver's wait for it (``waited_s`` is not set)."""

    from_stage: int
    to_stage: int
    what: str  # "kv" | "payload" | "chunks"
    nbytes: int
    seconds: float
    side: str  # "sender" | "receiver"
    #: Which KV of the request: ``"kv"`` (the primary) or a CFG companion's purpose.
    purpose: str = "kv"
    waited_s: float = 0.0
    #: time.time() when the receiver held the whole payload (0: not measured)
    ready_at: float = 0.0


class Tensor(msgspec.Struct, forbid_unknown_fields=True):
    """A small dense tensor in a control message (images, short token arrays)."""

    dtype: str
    shape: list[int]
    data: bytes


class StageDone(_Msg, tag="done"):
    request_id: str
    stage_id: int
    #: Text outputs: ``text``, ``token_ids``, ``prompt_token_ids``; diffusion: ``image``.
    output: dict[str, Any] = {}
    image: Tensor | None = None
    #: a vocoder stage's samples (float32, [n], in [-1, 1]; ``output["sample_rate"]``)
    audio: Tensor | None = None
    transfer_request_id: str = ""
    sender_info: dict[str, Any] = {}
    started: float = 0.0  # time.time() on the stage
    finished: float = 0.0
    transfers: list[TransferStat] = []
    #: time.time() when the stage produced the request's first and last token (a stage
    #: that makes no tokens: when it produced its output)
    first_token_at: float = 0.0
    last_token_at: float = 0.0


class StageProgress(_Msg, tag="progress"):
    """New output of a streaming request since the previous progress message.

    Deltas concatenate to the ``text`` / ``token_ids`` of the request's ``StageDone``
    (vLLM holds back text a stop string could still remove, so a delta is never taken
    back); the last tokens may arrive only with ``StageDone``. A vocoder stage's
    ``audio_delta`` pieces concatenate to its ``StageDone.audio``.
    """

    request_id: str
    stage_id: int
    text_delta: str = ""
    token_ids_delta: list[int] = []
    audio_delta: Tensor | None = None


class RequestFailed(_Msg, tag="request_failed"):
    request_id: str
    stage_id: int
    error: str
    #: The producer stage whose loss failed it (its unread data died with it), if that is why.
    lost_stage: int | None = None


class StageFailed(_Msg, tag="stage_failed"):
    stage_id: int
    error: str
    traceback: str = ""
    #: The failing process (0: not said); a late word of a replaced process is told apart.
    pid: int = 0


class Heartbeat(_Msg, tag="heartbeat"):
    stage_id: int
    #: The stage process's pid: a restarted stage's beats are told from its predecessor's.
    pid: int
    #: How long its engine has made no progress when the beat was sent, and why
    #: (:mod:`vllm_kvbridge.pipeline.liveness`); 0.0 while it makes progress.
    stalled_s: float = 0.0
    stall: str = ""


class StageStats(_Msg, tag="stage_stats"):
    """Counters of the stage's connectors (``leases_expired``, ``puts_full``; see
    ``connectors.base.EDGE_COUNTERS``), summed over its ranks, sent when they change. They
    start again from 0 in a restarted process (``pid`` tells them apart)."""

    stage_id: int
    pid: int
    counters: dict[str, float]


ToStage = Submit | Abort | Shutdown | ProducerLost
FromStage = Ready | StageDone | StageProgress | RequestFailed | StageFailed | Heartbeat | StageStats

_ENCODER = msgspec.msgpack.Encoder()
_TO_STAGE = msgspec.msgpack.Decoder(ToStage)
_FROM_STAGE = msgspec.msgpack.Decoder(FromStage)


def encode(msg: _Msg) -> bytes:
    return _ENCODER.encode(msg)


def decode_to_stage(data: bytes) -> ToStage:
    """Decode a frame the orchestrator sent (raises ``msgspec.DecodeError`` when malformed)."""
    return _TO_STAGE.decode(data)


def decode_from_stage(data: bytes) -> FromStage:
    """Decode a frame a stage sent (raises ``msgspec.DecodeError`` when malformed)."""
    return _FROM_STAGE.decode(data)


def tensor_to_msg(t: Any) -> Tensor:
    """A CPU torch tensor -> :class:`Tensor` (copied into bytes)."""
    arr = t.detach().cpu().contiguous().numpy()
    return Tensor(dtype=str(arr.dtype), shape=list(arr.shape), data=arr.tobytes())


_TENSOR_ITEMSIZE = {"float32": 4, "float16": 2, "uint8": 1, "int64": 8, "int32": 4}


def check_tensor(t: Tensor) -> None:
    """Raise ``ValueError`` unless :func:`tensor_from_msg` accepts ``t`` (dtype allow-list,
    size matches shape)."""
    itemsize = _TENSOR_ITEMSIZE.get(t.dtype)
    if itemsize is None:
        raise ValueError(f"tensor dtype {t.dtype!r} not allowed in control messages")
    count = 1
    for dim in t.shape:
        if dim < 0:
            raise ValueError(f"negative dimension in tensor shape {t.shape}")
        count *= dim
    if count * itemsize != len(t.data):
        raise ValueError(
            f"tensor of shape {t.shape} {t.dtype} needs {count * itemsize} bytes, got {len(t.data)}"
        )


def check_from_stage(msg: FromStage) -> FromStage:
    """``msg`` once the tensors it carries are well-formed (``ValueError`` otherwise), so
    that the orchestrator, which drops a frame that fails here, never fails converting one."""
    for t in (getattr(msg, "image", None), getattr(msg, "audio", None), getattr(msg, "audio_delta", None)):
        if t is not None:
            check_tensor(t)
    return msg


def tensor_from_msg(t: Tensor) -> Any:
    """:class:`Tensor` -> numpy array (validated: :func:`check_tensor`)."""
    import numpy as np

    check_tensor(t)
    return np.frombuffer(t.data, dtype=np.dtype(t.dtype)).reshape(t.shape).copy()
