"""The wire fast paths keep every check: memoised shapes, batched descriptor checks,
copies from ``data_ptr``, one-``frombuffer`` views of packed buffers.

Each test pins a place where a fast path could accept what the scalar path rejects (or
build something different from it).
"""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
import torch
from kv_codec_fixtures import packed, rewrite_kv_header

from vllm_kvbridge.errors import PayloadError
from vllm_kvbridge.wire import (
    KVCacheTransferData,
    Limits,
    decode_frames,
    decode_packed,
    encode,
    tensors_bitwise_equal,
)
from vllm_kvbridge.wire._buffers import GIL_FREE_COPY, check_shape, check_wire_shape
from vllm_kvbridge.wire.dtypes import ITEMSIZE, TORCH_DTYPES
from vllm_kvbridge.wire.kv_format import KVHeader, TensorDesc, validate_header
from vllm_kvbridge.wire.limits import DEFAULT_LIMITS
from vllm_kvbridge.wire.testing import assert_payload_equal, random_tensor


def kv_payload(layers: int = 28, shape=(2, 4, 8), dtype: str = "bfloat16") -> dict[str, list[torch.Tensor]]:
    return {
        "key_cache": [random_tensor(dtype, shape, 2 * i) for i in range(layers)],
        "value_cache": [random_tensor(dtype, shape, 2 * i + 1) for i in range(layers)],
    }


# -- memoised shape check --------------------------------------------------------------
def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except PayloadError as exc:
        return ("error", str(exc))


def test_memoised_shape_check_agrees_with_the_scalar_check():
    rng = random.Random(0)
    dims = [0, 1, 2, 3, 7, 64, 2**31, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63)]
    limits = [DEFAULT_LIMITS, Limits(max_ndim=2)]
    for _ in range(3000):
        shape = [rng.choice(dims) for _ in range(rng.randint(0, 4))]
        dtype = rng.choice([*TORCH_DTYPES, "float128"])
        numel = int(np.prod(shape, dtype=object)) if shape else 1
        nbytes = rng.choice([numel * ITEMSIZE.get(dtype, 1), 0, 8, numel])
        lim = rng.choice(limits)
        # Twice: the second call is answered from the cache when the first passed.
        for _ in range(2):
            fast = _outcome(check_wire_shape, shape, dtype, nbytes, lim, "t")
            slow = _outcome(check_shape, shape, dtype, nbytes, lim, "t")
            assert fast[0] == slow[0], (shape, dtype, nbytes, lim.max_ndim)
            if fast[0] == "ok":
                assert fast[1][0] == slow[1]
            else:
                assert fast[1] == slow[1]


def test_memoised_shape_check_is_keyed_on_nbytes_and_the_ndim_limit():
    assert check_wire_shape([2, 3], "float32", 24, DEFAULT_LIMITS, "t") == ((2, 3), (3, 1))
    with pytest.raises(PayloadError, match="needs 24 bytes, buffer has 20"):
        check_wire_shape([2, 3], "float32", 20, DEFAULT_LIMITS, "t")
    with pytest.raises(PayloadError, match="max_ndim=1"):
        check_wire_shape([2, 3], "float32", 24, Limits(max_ndim=1), "t")
    # Decoding the same payload under a lower limit still fails after a cached success.
    enc = encode({"x": torch.ones(2, 3)})
    decode_frames(enc.frames())
    with pytest.raises(PayloadError, match="max_ndim=1"):
        decode_frames(enc.frames(), limits=Limits(max_ndim=1))


def test_contiguous_strides_match_torch():
    for shape in [(), (5,), (2, 3), (4, 0, 3), (1, 1, 7), (3, 4, 5, 6)]:
        _, strides = check_wire_shape(list(shape), "int8", int(np.prod(shape)), DEFAULT_LIMITS, "t")
        assert strides == torch.empty(shape).stride()


# -- batched KV descriptor checks ------------------------------------------------------
def _header(**overrides) -> KVHeader:
    fields = dict(
        request_id="r",
        num_layers=2,
        tensors=[TensorDesc(0, 0, "float32", [2, 3], 0, 24), TensorDesc(0, 1, "float32", [2, 3], 64, 24)],
        block_ids=[],
        seq_len=None,
        block_size=None,
        tp_rank=0,
        tp_size=1,
        head_start=None,
        head_end=None,
        num_kv_heads_total=None,
        metadata={},
    )
    fields.update(overrides)
    return KVHeader(**fields)


