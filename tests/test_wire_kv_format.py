"""The KV container (KVCacheTransferData) in the payload codec: layout, round trips (host,
device tensor, frames), zero copy, validation of construction and of decoding."""

from __future__ import annotations

import struct
import warnings

import msgspec
import numpy as np
import pytest
import torch
from kv_codec_fixtures import kv_header, packed_device, rewrite_kv_header
from kv_codec_fixtures import packed as repack

from vllm_kvbridge.errors import PayloadError
from vllm_kvbridge.wire import KVCacheTransferData, Limits, decode_frames, decode_packed, encode
from vllm_kvbridge.wire.codec import PREFIX_SIZE
from vllm_kvbridge.wire.decode import decode_packed_device
from vllm_kvbridge.wire.device_pack import pack_into_device
from vllm_kvbridge.wire.dtypes import TORCH_DTYPES
from vllm_kvbridge.wire.kv_format import KVHeader
from vllm_kvbridge.wire.testing import random_tensor

SHAPE = (6, 2, 8)  # [seq_len, num_kv_heads, head_dim]


def make_kv(dtype="bfloat16", num_layers=3, shape=SHAPE, **kw) -> KVCacheTransferData:
    fields = dict(
        block_ids=[7, 8],
        metadata={"model": "tiny", "layers": num_layers, "scale": 0.5, "tags": ["a", None, True]},
        seq_len=shape[0],
        block_size=16,
    )
    fields.update(kw)
    return KVCacheTransferData(
        "req-42",
        {
            "key_cache": [random_tensor(dtype, shape, seed=2 * i) for i in range(num_layers)],
            "value_cache": [random_tensor(dtype, shape, seed=2 * i + 1) for i in range(num_layers)],
        },
        **fields,
    )


def address(buffer) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def table(buf) -> list[tuple[int, int]]:
    """The packed layout's frame table: (offset, nbytes) per buffer."""
    n = struct.unpack_from("<I", buf, 8)[0]
    return [struct.unpack_from("<QQ", buf, PREFIX_SIZE + 16 * i) for i in range(n)]


# -- round trips -----------------------------------------------------------------------
def round_trips(kv: KVCacheTransferData):
    """Every way of packing and unpacking, each yielding the decoded object."""
    enc = encode(kv)
    packed = enc.to_bytes()
    yield "to_bytes/decode_packed", decode_packed(packed)
    big = bytearray(len(packed) + 256)
    assert enc.pack_into(big, 128) == len(packed) == enc.packed_size()
    assert bytes(big[128 : 128 + len(packed)]) == packed
    yield "pack_into/decode_packed", decode_packed(memoryview(big)[128:])
    device_tensor = torch.zeros(enc.packed_size(), dtype=torch.uint8)
    head = pack_into_device(enc, device_tensor)
    assert bytes(device_tensor.numpy()) == packed
    yield "pack_into_device/decode_packed_device", decode_packed_device(head, device_tensor)
    yield "codec frames", decode_frames(enc.frames())
    yield "codec packed, nested", decode_packed(encode({"kv": kv}).to_bytes())["kv"]


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_every_dtype_round_trips_bit_exact(dtype):
    kv = make_kv(dtype)
    for how, out in round_trips(kv):
        assert isinstance(out, KVCacheTransferData), how
        assert kv.equals(out), how
        assert out.layer_blocks["key_cache"][0].dtype == TORCH_DTYPES[dtype], how


def test_missing_layers_value_only_and_empty_tensors_round_trip():
    kv = KVCacheTransferData(
        "r",
        {
            "key_cache": [
                None,
                random_tensor("float16", (4, 1, 2), 1),
                torch.empty(0, 1, 2, dtype=torch.float16),
            ],
            "value_cache": [random_tensor("float32", (3, 3), 2)],
        },
        tp_rank=3,
        tp_size=4,
        head_start=6,
        head_end=8,
        num_kv_heads_total=8,
    )
    assert kv.num_layers == 3
    for how, out in round_trips(kv):
        assert kv.equals(out), how
        assert out.num_layers == 3
        assert out.layer_blocks["key_cache"][0] is None
        assert out.layer_blocks["value_cache"][1:] == [None, None]
        assert (out.tp_rank, out.tp_size, out.head_start, out.head_end, out.num_kv_heads_total) == (
            3,
            4,
            6,
            8,
            8,
        )


