"""Decode/encode limits of the payload codec (the KV container it carries included).

Every wire field that sizes something (a count, a depth, a shape, a byte length) is
checked against a :class:`Limits` before anything is built from it, so a malformed or
hostile payload costs at most what these limits allow. The defaults are generous (a
large KV cache fits) but finite; a receiver facing untrusted peers should lower them.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvbridge.errors import PayloadError


@dataclass(frozen=True)
class Limits:
    """Upper bounds enforced by :func:`~vllm_kvbridge.wire.encode` and every decoder.

    * ``max_depth``: nesting depth of containers (the root container is depth 1).
    * ``max_items``: container elements plus scalars, counted over the whole payload.
    * ``max_buffers``: out-of-band buffers (tensors/arrays) per payload.
    * ``max_total_bytes``: sum of tensor/array bytes per payload.
    * ``max_ndim``: dimensions of one tensor/array.
    * ``max_skeleton_bytes``: size of the msgpack skeleton (KV headers included).
      Decoding allocates Python objects in proportion to it (up to ~64x for a skeleton
      made only of empty containers), so lower it for untrusted peers.
    * ``max_str_bytes``: one str or bytes value (UTF-8 bytes for str).
    """

    max_depth: int = 32
    max_items: int = 1_000_000
    max_buffers: int = 65_536
    max_total_bytes: int = 64 << 30
    max_ndim: int = 8
    max_skeleton_bytes: int = 64 << 20
    max_str_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise PayloadError(f"Limits.{name} must be a non-negative int, got {value!r}")


DEFAULT_LIMITS = Limits()
