"""The payload codec: round trips, zero copy, limits, and malformed input."""

from __future__ import annotations

import struct
import warnings

import msgspec
import numpy as np
import pytest
import torch
import zmq

from vllm_kvbridge.errors import PayloadError
from vllm_kvbridge.wire import (
    KVCacheTransferData,
    Limits,
    decode_frames,
    decode_packed,
    encode,
)
from vllm_kvbridge.wire.codec import PREFIX_SIZE
from vllm_kvbridge.wire.dtypes import NUMPY_DTYPES, TORCH_DTYPES
from vllm_kvbridge.wire.testing import (
    all_dtypes_payload,
    assert_payload_equal,
    random_array,
    random_tensor,
)

Ext = msgspec.msgpack.Ext


def via_frames(obj, **kw):
    return decode_frames(encode(obj).frames(), **kw)


def via_packed(obj, **kw):
    return decode_packed(encode(obj).to_bytes(), **kw)


def via_pack_into(obj, **kw):
    enc = encode(obj)
    buf = bytearray(enc.packed_size() + 100)  # trailing bytes must be ignored
    assert enc.pack_into(buf) == enc.packed_size()
    return decode_packed(buf, **kw)


ROUND_TRIPS = [via_frames, via_packed, via_pack_into]


def address(buffer) -> int:
    """Address of the first byte of a buffer-protocol object."""
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def skeleton(root) -> bytes:
    return msgspec.msgpack.encode(["kvbw", 1, root])


def tensor_ext(index, dtype, shape, code=1) -> Ext:
    return Ext(code, msgspec.msgpack.encode([index, dtype, shape]))


# -- round trips -----------------------------------------------------------------------
@pytest.mark.parametrize("rt", ROUND_TRIPS)
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_every_torch_dtype_round_trips_bit_exact(rt, dtype):
    payload = {
        "plain": random_tensor(dtype, (4, 3, 2), seed=1),
        "scalar": random_tensor(dtype, (), seed=2),
        "empty": random_tensor(dtype, (0, 7), seed=3),
        "non_contiguous": random_tensor(dtype, (6, 5), seed=4).t(),
        "sliced": random_tensor(dtype, (10,), seed=5)[2:9:3],
    }
    out = rt(payload)
    assert_payload_equal(payload, out)
    assert out["non_contiguous"].is_contiguous()


@pytest.mark.parametrize("rt", ROUND_TRIPS)
@pytest.mark.parametrize("dtype", list(NUMPY_DTYPES))
def test_every_numpy_dtype_round_trips_bit_exact(rt, dtype):
    payload = [
        random_array(dtype, (3, 4), seed=1),
        random_array(dtype, (), seed=2),
        random_array(dtype, (0, 3), seed=3),
        random_array(dtype, (5, 6), seed=4)[::2, 1::2],  # non-contiguous
    ]
    assert_payload_equal(payload, rt(payload))


