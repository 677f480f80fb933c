"""The registered-buffer pool shared by the Mooncake, NIXL and ZMQ connectors
(connectors/registered_pool.py), with registration counted through its two callables."""

from __future__ import annotations

import gc

from vllm_kvbridge.connectors.registered_pool import MIN_SLAB, RegisteredBufferPool


def _pool(keep: int) -> tuple[RegisteredBufferPool, dict[int, int]]:
    registered: dict[int, int] = {}

    def register(ptr: int, nbytes: int) -> int:
        registered[ptr] = nbytes
        return 0

    def unregister(ptr: int) -> int:
        registered.pop(ptr)
        return 0

    return RegisteredBufferPool(register, unregister, keep), registered


def test_slabs_of_several_sizes_are_reused_each_for_its_size() -> None:
    """Found by bench kv-path (2k then 8k tokens over ZMQ): with a 1 MiB and a 4 MiB slab
    both free, taking the 4 MiB one compared arrays elementwise (list.remove) and raised."""
    pool, registered = _pool(64 * MIN_SLAB)
    small, _ = pool.acquire(MIN_SLAB)
    big, _ = pool.acquire(3 * MIN_SLAB)
    assert big.nbytes == 4 * MIN_SLAB
    pool.release(small)
    pool.release(big)
    for _ in range(3):
        again_big, pooled = pool.acquire(3 * MIN_SLAB)
        again_small, _ = pool.acquire(MIN_SLAB // 2)
        assert pooled and again_big is big and again_small is small
        pool.release(again_big)
        pool.release(again_small)
    assert pool.registrations == 2 and len(registered) == 2
    pool.close()
    assert registered == {}


def test_a_lent_view_sends_its_slab_home_when_the_last_view_dies() -> None:
    pool, registered = _pool(8 * MIN_SLAB)
    slab, _ = pool.acquire(MIN_SLAB)
    view = pool.lend_view(slab, 100)
    part = view[10:20]
    del view
    gc.collect()
    assert pool.lent == 1  # `part` still views the slab
    del part
    gc.collect()
    assert pool.lent == 0 and pool.acquire(MIN_SLAB)[0] is slab
    pool.close()
    assert registered == {}
