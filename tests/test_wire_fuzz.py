"""Hypothesis fuzzing of both decoders: only PayloadError, never a large allocation.

While each test runs, the process's address space is capped (soft RLIMIT_AS) at what it
already maps plus ``HEADROOM``, and the previous soft limit is restored afterwards (an
unprivileged process may raise its soft limit back up to the hard limit). A decoder that
sized an allocation from an unchecked wire field would then fail loudly (MemoryError or
torch's RuntimeError, which are not PayloadError) instead of passing on a machine with
plenty of memory; ``test_memory_cap_is_effective`` proves the cap bites. Examples are
derandomized so the suite is reproducible; set ``KVBRIDGE_FUZZ_EXAMPLES`` to fuzz longer.
"""

from __future__ import annotations

import os
import resource
import struct

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_codec_fixtures import kv_header, packed_device, rewrite_kv_header
from kv_codec_fixtures import packed as repack

from vllm_kvbridge.errors import PayloadError
from vllm_kvbridge.wire import KVCacheTransferData, decode_frames, decode_packed, encode
from vllm_kvbridge.wire.decode import decode_packed_device
from vllm_kvbridge.wire.testing import random_array, random_tensor

HEADROOM = 512 << 20
EXAMPLES = int(os.environ.get("KVBRIDGE_FUZZ_EXAMPLES", "300"))

