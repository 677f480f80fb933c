"""The sender-side held table of the pull connectors: what a sender keeps for receivers to pull.

One implementation for every connector whose receiver pulls from the sender (ZMQ, NIXL,
Mooncake's transfer engine, and the Mooncake store's key tracking): each keeps only its
data plane (what a held value is, how its bytes move) and says what releasing one means
(return a slab to its pool, discard a registered slab, remove a store key, nothing).

An entry (:class:`Held`) lives through these states, all under :attr:`HeldTable.lock`:

  * **reserved**: :meth:`~HeldTable.reserve` counts ``nbytes`` against the byte budget
    (``max_bytes``) before the sender writes the payload, so concurrent puts respect it;
    a key already held (or being reserved) is refused, one that could never fit is refused,
    and one that does not fit *now* is answered ``full`` (the sender waits for room);
  * **held** (unclaimed): :meth:`~HeldTable.publish` (or :meth:`~HeldTable.add`, both
    steps at once) holds the value until ``ttl_s`` after the put; a receiver's
    :meth:`~HeldTable.renew` moves that to ``lease_s`` from then;
  * **claimed**: :meth:`~HeldTable.claim` lends it to one receiver for ``lease_s`` under a
    claim id; the same receiver claiming again gets the same claim (renewed, where the
    connector's protocol renews by claiming again); others see it missing;
  * **gone**: :meth:`~HeldTable.release_claim` (the reader is done), :meth:`~HeldTable.drop`
    (confirmed or cleaned up), or :meth:`~HeldTable.sweep`, which takes the entries past
    their expiry and hands them to the connector's ``on_expired`` callback outside the lock
    (counted: ``expired`` for unclaimed ones, ``lease_expired`` for claims).

Thread-safe: the lock is reentrant and public, so a connector can make a compound decision
(e.g. ZMQ's "missing, so hold this GET") atomic with the table's state.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

V = TypeVar("V")


@dataclass
class Held(Generic[V]):
    """One held payload: ``value`` is the connector's (a slab, frames, a store key...)."""

    key: str
    value: V
    nbytes: int
    expires: float  # monotonic: ttl_s after the put, pushed out by renewals and claims
    claim: Hashable | None = None  # the claim id once a receiver claimed it
    claimer: bytes = b""

    @property
    def claimed(self) -> bool:
        return self.claim is not None


@dataclass(frozen=True)
class Refusal:
    """Why :meth:`HeldTable.reserve` refused: ``full`` when room may come back (wait and
    put again), otherwise never (the put fails)."""

    why: str
    full: bool = False