@pytest.mark.parametrize("rt", ROUND_TRIPS)
def test_nested_values_round_trip(rt):
    payload = {
        "str": "héllo \u2603 \U0001f600",
        "empty_str": "",
        "bytes": b"\x00\xff" * 10,
        "ints": [0, 1, -1, 2**63 - 1, -(2**63), 255, 65536],
        "floats": [0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan"), 1e-310],
        "flags": (True, False, None),
        7: "int key",
        -3: {"neg": "int key"},
        "nested": {"a": [({"b": (1, [2, (3,)])},), [], (), {}]},
        "tensors": [torch.arange(4), (np.arange(3), {"t": torch.ones(2, 2)})],
        "tuple_of_tuples": ((), ((),), (1, "x")),
    }
    out = rt(payload)
    assert_payload_equal(payload, out)
    assert type(out["nested"]["a"][0]) is tuple
    assert type(out["tuple_of_tuples"][1][0]) is tuple


@pytest.mark.parametrize("rt", ROUND_TRIPS)
def test_all_dtypes_in_one_payload(rt):
    payload = all_dtypes_payload(seed=7)
    assert_payload_equal(payload, rt(payload))


@pytest.mark.parametrize("rt", ROUND_TRIPS)
@pytest.mark.parametrize("root", [None, 3, "s", b"b", 1.25, True, [], {}, ()])
def test_scalar_and_empty_roots(rt, root):
    assert_payload_equal(root, rt(root))


@pytest.mark.parametrize("rt", ROUND_TRIPS)
def test_kv_transfer_data_inside_a_payload(rt):
    kv = KVCacheTransferData(
        "req-1",
        {
            "key_cache": [random_tensor("bfloat16", (5, 2, 4), 1), None],
            "value_cache": [random_tensor("bfloat16", (5, 2, 4), 2), random_tensor("float32", (5, 2, 4), 3)],
        },
        block_ids=[3, 4],
        metadata={"stage": 0, "notes": ["x", 1.5, None]},
        seq_len=5,
        block_size=16,
        tp_rank=1,
        tp_size=2,
        head_start=2,
        head_end=4,
        num_kv_heads_total=4,
    )
    payload = {"before": torch.ones(3), "kv": kv, "after": [kv, torch.zeros(2)]}
    out = rt(payload)
    assert_payload_equal(payload, out)
    assert out["kv"].layer_blocks["key_cache"][1] is None


def test_subclassed_containers_come_back_as_base_types():
    from collections import OrderedDict, namedtuple

    Point = namedtuple("Point", "x y")
    out = via_frames({"od": OrderedDict(a=1), "nt": Point(1, 2)})
    assert type(out["od"]) is dict and out["od"] == {"a": 1}
    assert type(out["nt"]) is tuple and out["nt"] == (1, 2)


def test_requires_grad_and_conj_tensors_are_encoded_by_value():
    t = torch.randn(3, requires_grad=True)
    c = torch.randn(4, dtype=torch.complex64).conj()
    out = via_packed({"t": t, "c": c})
    assert_payload_equal({"t": t.detach(), "c": c.resolve_conj()}, out)


def test_big_endian_numpy_is_sent_in_native_order():
    a = np.arange(6, dtype=">i4").reshape(2, 3)
    out = via_frames(a)
    assert out.dtype == np.dtype("int32") and (out == a).all()


def test_decode_accepts_zmq_frames():
    enc = encode({"x": torch.arange(10)})
    frames = [zmq.Frame(bytes(f)) for f in enc.frames()]
    assert_payload_equal({"x": torch.arange(10)}, decode_frames(frames))


def test_encoded_sizes_and_layout():
    t = torch.arange(100, dtype=torch.int32)
    enc = encode({"a": t, "b": np.ones(3)})
    assert len(enc.buffers) == 2
    assert enc.nbytes == len(enc.skeleton) + 400 + 24
    assert enc.frames()[0] is enc.skeleton
    packed = enc.to_bytes()
    assert len(packed) == enc.packed_size()
    magic, version, flags, n, skel_len, total = struct.unpack_from("<4sHHIIQ", packed)
    assert (magic, version, flags, n, skel_len, total) == (b"KVBW", 1, 0, 2, len(enc.skeleton), len(packed))
    table = struct.unpack_from("<4Q", packed, PREFIX_SIZE)
    assert table[1] == 400 and table[3] == 24
    assert all(off % 64 == 0 for off in table[0::2])
    assert packed[table[0] : table[0] + 400] == t.numpy().tobytes()
    # pack_into at an offset writes exactly the same bytes there
    buf = bytearray(b"\xaa" * (len(packed) + 64))
    assert enc.pack_into(buf, 64) == len(packed)
    assert bytes(buf[64:]) == packed and buf[:64] == b"\xaa" * 64


def test_pack_into_rejects_small_or_read_only_destinations():
    enc = encode({"a": torch.ones(10)})
    with pytest.raises(PayloadError, match="too small"):
        enc.pack_into(bytearray(enc.packed_size() - 1))
    with pytest.raises(PayloadError, match="too small"):
        enc.pack_into(bytearray(enc.packed_size()), offset=1)
    with pytest.raises(PayloadError, match="read-only"):
        enc.pack_into(bytes(enc.packed_size()))
    with pytest.raises(PayloadError, match="buffer protocol"):
        enc.pack_into([0] * enc.packed_size())


# -- zero copy -------------------------------------------------------------------------
def test_encode_does_not_copy_contiguous_tensors_or_arrays():
    t = torch.randn(64, 64)
    a = np.arange(100.0)
    enc = encode({"t": t, "a": a})
    assert address(enc.buffers[0]) == t.data_ptr()
    assert address(enc.buffers[1]) == a.ctypes.data
    del t, a  # the buffers keep the sources alive
    assert len(bytes(enc.buffers[0])) == 64 * 64 * 4


def test_decode_frames_is_zero_copy_and_copy_true_is_not():
    src = torch.arange(16, dtype=torch.float32)
    enc = encode({"t": src, "a": np.arange(4)})
    frames = [enc.skeleton, *(bytearray(b) for b in enc.buffers)]
    out = decode_frames(frames)
    assert out["t"].data_ptr() == address(frames[1])
    assert out["a"].ctypes.data == address(frames[2])
    frames[1][0:4] = struct.pack("<f", 42.0)  # writes through to the decoded view
    assert out["t"][0].item() == 42.0
    copied = decode_frames(frames, copy=True)
    assert copied["t"].data_ptr() != address(frames[1])
    frames[1][0:4] = struct.pack("<f", 7.0)
    assert copied["t"][0].item() == 42.0 and out["t"][0].item() == 7.0
    assert copied["a"].flags.owndata


def test_decode_packed_is_zero_copy_into_the_buffer():
    enc = encode([torch.ones(1000), np.zeros(10)])
    buf = bytearray(enc.packed_size())
    enc.pack_into(buf)
    out = decode_packed(buf)
    base = address(buf)
    assert base <= out[0].data_ptr() < base + len(buf)
    assert (out[0].data_ptr() - base) % 64 == 0
    assert base <= out[1].ctypes.data < base + len(buf)
    assert not base <= decode_packed(buf, copy=True)[0].data_ptr() < base + len(buf)


def test_read_only_buffers_decode_without_warnings():
    packed = encode({"t": torch.ones(8), "a": np.ones(3)}).to_bytes()  # bytes: read-only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = decode_packed(packed)
        assert_payload_equal({"t": torch.ones(8), "a": np.ones(3)}, out)
        assert not out["a"].flags.writeable  # numpy keeps the read-only flag
        assert decode_packed(packed, copy=True)["a"].flags.writeable


# -- unsupported values on encode ------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({1, 2}, "unsupported type builtins.set"),
        (object(), "unsupported type builtins.object"),
        (np.float32(1.0), "unsupported type numpy.float32"),
        (bytearray(b"x"), "unsupported type builtins.bytearray"),
        (2**63, "does not fit in 64 bits"),
        (-(2**63) - 1, "does not fit in 64 bits"),
        ({True: 1}, "is not a str or int64"),
        ({1.5: 1}, "is not a str or int64"),
        ({(1, 2): 1}, "is not a str or int64"),
        ({2**64: 1}, "is not a str or int64"),
        (torch.zeros(2, dtype=torch.uint16), "not in the wire allow-list"),
        (torch.zeros(2, dtype=torch.uint32), "not in the wire allow-list"),
        (torch.zeros(2, dtype=torch.uint64), "not in the wire allow-list"),
        (torch.zeros(3).to_sparse(), "dense"),
        (torch.empty(2, device="meta"), "meta"),
        (np.array([object()]), "not in the wire allow-list"),
        (np.zeros(2, dtype=[("a", "i4")]), "not in the wire allow-list"),
        (np.zeros(2, dtype="U3"), "not in the wire allow-list"),
        (np.ma.masked_array([1, 2]), "unsupported type numpy.ma"),
        ("\ud800", "cannot be encoded"),
    ],
)
def test_unsupported_values_raise_payload_error(value, message):
    with pytest.raises(PayloadError, match=message):
        encode({"outer": [0, value]})