fuzz_settings = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(autouse=True)
def memory_cap():
    """Lower the soft address-space limit for the duration of one test, then restore it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = mapped + HEADROOM
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# -- valid samples to mutate ------------------------------------------------------------
def _kv(num_layers=2):
    return KVCacheTransferData(
        "req-fuzz",
        {
            "key_cache": [random_tensor("bfloat16", (2, 1, 4), i) for i in range(num_layers)],
            "value_cache": [random_tensor("bfloat16", (2, 1, 4), 10 + i) for i in range(num_layers)],
        },
        block_ids=[1, 2],
        metadata={"a": [1, "x", None], "b": {"c": 1.5}},
        seq_len=2,
        block_size=16,
        tp_rank=0,
        tp_size=2,
        head_start=0,
        head_end=1,
        num_kv_heads_total=2,
    )


PAYLOADS = [
    {"t": random_tensor("float32", (3, 2), 1), "ids": [1, 2, 3], "done": False},
    {"nested": ({"a": (1, [2.5, b"x"])}, [], ()), 7: "k", "n": None},
    [
        random_tensor("bool", (5,), 2),
        random_array("int16", (2, 2), 3),
        random_tensor("float8_e4m3fn", (3,), 4),
    ],
    {"kv": _kv(1), "extra": torch.arange(3)},
]
PACKED = [encode(p).to_bytes() for p in PAYLOADS]
FRAMES = [encode(p).frames() for p in PAYLOADS]
KV_FRAMES = [encode(_kv(1)).frames(), encode(_kv(2)).frames(), encode(KVCacheTransferData("e", {})).frames()]
KV_PACKED = [repack(frames) for frames in KV_FRAMES]
INTERESTING = [
    0,
    1,
    2,
    7,
    8,
    63,
    64,
    65,
    255,
    2**15,
    2**16 - 1,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**40,
    2**62,
    2**63 - 1,
    2**63,
    2**64 - 1,
]


def expect_payload_error_only(fn, *args):
    """Run a decoder: success or PayloadError are fine, anything else fails the test."""
    try:
        return fn(*args)
    except PayloadError as exc:
        assert str(exc), "PayloadError without a message"
        return None


def decode_kv_device(data: bytes):
    """The device decoder over ``data``, whose head is its own first bytes (as packed)."""
    holder = torch.frombuffer(bytearray(data) or bytearray(1), dtype=torch.uint8)
    return decode_packed_device(data, holder[: len(data)])


@st.composite
def mutated(draw, samples):
    """A valid encoding with 1-4 mutations: bit flips, byte/field rewrites, truncation, splices."""
    buf = bytearray(draw(st.sampled_from(samples)))
    for _ in range(draw(st.integers(1, 4))):
        if not buf:
            break
        op = draw(st.sampled_from(["flip", "byte", "u16", "u32", "u64", "truncate", "insert", "delete"]))
        # Half the time aim at the prefix/table/header region, where the sizes live.
        hot = draw(st.booleans())
        limit = min(len(buf), 96) if hot else len(buf)
        pos = draw(st.integers(0, limit - 1))
        if op == "flip":
            buf[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte":
            buf[pos] = draw(st.integers(0, 255))
        elif op in ("u16", "u32", "u64"):
            size = {"u16": 2, "u32": 4, "u64": 8}[op]
            pos -= pos % size
            if pos + size <= len(buf):
                value = draw(st.sampled_from(INTERESTING) | st.integers(0, 2 ** (8 * size) - 1))
                buf[pos : pos + size] = (value % 2 ** (8 * size)).to_bytes(size, "little")
        elif op == "truncate":
            del buf[pos:]
        elif op == "insert":
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        else:
            del buf[pos : pos + draw(st.integers(1, 16))]
    return bytes(buf)


# -- the cap itself --------------------------------------------------------------------
def test_memory_cap_is_effective():
    with pytest.raises((MemoryError, RuntimeError)):
        torch.empty(4 << 30, dtype=torch.uint8)
    with pytest.raises(MemoryError):
        bytearray(4 << 30)


# -- random bytes ------------------------------------------------------------------------
@fuzz_settings
@given(st.binary(max_size=600))
def test_random_bytes(data):
    expect_payload_error_only(decode_packed, data)
    expect_payload_error_only(decode_kv_device, data)
    expect_payload_error_only(decode_frames, [data])
    expect_payload_error_only(decode_frames, [data, data])


@fuzz_settings
@given(
    st.sampled_from([b"KVBW\x01\x00\x00\x00", b"KVBC\x01\x00\x00\x00", b"\x93\xa4kvbw\x01"]),
    st.binary(max_size=400),
)
def test_random_bytes_behind_a_valid_magic(prefix, data):
    data = prefix + data
    expect_payload_error_only(decode_packed, data)
    expect_payload_error_only(decode_kv_device, data)
    expect_payload_error_only(decode_frames, [data, b"\x00" * 64])


# -- mutations of valid encodings ------------------------------------------------------
@fuzz_settings
@given(mutated(PACKED))
def test_mutated_packed_payloads(data):
    expect_payload_error_only(decode_packed, data)


@fuzz_settings
@given(mutated(KV_PACKED))
def test_mutated_packed_kv(data):
    expect_payload_error_only(decode_packed, data)
    expect_payload_error_only(decode_kv_device, data)


@fuzz_settings
@given(st.integers(0, len(FRAMES) - 1), st.data())
def test_mutated_skeletons(index, data):
    frames = FRAMES[index]
    skeleton = data.draw(mutated([bytes(frames[0])]))
    buffers = list(frames[1:])
    if buffers and data.draw(st.booleans()):  # also resize one buffer
        i = data.draw(st.integers(0, len(buffers) - 1))
        buffers[i] = bytes(buffers[i])[: data.draw(st.integers(0, len(buffers[i])))]
    expect_payload_error_only(decode_frames, [skeleton, *buffers])


# -- field rewrites with arbitrary msgpack values ------------------------------------
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.sampled_from(INTERESTING)
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.sampled_from(["float32", "bfloat16", "bool", "Tensor", "__class__", "", "float128"])
    | st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=8)),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=8,
)


def _paths(node, prefix=()):
    """Every (container, key) position inside a decoded msgpack tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield (node, key)
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield (node, i)
            yield from _paths(value, (*prefix, i))


