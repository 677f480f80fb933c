"""The pull connectors' one sender-side held table (connectors/held_table.py).

Reservations against the byte budget (a clear ``full`` answer), TTL and renewals, claims
and their leases, the sweep and its release callback, and many threads at once. Real
threads; expiry is waited for as a condition, never assumed after a fixed sleep."""

from __future__ import annotations

import threading
import time

from vllm_kvbridge.connectors.held_table import Held, HeldTable


def _until(pred, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.002)


def _sweep_until(table: HeldTable, pred) -> list[Held]:  # type: ignore[no-untyped-def,type-arg]
    taken: list[Held] = []  # type: ignore[type-arg]
    _until(lambda: bool(taken.extend(table.sweep())) or pred(taken))
    return taken


def test_the_budget_answers_full_when_room_may_come_back_and_fails_what_never_fits() -> None:
    table: HeldTable[str] = HeldTable(60, 60, 100, budget_option="max_held_bytes")
    assert table.reserve("a", 60) is None
    full = table.reserve("b", 50)
    assert full is not None and full.full and "max_held_bytes=100" in full.why
    never = table.reserve("c", 101)
    assert never is not None and not never.full and "max_held_bytes=100" in never.why
    twice = table.reserve("a", 1)
    assert twice is not None and not twice.full and "already held" in twice.why
    table.unreserve("a")  # a reservation ends unpublished: its bytes come back
    assert table.counts()["held_bytes"] == 0
    assert table.add("b", "x", 50) is None and table.counts()["held_bytes"] == 50
    assert table.drop("b") is not None and table.counts()["held_bytes"] == 0


def test_a_claim_is_one_receivers_and_the_same_receiver_gets_it_again() -> None:
    table: HeldTable[str] = HeldTable(60, 30, None)
    assert table.reserve("k", 10) is None and table.publish("k", "slab")
    assert table.claim("k", b"r1", limit=9).claim is None  # too big: returned unclaimed (TOOBIG)
    first = table.claim("k", b"r1", limit=10)
    assert first is not None and first.claimed and first.value == "slab"
    assert table.claim("k", b"r2", limit=10) is None  # another receiver: missing
    again = table.claim("k", b"r1", limit=10)
    assert again is first and again.claim == first.claim
    assert table.counts()["held"] == 0 and table.counts()["claimed"] == 1
    assert table.release_claim(first.claim, key="other") is None  # not that key's claim
    assert table.release_claim(first.claim, key="k") is first
    assert table.release_claim(first.claim) is None and table.counts()["held_bytes"] == 0


def test_claiming_again_renews_the_lease_only_where_the_protocol_says_so() -> None:
    for renews in (False, True):
        table: HeldTable[str] = HeldTable(60, 30, None, reclaim_renews=renews)
        table.add("k", "v", 1)
        held = table.claim("k", b"r", 1)
        held.expires -= 20  # as if 20 s of its 30 s lease had passed
        before = held.expires
        table.claim("k", b"r", 1)
        assert (held.expires > before) is renews


def test_renew_moves_an_unclaimed_keys_expiry_and_leaves_a_claim_to_its_lease() -> None:
    table: HeldTable[str] = HeldTable(0.05, 60, None)
    table.add("k", "v", 1)
    assert table.renew("k") and table.get("k").expires > time.monotonic() + 50
    claimed = table.claim("k", b"r", 1)
    expires = claimed.expires
    assert table.renew("k") and claimed.expires == expires
    assert not table.renew("nobody")


def test_the_sweep_takes_expired_entries_counts_them_and_releases_them_outside_the_lock() -> None:
    released: list[tuple[str, bool, bool]] = []
    table: HeldTable[str]

    def on_expired(held: Held[str]) -> None:
        # Another thread can take the lock now: the callback runs outside it.
        free: list[bool] = []

        def probe() -> None:
            free.append(table.lock.acquire(timeout=5))
            if free[0]:
                table.lock.release()

        prober = threading.Thread(target=probe)
        prober.start()
        prober.join()
        released.append((held.key, held.claimed, free[0]))

    table = HeldTable(0.05, 0.05, 100, on_expired=on_expired)
    table.add("unread", "a", 10)
    table.add("claimed", "b", 20)
    assert table.claim("claimed", b"r", 100) is not None
    taken = _sweep_until(table, lambda taken: len(taken) == 2)
    assert sorted(h.key for h in taken) == ["claimed", "unread"]
    assert sorted(released) == [("claimed", True, True), ("unread", False, True)]
    counts = table.counts()
    assert counts["expired"] == 1 and counts["lease_expired"] == 1 and counts["held_bytes"] == 0
    assert table.release_claim(taken[0].claim) is None  # an expired claim is gone


def test_a_claimed_key_is_put_again_only_where_keys_are_reusable_while_claimed() -> None:
    for reusable in (False, True):
        table: HeldTable[str] = HeldTable(60, 60, None, keys_reusable_while_claimed=reusable)
        table.add("k", "first", 1)
        table.claim("k", b"r", 1)
        assert (table.add("k", "second", 1) is None) is reusable


def test_a_closed_table_refuses_publishing_and_hands_back_what_it_held() -> None:
    table: HeldTable[str] = HeldTable(60, 60, None)
    table.add("a", "x", 1)
    table.add("b", "y", 1)
    table.claim("b", b"r", 1)
    assert table.reserve("c", 1) is None
    assert sorted(h.key for h in table.clear()) == ["a", "b"]
    assert not table.publish("c", "z") and table.counts()["held_bytes"] == 0


def test_many_threads_putting_at_once_never_overrun_the_budget() -> None:
    table: HeldTable[int] = HeldTable(60, 60, 10 * 100)
    answers: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def putter(t: int) -> None:
        start.wait()
        for i in range(50):
            refused = table.add(f"{t}-{i}", i, 100)
            with lock:
                answers.append("ok" if refused is None else "full" if refused.full else "failed")

    threads = [threading.Thread(target=putter, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Exactly the budget's worth went in, whoever won; every other put was answered full.
    assert answers.count("ok") == 10 and answers.count("full") == 8 * 50 - 10
    assert table.counts()["held_bytes"] == 1000 and table.counts()["held"] == 10
