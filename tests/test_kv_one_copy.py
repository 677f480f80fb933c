"""The sender's one-copy KV path: gather straight into the connector's destination.

Every connector lends its own memory (a shared-memory segment, a registered slab of the
Mooncake store, transfer engine or NIXL, the buffer ZMQ serves from) and receives the KV
bit-exact for every page format, for lengths that are not a multiple of the block size and
for TP-sliced sends; and the sender moves the KV bytes exactly once (counted at the torch
dispatcher and at the codec's memmove), where the old path copied them three times (pages,
dense tensors, segment)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from connector_fixtures import SPECS_BY_NAME
from kv_fixtures import BLOCK, HEAD, NUM_LAYERS, reference_gather, vllm_layer_views
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_kvbridge.connectors.base import HeapReservation, LentReservation, PutResult
from vllm_kvbridge.kv.config import KVTransferConfig
from vllm_kvbridge.kv.layout import KVCacheLayout, KVContent, cpu_layout, packed_layout
from vllm_kvbridge.kv.manager import KVTransferManager
from vllm_kvbridge.wire import codec

pytest_plugins = ["connector_fixtures"]  # token, and a real mooncake_master per test
# slow: every connector with real KV, a mooncake_master per Mooncake row, ~50 s in all
pytestmark = [pytest.mark.forked, pytest.mark.slow]

HEADS = 4
NUM_BLOCKS = 16
#: seq_len, block ids: one token, a partial block, exactly whole blocks, whole + partial
PLANS = {
    "one": (1, [7]),
    "partial": (BLOCK - 5, [3]),
    "whole": (2 * BLOCK, [9, 2]),
    "mixed": (3 * BLOCK + 11, [11, 0, 5, 14]),
}


def _amx_reference(cache: torch.Tensor, block_ids: list[int], seq_len: int, hs: int, he: int) -> Any:
    """Token by token from the amx tile format (K ``[N/16, D/2, 16, 2]``, V ``[D/16, N/2, 16, 2]``)."""
    n, d = BLOCK, HEAD
    k = torch.empty(seq_len, he - hs, d, dtype=cache.dtype)
    v = torch.empty(seq_len, he - hs, d, dtype=cache.dtype)
    for t in range(seq_len):
        block, p = block_ids[t // n], t % n
        for h in range(hs, he):
            page = cache[block, h].reshape(-1)
            for c in range(d):
                k[t, h - hs, c] = page[((p // 16) * (d // 2) + c // 2) * 32 + (p % 16) * 2 + c % 2]
                v[t, h - hs, c] = page[n * d + ((c // 16) * (n // 2) + p // 2) * 32 + (c % 16) * 2 + p % 2]
    return k, v


def _caches(kind: str) -> tuple[list[torch.Tensor], KVCacheLayout]:
    """Per-layer caches of one page format, random contents (exact copies are checked)."""
    gen = torch.Generator().manual_seed(5)
    if kind.startswith("packed-"):  # a CUDA backend's format, in one of vLLM's physical orders
        order = kind.removeprefix("packed-")
        views = vllm_layer_views(order, NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, HEAD, torch.float16)
        return views, packed_layout(HEADS, HEAD, BLOCK, torch.float16, physical_order=order)
    dtype = torch.bfloat16 if kind == "cpu-amx" else torch.float32
    caches = [
        torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=gen).to(dtype) for _ in range(NUM_LAYERS)
    ]
    return caches, cpu_layout(HEADS, HEAD, BLOCK, dtype, isa="amx" if kind == "cpu-amx" else "vec")


def _reference(caches: list[torch.Tensor], layout: KVCacheLayout, plan: tuple[int, list[int]], heads: range):
    seq_len, block_ids = plan
    out = []
    for cache in caches:
        if layout.content is KVContent.CPU_AMX:
            out.append(_amx_reference(cache, block_ids, seq_len, heads.start, heads.stop))
        else:
            out.append(reference_gather(cache, layout, block_ids, seq_len, heads.start, heads.stop))
    return out


def _managers(
    name: str, token: str, to_tp: int, **send: Any
) -> tuple[KVTransferManager, list[KVTransferManager]]:
    spec = SPECS_BY_NAME[name]
    edge = {"connector": name, "connector_config": spec.config(token), "from_tp": 1, "to_tp": to_tp}
    sender = KVTransferManager(
        KVTransferConfig(need_send_cache=True, stage_id=0, to_stage=1, **edge, **send), num_kv_heads=HEADS
    )
    receivers = [
        KVTransferManager(
            KVTransferConfig(need_recv_cache=True, stage_id=1, from_stage=0, recv_timeout=20, **edge),
            num_kv_heads=HEADS,
            tp_rank=rank,
        )
        for rank in range(to_tp)
    ]
    return sender, receivers


def _send_all(
    sender: KVTransferManager, caches: list[torch.Tensor], layout: KVCacheLayout, prefix: str = ""
) -> None:
    """Send every plan of :data:`PLANS` (request ids ``prefix + name``) and wait until sent."""
    # blocks_held: the caches outlive the sends, so a staged gather may run on the copy thread
    plans = {
        prefix + rid: {"block_ids": ids, "seq_len": n, "blocks_held": True} for rid, (n, ids) in PLANS.items()
    }
    sender.layout = layout
    assert sorted(sender.handle_finished_requests_kv_transfer(plans, caches, BLOCK, "auto")) == sorted(plans)
    _wait_sent(sender, set(plans))


def _wait_sent(sender: KVTransferManager, request_ids: set[str]) -> None:
    """Until the sends of ``request_ids`` completed (each reported once); none may fail."""
    done: set[str] = set()
    while not request_ids <= done:
        d, failed = sender.get_finished()
        assert not failed, {rid: sender.send_failure_reason(rid) for rid in failed}
        done |= d
        time.sleep(0.005)


def _assert_all_received(
    receiver: KVTransferManager, caches: list[torch.Tensor], layout: KVCacheLayout
) -> None:
    for rid, plan in PLANS.items():
        data, _ = receiver.receive_kv_cache_for_request(rid)
        for layer, (k, v) in enumerate(_reference(caches, layout, plan, range(HEADS))):
            assert torch.equal(data.key_cache[layer], k) and torch.equal(data.value_cache[layer], v)


@pytest.fixture(
    params=[
        "SharedMemoryConnector",
        "ZmqConnector",
        "MooncakeStoreConnector",
        "MooncakeTransferEngineConnector",
        "NixlConnector",
    ]
)
def connector_name(request: pytest.FixtureRequest) -> str:
    for fixture in SPECS_BY_NAME[request.param].fixtures:
        request.getfixturevalue(fixture)
    return request.param


#: Every page format: the CPU backend's (vec, amx tiles) and a CUDA backend's in two of vLLM's
#: physical orders.
KINDS = ("cpu-vec", "cpu-amx", "packed-LBHNC", "packed-BLNHC")


@pytest.mark.parametrize("to_tp", [1, 2])
def test_one_copy_kv_is_bit_exact(connector_name: str, to_tp: int, token: str) -> None:
    # every format through one pair of managers: a connector's set-up and close (a Mooncake
    # master and clients: seconds) is paid once, not once per format
    assert _sent_bit_exact(connector_name, KINDS, to_tp, token) is None  # the direct path


def test_staged_kv_is_bit_exact(connector_name: str, token: str) -> None:
    """The staged path (issue 14: the GPU default) into every connector's destination."""
    stats = _sent_bit_exact(connector_name, ("cpu-vec", "packed-BLNHC"), 2, token, staging_bytes=8 << 20)
    assert stats is not None and stats["in_use"] == 0 and stats["bypassed"] == stats["full"] == 0