#: Rewrite values: boundary ints (which size things) are drawn twice as often as
#: arbitrary msgpack values (which test the type checks).
boundary_ints = st.sampled_from([*INTERESTING, -1, -(2**63)])
rewrite_values = st.one_of(boundary_ints, boundary_ints, msgpack_values)


@fuzz_settings
@given(st.integers(0, len(KV_FRAMES) - 2), st.data())
def test_kv_header_field_rewrites(index, data):
    frames = KV_FRAMES[index]
    header = kv_header(frames)
    # Three pools so the fields that size things are hit often: top-level fields,
    # tensor-descriptor slots, and any position at all (metadata, block ids, ...).
    pools = [
        [(header, key) for key in header if key not in ("tensors", "metadata")],
        [(desc, i) for desc in header["tensors"] for i in range(len(desc))],
        list(_paths(header)),
    ]
    for _ in range(data.draw(st.integers(1, 2))):
        pool = data.draw(st.sampled_from([p for p in pools if p]))
        container, key = data.draw(st.sampled_from(pool))
        container[key] = data.draw(rewrite_values)
    rebuilt = rewrite_kv_header(frames, lambda h: h.update(header))
    expect_payload_error_only(decode_frames, rebuilt)
    expect_payload_error_only(decode_packed, repack(rebuilt))
    expect_payload_error_only(lambda: decode_packed_device(*packed_device(rebuilt)))


def _raw_ext(code, data):
    return msgspec.msgpack.Ext(code, bytes(data))


@fuzz_settings
@given(st.integers(0, len(FRAMES) - 1), st.data())
def test_skeleton_field_rewrites(index, data):
    frames = FRAMES[index]
    tree = msgspec.msgpack.decode(frames[0], ext_hook=_raw_ext)
    # Tensor references and KV headers are msgpack inside ext data: open some of them up.
    for container, key in list(_paths(tree)):
        value = container[key]
        if isinstance(value, msgspec.msgpack.Ext) and value.code in (1, 2, 4) and data.draw(st.booleans()):
            inner = msgspec.msgpack.decode(value.data)
            targets = list(_paths(inner))
            if targets:
                c, k = data.draw(st.sampled_from(targets))
                c[k] = data.draw(rewrite_values)
            container[key] = msgspec.msgpack.Ext(value.code, msgspec.msgpack.encode(inner))
    targets = list(_paths(tree))
    if data.draw(st.booleans()):
        container, key = data.draw(st.sampled_from(targets))
        container[key] = data.draw(rewrite_values)
    expect_payload_error_only(decode_frames, [msgspec.msgpack.encode(tree), *frames[1:]])


@fuzz_settings
@given(st.integers(0, len(PACKED) - 1), st.data())
def test_packed_table_rewrites(index, data):
    """Rewrite prefix and frame-table words of the packed payload with boundary values."""
    buf = bytearray(PACKED[index])
    n = struct.unpack_from("<I", buf, 8)[0]
    words = [(8, "<I"), (12, "<I"), (16, "<Q")] + [(24 + 8 * i, "<Q") for i in range(2 * n)]
    for _ in range(data.draw(st.integers(1, 3))):
        pos, fmt = data.draw(st.sampled_from(words))
        bits = 32 if fmt == "<I" else 64
        current = struct.unpack_from(fmt, buf, pos)[0]
        value = data.draw(
            st.sampled_from(INTERESTING)
            | st.integers(0, 2**bits - 1)
            | st.integers(-256, 256).map(lambda d, c=current: c + d)
        )
        struct.pack_into(fmt, buf, pos, value % 2**bits)
    result = expect_payload_error_only(decode_packed, bytes(buf))
    if result is not None:  # whatever decodes must only view bytes inside the buffer
        for value in result.values() if isinstance(result, dict) else result:
            if isinstance(value, torch.Tensor):
                assert value.numel() * value.element_size() <= len(buf)
            elif isinstance(value, np.ndarray):
                assert value.nbytes <= len(buf)