def test_key_only_kv_and_no_tensors_round_trip():
    kv = KVCacheTransferData("mla", {"key_cache": [random_tensor("bfloat16", (5, 1, 16), 0)]})
    for how, out in round_trips(kv):
        assert kv.equals(out), how
    empty = KVCacheTransferData("nothing", {})
    assert empty.num_layers == 0 and empty.nbytes == 0
    for how, out in round_trips(empty):
        assert empty.equals(out), how


def test_non_contiguous_and_grad_tensors_pack_by_value():
    base = random_tensor("float32", (8, 2, 6), 3)
    k = base.transpose(0, 2)  # non-contiguous
    v = base.transpose(0, 2).clone().requires_grad_(True)
    kv = KVCacheTransferData("nc", {"key_cache": [k], "value_cache": [v]})
    for how, out in round_trips(kv):
        assert torch.equal(out.key_cache[0], k) and torch.equal(out.value_cache[0], v.detach()), how


def test_properties_and_repr():
    kv = make_kv("float32", num_layers=2)
    assert kv.num_layers == 2
    assert kv.nbytes == 4 * 6 * 2 * 8 * 4
    assert kv.key_cache is kv.layer_blocks["key_cache"]
    assert "req-42" in repr(kv) and "nbytes=" in repr(kv) and "tensor(" not in repr(kv)
    assert not kv.equals(make_kv("float32", num_layers=2, seq_len=5))
    assert not kv.equals(make_kv("bfloat16", num_layers=2))
    assert not kv.equals("kv")


# -- layout ----------------------------------------------------------------------------
def test_byte_layout_matches_the_documentation():
    kv = make_kv("float16")
    enc = encode(kv)
    top = msgspec.msgpack.decode(enc.skeleton)
    assert top[:2] == ["kvbw", 1] and top[2].code == 4  # ext 4: the KV header
    header = msgspec.msgpack.decode(top[2].data, type=KVHeader)
    assert header.request_id == "req-42" and header.num_layers == 3 and header.block_ids == [7, 8]
    assert (header.seq_len, header.block_size, header.tp_rank, header.tp_size) == (6, 16, 0, 1)
    assert header.metadata == kv.metadata
    nbytes = 6 * 2 * 8 * 2
    assert len(header.tensors) == 6
    packed = enc.to_bytes()
    entries = table(packed)
    assert [d.offset for d in header.tensors] == list(range(6))  # offsets are buffer indices
    for d in header.tensors:
        assert d.nbytes == nbytes and d.dtype == "float16" and d.shape == [6, 2, 8]
        t = kv.layer_blocks["key_cache" if d.kind == 0 else "value_cache"][d.layer]
        start, size = entries[d.offset]
        assert start % 64 == 0 and size == nbytes
        assert packed[start : start + nbytes] == t.numpy().tobytes()
        assert bytes(enc.buffers[d.offset]) == t.numpy().tobytes()


# -- zero copy -------------------------------------------------------------------------
def test_decode_packed_is_zero_copy_and_copy_true_is_not():
    kv = make_kv("float32")
    enc = encode(kv)
    buf = bytearray(enc.packed_size())
    enc.pack_into(buf)
    out = decode_packed(buf)
    base = address(buf)
    k0 = out.key_cache[0]
    assert base <= k0.data_ptr() < base + len(buf) and (k0.data_ptr() - base) % 64 == 0
    data_offset = table(buf)[0][0]  # key_cache[0] is buffer 0
    buf[data_offset : data_offset + 4] = struct.pack("<f", 123.0)  # writes through
    assert k0.flatten()[0].item() == 123.0
    copied = decode_packed(buf, copy=True)
    assert not base <= copied.key_cache[0].data_ptr() < base + len(buf)
    buf[data_offset : data_offset + 4] = struct.pack("<f", 1.0)
    assert copied.key_cache[0].flatten()[0].item() == 123.0


