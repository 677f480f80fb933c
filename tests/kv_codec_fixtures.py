"""The KV container in the payload codec, taken apart for tests that corrupt it.

A KV payload's skeleton is ``["kvbw", 1, Ext(4, KV header)]`` (wire/codec.py); these
helpers decode that header to a plain msgpack tree, let a test change it, and rebuild the
frames or the packed layout around the unchanged tensor buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import torch

from vllm_kvbridge.wire import Encoded
from vllm_kvbridge.wire.codec import EXT_KV
from vllm_kvbridge.wire.device_pack import pack_into_device


def kv_header(frames: list[Any]) -> dict[str, Any]:
    """The KV header of a payload whose root is one KVCacheTransferData, as a plain dict."""
    top = msgspec.msgpack.decode(bytes(frames[0]))
    assert top[2].code == EXT_KV
    return msgspec.msgpack.decode(top[2].data)


def rewrite_kv_header(frames: list[Any], mutate: Callable[[dict[str, Any]], Any]) -> list[Any]:
    """``frames`` with the KV header rebuilt after ``mutate(header)``; buffers unchanged."""
    header = kv_header(frames)
    mutate(header)
    ext = msgspec.msgpack.Ext(EXT_KV, msgspec.msgpack.encode(header))
    return [msgspec.msgpack.encode(["kvbw", 1, ext]), *frames[1:]]


def packed(frames: list[Any]) -> bytes:
    """The packed layout (Encoded.to_bytes) of ``[skeleton, *buffers]``."""
    return Encoded(bytes(frames[0]), [memoryview(bytes(b)) for b in frames[1:]]).to_bytes()


def packed_device(frames: list[Any], device: str = "cpu") -> tuple[bytes, torch.Tensor]:
    """``(head, data)``: the packed layout in a uint8 tensor on ``device`` (zeroed first,
    so it is byte for byte :func:`packed`) and its head."""
    enc = Encoded(bytes(frames[0]), [memoryview(bytes(b)) for b in frames[1:]])
    data = torch.zeros(enc.packed_size(), dtype=torch.uint8, device=device)
    return pack_into_device(enc, data), data
