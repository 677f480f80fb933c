"""Audio a pipeline produced (a vocoder stage's samples), as 16-bit PCM and WAV bytes for
the CLI's files and the server's responses. No audio dependency: the stdlib writes WAV.
"""

from __future__ import annotations

import io
import wave
from typing import Any

__all__ = ["encode_pcm16", "encode_wav"]


def encode_pcm16(samples: Any) -> bytes:
    """Samples ``[n]`` in [-1, 1] (clipped) -> little-endian signed 16-bit PCM bytes."""
    import numpy as np

    arr = np.asarray(samples, dtype=np.float32).reshape(-1)
    return (np.nan_to_num(arr).clip(-1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def encode_wav(samples: Any, sample_rate: int) -> bytes:
    """Samples ``[n]`` in [-1, 1] -> a mono 16-bit PCM WAV file."""
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be > 0, got {sample_rate}")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(encode_pcm16(samples))
    return out.getvalue()
