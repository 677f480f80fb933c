"""The receiver's kept mappings of claimed pool segments (a part of
:class:`~vllm_kvbridge.connectors.shm.SharedMemoryConnector`).

Why keep them: a sender reuses its pool segments, so the next payload often lands in a
segment this receiver has mapped before; keeping that mapping saves the mmap, the
populate and the munmap of every get (together ~40 ms per GiB). A kept mapping is dropped
once its sender has unlinked or retired the segment, or to make room under
``map_cache_bytes`` (least recently used first). Callers hold the connector's lock.
"""

from __future__ import annotations

import os
import time
from typing import Any

from vllm_kvbridge.connectors import shm_segments as seg


class MapCache:
    """Kept :class:`~vllm_kvbridge.connectors.shm_segments.ReceiverMapping` s by segment
    identity (device, inode), at most ``capacity`` bytes mapped at once."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._maps: dict[tuple[int, int], seg.ReceiverMapping] = {}

    def take(
        self, fd: int, st: os.stat_result, max_payload_bytes: int
    ) -> tuple[seg.ReceiverMapping | None, bool]:
        """``(mapping, newly kept)`` of the claimed segment ``fd``, marked busy: the kept one,
        or a new one kept if it fits; ``(None, False)`` when it is not to be kept (no room,
        a segment whose name is gone, or one still being viewed: a sender that republished
        it early). Only segments that still have a name (the sender's pool name:
        ``st_nlink`` > 0 once the claim name is gone) and fit ``max_payload_bytes`` are kept.
        """
        ident = (st.st_dev, st.st_ino)
        mapping = self._maps.get(ident)
        if mapping is not None and not mapping.busy and mapping.size == st.st_size:
            mapping.busy = True
            mapping.last_used = time.monotonic()
            return mapping, False
        keep = (
            mapping is None
            and st.st_nlink > 0
            and st.st_size - seg.HEADER_SIZE <= max_payload_bytes
            and self._make_room(st.st_size)
        )
        if not keep:
            return None, False
        mapping = seg.ReceiverMapping(fd, st.st_size, detached=False)
        mapping.busy = True
        self._maps[ident] = mapping
        return mapping, True

    def _make_room(self, size: int) -> bool:
        """Make room for a new kept mapping of ``size`` bytes; False if it cannot fit.

        Drops orphaned kept mappings, then idle ones (least recently used first), but
        only when that is enough: a mapping that cannot fit evicts nothing.
        """
        self.sweep()
        busy = sum(m.size for m in self._maps.values() if m.busy)
        if busy + size > self.capacity:
            return False
        used = sum(m.size for m in self._maps.values())
        for ident, mapping in sorted(self._maps.items(), key=lambda item: item[1].last_used):
            if used + size <= self.capacity:
                break
            if not mapping.busy:
                del self._maps[ident]
                mapping.close()
                used -= mapping.size
        return True

    def sweep(self) -> None:
        """Unmap kept mappings of segments the sender has unlinked or retired."""
        for ident, mapping in list(self._maps.items()):
            if not mapping.busy and mapping.orphaned():
                del self._maps[ident]
                mapping.close()

    def stats(self) -> dict[str, Any]:
        return {
            "mapped_segments": len(self._maps),
            "mapped_bytes": sum(m.size for m in self._maps.values()),
        }

    def close(self) -> None:
        """Drop every kept mapping (payloads still viewed keep theirs until released)."""
        for mapping in self._maps.values():
            mapping.close()
        self._maps.clear()