def test_encode_error_names_the_path():
    with pytest.raises(PayloadError, match=r"at payload\['a'\]\[1\]\[0\]\['b'\]"):
        encode({"a": [0, ({"b": {3}},)]})


# -- limits (each limit on encode and on decode) --------------------------------------
def nested(depth):
    obj = 0
    for _ in range(depth):
        obj = [obj]
    return obj


def check_limit(payload, strict: Limits, match: str):
    """Encode must refuse under ``strict``; a payload encoded with defaults must not decode."""
    with pytest.raises(PayloadError, match=match):
        encode(payload, limits=strict)
    enc = encode(payload)
    with pytest.raises(PayloadError, match=match):
        decode_frames(enc.frames(), limits=strict)
    with pytest.raises(PayloadError, match=match):
        decode_packed(enc.to_bytes(), limits=strict)


def test_limit_max_depth():
    assert via_frames(nested(4)) == nested(4)
    encode(nested(4), limits=Limits(max_depth=4))
    check_limit(nested(5), Limits(max_depth=4), "max_depth=4")
    check_limit({"a": {"b": ({"c": []},)}}, Limits(max_depth=3), "max_depth=3")


def test_limit_max_items():
    encode(list(range(9)), limits=Limits(max_items=10))  # 9 ints + the list
    check_limit(list(range(10)), Limits(max_items=10), "max_items=10")
    check_limit({"a": {"b": [1, 2]}}, Limits(max_items=4), "max_items=4")


