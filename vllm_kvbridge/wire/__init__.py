"""The wire format: the payload codec, which also carries the KV container.

* :func:`encode` / :func:`decode_frames` / :func:`decode_packed`: stage payloads as a
  msgpack skeleton plus out-of-band tensor buffers (:mod:`.codec`, :mod:`.decode`).
* :class:`KVCacheTransferData`: one request's KV cache (:mod:`.kv_format`), which the
  codec carries as a header plus one out-of-band buffer per tensor.
* :class:`Limits`: the bounds every decoder enforces. Every decode error is a
  :class:`PayloadError`.

Imports neither vLLM nor any other layer of the package above ``errors``.
"""

from vllm_kvbridge.errors import PayloadError
from vllm_kvbridge.wire._buffers import tensors_bitwise_equal
from vllm_kvbridge.wire.codec import Encoded, encode
from vllm_kvbridge.wire.decode import decode_frames, decode_packed
from vllm_kvbridge.wire.dtypes import NUMPY_DTYPES, TORCH_DTYPES
from vllm_kvbridge.wire.kv_format import KVCacheTransferData
from vllm_kvbridge.wire.limits import DEFAULT_LIMITS, Limits

__all__ = [
    "DEFAULT_LIMITS",
    "NUMPY_DTYPES",
    "TORCH_DTYPES",
    "Encoded",
    "KVCacheTransferData",
    "Limits",
    "PayloadError",
    "decode_frames",
    "decode_packed",
    "encode",
    "tensors_bitwise_equal",
]