def test_decode_packed_device_returns_views_of_the_tensor():
    kv = make_kv("bfloat16")
    head, packed = packed_device(encode(kv).frames())
    out = decode_packed_device(head, packed)
    for t in out.key_cache + out.value_cache:
        assert t.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
    copied = decode_packed_device(head, packed, copy=True)
    assert copied.key_cache[0].untyped_storage().data_ptr() != packed.untyped_storage().data_ptr()
    assert kv.equals(copied)
    # a plain uint8 CPU tensor's numpy view, given to decode_packed, is viewed the same way
    via_decode_packed = decode_packed(packed.numpy()).value_cache[2]
    assert via_decode_packed.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()


def test_decode_packed_device_with_misaligned_storage_offset_clones_once():
    kv = make_kv("float32")
    head, packed = packed_device(encode(kv).frames())
    holder = torch.zeros(packed.numel() + 1, dtype=torch.uint8)
    holder[1:] = packed
    out = decode_packed_device(head, holder[1:])
    assert kv.equals(out)
    assert out.key_cache[0].untyped_storage().data_ptr() != holder.untyped_storage().data_ptr()


def test_decode_packed_of_read_only_bytes_warns_nothing():
    packed = encode(make_kv("float32")).to_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_kv("float32").equals(decode_packed(packed))


def test_pack_into_checks_the_destination():
    enc = encode(make_kv("float32"))
    with pytest.raises(PayloadError, match="too small"):
        enc.pack_into(bytearray(enc.packed_size() - 1))
    with pytest.raises(PayloadError, match="read-only"):
        enc.pack_into(bytes(enc.packed_size()))
    arr = np.zeros(enc.packed_size(), dtype=np.uint8)  # numpy destinations work too
    enc.pack_into(arr)
    assert arr.tobytes() == enc.to_bytes()
    with pytest.raises(PayloadError, match="too small"):
        pack_into_device(enc, torch.empty(enc.packed_size() - 1, dtype=torch.uint8))


# -- construction validation -----------------------------------------------------------
def t(shape=(2, 1, 4), dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(layer_blocks=[t()]), "layer_blocks must be a dict"),
        (dict(layer_blocks={"keys": [t()]}), "unknown keys"),
        (dict(layer_blocks={"key_cache": t()}), "must be a list"),
        (dict(layer_blocks={"key_cache": [np.zeros(3)]}), "must be a torch.Tensor or None"),
        (dict(layer_blocks={"key_cache": [t(dtype=torch.uint16)]}), "not in the wire allow-list"),
        (dict(layer_blocks={"key_cache": [t().to_sparse()]}), "dense"),
        (dict(layer_blocks={"key_cache": [t((2, 1, 4))], "value_cache": [t((2, 1, 5))]}), "differ"),
        (dict(layer_blocks={"key_cache": [t((1,) * 9)]}), "max_ndim"),
        (dict(request_id=7), "request_id must be a str"),
        (dict(block_ids=[1, -2]), "block id -2"),
        (dict(block_ids=[1, "2"]), "block id '2'"),
        (dict(block_ids=5), "block_ids must be a list"),
        (dict(seq_len=-1), "seq_len"),
        (dict(seq_len=1.5), "seq_len"),
        (dict(block_size=0), "block_size"),
        (dict(tp_size=0), "tp_size"),
        (dict(tp_rank=2, tp_size=2), "tp_rank 2 must be < tp_size 2"),
        (dict(head_start=1), "given together"),
        (dict(head_start=3, head_end=2), "head_start 3 > head_end 2"),
        (dict(head_start=0, head_end=5, num_kv_heads_total=4), "head_end 5 > num_kv_heads_total 4"),
        (dict(metadata=[1]), "metadata must be a dict"),
        (dict(metadata={"s": {1, 2}}), r"metadata\['s'\]: set is not JSON-safe"),
        (dict(metadata={"t": (1, 2)}), "tuple is not JSON-safe"),
        (dict(metadata={"b": b"x"}), "bytes is not JSON-safe"),
        (dict(metadata={"x": float("nan")}), "not finite"),
        (dict(metadata={"x": {1: 2}}), "is not a str"),
        (dict(metadata={"x": 2**64}), "does not fit in 64 bits"),
        (dict(metadata={"x": torch.ones(1)}), "Tensor is not JSON-safe"),
    ],
)
def test_construction_rejects_bad_fields(kwargs, message):
    fields = dict(request_id="r", layer_blocks={"key_cache": [t()], "value_cache": [t()]})
    fields.update(kwargs)
    with pytest.raises(PayloadError, match=message):
        KVCacheTransferData(**fields)


