"""The packed KV format: one request's per-layer K/V tensors in one contiguous buffer.

:class:`KVCacheTransferData` is what the KV manager sends between stages. It packs into a
single buffer (for shared memory, a store, or one device tensor) and unpacks into tensors
that are *views* of that buffer (zero copy) unless a copy is asked for. The payload codec
(:mod:`vllm_kvbridge.wire.codec`) also carries it as a tagged type, one out-of-band buffer
per tensor.

Byte layout (all integers little-endian)::

    offset  size  field
    0       4     magic  b"KVBC"
    4       2     version (u16, currently 1)
    6       2     flags (u16, must be 0)
    8       4     header_len (u32): length of the msgpack header that follows
    12      4     reserved (u32, must be 0)
    16      8     data_offset (u64): start of the data region, a multiple of 64,
                  >= 32 + header_len; bytes in between are zero padding
    24      8     data_len (u64): length of the data region
    32      H     header: msgpack map of :class:`KVHeader` (msgspec), H = header_len
    D       L     data region, D = data_offset, L = data_len; tensor i occupies
                  [D + tensors[i].offset, D + tensors[i].offset + tensors[i].nbytes),
                  every tensors[i].offset a multiple of 64, gaps zero-filled
                  (except in :meth:`KVCacheTransferData.to_gpu_tensor`, see there)

The buffer given to a decoder may be longer than ``data_offset + data_len`` (a pooled
shared-memory segment); trailing bytes are ignored.

:class:`KVHeader` fields: ``request_id``, ``num_layers``, ``tensors`` (a list of
:class:`TensorDesc` ``[layer, kind (0 = K, 1 = V), dtype name, shape, offset, nbytes]``),
``block_ids``, ``seq_len``, ``block_size``, TP slice info (``tp_rank``, ``tp_size``,
``head_start``, ``head_end``, ``num_kv_heads_total``) and JSON-safe ``metadata``.

Decoding validates, before building any tensor: magic, version, reserved fields, header
length against the buffer and ``Limits.max_skeleton_bytes``, the header's types (msgspec
typed decode), every descriptor (layer in range, kind, dtype in the allow-list, ndim,
``prod(shape) * itemsize == nbytes``, no duplicate (layer, kind), 64-byte aligned offset,
inside the data region, no overlap), K/V shape agreement per layer, the TP fields, the
metadata (JSON-safe, within the depth/item/string limits) and, optionally, the expected
request id. Every failure is a :class:`PayloadError` naming the field.

In the payload codec the same header is used, except that ``tensors[i].offset`` is the
index of the out-of-band buffer that holds the tensor's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_kvbridge.errors import PayloadError
from vllm_kvbridge.wire._buffers import (
    OutOfBand,
    align_up,
    buffer_address,
    byte_view,
    copy_many,
    dense_cpu,
    prepare_tensor,
    tensor_bytes,
    tensor_from_device_bytes,
    tensors_bitwise_equal,
    writable_byte_view,
)
from vllm_kvbridge.wire.dtypes import ITEMSIZE, TORCH_DTYPE_NAMES
from vllm_kvbridge.wire.fill import TensorFill
from vllm_kvbridge.wire.kv_header import (
    FIXED,
    FIXED_SIZE,
    KEY,
    KINDS,
    MAGIC,
    VALUE,
    VERSION,
    ZEROS,
    KVHeader,
    TensorDesc,
    check_json_safe,
    decode_header,
    header_encoder,
    parse_prefix,
    validate_fields,
    validate_header,
)
from vllm_kvbridge.wire.limits import DEFAULT_LIMITS, Limits

__all__ = [
    "FIXED_SIZE",
    "KEY",
    "KINDS",
    "MAGIC",
    "VALUE",
    "VERSION",
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

    def __post_init__(self) -> None:
        self._header(DEFAULT_LIMITS)

    # -- views -----------------------------------------------------------------------
    @property
    def key_cache(self) -> list[torch.Tensor | None]:
        return self.layer_blocks.get("key_cache", [])

    @property
    def value_cache(self) -> list[torch.Tensor | None]:
        return self.layer_blocks.get("value_cache", [])

    @property
    def num_layers(self) -> int:
        return max(len(self.layer_blocks.get(name, ())) for name in KINDS)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (excluding header and padding; see :meth:`packed_size`)."""
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
        )
        validate_fields(header, limits)
        return header, tensors

    def _layout(self, limits: Limits) -> tuple[bytes, int, int, KVHeader, list[torch.Tensor]]:
        """``(prefix bytes incl. header, data_offset, data_len, header, tensors)``."""
        header, tensors = self._header(limits)
        end = 0
        for d in header.tensors:
            d.offset = align_up(end)
            end = d.offset + d.nbytes
        raw = header_encoder.encode(header)
        if len(raw) > limits.max_skeleton_bytes:
            raise PayloadError(f"KV header of {len(raw)} bytes exceeds max_skeleton_bytes")
        data_offset = align_up(FIXED_SIZE + len(raw))
        prefix = FIXED.pack(MAGIC, VERSION, 0, len(raw), 0, data_offset, end) + raw
        return prefix, data_offset, end, header, tensors

    # -- packing ---------------------------------------------------------------------
    def packed_size(self, *, limits: Limits | None = None) -> int:
        """Bytes :meth:`pack_into` writes (header, padding and data)."""
        _, data_offset, data_len, _, _ = self._layout(limits or DEFAULT_LIMITS)
        return data_offset + data_len

    def pack_into(self, dst: Any, offset: int = 0, *, limits: Limits | None = None) -> int:
        """Write the packed form into ``dst[offset:]`` (one copy per tensor); returns bytes written.

        ``dst`` is any writable buffer (bytearray, memoryview, mmap, numpy uint8 array).
        GPU tensors are copied straight from the device into ``dst``. Alignment is relative
        to ``offset``: pass a 64-aligned offset into a 64-aligned buffer for aligned data.
        """
        prefix, data_offset, data_len, header, tensors = self._layout(limits or DEFAULT_LIMITS)
        total = data_offset + data_len
        mv = writable_byte_view(dst)
        if type(offset) is not int or offset < 0 or offset + total > len(mv):
            raise PayloadError(f"destination too small: need {total} bytes at offset {offset}, has {len(mv)}")
        region = mv[offset : offset + total]
        region[: len(prefix)] = prefix
        region[len(prefix) : data_offset] = ZEROS[: data_offset - len(prefix)]
        base = buffer_address(region) if total else 0
        end = 0
        copies: list[tuple[int, int, int]] = []  # made together: see copy_many
        for d, t in zip(header.tensors, tensors):
            start = data_offset + d.offset
            gap = start - (data_offset + end)
            if gap:
                region[start - gap : start] = ZEROS[:gap]
            _copy_tensor_into(region, base, start, t, copies)
            end = d.offset + d.nbytes
        copy_many(copies)
        return total

    def to_bytes(self, *, limits: Limits | None = None) -> bytes:
        """The packed form as ``bytes`` (one copy of each CPU tensor; GPU tensors two)."""
        prefix, data_offset, _, header, tensors = self._layout(limits or DEFAULT_LIMITS)
        pieces: list[Any] = [prefix, ZEROS[: data_offset - len(prefix)]]
        end = 0
        for d, t in zip(header.tensors, tensors):
            pieces.append(ZEROS[: d.offset - end])
            cpu, _ = prepare_tensor(_tensor(t), f"{KINDS[d.kind]}[{d.layer}]")
            pieces.append(tensor_bytes(cpu))
            end = d.offset + d.nbytes
        return b"".join(pieces)

    def to_gpu_tensor(
        self, device: torch.device | str | None = None, *, limits: Limits | None = None
    ) -> torch.Tensor:
        """The packed form as one 1-D uint8 tensor on ``device``.

        ``device`` defaults to the device of the first tensor (CPU when there is none).
        Tensors are copied once each (device-to-device when they already live there).
        Padding gaps between tensors are zeroed; the result decodes with
        :meth:`from_bytes_device` and, moved to the host, with :meth:`from_bytes`.
        """
        prefix, data_offset, data_len, header, tensors = self._layout(limits or DEFAULT_LIMITS)
        if device is None:
            device = tensors[0].device if tensors else torch.device("cpu")
        out = torch.empty(data_offset + data_len, dtype=torch.uint8, device=device)
        head = bytearray(data_offset)
        head[: len(prefix)] = prefix
        out[:data_offset].copy_(torch.frombuffer(head, dtype=torch.uint8))
        end = 0
        for d, t in zip(header.tensors, tensors):
            start = data_offset + d.offset
            if d.offset > end:
                out[data_offset + end : start].zero_()
            if d.nbytes:
                view = out[start : start + d.nbytes].view(t.dtype).view(t.shape)
                if type(t) is TensorFill:
                    t.fill_into(view)
                else:
                    view.copy_(t.detach())
            end = d.offset + d.nbytes
        return out

    # -- unpacking -------------------------------------------------------------------
    @classmethod
    def from_bytes(
        cls,
        buffer: Any,
        *,
        expected_request_id: str | None = None,
        copy: bool = False,
        limits: Limits | None = None,
    ) -> KVCacheTransferData:
        """Decode a packed buffer; tensors are views of ``buffer`` unless ``copy``.

        ``buffer``: anything with the buffer protocol (bytes, bytearray, memoryview, mmap,
        numpy array) or a 1-D uint8 tensor (then :meth:`from_bytes_device`). It may be
        longer than the packed data. Raises :class:`PayloadError` on anything malformed,
        over ``limits`` or, when given, with a request id other than ``expected_request_id``.
        See :mod:`vllm_kvbridge.wire._buffers` on tensors viewing read-only buffers.
        """
        if isinstance(buffer, torch.Tensor):
            return cls.from_bytes_device(
                buffer, expected_request_id=expected_request_id, copy=copy, limits=limits
            )
        limits = limits or DEFAULT_LIMITS
        mv = byte_view(buffer, "packed KV buffer")
        header, data_offset, checked = parse_prefix(
            lambda a, b: mv[a:b], len(mv), limits, expected_request_id
        )
        descs = header.tensors
        region = OutOfBand.from_packed(mv, [data_offset + d.offset for d in descs], [d.nbytes for d in descs])
        built = [
            # `what` names the tensor in the only error left at this point (bool bytes), so
            # it is only formatted for bool tensors.
            region.tensor(
                i, d.dtype, shape, strides, copy, d.dtype == "bool" and f"{KINDS[d.kind]}[{d.layer}]"
            )
            for i, (d, (shape, strides)) in enumerate(zip(descs, checked))
        ]
        return cls._from_header(header, built)

    @classmethod
    def from_bytes_device(
        cls,
        tensor: torch.Tensor,
        *,
        expected_request_id: str | None = None,
        copy: bool = False,
        limits: Limits | None = None,
    ) -> KVCacheTransferData:
        """Decode a packed 1-D uint8 tensor on any device; results are views into it.

        Only the prefix and header are copied to the host (to validate them). If the
        tensor's storage offset is not a multiple of 16 bytes (so typed views would be
        misaligned), it is cloned once first.
        """
        limits = limits or DEFAULT_LIMITS
        if not isinstance(tensor, torch.Tensor):
            raise PayloadError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
            raise PayloadError(
                f"expected a contiguous 1-D uint8 tensor, got {tensor.dtype} with shape {list(tensor.shape)}"
            )
        if tensor.storage_offset() % 16:
            tensor = tensor.clone()

        def read(a: int, b: int) -> bytes:
            return tensor[a:b].cpu().numpy().tobytes()

        header, data_offset, _ = parse_prefix(read, tensor.numel(), limits, expected_request_id)
        built = []
        for d in header.tensors:
            start = data_offset + d.offset
            what = f"{KINDS[d.kind]}[{d.layer}]"
            region = tensor[start : start + d.nbytes]
            built.append(tensor_from_device_bytes(region, d.dtype, tuple(d.shape), copy, what))
        return cls._from_header(header, built)

    from_bytes_gpu = from_bytes_device

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


def _copy_tensor_into(
    region: memoryview,
    base: int,
    start: int,
    t: torch.Tensor | TensorFill,
    copies: list[tuple[int, int, int]],
) -> None:
    """Copy ``t``'s bytes to ``region[start:]`` (``base``: address of ``region[0]``).

    Dense CPU tensors: one ``memmove`` added to ``copies``, which the caller makes with
    :func:`copy_many` (bounds were checked here). Anything else (strided, conj/neg views,
    other devices): one torch ``copy_`` straight into the destination, now.
    """
    if type(t) is TensorFill:
        t.fill_bytes(region, start)
        return
    nbytes = t.nbytes
    if nbytes == 0:
        return
    if dense_cpu(t):
        if start + nbytes > len(region):  # the layout guarantees this; never write out of bounds
            raise PayloadError(f"internal error: tensor of {nbytes} bytes at {start} overruns {len(region)}")
        copies.append((base + start, t.data_ptr(), nbytes))
    else:
        t = t.detach()
        torch.frombuffer(region, dtype=t.dtype, count=t.numel(), offset=start).view(t.shape).copy_(t)


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