def test_limit_max_buffers():
    encode([torch.ones(1)] * 3, limits=Limits(max_buffers=3))
    check_limit([torch.ones(1)] * 4, Limits(max_buffers=3), "max_buffers=3")


def test_limit_max_total_bytes():
    encode(torch.ones(256, dtype=torch.uint8), limits=Limits(max_total_bytes=256))
    check_limit(
        [torch.ones(200, dtype=torch.uint8), np.ones(57, np.uint8)],
        Limits(max_total_bytes=256),
        "max_total_bytes=256",
    )


def test_limit_max_ndim():
    encode(torch.ones((1,) * 3), limits=Limits(max_ndim=3))
    check_limit(torch.ones((1,) * 4), Limits(max_ndim=3), "max_ndim=3")
    check_limit(np.ones((1,) * 4), Limits(max_ndim=3), "max_ndim=3")


def test_limit_max_skeleton_bytes():
    payload = {"k" * 50: "v" * 50}
    size = len(encode(payload).skeleton)
    encode(payload, limits=Limits(max_skeleton_bytes=size))
    check_limit(payload, Limits(max_skeleton_bytes=size - 1), "max_skeleton_bytes")


@pytest.mark.parametrize("value", ["x" * 11, b"x" * 11, "\u00e9" * 6])
def test_limit_max_str_bytes(value):
    encode(value[:5], limits=Limits(max_str_bytes=10))
    check_limit({"k": value}, Limits(max_str_bytes=10), "max_str_bytes=10")


def test_limits_reject_bad_values():
    with pytest.raises(PayloadError, match="max_depth"):
        Limits(max_depth=-1)
    with pytest.raises(PayloadError, match="max_items"):
        Limits(max_items=1.5)


def test_decode_frames_checks_buffer_count_and_bytes_before_parsing():
    with pytest.raises(PayloadError, match="max_buffers=2"):
        decode_frames([b"garbage"] + [b""] * 3, limits=Limits(max_buffers=2))
    with pytest.raises(PayloadError, match="max_total_bytes=10"):
        decode_frames([b"garbage", b"x" * 11], limits=Limits(max_total_bytes=10))


