"""Large copies split across threads (wire/parallel_copy.py): the bytes are exactly
memmove's, for sizes that do not divide into pages, overlapping ranges, and in a forked
child (whose parent's copy threads do not exist)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from vllm_kvbridge.wire import parallel_copy


@pytest.mark.parametrize(
    "nbytes", [1, parallel_copy.PARALLEL_COPY - 1, parallel_copy.PARALLEL_COPY, (21 << 20) + 123]
)
def test_the_copy_is_memmoves(nbytes: int) -> None:
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes + 64, dtype=np.uint8)
    dst = np.zeros(nbytes + 64, dtype=np.uint8)
    parallel_copy.memmove(dst.ctypes.data + 7, src.ctypes.data + 3, nbytes)
    assert np.array_equal(dst[7 : 7 + nbytes], src[3 : 3 + nbytes])
    assert not dst[:7].any() and not dst[7 + nbytes :].any()  # nothing written outside


def test_overlapping_ranges_move_like_memmove() -> None:
    n = 24 << 20
    buf = np.arange(n + (1 << 20), dtype=np.uint64).view(np.uint8)[: n + (1 << 20)].copy()
    expected = buf.copy()
    expected[1 << 20 : (1 << 20) + n] = buf[:n]
    parallel_copy.memmove(buf.ctypes.data + (1 << 20), buf.ctypes.data, n)
    assert np.array_equal(buf, expected)


def test_a_forked_child_copies_on_threads_of_its_own() -> None:
    n = 16 << 20
    src = np.full(n, 3, dtype=np.uint8)
    parallel_copy.memmove(np.empty(n, dtype=np.uint8).ctypes.data, src.ctypes.data, n)  # pool made here
    pid = os.fork()
    if pid == 0:
        dst = np.zeros(n, dtype=np.uint8)
        parallel_copy.memmove(dst.ctypes.data, src.ctypes.data, n)
        os._exit(0 if (dst == 3).all() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("sizes", [[1, 3, 4096], [(1 << 20) + 5] * 9 + [17, 0, (3 << 20) + 1]])
def test_many_copies_land_exactly_and_big_totals_spread_over_threads(sizes, monkeypatch) -> None:
    """A payload's buffers together (not each) decide the split: 64 one-MiB tensors copy as
    fast as one 64 MiB blob. A buffer may be cut between two threads; every byte lands."""
    threads: set[str] = set()
    copy_all = parallel_copy._copy_all

    def recording(copies):
        import threading

        threads.add(threading.current_thread().name)
        copy_all(copies)

    monkeypatch.setattr(parallel_copy, "_copy_all", recording)
    total = sum(sizes)
    rng = np.random.default_rng(total)
    src = rng.integers(0, 256, total + 64 * len(sizes), dtype=np.uint8)
    dst = np.zeros(total + 64 * len(sizes) + 64, dtype=np.uint8)
    copies, expected, s_off, d_off = [], np.zeros_like(dst), 0, 0
    for n in sizes:
        d_off += 13  # gaps that must stay untouched
        copies.append((dst.ctypes.data + d_off, src.ctypes.data + s_off, n))
        expected[d_off : d_off + n] = src[s_off : s_off + n]
        s_off, d_off = s_off + n + 5, d_off + n
    parallel_copy.memmove_many(copies)
    assert np.array_equal(dst, expected)
    big = total >= parallel_copy.PARALLEL_COPY and len(os.sched_getaffinity(0)) > 1
    assert (len(threads) > 1) == big, threads
