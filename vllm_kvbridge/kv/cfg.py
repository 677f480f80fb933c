"""CFG companions: a request's primary KV plus the caches its guidance branches need.

The sender files a companion under the *primary's* request id with its own purpose (e.g.
``"cfg_neg"``; ``finished_reqs[...]["purpose"]``). The receiver names the companions a
request needs through one hook, ``cfg_kv_collect_func(req) -> Iterable[str]`` of purposes
(never ``"kv"``, no duplicates), and :func:`receive_with_companions` receives the primary and
every companion within **one** deadline; a cache that fails or does not come raises its
error (same class) naming it: ``CFG companion 'cfg_neg' of <request>: ...``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from vllm_kvbridge.connectors.keys import KV
from vllm_kvbridge.errors import ConfigError, TransferError
from vllm_kvbridge.kv.receive import KVReceiver, ReceivedKV

__all__ = ["CollectFunc", "companion_purposes", "receive_with_companions"]

#: The hook that names a request's companion caches by purpose.
CollectFunc = Callable[[Any], Iterable[str]]


def companion_purposes(cfg_kv_collect_func: CollectFunc | None, req: Any) -> list[str]:
    """The purposes ``cfg_kv_collect_func(req)`` names, checked (no ``"kv"``, no duplicates)."""
    purposes = list(cfg_kv_collect_func(req)) if cfg_kv_collect_func is not None else []
    if KV in purposes or len(set(purposes)) != len(purposes):
        raise ConfigError(f"cfg_kv_collect_func returned invalid purposes {purposes!r}")
    return purposes


def receive_with_companions(
    receiver: KVReceiver,
    recv_timeout: float,
    rid: str,
    cfg_kv_collect_func: CollectFunc | None,
    req: Any,
    target_device: Any,
    sender_info: Mapping[str, Any] | None,
) -> ReceivedKV:
    """The primary KV of ``rid`` and its companions, all within ``recv_timeout`` seconds."""
    deadline = time.monotonic() + recv_timeout
    purposes = companion_purposes(cfg_kv_collect_func, req)
    with _naming(rid, KV, bool(purposes)):
        data, nbytes = receiver.receive(rid, KV, target_device, sender_info, deadline)
    companions = {}
    for purpose in purposes:
        # The same deadline: after a failure nothing waits again, and a late companion
        # cannot stretch the request past one recv_timeout.
        with _naming(rid, purpose, True):
            companions[purpose], n = receiver.receive(rid, purpose, target_device, sender_info, deadline)
        nbytes += n
    return ReceivedKV(rid, data, companions, nbytes)


@contextlib.contextmanager
def _naming(rid: str, purpose: str, cfg: bool) -> Iterator[None]:
    """Re-raise a transfer error of one cache of a guided request with the cache named."""
    try:
        yield
    except TransferError as exc:
        if not cfg:
            raise
        what = "primary KV 'kv'" if purpose == KV else f"CFG companion {purpose!r}"
        raise type(exc)(f"{what} of {rid}: {exc}") from exc
