"""What an LLM stage's finished requests still wait for, from its workers' pushed outcomes.

A request that finished in vLLM is reported (``StageDone``) only once its sends settled:
its KV on every worker when the connector told vLLM a send is owed, its payload on the
payload rank when the stage captures. The workers push each transfer's outcome as it
starts and settles (:mod:`vllm_kvbridge.runner.outcomes`); :class:`AwaitedSends` keeps
them per transfer id and judges a request: wait, ready (with the sender info the consumer
needs), or failed (with the reason). Nobody polls: the stage engine sleeps on the inbox.

A send that is owed but never even starts within :data:`SEND_START_TIMEOUT_S` fails its
request (an ``on_finish`` send starts in the step after the finish); once started, a
send's own deadlines (``send_timeout``, retries) bound it and it settles either way.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from vllm_kvbridge.pipeline.sender_info import merge_kv_info
from vllm_kvbridge.runner.outcomes import OutcomeInbox, TransferOutcome
from vllm_kvbridge.runner.transfer_status import TransferStatus, failed

#: How long a finished request whose send is owed may wait for it to start.
SEND_START_TIMEOUT_S = 60.0
#: Transfer ids whose outcomes are kept (a request's arrive before and after its finish;
#: those of requests aborted or failed elsewhere age out).
MAX_KEPT = 65536


@dataclass
class _Sends:
    kv: dict[int, TransferOutcome] = field(default_factory=dict)  # worker pid -> latest
    payload: TransferOutcome | None = None


@dataclass(frozen=True)
class Verdict:
    #: "wait" | "ready" | "failed"
    state: str
    error: str = ""
    sender_info: dict[str, Any] = field(default_factory=dict)


_WAIT = Verdict("wait")


class AwaitedSends:
    """Outcomes per transfer id, and the verdict on a finished request (see the module doc)."""

    def __init__(self, inbox: OutcomeInbox, workers: int) -> None:
        self.inbox = inbox
        self.workers = workers  # KV outcomes owed per send: one per worker process
        self._sends: OrderedDict[str, _Sends] = OrderedDict()

    def take(self, timeout_s: float = 0.0) -> bool:
        """File what arrived (waiting up to ``timeout_s`` for the first); True if anything did."""
        got = self.inbox.take(timeout_s)
        for outcome in got:
            sends = self._sends.get(outcome.transfer_id)
            if sends is None:
                sends = self._sends[outcome.transfer_id] = _Sends()
                while len(self._sends) > MAX_KEPT:
                    self._sends.popitem(last=False)
            if outcome.what == "kv":
                sends.kv[outcome.pid] = outcome
            else:
                sends.payload = outcome
        return bool(got)

    def forget(self, transfer_id: str) -> None:
        self._sends.pop(transfer_id, None)

    def verdict(
        self, transfer_id: str, *, kv_owed: bool, payload_owed: bool, must_send_kv: bool, finished_at: float
    ) -> Verdict:
        """``kv_owed``: the connector told vLLM it sends the request's KV; ``payload_owed``:
        the stage captures it; ``must_send_kv``: a CFG group member, useless without its KV."""
        sends = self._sends.get(transfer_id) or _Sends()
        outcomes = [*sends.kv.values(), *([sends.payload] if sends.payload else [])]
        for o in outcomes:
            if o.status == TransferStatus.FAILED:
                return Verdict("failed", failed(o.reason))
        late = time.time() - finished_at >= SEND_START_TIMEOUT_S
        if kv_owed:
            if len(sends.kv) < self.workers:
                # Not started on every worker yet (on_finish sends in the next step).
                if not late:
                    return _WAIT
                return Verdict(
                    "failed", f"its KV send was owed but never started within {SEND_START_TIMEOUT_S:g} s"
                )
            if any(o.status == TransferStatus.PENDING for o in sends.kv.values()):
                return _WAIT
        elif must_send_kv:
            return Verdict("failed", "its KV was not sent (status none)")
        if payload_owed:
            if sends.payload is None:
                if not late:
                    return _WAIT
                return Verdict(
                    "failed", f"its payload was owed but never started within {SEND_START_TIMEOUT_S:g} s"
                )
            if sends.payload.status == TransferStatus.PENDING:
                return _WAIT
        info = merge_kv_info([{"kv": {transfer_id: o.info}} for o in sends.kv.values()], transfer_id)
        payload = (sends.payload.info.get("payload") if sends.payload else None) or {}
        if payload:
            info["payload"] = dict(payload)
        return Verdict("ready", sender_info=info)


__all__ = ["MAX_KEPT", "SEND_START_TIMEOUT_S", "AwaitedSends", "Verdict"]
