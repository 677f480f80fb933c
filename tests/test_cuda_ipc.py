"""The CUDA-IPC connector's parts that run without a GPU (issue 14 item 4).

On this machine (no CUDA) the connector must refuse at once, naming what to use instead,
and leave nothing behind. The packed layout in device memory it relies on
(``wire/device_pack.py``, ``decode_packed_device``) is plain torch on any device, so it
runs here on CPU tensors: byte for byte the host packing at every buffer, decoded
bit-exact as views of the buffer, a KV payload gathered straight into it from a paged
cache, and a head that does not match the buffer refused. The transfer itself between
two GPU processes is tests/gpu/test_cuda_ipc_cuda.py's (and the contract suite's, where
CUDA exists). Also the pure logic of pairing two stages' GPUs (``config/gpu_pairing.py``): a
receiver given the sender's GPU after its own, found by UUID, and stages that cannot be
paired refused when the config is resolved, naming the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from connector_fixtures import same

from vllm_kvbridge.connectors.registry import create_connector
from vllm_kvbridge.errors import ConfigError, PayloadError, TransferRefused
from vllm_kvbridge.kv.layout import packed_layout
from vllm_kvbridge.kv.paged import RequestGather
from vllm_kvbridge.wire import TORCH_DTYPES, KVCacheTransferData, decode_packed, encode
from vllm_kvbridge.wire.decode import decode_packed_device
from vllm_kvbridge.wire.device_pack import pack_into_device
from vllm_kvbridge.wire.fill import TensorFill
from vllm_kvbridge.wire.kv_format import KEY, VALUE


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
            TensorFill(gather.shape(0, kind), gather.dtype, lambda out, i=i: fill(i, out), gather.device)
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


# -- pairing the GPUs of two stages (issue item 3) ---------------------------------------
# A receiver opens the sender's buffer on the sender's GPU, so its process must see that
# GPU; stages pin GPUs with `devices` (their CUDA_VISIBLE_DEVICES), so the resolver gives a
# CUDA-IPC receiver the sender's GPU(s) after its own, and refuses at config time where it
# cannot (never one failed request after another).


def test_the_receiver_sees_its_own_gpus_first_and_the_senders_after() -> None:
    from vllm_kvbridge.config.gpu_pairing import cuda_ipc_visible_devices

    assert cuda_ipc_visible_devices("1", "0") == "1,0"  # its cuda:0 stays its own GPU
    assert cuda_ipc_visible_devices("2,3", "0,1") == "2,3,0,1"  # TP on both sides
    assert cuda_ipc_visible_devices(" 1 ", "1, 0") == "1,0"
    assert cuda_ipc_visible_devices("0", "0") == "0"  # one GPU: nothing to add
    assert cuda_ipc_visible_devices(None, "1") is None  # it sees every GPU already
    assert cuda_ipc_visible_devices(None, None) is None
    uuids = ("GPU-8932f937-d72c-4106-c12f-20bd9faed9f6", "GPU-a1b2c3d4-0000-1111-2222-333344445555")
    assert cuda_ipc_visible_devices(uuids[1], uuids[0]) == f"{uuids[1]},{uuids[0]}"


def test_stages_whose_gpus_cannot_be_paired_are_refused_at_config_time_naming_the_fix() -> None:
    from vllm_kvbridge.config.gpu_pairing import cuda_ipc_visible_devices

    with pytest.raises(ConfigError, match=r"stage 1.*stage 0.*sets no devices.*devices: \"0\""):
        cuda_ipc_visible_devices("1", None, receiver="stage 1", sender="stage 0")
    with pytest.raises(ConfigError, match=r"hides every GPU"):
        cuda_ipc_visible_devices("", "0")
    with pytest.raises(ConfigError, match=r"one form"):
        cuda_ipc_visible_devices("1", "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6")
    with pytest.raises(ConfigError, match=r"MIG.*SharedMemoryConnector"):
        cuda_ipc_visible_devices("MIG-aaaa", "MIG-bbbb")
    assert cuda_ipc_visible_devices("MIG-aaaa", "MIG-aaaa") == "MIG-aaaa"


def _cuda_ipc_config(tmp_path, devices: dict[int, str]) -> str:  # type: ignore[no-untyped-def]
    """The shipped CUDA-IPC stage config with ``devices`` set on the given stages."""
    import yaml

    doc = yaml.safe_load(CUDA_IPC_CONFIG.read_text())
    for stage in doc["stages"]:
        if stage["stage_id"] in devices:
            stage["devices"] = devices[stage["stage_id"]]
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


CUDA_IPC_CONFIG = Path(__file__).resolve().parent.parent / "stage_configs" / "ar_to_dit_cuda_ipc.yaml"


def test_a_resolved_pipeline_gives_the_receiving_stage_the_senders_gpu(tmp_path) -> None:
    from vllm_kvbridge.config.gpu_pairing import pair_cuda_ipc_devices
    from vllm_kvbridge.config.resolve import resolve

    plan = resolve(_cuda_ipc_config(tmp_path, {0: "0", 1: "1"}))  # the resolver pairs them
    assert [s.devices for s in plan.stages] == ["0", "1,0"]
    assert [s.devices for s in pair_cuda_ipc_devices(plan.stages)] == ["0", "1,0"]  # idempotent
    unpinned = resolve(_cuda_ipc_config(tmp_path, {}))  # the shipped config: one GPU
    assert [s.devices for s in unpinned.stages] == [None, None]
    with pytest.raises(ConfigError, match=r"stage 1.*stage 0.*sets no devices"):
        resolve(_cuda_ipc_config(tmp_path, {1: "1"}))


def test_the_senders_gpu_is_found_by_uuid_and_a_missing_one_names_the_fix() -> None:
    from vllm_kvbridge.connectors.cuda_ipc_devices import local_gpu_index

    visible = ["a1b2c3d4-0000-1111-2222-333344445555", "8932f937-d72c-4106-c12f-20bd9faed9f6"]
    # Another process numbers the GPUs otherwise: the UUID, not the index, says which.
    assert local_gpu_index("k", "8932f937-d72c-4106-c12f-20bd9faed9f6", visible) == 1
    assert local_gpu_index("k", "GPU-8932F937-D72C-4106-C12F-20BD9FAED9F6", visible) == 1
    with pytest.raises(TransferRefused, match=r"not visible.*devices.*cuda_ipc_visible_devices"):
        local_gpu_index("k", "ffffffff-d72c-4106-c12f-20bd9faed9f6", visible)


def test_the_cuda_ipc_stage_config_carries_no_cpu_only_engine_defaults() -> None:
    """fp32, eager mode and a short context are the CPU build's needs (the resolver adds
    them there); on a GPU they would only slow the LLM stage down."""
    import yaml

    doc = yaml.safe_load(CUDA_IPC_CONFIG.read_text())
    for stage in doc["stages"]:
        args = stage.get("engine_args") or {}
        assert not set(args) & {"enforce_eager", "dtype", "max_model_len"}, stage["stage_id"]
