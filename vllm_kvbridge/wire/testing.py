"""Helpers for tests of anything that moves payloads (wire, connectors, KV manager).

* :func:`random_tensor` / :func:`random_array`: tensors/arrays of any allow-listed dtype
  filled with random *bit patterns* (NaNs, infinities, subnormals included), so a round
  trip that converts instead of copying bytes is caught.
* :func:`assert_payload_equal`: exact structural equality (types, key order, tuple vs
  list, bit-identical tensors, NaN-aware floats).
* :func:`all_dtypes_payload`: one payload holding every allow-listed dtype.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import torch

from vllm_kvbridge.wire._buffers import tensors_bitwise_equal
from vllm_kvbridge.wire.dtypes import ITEMSIZE, NUMPY_DTYPES, TORCH_DTYPES
from vllm_kvbridge.wire.kv_format import KVCacheTransferData


def random_tensor(dtype: str | torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``shape`` whose bytes are random (bool: random 0/1)."""
    torch_dtype = TORCH_DTYPES[dtype] if isinstance(dtype, str) else dtype
    gen = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    if torch_dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).to(torch.bool)
    raw = torch.randint(0, 256, (numel * torch_dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(torch_dtype).reshape(shape)


def random_array(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """A numpy array of ``shape`` whose bytes are random (bool: random 0/1)."""
    rng = np.random.default_rng(seed)
    np_dtype = NUMPY_DTYPES[dtype]
    if np_dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=math.prod(shape) * ITEMSIZE[dtype], dtype=np.uint8)
    return raw.view(np_dtype).reshape(shape)


def all_dtypes_payload(seed: int = 0) -> dict[str, Any]:
    """``{"torch": {name: tensor}, "numpy": {name: array}}`` for every allow-listed dtype."""
    return {
        "torch": {name: random_tensor(name, (3, 5), seed + i) for i, name in enumerate(TORCH_DTYPES)},
        "numpy": {name: random_array(name, (2, 7), seed + i) for i, name in enumerate(NUMPY_DTYPES)},
    }


def assert_payload_equal(expected: Any, actual: Any, path: str = "payload") -> None:
    """Raise AssertionError (naming the path) unless ``actual`` equals ``expected`` exactly."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: expected a tensor, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, (
            f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        )
        assert tensors_bitwise_equal(expected, actual), f"{path}: tensor bytes differ"
        return
    if type(expected) is np.ndarray:
        assert type(actual) is np.ndarray, f"{path}: expected an ndarray, got {type(actual).__name__}"
        assert tensors_bitwise_equal(expected, actual), f"{path}: array dtype/shape/bytes differ"
        return
    if isinstance(expected, KVCacheTransferData):
        assert isinstance(actual, KVCacheTransferData), f"{path}: expected KVCacheTransferData"
        assert expected.equals(actual), f"{path}: KV data differs: {expected!r} vs {actual!r}"
        return
    assert type(actual) is type(expected), (
        f"{path}: type {type(actual).__name__} != {type(expected).__name__}"
    )
    if isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_payload_equal(expected[key], actual[key], f"{path}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_payload_equal(e, a, f"{path}[{i}]")
    elif isinstance(expected, float):
        assert struct.pack("<d", expected) == struct.pack("<d", actual), f"{path}: {actual!r} != {expected!r}"
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"
