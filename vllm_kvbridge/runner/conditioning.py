"""Per-step conditioning: a consumer LLM stage whose model takes, at each position, a row
of the producer's streamed payload (``payload.feed: per_step`` on an input edge).

The thinker -> talker case: the talker's position ``p`` is conditioned on the thinker's
hidden state of position ``p`` (its prompt rows first, then one row per generated token),
and the talker starts as soon as the first chunk lands instead of after the whole stream.

Who does what (vLLM's own split: the connector owns transfer state, the runner feeds it):

* :class:`ConditioningFeeds` (here) lives with the scheduler half of
  :class:`~vllm_kvbridge.runner.vllm_connector.KVBridgeConnector`, in the engine-core
  process. It receives each fed request's stream on a
  :class:`~vllm_kvbridge.runner.payload_receiver.PayloadReceiver` (ordered chunks, the
  edge's ``recv_timeout_s`` for the first one and ``stall_timeout_s`` between two) and
  keeps the rows that arrived.
* The scheduler (:mod:`vllm_kvbridge.runner.conditioning_scheduler`) runs a fed request
  only for positions whose rows are there: a request that is ahead of its producer is left
  out of that step (the rest of the batch runs), and when every request waits the engine
  core sleeps on the feed's arrival event instead of spinning. A stream that fails (stall,
  the producer's abort, a corrupt chunk) fails its request with the reason.
* The connector puts the rows of each step's scheduled positions into the step's
  connector metadata (``conditioning``: internal id -> ``(first position, rows)``), which
  vLLM hands to every worker; the runner mixin gives them to the model.

Model hook contract (what the model receives, per step): a model on a fed stage has
``kvbridge_conditioning_dim: int`` and ``kvbridge_set_conditioning(rows)``, called before
every forward with ``rows`` of shape ``[num_scheduled_tokens, kvbridge_conditioning_dim]``,
one row per scheduled token in the order of the step's ``input_ids``. A fed request's row
at position ``p`` is the producer's row ``p``; positions at or past the end of a finished
stream get zeros (the model's "the producer said everything" input), as do the tokens of
requests that are not fed. :mod:`vllm_kvbridge.models.tiny_talker` is the reference model.

Rows are taken from the payload's ``hidden_states`` tensor (``[n, dim]``); a chunk without
it (the finish marker) only ends the stream. Rows are kept until the request ends, so a
preempted request recomputes its positions with the same rows.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_kvbridge.connectors.registry import create_connector
from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.runner.payload_receiver import PayloadReceiver
from vllm_kvbridge.runner.settings import PayloadEdgeSettings

logger = logging.getLogger(__name__)

#: The payload key whose rows condition the consumer (the producer's captured hidden states).
ROWS_KEY = "hidden_states"
#: Key of a request's feed options in ``extra_args["kvbridge"]``.
CONDITION_OPTION = "condition"


@dataclass
class _Feed:
    """One fed request: the rows that arrived, in position order."""

    transfer_id: str
    from_stage: str
    parts: list[torch.Tensor] = field(default_factory=list)
    count: int = 0
    final: bool = False
    #: the rows' width: the model's ``kvbridge_conditioning_dim`` when the stage knows it,
    #: else the first chunk's
    dim: int | None = None
    #: why the stream cannot be used, though it arrived (rows of the wrong width)
    error: str | None = None
    cache: torch.Tensor | None = None  # parts concatenated, rebuilt when a part arrives


class ConditioningFeeds:
    """The fed requests of one stage (scheduler side); see the module docstring.

    Thread model: the receivers' threads add rows (:meth:`_on_chunk`) and the engine-core
    thread reads them; one lock guards the feeds, one event wakes a waiting scheduler.
    """

    def __init__(self, stage_id: int | str, edges: tuple[PayloadEdgeSettings, ...]) -> None:
        self.stage_id = stage_id
        self._edges = {str(e.peer_stage): e for e in edges}
        self._receivers: dict[str, PayloadReceiver] = {}
        self._lock = threading.Lock()
        self._feeds: dict[str, _Feed] = {}  # vLLM internal request id -> feed
        self._by_transfer: dict[tuple[str, str], str] = {}  # (from stage, transfer id) -> internal id
        self._arrived = threading.Event()
        # Created now, not at the first request: a bad connector config fails the engine's
        # start, and the first request does not wait for the connector to be set up.
        for from_stage in self._edges:
            self._receiver(from_stage)

    def _receiver(self, from_stage: str) -> PayloadReceiver:
        edge = self._edges.get(from_stage)
        if edge is None:
            raise ConfigError(
                f"stage {self.stage_id} has no per_step payload input from stage {from_stage!r} "
                f"(it has {sorted(self._edges)})"
            )
        receiver = self._receivers.get(from_stage)
        if receiver is None:
            receiver = PayloadReceiver(
                create_connector(edge.connector, edge.connector_config),
                edge.peer_stage,
                self.stage_id,
                mode=edge.mode,
                recv_timeout_s=edge.recv_timeout_s,
                stall_timeout_s=edge.stall_timeout_s,
                close_connector=True,
            )
            self._receivers[from_stage] = receiver
        return receiver

    # -- requests ------------------------------------------------------------------------
    def expect(self, req_id: str, options: Mapping[str, Any], *, expect_dim: int | None = None) -> None:
        """Start receiving the stream ``options`` names (``from_stage``, ``transfer_id``,
        optional ``metadata`` for the connector) for vLLM request ``req_id``; ``expect_dim``:
        the width the model takes (rows of another width fail the request)."""
        from_stage = str(options.get("from_stage", next(iter(self._edges), "")))
        transfer_id = str(options.get("transfer_id") or "")
        if not transfer_id:
            raise ConfigError(f"request {req_id}: extra_args.kvbridge.condition needs a transfer_id")
        receiver = self._receiver(from_stage)
        with self._lock:
            self._feeds[req_id] = _Feed(transfer_id, from_stage, dim=expect_dim)
            self._by_transfer[(from_stage, transfer_id)] = req_id
        metadata = options.get("metadata")
        receiver.expect(
            transfer_id, metadata=dict(metadata) if metadata else None, on_chunk=self._on_chunk_of(from_stage)
        )

    def _on_chunk_of(self, from_stage: str) -> Any:
        def on_chunk(transfer_id: str, index: int, data: dict[str, Any]) -> None:
            self._on_chunk(from_stage, transfer_id, data)

        return on_chunk

    def _on_chunk(self, from_stage: str, transfer_id: str, data: Mapping[str, Any]) -> None:
        rows = data.get(ROWS_KEY)
        with self._lock:
            req_id = self._by_transfer.get((from_stage, transfer_id))
            feed = self._feeds.get(req_id) if req_id is not None else None
            if feed is None:
                return
            if feed.error is not None:
                return
            if rows is not None and not (isinstance(rows, torch.Tensor) and rows.dim() == 2):
                feed.error = f"its {ROWS_KEY!r} is not a [rows, dim] tensor"
            elif rows is not None and rows.shape[0]:
                if feed.dim is not None and rows.shape[1] != feed.dim:
                    feed.error = f"rows of width {rows.shape[1]}, the model takes {feed.dim}"
                else:
                    feed.dim = int(rows.shape[1])
                    feed.parts.append(rows.detach().to("cpu", torch.float32))
                    feed.count += int(rows.shape[0])
                    feed.cache = None
        self._arrived.set()

    def _final(self, feed: _Feed) -> bool:
        """Whether the stream ended: its receiver got the final chunk (rows of every chunk
        reach :meth:`_on_chunk` before the receiver marks the stream done). Lock held."""
        if not feed.final:
            receiver = self._receivers.get(feed.from_stage)
            status = receiver.status(feed.transfer_id) if receiver is not None else None
            feed.final = status is not None and status[0] == "done"
        return feed.final

    def tracks(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._feeds

    def ready(self, req_id: str, start: int, num_tokens: int) -> bool:
        """Whether positions ``[start, start + num_tokens)`` of ``req_id`` can run now: their
        rows arrived, or the stream ended (later positions get zeros). Unfed: always."""
        with self._lock:
            feed = self._feeds.get(req_id)
            if feed is None:
                return True
            return feed.count >= start + num_tokens or self._final(feed)

    def rows(self, req_id: str, start: int, num_tokens: int) -> torch.Tensor | None:
        """The rows of positions ``[start, start + num_tokens)`` (zeros past the end of the
        stream); None for a request that is not fed."""
        with self._lock:
            feed = self._feeds.get(req_id)
            if feed is None:
                return None
            if feed.cache is None and feed.parts:
                feed.cache = torch.cat(feed.parts) if len(feed.parts) > 1 else feed.parts[0]
                feed.parts = [feed.cache]
            dim = feed.dim or 0
            out = torch.zeros(num_tokens, dim, dtype=torch.float32)
            if feed.cache is not None and start < feed.count:
                got = feed.cache[start : min(start + num_tokens, feed.count)]
                out[: got.shape[0]] = got
            return out

    def failed(self) -> dict[str, str]:
        """Fed requests whose stream failed, with the reason (a stall names the chunk that
        did not come in time, an abort the producer's reason). They are forgotten here: the
        scheduler fails them."""
        out: dict[str, str] = {}
        with self._lock:
            for req_id, feed in self._feeds.items():
                if feed.error is not None:
                    where = f"payload of {feed.transfer_id!r} from stage {feed.from_stage}"
                    out[req_id] = f"{where}: {feed.error}"
                    continue
                receiver = self._receivers.get(feed.from_stage)
                status = receiver.status(feed.transfer_id) if receiver is not None else None
                if status is not None and status[0] == "failed":
                    out[req_id] = str(status[1])
        for req_id in out:
            self.cancel(req_id)
        return out

    def cancel(self, req_id: str) -> None:
        """``req_id`` ended (finished, aborted, failed): stop its receive, drop its rows."""
        with self._lock:
            feed = self._feeds.pop(req_id, None)
            if feed is None:
                return
            self._by_transfer.pop((feed.from_stage, feed.transfer_id), None)
            receiver = self._receivers.get(feed.from_stage)
        if receiver is not None:
            receiver.cancel(feed.transfer_id)

    def wait(self, timeout: float) -> bool:
        """Sleep until a chunk arrives (True) or ``timeout`` passes."""
        got = self._arrived.wait(timeout)
        self._arrived.clear()
        return got

    def close(self) -> None:
        with self._lock:
            receivers, self._receivers = list(self._receivers.values()), {}
            self._feeds.clear()
            self._by_transfer.clear()
        for receiver in receivers:
            receiver.close()


def step_rows(
    conditioning: Mapping[str, tuple[int, torch.Tensor]],
    req_ids: list[str],
    num_scheduled_tokens: Mapping[str, int],
    dim: int,
) -> torch.Tensor:
    """The model's rows of one step (worker side): ``[num_scheduled_tokens, dim]`` in the
    step's token order (``req_ids``: the runner's batch order), each fed request's rows at
    its tokens and zeros elsewhere (see the hook contract in the module docstring)."""
    total = sum(num_scheduled_tokens.get(r, 0) for r in req_ids)
    out = torch.zeros(total, dim, dtype=torch.float32)
    offset = 0
    for req_id in req_ids:
        n = num_scheduled_tokens.get(req_id, 0)
        got = conditioning.get(req_id)
        if got is not None and n:
            rows = got[1]
            if rows.shape[0] != n or (rows.numel() and rows.shape[1] != dim):
                raise ConfigError(
                    f"request {req_id}: conditioning rows {tuple(rows.shape)} for {n} scheduled "
                    f"token(s) of a model that takes {dim}-wide rows"
                )
            if rows.numel():
                out[offset : offset + n] = rows
        offset += n
    return out
