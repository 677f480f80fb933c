"""The KV compatibility handshake: what a sender's KV is, checked before a receiver uses it.

A sender declares its KV in each put's metadata (``metadata["kv_spec"]``): the model, the
dtype, the layer count, the total KV heads and the head dim, plus a fingerprint (a hash
of those fields, to compare at a glance in logs). A receiver states what it expects
(``KVTransferConfig.expect_kv``, filled from the consuming module where it says, e.g.
the tiny DiT's ``kv_heads`` / ``kv_head_dim``). :func:`check_kv_compat` runs on every
received KV, after the TP pieces are merged and before anyone reads a tensor:

* the tensors that arrived must be what the sender declared (layers, head dim, dtype);
* every expected field must equal the sender's (declared, else measured on the tensors).

A mismatch raises :class:`KVMismatch` naming each field with both sides' values, which
fails that request (never a reshape error deep in a model, never garbage).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from vllm_kvbridge.errors import TransferCorrupt

#: Key of the sender's declaration in a KV put's metadata.
KV_SPEC_KEY = "kv_spec"
#: The fields of a declaration / an expectation.
FIELDS = ("model", "dtype", "num_layers", "num_kv_heads", "head_dim")


class KVMismatch(TransferCorrupt):
    """The KV that arrived is not the KV this receiver can use (the message says how)."""


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def fingerprint(fields: Mapping[str, Any]) -> str:
    """A short stable hash of the declared fields (absent ones count as null)."""
    canon = json.dumps({k: fields.get(k) for k in FIELDS}, sort_keys=True)
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def kv_spec(
    *, model: str | None, dtype: Any, num_layers: int, num_kv_heads: int, head_dim: int
) -> dict[str, Any]:
    """A sender's declaration (JSON-safe), with its fingerprint."""
    fields = {
        "model": model,
        "dtype": _dtype_name(dtype),
        "num_layers": int(num_layers),
        "num_kv_heads": int(num_kv_heads),
        "head_dim": int(head_dim),
    }
    return {**fields, "fingerprint": fingerprint(fields)}


def check_expectation(expect: Mapping[str, Any] | None, path: str = "expect_kv") -> dict[str, Any] | None:
    """Validate a receiver's expectation (config time): known fields, sane values."""
    if expect is None:
        return None
    unknown = sorted(set(expect) - set(FIELDS))
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {unknown} (known: {list(FIELDS)})")
    for name in ("num_layers", "num_kv_heads", "head_dim"):
        value = expect.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{path}.{name}: must be a positive int, got {value!r}")
    return {k: (_dtype_name(v) if k == "dtype" else v) for k, v in expect.items() if v is not None}


def check_kv_compat(data: Any, expect: Mapping[str, Any] | None, *, receiver: str = "this stage") -> None:
    """Raise :class:`KVMismatch` unless ``data`` (a merged ``KVCacheTransferData``) is what its
    sender declared and what ``expect`` asks for (see the module docstring)."""
    declared = dict((data.metadata or {}).get(KV_SPEC_KEY) or {})
    keys = [k for k in data.key_cache if k is not None]
    measured: dict[str, Any] = {"num_layers": len(data.key_cache)}
    if keys:
        measured["dtype"] = _dtype_name(keys[0].dtype)
        measured["head_dim"] = int(keys[0].shape[-1])
    problems = [
        f"{name}: declared {declared[name]!r}, arrived {measured[name]!r}"
        for name in ("num_layers", "dtype", "head_dim")
        if name in declared and name in measured and declared[name] != measured[name]
    ]
    if problems:
        raise KVMismatch(
            f"KV of request {data.request_id!r} is not what its sender declared: " + "; ".join(problems)
        )
    sender = {**measured, **{k: declared[k] for k in FIELDS if declared.get(k) is not None}}
    if data.num_kv_heads_total is not None:
        sender.setdefault("num_kv_heads", int(data.num_kv_heads_total))
    elif keys and "num_kv_heads" not in sender:
        sender["num_kv_heads"] = int(keys[0].shape[1])
    mismatched = [
        f"{name}: sender {sender.get(name)!r}, {receiver} expects {want!r}"
        for name, want in (expect or {}).items()
        if name in sender and sender[name] != want
    ]
    if mismatched:
        theirs = declared.get("fingerprint") or fingerprint(sender)
        raise KVMismatch(
            f"KV of request {data.request_id!r} does not match what {receiver} expects: "
            + "; ".join(mismatched)
            + f" (sender KV spec {theirs}, expected {fingerprint({**sender, **expect})})"  # type: ignore[dict-item]
        )


__all__ = ["FIELDS", "KV_SPEC_KEY", "KVMismatch", "check_expectation", "check_kv_compat", "kv_spec"]