class HeldTable(Generic[V]):
    """Key -> :class:`Held` with TTL, claims and their leases, a byte budget and a sweep.

    ``max_bytes`` None: no budget. ``budget_option`` names the connector option in refusals.
    ``reclaim_renews``: a receiver claiming a key it holds again renews the claim's lease
    (the transfer engine's long reads keep their claim that way); otherwise the claim keeps
    its expiry. ``keys_reusable_while_claimed``: a claimed key may be put again (its claim
    lives on under its id; NIXL's notification can trail the reader's get). ``claim_id``
    makes a new claim id (default: 1, 2, 3...). ``on_expired`` releases what a sweep took.
    """

    def __init__(
        self,
        ttl_s: float,
        lease_s: float,
        max_bytes: int | None = None,
        *,
        budget_option: str = "max_held_bytes",
        reclaim_renews: bool = False,
        keys_reusable_while_claimed: bool = False,
        claim_id: Callable[[], Hashable] | None = None,
        on_expired: Callable[[Held[V]], None] | None = None,
    ) -> None:
        self.ttl_s, self.lease_s, self.max_bytes = ttl_s, lease_s, max_bytes
        self.budget_option = budget_option
        self.reclaim_renews = reclaim_renews
        self.keys_reusable_while_claimed = keys_reusable_while_claimed
        self._new_claim_id = claim_id or itertools.count(1).__next__
        self._on_expired = on_expired
        #: Reentrant: a connector may hold it around several calls to make them one decision.
        self.lock = threading.RLock()
        self._held: dict[str, Held[V]] = {}  # unclaimed, by key
        self._claimed: dict[Hashable, Held[V]] = {}  # by claim id
        self._claims: dict[tuple[bytes, str], Hashable] = {}  # (claimer, key) -> claim id
        self._reserving: dict[str, int] = {}  # key -> bytes of a put under way
        self._bytes = 0  # held + claimed + reserved
        self._closed = False
        self.expired = 0  # unclaimed entries swept (ttl_s or a renewal's lease passed)
        self.lease_expired = 0  # claims swept (their reader died or gave up)

    def set_limits(self, ttl_s: float, lease_s: float, max_bytes: int | None) -> None:
        """The limits, once a connector has read its options (its table exists before, so
        that closing a connector whose options were bad finds it)."""
        with self.lock:
            self.ttl_s, self.lease_s, self.max_bytes = ttl_s, lease_s, max_bytes

    # -- sender: reserve, publish -------------------------------------------------------
    def reserve(self, key: str, nbytes: int) -> Refusal | None:
        """Count ``nbytes`` for ``key`` against the budget (None), or why not."""
        with self.lock:
            if self._busy(key) or key in self._reserving:
                return Refusal(f"key {key!r} is already held for sending")
            budget, option = self.max_bytes, self.budget_option
            if budget is not None:
                if nbytes > budget:  # would never fit: waiting cannot help
                    return Refusal(f"payload of {nbytes} bytes exceeds {option}={budget}")
                if self._bytes + nbytes > budget:
                    why = f"{self._bytes} bytes held + {nbytes} exceeds {option}={budget}"
                    return Refusal(why, full=True)
            self._reserving[key] = nbytes
            self._bytes += nbytes
            return None

    def unreserve(self, key: str) -> None:
        """A reservation ends unpublished: its bytes go back."""
        with self.lock:
            self._bytes -= self._reserving.pop(key, 0)

    def publish(self, key: str, value: V) -> bool:
        """Hold ``value`` under the reserved ``key`` for ``ttl_s``; False (and the
        reservation ended) when the table is closed or the key is held meanwhile."""
        with self.lock:
            nbytes = self._reserving.pop(key, 0)
            if self._closed or self._busy(key):
                self._bytes -= nbytes
                return False
            self._held[key] = Held(key, value, nbytes, time.monotonic() + self.ttl_s)
            return True

    def add(self, key: str, value: V, nbytes: int) -> Refusal | None:
        """:meth:`reserve` and :meth:`publish` at once."""
        with self.lock:
            refused = self.reserve(key, nbytes)
            if refused is None and not self.publish(key, value):
                return Refusal("the sender is closed")
            return refused

    def _busy(self, key: str) -> bool:
        if key in self._held:
            return True
        return not self.keys_reusable_while_claimed and any(c[1] == key for c in self._claims)

    # -- receivers: look up, claim, renew, release ----------------------------------------
    def get(self, key: str) -> Held[V] | None:
        """The unclaimed entry of ``key``, if held."""
        with self.lock:
            return self._held.get(key)

    def claim(self, key: str, claimer: bytes, limit: int) -> Held[V] | None:
        """Lend ``key`` to ``claimer`` for ``lease_s`` (unless it is over ``limit`` bytes:
        then it is returned unclaimed, for a TOOBIG answer). The same claimer asking again
        gets its claim; None when nobody holds it or another receiver claimed it."""
        with self.lock:
            claim = self._claims.get((claimer, key))
            held = self._claimed.get(claim) if claim is not None else None
            if held is not None:
                if self.reclaim_renews:
                    held.expires = time.monotonic() + self.lease_s
                return held
            held = self._held.get(key)
            if held is None or held.nbytes > limit:
                return held
            del self._held[key]
            held.claim, held.claimer = self._new_claim_id(), claimer
            held.expires = time.monotonic() + self.lease_s
            self._claimed[held.claim] = held
            self._claims[(claimer, key)] = held.claim
            return held

    def renew(self, key: str) -> bool:
        """A waiting receiver keeps ``key``: an unclaimed one's expiry moves to ``lease_s``
        from now; a claimed one is left to its claim's lease. Whether it is held."""
        with self.lock:
            held = self._held.get(key)
            if held is not None:
                held.expires = time.monotonic() + self.lease_s
                return True
            return any(c[1] == key for c in self._claims)

    def release_claim(self, claim: Hashable, key: str | None = None) -> Held[V] | None:
        """The reader of ``claim`` is done (or gave up): the entry, gone from the table, or
        None when that claim is not held (expired, released, or not ``key``'s)."""
        with self.lock:
            held = self._claimed.get(claim)
            if held is None or (key is not None and held.key != key):
                return None
            return self._forget_claim(held)

    def drop(self, key: str, *, claimed_too: bool = False) -> Held[V] | None:
        """Forget ``key`` (confirmed by its receiver, or cleaned up): the entry, or None.
        ``claimed_too``: a claimed one too (the caller must not reuse its buffer)."""
        with self.lock:
            held = self._held.pop(key, None)
            if held is not None:
                self._bytes -= held.nbytes
                return held
            if claimed_too:
                for (_, claimed_key), claim in self._claims.items():
                    if claimed_key == key:
                        return self._forget_claim(self._claimed[claim])
            return None

    def _forget_claim(self, held: Held[V]) -> Held[V]:
        del self._claimed[held.claim]
        self._claims.pop((held.claimer, held.key), None)
        self._bytes -= held.nbytes
        return held

    # -- expiry, state, close -------------------------------------------------------------
    def sweep(self) -> list[Held[V]]:
        """Take the entries past their expiry (counted) and release each with ``on_expired``,
        outside the lock; the taken entries."""
        now = time.monotonic()
        with self.lock:
            gone = [self._held.pop(k) for k, h in list(self._held.items()) if h.expires <= now]
            lapsed = [self._forget_claim(h) for h in list(self._claimed.values()) if h.expires <= now]
            self._bytes -= sum(h.nbytes for h in gone)
            self.expired += len(gone)
            self.lease_expired += len(lapsed)
        if self._on_expired is not None:
            for held in (*gone, *lapsed):
                self._on_expired(held)
        return [*gone, *lapsed]

    def keys(self) -> list[str]:
        """The keys held unclaimed now."""
        with self.lock:
            return list(self._held)

    def __contains__(self, key: object) -> bool:
        with self.lock:
            return isinstance(key, str) and (key in self._held or key in self._reserving)

    def __iter__(self) -> Iterator[Held[V]]:
        with self.lock:
            return iter([*self._held.values(), *self._claimed.values()])

    @property
    def any_claimed(self) -> bool:
        with self.lock:
            return bool(self._claimed)

    def counts(self) -> dict[str, Any]:
        """``held`` (unclaimed), ``claimed``, ``held_bytes`` (reservations included),
        ``expired`` and ``lease_expired``."""
        with self.lock:
            return {
                "held": len(self._held),
                "claimed": len(self._claimed),
                "held_bytes": self._bytes,
                "expired": self.expired,
                "lease_expired": self.lease_expired,
            }

    def clear(self) -> list[Held[V]]:
        """Close the table (later publishes are refused) and take every entry."""
        with self.lock:
            self._closed = True
            taken = [*self._held.values(), *self._claimed.values()]
            self._held.clear()
            self._claimed.clear()
            self._claims.clear()
            self._reserving.clear()
            self._bytes = 0
            return taken


__all__ = ["Held", "HeldTable", "Refusal"]