@pytest.mark.parametrize(
    ("desc", "message"),
    [
        (TensorDesc(True, 1, "float32", [2, 3], 64, 24), "layer True outside"),
        (TensorDesc(0, True, "float32", [2, 3], 64, 24), "kind True is neither"),
        (TensorDesc(0, 1, "float32", [True, 6], 64, 24), "bad dimension True"),
        (TensorDesc(0, 1, "float32", "23", 64, 24), "shape must be a list of ints, got str"),
        (TensorDesc(0, 1, 5, [2, 3], 64, 24), "dtype 5 is not in the wire allow-list"),
        (TensorDesc(0, 1, "float32", [2, 3], 64, 24.0), r"nbytes must be an int"),
        (TensorDesc(0, 1, "float32", [2, 3], True, 24), r"offset must be an int"),
    ],
)
def test_hand_built_headers_with_wrong_types_are_rejected(desc, message):
    validate_header(_header(), DEFAULT_LIMITS)  # control; also warms the shape cache
    h = _header(tensors=[TensorDesc(0, 0, "float32", [2, 3], 0, 24), desc])
    with pytest.raises(PayloadError, match=message):
        validate_header(h, DEFAULT_LIMITS)


def test_hand_built_headers_the_scalar_checks_accept_are_accepted():
    # A tuple shape (never produced by a decode) passes check_shape; the batched check
    # must not turn it into an error.
    descs = [TensorDesc(0, 0, "float32", (2, 3), 0, 24), TensorDesc(0, 1, "float32", [2, 3], 64, 24)]
    h = _header(tensors=descs)
    assert [c[0] for c in validate_header(h, DEFAULT_LIMITS)] == [(2, 3), (2, 3)]


def test_descriptor_errors_name_the_first_bad_descriptor():
    descs = [TensorDesc(layer, kind, "float32", [2, 3], 0, 24) for layer in range(2) for kind in (0, 1)]
    descs[3] = TensorDesc(1, 1, "float32", [3, 2], 0, 24)
    with pytest.raises(PayloadError, match=r"layer 1: key shape \[2, 3\] and value shape \[3, 2\] differ"):
        validate_header(_header(tensors=descs), DEFAULT_LIMITS)
    descs[3] = TensorDesc(1, 0, "float32", [2, 3], 0, 24)
    with pytest.raises(PayloadError, match=r"duplicate descriptor for key_cache\[1\]"):
        validate_header(_header(tensors=descs), DEFAULT_LIMITS)
    descs[3] = TensorDesc(1, 1, "float32", [2, 3], 0, 24)
    with pytest.raises(PayloadError, match="max_total_bytes=95"):
        validate_header(_header(tensors=descs), Limits(max_total_bytes=95))
    validate_header(_header(tensors=descs), Limits(max_total_bytes=96))


def test_kv_with_buffer_indices_out_of_order_still_decodes():
    kv = KVCacheTransferData("r", kv_payload(layers=2, dtype="float32"))
    frames = encode(kv).frames()

    def swap(h):  # same sizes: point key_cache[0] and value_cache[1] at each other's bytes
        a, b = h["tensors"][0], h["tensors"][3]
        a[4], b[4] = b[4], a[4]

    swapped = rewrite_kv_header(frames, swap)
    for out in (decode_frames(swapped), decode_packed(packed(swapped))):
        assert tensors_bitwise_equal(out.key_cache[0], kv.value_cache[1])
        assert tensors_bitwise_equal(out.value_cache[1], kv.key_cache[0])
        assert tensors_bitwise_equal(out.key_cache[1], kv.key_cache[1])

    def overlap(h):  # out of order and sharing a buffer
        h["tensors"][3][4] = h["tensors"][1][4]

    shared = rewrite_kv_header(frames, overlap)
    for decode in (decode_frames, lambda f: decode_packed(packed(f))):
        with pytest.raises(PayloadError, match="buffer 1 is referenced twice"):
            decode(shared)