def test_mutation_after_construction_is_caught_when_packing():
    kv = make_kv("float32")
    kv.layer_blocks["value_cache"][0] = t((1, 1, 1))
    with pytest.raises(PayloadError, match="differ"):
        encode(kv)


# -- decode validation -----------------------------------------------------------------
def sample_frames() -> list:
    return encode(make_kv("float32", num_layers=2, shape=(3, 1, 4))).frames()


def decoders(frames: list):
    """Every decoder of a KV payload, each a thunk: frames, packed on the host, on a device."""
    yield lambda: decode_frames(frames)
    yield lambda: decode_packed(repack(frames))
    yield lambda: decode_packed_device(*packed_device(frames))


def set_desc(i, field_index, value):
    def mutate(h):
        h["tensors"][i][field_index] = value

    return mutate


def set_field(name, value):
    def mutate(h):
        h[name] = value

    return mutate


def test_rewrite_helper_produces_a_valid_buffer():
    frames = sample_frames()
    assert [bytes(f) for f in rewrite_kv_header(frames, lambda h: None)] == [bytes(f) for f in frames]
    assert kv_header(frames)["request_id"] == "req-42"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (set_desc(0, 0, 2), r"layer 2 outside \[0, 2\)"),
        (set_desc(0, 0, -1), r"layer -1 outside"),
        (set_desc(0, 1, 2), "kind 2 is neither"),
        (set_desc(0, 2, "float128"), "not in the wire allow-list"),
        (set_desc(0, 2, "__class__"), "not in the wire allow-list"),
        (set_desc(0, 2, "float64"), r"needs 96 bytes, buffer has 48"),
        (set_desc(0, 3, [3, 1, 5]), "needs 60 bytes"),
        (set_desc(0, 3, [-3, 1, 4]), "bad dimension -3"),
        (set_desc(0, 3, [1] * 9), "max_ndim"),
        (set_desc(0, 3, [0, 2**62, 2**62]), "needs 0 bytes|overflows"),
        (set_desc(0, 4, 1), "buffer 1 is referenced twice"),
        (set_desc(0, 4, 2**40), "buffer index 1099511627776 out of range"),
        (set_desc(0, 4, 4), r"buffer index 4 out of range \(4 buffers\)"),
        (set_desc(0, 4, -1), "offset must be an int"),
        (set_desc(0, 5, 2**63), "nbytes must be an int"),
        (set_desc(0, 5, 2**40), "needs 48 bytes"),
        (lambda h: h["tensors"].pop(), "buffer 3 is not referenced"),
        (set_desc(0, 0, "0"), "malformed KV header"),
        (set_desc(0, 3, "3x1x4"), "malformed KV header"),
        (lambda h: h["tensors"][0].append(1), "malformed KV header"),
        (lambda h: h["tensors"].append(list(h["tensors"][0])), "duplicate descriptor"),
        (lambda h: h["tensors"][1].__setitem__(3, [4, 1, 3]), "differ"),
        (set_field("num_layers", 1), "layer 1 outside"),
        (set_field("num_layers", 2**40), "num_layers .* exceeds max_items"),
        (set_field("num_layers", -1), "num_layers must be an int"),
        (set_field("tp_rank", 5), "tp_rank 5 must be < tp_size 1"),
        (set_field("head_end", 3), "given together"),
        (set_field("block_size", 0), "block_size"),
        (set_field("block_ids", [-1]), "block id -1"),
        (set_field("metadata", {"x": float("inf")}), "not finite"),
        (set_field("metadata", {"x": msgspec.msgpack.Ext(5, b"")}), "Ext is not JSON-safe"),
        (set_field("metadata", {"a": {"b": {"c": {}}}}), None),
        (set_field("request_id", 5), "malformed KV header"),
        (set_field("extra", 1), "malformed KV header"),
        (lambda h: h.pop("seq_len"), "malformed KV header"),
    ],
)
def test_decode_rejects_bad_headers(mutate, message):
    bad = rewrite_kv_header(sample_frames(), mutate)
    for decode in decoders(bad):
        if message is None:  # a control: valid rewrite decodes
            assert isinstance(decode(), KVCacheTransferData)
            continue
        with pytest.raises(PayloadError, match=message):
            decode()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p[:23], "truncated"),
        (lambda p: p[:-1], "truncated"),
        (lambda p: b"", "truncated"),
        (lambda p: b"KVBC" + p[4:], "bad magic"),
    ],
)
def test_decode_rejects_a_truncated_or_foreign_kv_payload(mutate, message):
    # the codec's prefix and table checks are test_wire_codec.py's malformed-buffer tests
    with pytest.raises(PayloadError, match=message):
        decode_packed(mutate(encode(make_kv("float32", num_layers=2, shape=(3, 1, 4))).to_bytes()))