def _sent_bit_exact(
    connector_name: str, kinds: tuple[str, ...], to_tp: int, token: str, **send: Any
) -> dict | None:
    """Send every plan in each page format, receive it on each rank and compare; the
    staging pool's counters."""
    sender, receivers = _managers(connector_name, token, to_tp, **send)
    try:
        if connector_name != "ZmqConnector":  # ZMQ's reservation is its own served buffer
            probe = sender.connector.reserve(0, 1, "probe", 64)
            assert isinstance(probe, LentReservation), "the connector lends its own memory"
            probe.release()
        for kind in kinds:
            caches, layout = _caches(kind)
            _send_all(sender, caches, layout, prefix=f"{kind}-")
            for rank, receiver in enumerate(receivers):
                heads = range(rank * HEADS // to_tp, (rank + 1) * HEADS // to_tp)
                for name, plan in PLANS.items():
                    rid = f"{kind}-{name}"
                    info = sender.get_sender_info(rid)  # what the pipeline forwards
                    data, _ = receiver.receive_kv_cache_for_request(rid, sender_info=info)
                    assert (data.head_start, data.head_end) == (heads.start, heads.stop)
                    assert data.seq_len == plan[0]
                    for layer, (k, v) in enumerate(_reference(caches, layout, plan, heads)):
                        assert torch.equal(data.key_cache[layer], k), (kind, rid, layer)
                        assert torch.equal(data.value_cache[layer], v), (kind, rid, layer)
        stats = sender.staging_stats()
    finally:
        for receiver in receivers:
            receiver.shutdown()
        sender.shutdown()
    assert SPECS_BY_NAME[connector_name].leftovers(token) == []
    return stats


class _BytesWritten(TorchDispatchMode):
    """Bytes every torch op on this thread writes (new outputs, in-place and ``out=``
    results), excluding views and uninitialised allocations."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("empty", "empty_strided"):
            return out
        outs = out if isinstance(out, tuple | list) else (out,)
        for ret, t in zip(func._schema.returns, outs):
            alias = ret.alias_info
            if isinstance(t, torch.Tensor) and (alias is None or alias.is_write):
                self.nbytes += t.nbytes
                self.ops[str(func)] = self.ops.get(str(func), 0) + t.nbytes
        return out


def test_the_sender_copies_the_kv_bytes_once(token: str, monkeypatch: pytest.MonkeyPatch) -> None:
    caches, layout = _caches("cpu-vec")
    memmoved = []
    real_copy = codec.copy_many
    monkeypatch.setattr(
        codec, "copy_many", lambda copies: (memmoved.extend(n for *_, n in copies), real_copy(copies))
    )
    reserved: list[Any] = []
    sender, receivers = _managers("SharedMemoryConnector", token, 1)
    real_reserve = sender.connector.reserve

    def spy(*args: Any) -> Any:
        got = real_reserve(*args)
        reserved.append(got)
        return got

    monkeypatch.setattr(sender.connector, "reserve", spy)
    try:
        plans = {rid: {"block_ids": ids, "seq_len": n} for rid, (n, ids) in PLANS.items()}
        sender.layout = layout
        with _BytesWritten() as written:
            sender.handle_finished_requests_kv_transfer(plans, caches, BLOCK, "auto")
        kv_bytes = sum(n for n, _ in PLANS.values()) * NUM_LAYERS * 2 * HEADS * HEAD * 4
        index_bytes = 2 * 4 * 8 * len(PLANS)  # the block index tensors (host and device)
        assert kv_bytes <= written.nbytes <= kv_bytes + index_bytes, written.ops
        assert memmoved == [], "the KV went through a second, byte copy"
        assert all(isinstance(r, LentReservation) for r in reserved) and len(reserved) == len(PLANS)
        # published from the segments gathered into (the test once sent a second round of
        # the same ids here and stopped at the first round's completions, so the connector
        # could close under the second round's puts and leave their segments behind)
        _wait_sent(sender, set(plans))
        _assert_all_received(receivers[0], caches, layout)
    finally:
        receivers[0].shutdown()
        sender.shutdown()


def test_a_full_connector_falls_back_to_a_host_buffer_and_waits_for_room(
    token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No room in the connector at the gather (its memory is held by unread KV): the KV goes
    to a host buffer, whose put waits for room instead of failing, and lands exact."""
    caches, layout = _caches("cpu-vec")
    sender, receivers = _managers("SharedMemoryConnector", token, 1)
    conn = sender.connector
    real_reserve = conn.reserve
    fallbacks: list[Any] = []

    def full_once(from_stage: Any, to_stage: Any, key: str, nbytes: int) -> Any:
        if not fallbacks:
            fallbacks.append(key)
            return PutResult(ok=False, error="injected: no room now", full=True)
        return real_reserve(from_stage, to_stage, key, nbytes)

    monkeypatch.setattr(conn, "reserve", full_once)
    heap_publishes: list[str] = []
    real_publish = HeapReservation.publish
    monkeypatch.setattr(
        HeapReservation, "publish", lambda self: (heap_publishes.append(self.key), real_publish(self))[1]
    )
    try:
        _send_all(sender, caches, layout)
        assert heap_publishes == fallbacks
        _assert_all_received(receivers[0], caches, layout)
    finally:
        receivers[0].shutdown()
        sender.shutdown()
    assert SPECS_BY_NAME["SharedMemoryConnector"].leftovers(token) == []


def test_a_failed_send_gives_its_reserved_segments_back(token: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A publish that keeps failing fails the request with the reason, and the segment it
    had reserved goes back to the pool (the connector holds no bytes for it)."""
    caches, layout = _caches("cpu-vec")
    sender, receivers = _managers(
        "SharedMemoryConnector", token, 1, send_retries=1, send_backoff_s=0.01, send_max_backoff_s=0.01
    )
    conn = sender.connector

    def refuse(reservation: Any, start: float) -> PutResult:
        return conn._put_failed("injected: the link is down")

    monkeypatch.setattr(conn, "_publish_lent", refuse)
    try:
        plans = {"doomed": {"block_ids": [3, 4], "seq_len": BLOCK + 3}}
        sender.layout = layout
        sender.handle_finished_requests_kv_transfer(plans, caches, BLOCK, "auto")
        failed: set[str] = set()
        while not failed:
            done, failed = sender.get_finished()
            assert not done
        assert "injected: the link is down" in sender.send_failure_reason("doomed")
        assert conn.health()["held_bytes"] == 0
    finally:
        receivers[0].shutdown()
        sender.shutdown()
