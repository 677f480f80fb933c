"""The dtype allow-list: the only dtypes that cross the wire, by their wire names.

Wire names are looked up in these dicts and nowhere else (never ``getattr(torch, name)``),
so a payload cannot name an arbitrary torch attribute. Adding a dtype means adding one
row here; the payload codec (and the KV container it carries) picks it up.
"""

from __future__ import annotations

import numpy as np
import torch

#: wire name -> torch dtype.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}

#: torch dtype -> wire name.
TORCH_DTYPE_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in TORCH_DTYPES.items()}

#: wire name -> numpy dtype (numpy has no bfloat16/float8; those are torch-only).
NUMPY_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
}

#: numpy dtype (native byte order) -> wire name.
NUMPY_DTYPE_NAMES: dict[np.dtype, str] = {dt: name for name, dt in NUMPY_DTYPES.items()}

#: wire name -> bytes per element.
ITEMSIZE: dict[str, int] = {name: dt.itemsize for name, dt in TORCH_DTYPES.items()}
