"""Images a pipeline produced, as PNG bytes for the CLI's files and the server's responses.

No imaging dependency: a PNG is a signature, IHDR, zlib'd scanlines and IEND.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

__all__ = ["encode_png"]


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def encode_png(image: Any) -> bytes:
    """``[3|1, H, W]`` (or ``[H, W]``) values in [0, 1] -> 8-bit RGB/gray PNG bytes."""
    import numpy as np

    arr = np.asarray(image, dtype=np.float32)
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3 or arr.shape[0] not in (1, 3):
        raise ValueError(f"expected an image [C, H, W] with C in (1, 3), got shape {arr.shape}")
    pixels = (np.nan_to_num(arr).clip(0.0, 1.0) * 255.0 + 0.5).astype(np.uint8).transpose(1, 2, 0)
    h, w, c = pixels.shape
    raw = b"".join(b"\x00" + pixels[y].tobytes() for y in range(h))  # filter type 0 per row
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2 if c == 3 else 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"IDAT", zlib.compress(raw, 6))
        + _chunk(b"IEND", b"")
    )
