"""LEADER -> FOLLOWER distribution's packing (kv/distribution.py) without a process group:
each cache travels in the payload codec's packed layout plus its head; the gloo tests
(tests/test_kv_tp.py, tests/test_dit_cfg*.py) run the whole protocol."""

from __future__ import annotations

import pytest
import torch

from vllm_kvbridge.errors import PayloadError
from vllm_kvbridge.kv.distribution import pack_kv, unpack_kv
from vllm_kvbridge.wire import KVCacheTransferData, decode_packed, encode
from vllm_kvbridge.wire.dtypes import TORCH_DTYPES
from vllm_kvbridge.wire.fill import TensorFill
from vllm_kvbridge.wire.testing import random_tensor

CPU = torch.device("cpu")
#: A TP slice, so the slice fields travel too.
TP_SLICE = {"tp_rank": 1, "tp_size": 2, "head_start": 2, "head_end": 4, "num_kv_heads_total": 4}


def make_kv(dtype: str = "bfloat16", rid: str = "req-7", **kw) -> KVCacheTransferData:
    base = random_tensor(dtype, (2, 6, 4), seed=5)
    return KVCacheTransferData(
        rid,
        {
            # a missing layer, a non-contiguous key and an empty layer travel too
            "key_cache": [
                random_tensor(dtype, (6, 2, 4), seed=1),
                None,
                base.transpose(0, 1),
                torch.empty(0, 2, 4, dtype=TORCH_DTYPES[dtype]),
            ],
            "value_cache": [
                random_tensor(dtype, (6, 2, 4), seed=2),
                None,
                random_tensor(dtype, (6, 2, 4), seed=3),
            ],
        },
        block_ids=[3, 4],
        metadata={"purpose": "cfg_neg", "x": [1, None]},
        seq_len=6,
        block_size=16,
        **TP_SLICE,
        **kw,
    )


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_pack_unpack_round_trips_bit_exact_as_views_of_the_packed_tensor(dtype):
    kv = make_kv(dtype)
    head, packed = pack_kv(kv, CPU)
    assert head.dtype == packed.dtype == torch.uint8 and head.device == packed.device == CPU
    # the codec's layout, byte for byte: the host decoder reads the same tensor
    assert kv.equals(decode_packed(packed.numpy()))
    assert bytes(packed[: head.numel()].numpy()) == bytes(head.numpy())
    out = unpack_kv(head, packed, "req-7")
    assert kv.equals(out)
    storage = packed.untyped_storage().data_ptr()
    for t in out.key_cache + out.value_cache:
        assert t is None or t.numel() == 0 or t.untyped_storage().data_ptr() == storage


def test_pack_copies_each_tensor_once_into_the_packed_tensor():
    kv = make_kv("float32")
    head, packed = pack_kv(kv, CPU)
    # the fills are the packing's own: the caller's data keeps its tensors
    assert all(type(t) is not TensorFill for t in kv.key_cache + kv.value_cache)
    enc = encode(kv)
    assert packed.numel() == enc.packed_size()
    host = bytearray(enc.packed_size())
    enc.pack_into(host)
    assert bytes(head.numpy()) == bytes(host[: head.numel()])  # same head as the host packer


def test_pack_keeps_fills_and_writes_them_once():
    calls = []
    src = random_tensor("float16", (3, 1, 2), seed=9)

    def fill(out):
        calls.append(out.device)
        out.copy_(src)

    kv = KVCacheTransferData("f", {"key_cache": [TensorFill((3, 1, 2), torch.float16, fill)]})
    head, packed = pack_kv(kv, CPU)
    assert calls == [CPU]
    assert torch.equal(unpack_kv(head, packed, "f").key_cache[0], src)


def test_unpack_rejects_another_request_id():
    head, packed = pack_kv(make_kv("float32"), CPU)
    with pytest.raises(PayloadError, match="request id mismatch: buffer holds 'req-7', expected 'other'"):
        unpack_kv(head, packed, "other")


def test_unpack_rejects_a_payload_that_is_not_a_cache():
    enc = encode({"not": "kv"})
    packed = torch.empty(enc.packed_size(), dtype=torch.uint8)
    enc.pack_into(packed.numpy())
    head = packed[:64].clone()
    with pytest.raises(PayloadError, match="expected a KV cache, got dict"):
        unpack_kv(head, packed, "r")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda h, p: (h[:10], p), "truncated"),
        (lambda h, p: (h, p[:-1]), "truncated"),
        (lambda h, p: (torch.cat([torch.tensor(list(b"XXXX"), dtype=torch.uint8), h[4:]]), p), "bad magic"),
    ],
)
def test_unpack_rejects_corrupt_or_truncated_input(mutate, message):
    head, packed = pack_kv(make_kv("float32"), CPU)
    head, packed = mutate(head, packed)
    with pytest.raises(PayloadError, match=message):
        unpack_kv(head, packed, "req-7")