# -- malformed frames -----------------------------------------------------------------
FLOAT2 = struct.pack("<2f", 1.0, 2.0)


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([], "no frames"),
        ([123], "does not support the buffer protocol"),
        ([b""], "malformed skeleton"),
        ([b"\xc1"], "malformed skeleton"),
        ([b"\x93\xa4kvbw\x01"], "malformed skeleton"),  # truncated
        ([msgspec.msgpack.encode(["nope", 1, 0])], "bad magic"),
        ([msgspec.msgpack.encode({"a": 1})], "bad magic"),
        ([msgspec.msgpack.encode(["kvbw", 1])], "bad magic"),
        ([msgspec.msgpack.encode(["kvbw", 2, 0])], "unsupported payload version 2"),
        ([skeleton(tensor_ext(0, "float32", [2]))], "index 0 out of range"),
        ([skeleton(tensor_ext(-1, "float32", [2])), FLOAT2], "index -1 out of range"),
        ([skeleton([tensor_ext(0, "float32", [2])] * 2), FLOAT2], "referenced twice"),
        ([skeleton(None), FLOAT2], "buffer 0 is not referenced"),
        ([skeleton(tensor_ext(0, "float32", [3])), FLOAT2], r"needs 12 bytes, buffer has 8"),
        ([skeleton(tensor_ext(0, "float32", [-2])), FLOAT2], "bad dimension -2"),
        ([skeleton(tensor_ext(0, "float32", [2**64 - 1])), FLOAT2], "bad dimension"),
        ([skeleton(tensor_ext(0, "float32", [0, 2**62, 2**62])), b""], "overflows int64"),
        ([skeleton(tensor_ext(0, "float32", [1] * 9)), FLOAT2[:4]], "max_ndim"),
        ([skeleton(tensor_ext(0, "Tensor", [2])), FLOAT2], "not in the wire allow-list"),
        ([skeleton(tensor_ext(0, "__class__", [2])), FLOAT2], "not in the wire allow-list"),
        ([skeleton(tensor_ext(0, "float128", [1])), FLOAT2 * 2], "not in the wire allow-list"),
        ([skeleton(tensor_ext(0, "bfloat16", [4], code=2)), FLOAT2], "not available for numpy"),
        ([skeleton(tensor_ext(0, "bool", [2])), b"\x01\x02"], "bool data holds bytes"),
        ([skeleton(Ext(1, b"\x93")), FLOAT2], "malformed tensor reference"),
        ([skeleton(Ext(1, msgspec.msgpack.encode([0, 5, [2]]))), FLOAT2], "malformed tensor reference"),
        ([skeleton(Ext(1, msgspec.msgpack.encode([0, "float32", "2"]))), FLOAT2], "malformed tensor"),
        ([skeleton(Ext(9, b""))], "unknown extension type 9"),
        ([skeleton(Ext(3, b"x"))], "malformed tuple tag"),
        ([skeleton(Ext(3, b""))], "tuple tag outside"),
        ([skeleton([1, Ext(3, b"")])], "tuple tag outside"),
        ([skeleton({"k": Ext(4, b"\x80")})], "malformed KV header"),
        ([skeleton(Ext(-1, b"\x00\x00\x00\x01"))], "unexpected decoded type datetime"),
        ([b"\x93\xa4kvbw\x01\x81\x91\x01\x02"], "dict key of type tuple"),
        ([b"\x93\xa4kvbw\x01\x81\xc3\x01"], "dict key of type bool"),
        ([b"\x93\xa4kvbw\x01\x81\x80\x01"], "malformed skeleton"),  # unhashable map key
        ([b"\x93\xa4kvbw\x01\xcf\xff\xff\xff\xff\xff\xff\xff\xff"], "does not fit in int64"),
        ([b"\x93\xa4kvbw\x01" + b"\x91" * 100_000 + b"\xc0"], "nesting too deep|max_depth"),
    ],
)
def test_malformed_frames_raise_payload_error(frames, message):
    with pytest.raises(PayloadError, match=message):
        decode_frames(frames)


def test_decode_errors_name_the_path():
    sk = skeleton({"a": [0, {"b": tensor_ext(0, "float32", [3])}]})
    with pytest.raises(PayloadError, match=r"at payload\['a'\]\[1\]\['b'\]"):
        decode_frames([sk, FLOAT2])