def test_trailing_bytes_are_ignored():
    packed = repack(sample_frames())
    assert decode_packed(packed + b"\xff" * 1000).equals(decode_packed(packed))
    head, data = packed_device(sample_frames())
    longer = torch.cat([data, torch.full((1000,), 0xFF, dtype=torch.uint8)])
    assert decode_packed_device(head, longer).equals(decode_packed(packed))


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        (Limits(max_total_bytes=100), "max_total_bytes=100"),
        (Limits(max_buffers=3), "exceed max_buffers=3"),
        (Limits(max_skeleton_bytes=50), "max_skeleton_bytes"),
        (Limits(max_ndim=2), "max_ndim=2"),
        (Limits(max_str_bytes=4), "within max_str_bytes|max_str_bytes=4"),
        (Limits(max_depth=1), "max_depth=1"),
        (Limits(max_items=5), "max_items=5"),
    ],
)
def test_decode_enforces_limits(limits, message):
    kv = make_kv("float32", num_layers=2, shape=(3, 1, 4), metadata={"nested": {"deep": [1, 2, 3, 4, 5]}})
    packed = encode(kv).to_bytes()
    with pytest.raises(PayloadError, match=message):
        decode_packed(packed, limits=limits)
    with pytest.raises(PayloadError, match=message):
        encode(kv, limits=limits)
    with pytest.raises(PayloadError, match=message):
        decode_frames(encode(kv).frames(), limits=limits)


def test_decode_packed_device_rejects_wrong_tensors_and_short_input():
    kv = make_kv("float32")
    head, packed = packed_device(encode(kv).frames())
    with pytest.raises(PayloadError, match="1-D uint8 tensor"):
        decode_packed_device(head, packed.view(torch.int8))
    with pytest.raises(PayloadError, match="1-D uint8 tensor"):
        decode_packed_device(head, packed[: packed.numel() // 64 * 64].view(-1, 8))
    with pytest.raises(PayloadError, match="1-D uint8 tensor"):
        decode_packed_device(head, bytes(packed.numpy()))
    with pytest.raises(PayloadError, match="truncated"):
        decode_packed_device(head, torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(PayloadError, match="truncated"):
        decode_packed_device(head, packed[:-1])
    with pytest.raises(PayloadError, match="head truncated"):
        decode_packed_device(head[:-1], packed)
    with pytest.raises(PayloadError, match="head truncated"):
        decode_packed_device(head[:10], packed)
    # a strided tensor is made contiguous once (typed views need it), not misread
    strided = torch.zeros(2 * packed.numel(), dtype=torch.uint8)
    strided[::2] = packed
    assert kv.equals(decode_packed_device(head, strided[::2]))


def test_codec_form_rejects_bad_buffer_references():
    kv = make_kv("float32", num_layers=1, shape=(2, 1, 2))
    frames = encode(kv).frames()
    with pytest.raises(PayloadError, match="descriptor says 16 bytes, buffer 0 has 8"):
        decode_frames([frames[0], bytes(8), frames[2]])
    with pytest.raises(PayloadError, match="index 1 out of range"):
        decode_frames(frames[:2])
    with pytest.raises(PayloadError, match="not referenced"):
        decode_frames([*frames, b""])


def test_codec_encode_of_kv_does_not_copy_tensors():
    kv = make_kv("float32", num_layers=2)
    enc = encode(kv)
    expected = [kv.key_cache[0], kv.key_cache[1], kv.value_cache[0], kv.value_cache[1]]
    assert [address(b) for b in enc.buffers] == [t.data_ptr() for t in expected]
