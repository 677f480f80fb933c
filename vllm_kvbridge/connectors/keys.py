"""The one place transfer keys are built.

A key names one transfer on one edge: ``(request id, from stage, to stage, purpose,
chunk index, sender rank, receiver rank)``. Its string form is used verbatim as a
shared-memory segment name suffix, a ZMQ lookup key and a Mooncake store key, so it

* uses only ``[A-Za-z0-9_.-]`` (safe in /dev/shm, in URLs and in store keys),
* is unambiguous: every field has a fixed prefix and a separator that cannot occur
  inside a field (the edge's two stage names are escaped by :func:`edge_name`, so a ``-``
  inside a stage name never reads as the separator), and user-supplied request ids that
  are not already safe are hashed (prefix ``h``) while safe ones are kept readable
  (prefix ``i``),
* is bounded in length (hashing caps long ids).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from vllm_kvbridge.errors import ConfigError

_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SAFE_PART = re.compile(r"[A-Za-z0-9_-]{1,32}")
_KEY = re.compile(
    r"kvb\.(?P<src>[A-Za-z0-9_]+)-(?P<dst>[A-Za-z0-9_]+)\.(?P<purpose>[A-Za-z0-9_-]+)"
    r"\.(?P<rid>[ih][A-Za-z0-9_-]+)\.c(?P<chunk>n|\d+)\.r(?P<srank>\d+)-(?P<drank>\d+)"
)

#: Purposes the library itself uses; users may add their own (``[A-Za-z0-9_-]``).
KV = "kv"
PAYLOAD = "payload"
CHUNK = "chunk"


def encode_request_id(request_id: str) -> str:
    """Readable when safe (``i<id>``), otherwise a stable hash (``h<32 hex>``)."""
    if not isinstance(request_id, str) or not request_id:
        raise ConfigError(f"request id must be a non-empty string, got {request_id!r}")
    if _SAFE_ID.fullmatch(request_id):
        return "i" + request_id
    digest = hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()
    return "h" + digest[:32]


def _stage_part(stage: int | str, what: str) -> str:
    text = str(stage)
    if not _SAFE_PART.fullmatch(text):
        raise ConfigError(f"{what} {stage!r} must match [A-Za-z0-9_-]{{1,32}}")
    return text


def _escape(part: str) -> str:
    # "_" doubles and "-" becomes "_d": the escaped form has no "-", so "-" can separate.
    return part.replace("_", "__").replace("-", "_d")


def _unescape(part: str) -> str:
    return re.sub(r"_(_|d)", lambda m: "_" if m.group(1) == "_" else "-", part)


def edge_name(from_stage: int | str, to_stage: int | str) -> str:
    """The unambiguous, ``[A-Za-z0-9_-]{1,64}`` name of an edge, e.g. ``"0-1"``.

    Used in transfer keys and as the default shared-memory namespace. Stage names are
    escaped so that ``("a-b", "c")`` and ``("a", "b-c")`` never meet; numeric stages stay
    as they are.
    """
    src = _escape(_stage_part(from_stage, "from_stage"))
    dst = _escape(_stage_part(to_stage, "to_stage"))
    return f"{src}-{dst}"


@dataclass(frozen=True)
class TransferKey:
    """Typed parts of a key; :meth:`encode` gives the string every connector uses."""

    request_id: str
    from_stage: int | str
    to_stage: int | str
    purpose: str = KV
    chunk: int | None = None
    from_rank: int = 0
    to_rank: int = 0

    def encode(self) -> str:
        edge = edge_name(self.from_stage, self.to_stage)
        purpose = _stage_part(self.purpose, "purpose")
        if self.chunk is not None and (not isinstance(self.chunk, int) or self.chunk < 0):
            raise ConfigError(f"chunk index must be a non-negative int, got {self.chunk!r}")
        for name in ("from_rank", "to_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a non-negative int, got {value!r}")
        chunk = "n" if self.chunk is None else str(self.chunk)
        rid = encode_request_id(self.request_id)
        return f"kvb.{edge}.{purpose}.{rid}.c{chunk}.r{self.from_rank}-{self.to_rank}"

    def __str__(self) -> str:
        return self.encode()


def parse_key(key: str) -> dict[str, str | int | None]:
    """Split an encoded key back into its parts (stage names decoded, request id encoded)."""
    match = _KEY.fullmatch(key)
    if match is None:
        raise ConfigError(f"not a kvbridge transfer key: {key!r}")
    parts = match.groupdict()
    chunk = parts.pop("chunk")
    return {
        **parts,
        "src": _unescape(parts["src"]),
        "dst": _unescape(parts["dst"]),
        "chunk": None if chunk == "n" else int(chunk),
        "srank": int(parts["srank"]),
        "drank": int(parts["drank"]),
    }


def kv_key(
    request_id: str,
    from_stage: int | str,
    to_stage: int | str,
    *,
    from_rank: int = 0,
    to_rank: int = 0,
    purpose: str = KV,
) -> str:
    """Key of a request's KV cache on an edge (``purpose`` distinguishes CFG companions)."""
    return TransferKey(request_id, from_stage, to_stage, purpose, None, from_rank, to_rank).encode()


def payload_key(
    request_id: str,
    from_stage: int | str,
    to_stage: int | str,
    *,
    chunk: int | None = None,
    from_rank: int = 0,
    to_rank: int = 0,
) -> str:
    """Key of a full payload (``chunk=None``) or of one async chunk."""
    purpose = PAYLOAD if chunk is None else CHUNK
    return TransferKey(request_id, from_stage, to_stage, purpose, chunk, from_rank, to_rank).encode()