def test_non_contiguous_frame_is_rejected():
    sk = skeleton(tensor_ext(0, "uint8", [2]))
    strided = memoryview(np.arange(4, dtype=np.uint8))[::2]
    with pytest.raises(PayloadError, match="not C-contiguous"):
        decode_frames([sk, strided])


# -- malformed packed buffers ---------------------------------------------------------
def packed_sample() -> bytes:
    return encode({"a": torch.arange(10, dtype=torch.int64), "b": np.ones(3, np.float32)}).to_bytes()


def rewrite(packed: bytes, fmt: str, offset: int, *values) -> bytes:
    buf = bytearray(packed)
    struct.pack_into(fmt, buf, offset, *values)
    return bytes(buf)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p[:10], "truncated"),
        (lambda p: p[:-1], "truncated"),
        (lambda p: b"XXXX" + p[4:], "bad magic"),
        (lambda p: b"KVBC" + p[4:], r"bad magic b'KVBC': not a packed payload$"),
        (lambda p: rewrite(p, "<H", 4, 2), "version 2"),
        (lambda p: rewrite(p, "<H", 6, 1), "flags"),
        (lambda p: rewrite(p, "<I", 8, 2**32 - 1), "max_buffers"),
        (lambda p: rewrite(p, "<I", 8, 1000), "overrun"),
        (lambda p: rewrite(p, "<I", 12, 2**32 - 1), "max_skeleton_bytes"),
        (lambda p: rewrite(p, "<I", 12, 10_000), "overrun"),
        (lambda p: rewrite(p, "<Q", 16, 2**64 - 1), "truncated"),
        (lambda p: rewrite(p, "<Q", 24, 65), "not 64-byte aligned"),
        (lambda p: rewrite(p, "<Q", 24, 0), "overlaps the skeleton"),
        (lambda p: rewrite(p, "<Q", 40, struct.unpack_from("<Q", p, 24)[0]), "overlaps"),
        (lambda p: rewrite(p, "<Q", 32, 2**63), "outside total_len"),
        (lambda p: rewrite(p, "<Q", 48, 13), "outside total_len|needs 12 bytes"),
        (lambda p: rewrite(p, "<Q", 48, 8), "needs 12 bytes, buffer has 8"),
    ],
)
def test_malformed_packed_raises_payload_error(mutate, message):
    with pytest.raises(PayloadError, match=message):
        decode_packed(mutate(packed_sample()))


def test_packed_buffer_count_and_total_checked_against_limits():
    packed = packed_sample()
    with pytest.raises(PayloadError, match="max_buffers=1"):
        decode_packed(packed, limits=Limits(max_buffers=1))
    with pytest.raises(PayloadError, match="max_total_bytes=50"):
        decode_packed(packed, limits=Limits(max_total_bytes=50))


def test_decode_packed_accepts_memoryview_and_numpy_buffers():
    packed = packed_sample()
    expected = {"a": torch.arange(10, dtype=torch.int64), "b": np.ones(3, np.float32)}
    assert_payload_equal(expected, decode_packed(memoryview(packed)))
    assert_payload_equal(expected, decode_packed(np.frombuffer(packed, np.uint8)))
    with pytest.raises(PayloadError, match="buffer protocol"):
        decode_packed("not a buffer")


@pytest.mark.parametrize("offset", [0, 64, 7])
def test_large_buffers_pack_at_the_right_place(offset):
    """Buffers >= 1 MiB take the GIL-free memmove path; check placement and neighbours."""
    payload = {"small": torch.arange(5), "big": random_tensor("float32", (3, 1 << 18), 9), "tail": np.ones(3)}
    enc = encode(payload)
    buf = bytearray(b"\xee" * (offset + enc.packed_size() + 64))
    enc.pack_into(buf, offset)
    assert buf[:offset] == b"\xee" * offset and buf[-64:] == b"\xee" * 64
    assert bytes(buf[offset:-64]) == enc.to_bytes()
    assert_payload_equal(payload, decode_packed(memoryview(buf)[offset:]))
