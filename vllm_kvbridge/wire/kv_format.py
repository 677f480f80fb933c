"""The KV container: one request's per-layer K/V tensors and what the receiver needs.

:class:`KVCacheTransferData` is what the KV manager sends between stages. It travels only
inside the payload codec (:mod:`vllm_kvbridge.wire.codec`, extension type 4): a msgpack
:class:`KVHeader` plus one out-of-band buffer per tensor, framed, packed into host memory
(:meth:`Encoded.pack_into <vllm_kvbridge.wire.codec.Encoded.pack_into>`) or into one
device tensor (:func:`~vllm_kvbridge.wire.device_pack.pack_into_device`). Decoded tensors
are views of the received buffers unless a copy is asked for.

:class:`KVHeader` fields: ``request_id``, ``num_layers``, ``tensors`` (a list of
:class:`TensorDesc` ``[layer, kind (0 = K, 1 = V), dtype name, shape, offset, nbytes]``,
where ``offset`` is the index of the out-of-band buffer that holds the tensor's bytes),
``block_ids``, ``seq_len``, ``block_size``, TP slice info (``tp_rank``, ``tp_size``,
``head_start``, ``head_end``, ``num_kv_heads_total``), JSON-safe ``metadata`` and
``layer_starts`` (per layer, the first token its tensors hold: a sliding-window layer
carries only its window; None: every layer holds tokens ``[0, seq_len)``).

Decoding (:func:`codec_decode`) validates, before building any tensor: the header's types
(msgspec typed decode), every descriptor (layer in range, kind, dtype in the allow-list,
ndim, ``prod(shape) * itemsize == nbytes``, no duplicate (layer, kind), buffer index in
range, referenced once, of exactly ``nbytes``), K/V shape agreement per layer, the TP
fields, the metadata (JSON-safe, within the depth/item/string limits). Every failure is a
:class:`PayloadError` naming the field. (The codec checks the skeleton's size, the frame
table and ``Limits`` around it.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_kvbridge.errors import PayloadError
from vllm_kvbridge.wire._buffers import (
    OutOfBand,
    dense_cpu,
    prepare_tensor,
    tensor_bytes,
    tensors_bitwise_equal,
)
from vllm_kvbridge.wire.dtypes import ITEMSIZE, TORCH_DTYPE_NAMES
from vllm_kvbridge.wire.fill import TensorFill
from vllm_kvbridge.wire.kv_header import (
    KEY,
    KINDS,
    VALUE,
    KVHeader,
    TensorDesc,
    check_json_safe,
    decode_header,
    header_encoder,
    validate_fields,
    validate_header,
)
from vllm_kvbridge.wire.limits import DEFAULT_LIMITS, Limits

__all__ = [
    "KEY",
    "KINDS",
    "VALUE",
    "KVCacheTransferData",
    "KVHeader",
    "TensorDesc",
    "check_json_safe",
    "codec_decode",
    "validate_header",
]


# -- the transfer object -----------------------------------------------------------------
@dataclass(eq=False)
class KVCacheTransferData:
    """One request's KV cache (or a TP slice of it) plus what the receiver needs to use it.

    ``layer_blocks`` is ``{"key_cache": [Tensor | None per layer], "value_cache": [...]}``
    (a missing key means "no tensors of that kind"); ``None`` marks a layer this sender
    does not carry. K and V of one layer must have the same shape. Tensors may live on any
    device and need not be contiguous; they are copied once when packed. An entry may also
    be a :class:`~vllm_kvbridge.wire.fill.TensorFill`: its values are written straight
    into the destination when packed (the sender's one-copy path) and materialized where
    a tensor is needed.

    TP slice info: this data is rank ``tp_rank`` of ``tp_size`` on the sender and holds KV
    heads ``[head_start, head_end)`` of ``num_kv_heads_total`` (``None``: not sliced /
    unknown). ``seq_len``/``block_size`` describe the tokens and the sender's paging.
    ``metadata`` must be JSON-safe (see :func:`check_json_safe`).

    Construction validates (PayloadError on bad fields); equality is :meth:`equals`
    (bit-exact), since ``==`` on tensors is elementwise.
    """

    request_id: str
    layer_blocks: dict[str, list[torch.Tensor | None]]
    block_ids: list[int] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    seq_len: int | None = None
    block_size: int | None = None
    tp_rank: int = 0
    tp_size: int = 1
    head_start: int | None = None
    head_end: int | None = None
    num_kv_heads_total: int | None = None
    #: per layer, the first token position its K/V hold (vLLM's sliding-window layers keep
    #: only their window); None: every layer holds tokens ``[0, seq_len)``
    layer_starts: list[int] | None = None

    def __post_init__(self) -> None:
        self._header(DEFAULT_LIMITS)

    # -- views -----------------------------------------------------------------------
    @property
    def key_cache(self) -> list[torch.Tensor | None]:
        return self.layer_blocks.get("key_cache", [])

    @property
    def value_cache(self) -> list[torch.Tensor | None]:
        return self.layer_blocks.get("value_cache", [])

    def layer_start(self, layer: int) -> int:
        """The position of the first token layer ``layer``'s K/V hold."""
        return self.layer_starts[layer] if self.layer_starts is not None else 0

    @property
    def num_layers(self) -> int:
        return max(len(self.layer_blocks.get(name, ())) for name in KINDS)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (excluding the header and any framing)."""
        return sum(t.nbytes for _, _, t in self._entries())

    def __repr__(self) -> str:
        present = sum(1 for _ in self._entries())
        return (
            f"KVCacheTransferData(request_id={self.request_id!r}, num_layers={self.num_layers}, "
            f"tensors={present}, nbytes={self.nbytes}, seq_len={self.seq_len}, "
            f"tp={self.tp_rank}/{self.tp_size}, heads=[{self.head_start}, {self.head_end}))"
        )

    def equals(self, other: object) -> bool:
        """True when every field matches and every tensor is bit-identical (any device)."""
        if not isinstance(other, KVCacheTransferData):
            return False
        fields = (
            "request_id",
            "block_ids",
            "metadata",
            "seq_len",
            "block_size",
            "tp_rank",
            "tp_size",
            "head_start",
            "head_end",
            "num_kv_heads_total",
            "layer_starts",
        )
        if any(getattr(self, f) != getattr(other, f) for f in fields):
            return False
        if self.num_layers != other.num_layers:
            return False
        for name in KINDS:
            mine, theirs = self.layer_blocks.get(name, []), other.layer_blocks.get(name, [])
            for layer in range(self.num_layers):
                a = mine[layer] if layer < len(mine) else None
                b = theirs[layer] if layer < len(theirs) else None
                if (a is None) != (b is None) or (
                    a is not None and not tensors_bitwise_equal(_tensor(a), _tensor(b))
                ):
                    return False
        return True

    # -- description -----------------------------------------------------------------
    def _entries(self) -> list[tuple[int, int, torch.Tensor]]:
        blocks = self.layer_blocks
        if type(blocks) is not dict:
            raise PayloadError(f"layer_blocks must be a dict, got {type(blocks).__name__}")
        unknown = set(blocks) - set(KINDS)
        if unknown:
            raise PayloadError(f"layer_blocks has unknown keys {sorted(map(str, unknown))}; use {KINDS}")
        out = []
        for kind, name in enumerate(KINDS):
            seq = blocks.get(name, [])
            if not isinstance(seq, list | tuple):
                raise PayloadError(f"layer_blocks[{name!r}] must be a list, got {type(seq).__name__}")
            for layer, t in enumerate(seq):
                if t is None:
                    continue
                if not isinstance(t, torch.Tensor | TensorFill):
                    raise PayloadError(
                        f"{name}[{layer}] must be a torch.Tensor or None, got {type(t).__name__}"
                    )
                out.append((layer, kind, t))
        return out

    def _header(self, limits: Limits) -> tuple[KVHeader, list[torch.Tensor]]:
        """The validated header (offsets 0) and the tensors in descriptor order."""
        entries = self._entries()
        if len(entries) > limits.max_buffers:
            raise PayloadError(f"{len(entries)} tensors exceed max_buffers={limits.max_buffers}")
        descs, tensors = [], []
        key_shapes: dict[int, list[int]] = {}
        total = 0
        # Descriptors built from real tensors are consistent by construction (shape and
        # nbytes agree, layers in range, no duplicates), so only what can be wrong is checked.
        for layer, kind, t in entries:
            name = TORCH_DTYPE_NAMES.get(t.dtype)
            if name is None:
                raise PayloadError(f"{KINDS[kind]}[{layer}]: dtype {t.dtype} is not in the wire allow-list")
            if type(t) is not TensorFill and (t.layout != torch.strided or t.is_meta):
                raise PayloadError(f"{KINDS[kind]}[{layer}]: only dense tensors with data are supported")
            shape = list(t.shape)
            if len(shape) > limits.max_ndim:
                raise PayloadError(
                    f"{KINDS[kind]}[{layer}]: ndim {len(shape)} exceeds max_ndim={limits.max_ndim}"
                )
            if kind == KEY:
                key_shapes[layer] = shape
            elif key_shapes.get(layer, shape) != shape:
                raise PayloadError(
                    f"layer {layer}: key shape {key_shapes[layer]} and value shape {shape} differ"
                )
            nbytes = t.numel() * ITEMSIZE[name]
            total += nbytes
            descs.append(TensorDesc(layer, kind, name, shape, 0, nbytes))
            tensors.append(t)
        if total > limits.max_total_bytes:
            raise PayloadError(f"tensor bytes exceed max_total_bytes={limits.max_total_bytes}")
        if not isinstance(self.block_ids, list | tuple):
            raise PayloadError(f"block_ids must be a list of ints, got {type(self.block_ids).__name__}")
        header = KVHeader(
            request_id=self.request_id,
            num_layers=self.num_layers,
            tensors=descs,
            block_ids=list(self.block_ids),
            seq_len=self.seq_len,
            block_size=self.block_size,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            head_start=self.head_start,
            head_end=self.head_end,
            num_kv_heads_total=self.num_kv_heads_total,
            metadata=self.metadata,
            layer_starts=None if self.layer_starts is None else list(self.layer_starts),
        )
        validate_fields(header, limits)
        return header, tensors

    @classmethod
    def _from_header(cls, header: KVHeader, tensors: list[torch.Tensor]) -> KVCacheTransferData:
        """Build from a header already validated by :func:`validate_header` (skips re-validation)."""
        lists: tuple[list[torch.Tensor | None], list[torch.Tensor | None]] = (
            [None] * header.num_layers,
            [None] * header.num_layers,
        )
        for d, t in zip(header.tensors, tensors):
            lists[d.kind][d.layer] = t
        obj = cls.__new__(cls)
        obj.__dict__.update(
            request_id=header.request_id,
            layer_blocks={KINDS[0]: lists[0], KINDS[1]: lists[1]},
            block_ids=header.block_ids,
            metadata=header.metadata,
            seq_len=header.seq_len,
            block_size=header.block_size,
            tp_rank=header.tp_rank,
            tp_size=header.tp_size,
            head_start=header.head_start,
            head_end=header.head_end,
            num_kv_heads_total=header.num_kv_heads_total,
            layer_starts=header.layer_starts,
        )
        return obj

    # -- payload-codec support (offsets are out-of-band buffer indices) --------------
    def _codec_encode(self, limits: Limits, first_index: int) -> tuple[bytes, list[Any]]:
        """``(header bytes, buffer sources)``: each source is the tensor itself when it is a
        dense CPU tensor (see :class:`~vllm_kvbridge.wire.codec.Encoded`), else a memoryview
        of a dense host copy."""
        header, tensors = self._header(limits)
        sources: list[Any] = []
        for i, (d, t) in enumerate(zip(header.tensors, tensors)):
            d.offset = first_index + i
            if dense_cpu(t) or type(t) is TensorFill:  # copied (or written) once, when packed
                sources.append(t)
            else:
                cpu, _ = prepare_tensor(_tensor(t), f"{KINDS[d.kind]}[{d.layer}]")
                sources.append(tensor_bytes(cpu))
        return header_encoder.encode(header), sources


def _tensor(t: torch.Tensor | TensorFill) -> torch.Tensor:
    """``t`` itself, or a fill's values as a new tensor."""
    return t.materialize() if type(t) is TensorFill else t


def codec_decode(
    raw: bytes | memoryview,
    frames: OutOfBand,
    used: bytearray,
    limits: Limits,
    copy: bool,
) -> KVCacheTransferData:
    """Build a KVCacheTransferData from its codec form (header + out-of-band buffers)."""
    header = decode_header(raw)
    checked = validate_header(header, limits)
    built = []
    sizes = frames.sizes
    for d, (shape, strides) in zip(header.tensors, checked):
        what = f"{KINDS[d.kind]}[{d.layer}]"
        index = d.offset
        if index >= len(sizes):
            raise PayloadError(f"{what}: buffer index {index} out of range ({len(sizes)} buffers)")
        if used[index]:
            raise PayloadError(f"{what}: buffer {index} is referenced twice")
        used[index] = 1
        if sizes[index] != d.nbytes:
            raise PayloadError(f"{what}: descriptor says {d.nbytes} bytes, buffer {index} has {sizes[index]}")
        built.append(frames.tensor(index, d.dtype, shape, strides, copy, what))
    return KVCacheTransferData._from_header(header, built)
