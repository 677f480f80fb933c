"""The CUDA-IPC connector's parts that run without a GPU (issue 14 item 4).

On this machine (no CUDA) the connector must refuse at once, naming what to use instead,
and leave nothing behind. The packed layout in device memory it relies on
(``wire/device_pack.py``, ``decode_packed_device``) is plain torch on any device, so it
runs here on CPU tensors: byte for byte the host packing at every buffer, decoded
bit-exact as views of the buffer, a KV payload gathered straight into it from a paged
cache, and a head that does not match the buffer refused. The transfer itself between
two GPU processes is tests/gpu/test_cuda_ipc_cuda.py's (and the contract suite's, where
CUDA exists).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from connector_fixtures import same

from vllm_kvbridge.connectors.registry import create_connector
from vllm_kvbridge.errors import ConfigError, PayloadError
from vllm_kvbridge.kv.layout import KEY, VALUE, RequestGather, packed_layout
from vllm_kvbridge.wire import TORCH_DTYPES, KVCacheTransferData, decode_packed, encode
from vllm_kvbridge.wire.decode import decode_packed_device
from vllm_kvbridge.wire.device_pack import pack_into_device
from vllm_kvbridge.wire.fill import TensorFill


def _payload() -> dict:
    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for name, dtype in TORCH_DTYPES.items():
        raw = torch.randint(0, 256, (3, 5), generator=gen, dtype=torch.uint8)
        if dtype == torch.bool:
            tensors[name] = raw % 2 == 1
        elif dtype.itemsize == 1:
            tensors[name] = raw.view(dtype)
        else:
            tensors[name] = torch.randint(
                0, 256, (3, 5 * dtype.itemsize), generator=gen, dtype=torch.uint8
            ).view(dtype)
    return {
        "tensors": tensors,
        "empty": torch.empty(0, 4),
        "array": np.arange(12, dtype=np.int32).reshape(3, 4),
        "nested": [{"x": torch.arange(7.0)}, ("s", 1, None)],
        "blob": b"\x00\x01",
    }


def _packed(payload: object) -> tuple[torch.Tensor, bytes, bytearray]:
    enc = encode(payload)
    data = torch.full((enc.packed_size() + 64,), 0xAB, dtype=torch.uint8)
    head = pack_into_device(enc, data)
    host = bytearray(enc.packed_size())
    enc.pack_into(host)
    return data, head, host


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_the_connector_refuses_at_once_naming_what_to_use(tmp_path) -> None:
    for name in ("CudaIpcConnector", "cuda_ipc"):
        with pytest.raises(ConfigError, match=r"no CUDA device.*SharedMemoryConnector"):
            create_connector(name, {"namespace": "tcudaipc", "shm_dir": str(tmp_path)})
    assert os.listdir(tmp_path) == []


def test_device_packing_is_the_host_packing_at_every_buffer_and_decodes_bit_exact() -> None:
    payload = _payload()
    data, head, host = _packed(payload)
    assert bytes(host[: len(head)]) == head
    out = decode_packed_device(head, data)
    assert same(out, decode_packed(host)) and same(out["tensors"], payload["tensors"])
    # Every buffer's bytes are where the host layout has them, and tensors are views of them.
    start, end = data.data_ptr(), data.data_ptr() + data.numel()
    for t in out["tensors"].values():
        assert start <= t.data_ptr() < end
    x = out["nested"][0]["x"]
    offset = x.data_ptr() - start
    assert bytes(data[offset : offset + x.nbytes].numpy()) == bytes(host[offset : offset + x.nbytes])
    assert isinstance(out["array"], np.ndarray) and np.array_equal(out["array"], payload["array"])
    copied = decode_packed_device(head, data, copy=True)["nested"][0]["x"]
    assert copied.data_ptr() != x.data_ptr() and torch.equal(copied, x)


def test_a_kv_gather_writes_straight_into_the_device_buffer() -> None:
    """The KV sender's TensorFill sources gather from the paged cache into the buffer's
    ranges (no staging tensor: the fill's device is the buffer's)."""
    layers, blocks, heads, block, dim = 2, 8, 2, 4, 8
    gen = torch.Generator().manual_seed(9)
    caches = [torch.randn(blocks, heads, block, 2 * dim, generator=gen) for _ in range(layers)]
    block_ids, seq_len = [5, 2, 7], 10
    # vLLM's CUDA backends' logical view (HND order): K then V packed in the last dim
    layout = packed_layout(heads, dim, block, torch.float32, physical_order="LBHNC")
    gather = RequestGather(caches, layout, block_ids, seq_len, head_start=0, head_end=heads)
    staged: list[int] = []

    def fills(kind: int) -> list:
        def fill(layer: int, out: torch.Tensor) -> None:
            staged.append(out.data_ptr())
            gather.write(layer, kind, out)

        return [
            TensorFill(gather.shapes[kind], gather.dtype, lambda out, i=i: fill(i, out), gather.device)
            for i in range(layers)
        ]

    kv = KVCacheTransferData(
        request_id="r",
        layer_blocks={"key_cache": fills(KEY), "value_cache": fills(VALUE)},
        block_ids=block_ids,
        seq_len=seq_len,
        block_size=block,
    )
    enc = encode(kv)
    data = torch.empty(enc.packed_size(), dtype=torch.uint8)
    head = pack_into_device(enc, data)
    assert len(staged) == 2 * layers
    assert all(data.data_ptr() <= p < data.data_ptr() + data.numel() for p in staged)
    got = decode_packed_device(head, data)
    for layer in range(layers):
        pages = caches[layer][block_ids].permute(0, 2, 1, 3).reshape(-1, heads, 2 * dim)[:seq_len]
        assert torch.equal(got.key_cache[layer], pages[..., :dim])
        assert torch.equal(got.value_cache[layer], pages[..., dim:])


def test_a_head_that_does_not_match_its_buffer_is_refused() -> None:
    payload = {"a": torch.arange(100, dtype=torch.int64), "b": torch.ones(3, dtype=torch.bool)}
    data, head, _ = _packed(payload)
    with pytest.raises(PayloadError, match="head truncated"):
        decode_packed_device(head[:-3], data)
    with pytest.raises(PayloadError, match="truncated"):
        decode_packed_device(head, data[: len(head) + 8])  # the buffers are not all there
    with pytest.raises(PayloadError, match="1-D uint8"):
        decode_packed_device(head, data.view(torch.int8))
    flag = decode_packed_device(head, data)["b"]
    offset = flag.data_ptr() - data.data_ptr()
    data[offset] = 7  # not a bool byte
    with pytest.raises(PayloadError, match="bool"):
        decode_packed_device(head, data)
    with pytest.raises(PayloadError, match="too small"):
        pack_into_device(encode(payload), torch.empty(16, dtype=torch.uint8))


def test_a_fill_encodes_as_a_tensor_written_where_the_payload_is_packed() -> None:
    """How the connector's put keeps a device tensor on the device: a TensorFill in a
    payload, copied by the fill straight into the buffer's range (host or device)."""
    src = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    written: list[int] = []

    def fill(out: torch.Tensor) -> None:
        written.append(out.data_ptr())
        out.copy_(src)

    payload = {"x": TensorFill(tuple(src.shape), src.dtype, fill, src.device), "n": 1}
    enc = encode(payload)
    host = bytearray(enc.packed_size())
    enc.pack_into(host)
    assert torch.equal(decode_packed(host)["x"], src)
    data = torch.empty(enc.packed_size(), dtype=torch.uint8)
    got = decode_packed_device(pack_into_device(enc, data), data)
    assert torch.equal(got["x"], src) and got["x"].data_ptr() == written[-1]