def test_packed_kv_views_share_one_buffer_and_keep_it_alive():
    kv = KVCacheTransferData("r", kv_payload(layers=3, dtype="float16"))
    buf = bytearray(encode(kv).to_bytes())
    out = decode_packed(buf)
    base = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    for t in [*out.key_cache, *out.value_cache]:
        assert base <= t.data_ptr() < base + len(buf) and t.is_contiguous()
    out.key_cache[2][0, 0, 0] = 7.0  # writes through to the buffer
    assert decode_packed(buf).key_cache[2][0, 0, 0].item() == 7.0
    kept = out.value_cache[1]
    del out, buf
    assert tensors_bitwise_equal(kept, kv.value_cache[1])


def test_packed_decode_of_mixed_dtypes_builds_exact_views():
    payload = {name: random_tensor(name, (3, 5), i) for i, name in enumerate(TORCH_DTYPES)}
    payload["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    payload["empty"] = torch.empty(0, 4, dtype=torch.complex128)
    payload["np"] = np.arange(12, dtype=np.int16).reshape(3, 4)
    enc = encode(payload)
    buf = bytearray(enc.packed_size() + 3)
    enc.pack_into(buf)
    out = decode_packed(buf)
    assert_payload_equal(payload, out)
    bad = bytearray(buf)
    offset = struct.unpack_from("<Q", bad, 24)[0]  # buffer 0 is the bool tensor
    bad[offset] = 2
    with pytest.raises(PayloadError, match=r"bool data holds bytes other than 0 and 1 at payload\['bool'\]"):
        decode_packed(bad)


# -- encode: copies straight from the tensor -------------------------------------------
def test_pack_into_notices_a_tensor_changed_in_place_after_encode():
    t = torch.arange(256, dtype=torch.float32)
    enc = encode({"t": t})
    t.resize_(1 << 20)  # bigger: a copy of the old size would read the wrong bytes
    with pytest.raises(PayloadError, match="changed in place after encode"):
        enc.pack_into(bytearray(1 << 16))
    u = torch.arange(256, dtype=torch.float32)
    enc = encode({"u": u})
    u.as_strided_((128,), (2,))
    with pytest.raises(PayloadError, match="changed in place after encode"):
        enc.pack_into(bytearray(1 << 16))


@pytest.mark.parametrize("sizes", [[1024, 3 * GIL_FREE_COPY // 2, 64, 0, GIL_FREE_COPY, 7]])
def test_pack_into_mixes_small_and_large_copies_and_the_buffers_view(sizes):
    payload = [random_tensor("uint8", (n,), i) for i, n in enumerate(sizes)]
    payload.append(torch.arange(10)[::2])  # not contiguous: copied once at encode
    payload.append(torch.randn(3, dtype=torch.complex64).conj())  # conj bit: resolved at encode
    enc = encode(payload)
    packed = bytearray(enc.packed_size())
    enc.pack_into(packed)
    assert bytes(packed) == enc.to_bytes()  # to_bytes goes through the lazily built views
    assert [b.nbytes for b in enc.buffers] == [*sizes, 40, 24]
    out = decode_packed(packed)
    assert_payload_equal([*payload[:-2], payload[-2].contiguous(), payload[-1].resolve_conj()], out)


def test_subclass_tensors_take_the_checked_path():
    p = torch.nn.Parameter(torch.randn(4, 4))
    out = decode_packed(encode({"p": p}).to_bytes())
    assert type(out["p"]) is torch.Tensor and torch.equal(out["p"], p.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64])
def test_grad_tensors_encode_without_a_copy_for_every_path(dtype):
    t = torch.randn(4, 3, dtype=dtype, requires_grad=True)
    enc = encode({"t": t})
    assert np.frombuffer(enc.buffers[0], dtype=np.uint8).ctypes.data == t.data_ptr()
    expected = {"t": t.detach()}
    assert_payload_equal(expected, decode_frames(enc.frames()))
    assert_payload_equal(expected, decode_packed(enc.to_bytes()))
    buf = bytearray(enc.packed_size())
    enc.pack_into(buf)
    assert_payload_equal(expected, decode_packed(buf))
