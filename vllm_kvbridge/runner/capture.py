"""Hidden-state capture bookkeeping: one implementation for every vLLM runner and both
scheduling modes (nothing here imports vLLM).

Rows come from the forward, token ids from the scheduler, and they are paired by
position. The row at position ``p`` (a request's final hidden state there) is what the
token at ``p + 1`` was sampled from. The runner hooks (V1: ``_model_forward``; V2:
``sample_tokens`` before vLLM's own) record each step's rows of each captured request as
a :class:`RowBlock` (first position, count, the rows on their way to the host). The
scheduler half of the KV connector ships each request's generated token ids, the ones
vLLM's scheduler accepted (``Request.output_token_ids``), in the step metadata
(:class:`CaptureUpdate`). A block is emitted once the token of its last row is known.

Why the scheduler's tokens and not the runner's sampled output: with async scheduling
(vLLM's GPU default) a step's sampled ids reach the host only after the next step's
forward, and a request that stopped at step ``k`` still runs step ``k + 1`` (scheduled
before the stop was known). That step's rows and tokens were never part of the request.
The scheduler's list is the request's output, on V1, V2, synchronous or asynchronous
scheduling alike. At the request's end the final list says how many rows belong to it
(prompt + generated - 1); rows beyond are dropped (:meth:`RequestCapture.take_ready`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_kvbridge.wire.host_staging import StagedRows


@dataclass(frozen=True)
class CaptureUpdate:
    """The scheduler half's word on one capturing request, in one step's metadata.

    The first update of a request announces it (the workers capture only announced
    requests); later ones carry the output tokens generated since the previous one.
    """

    transfer_id: str
    num_prompt_tokens: int
    #: index in the request's output tokens of ``tokens[0]``
    start: int
    tokens: tuple[int, ...] = ()


@dataclass
class CapturingRequest:
    """The scheduler half's cursor on one capturing request (``request``: vLLM's ``Request``)."""

    request: Any
    transfer_id: str
    announced: bool = False
    shipped: int = 0  # output tokens already sent to the workers

    def update(self) -> CaptureUpdate | None:
        """This step's update: the announcement, or the tokens accepted since the last one."""
        if self.announced and len(self.request.output_token_ids) == self.shipped:
            return None
        return self.final_update()

    def final_update(self) -> CaptureUpdate:
        """The rest of the request's output (sent with its end, even when empty)."""
        outputs = self.request.output_token_ids
        start, self.shipped, self.announced = self.shipped, len(outputs), True
        return CaptureUpdate(self.transfer_id, self.request.num_prompt_tokens, start, tuple(outputs[start:]))


class StepRows:
    """One step's hidden rows of every captured request, in one device-to-host copy
    (:class:`~vllm_kvbridge.wire.host_staging.StagedRows`); each request takes its own
    rows once, when its block is emitted (by then the copy has long completed)."""

    __slots__ = ("_rows", "_staged")

    def __init__(self) -> None:
        self._staged: StagedRows | None = None
        self._rows: dict[Any, torch.Tensor] | None = None

    def stage(self, source: torch.Tensor, spans: dict[str, tuple[int, int]]) -> None:
        self._staged = StagedRows(source, spans)

    def take(self, req_id: str) -> torch.Tensor | None:
        if self._rows is None:
            staged, self._staged = self._staged, None
            self._rows = staged.take() if staged is not None else {}
        return self._rows.pop(req_id, None)


@dataclass
class RowBlock:
    """One step's rows of one request: positions ``[first, first + n)``."""

    req_id: str
    first: int
    n: int
    #: the subclass hook's tensors (``kvbridge_step_extras``), one row per hidden row
    extras: dict[str, torch.Tensor]
    #: where its hidden rows are (None when hidden states are not captured)
    rows: StepRows | None


class CaptureError(RuntimeError):
    """The request's capture cannot be completed (its payload fails with this reason)."""


@dataclass
class RequestCapture:
    """What the runner holds for one captured request until it ends."""

    transfer_id: str
    num_prompt_tokens: int
    #: generated token ids the scheduler reported so far
    tokens: list[int] = field(default_factory=list)
    blocks: deque[RowBlock] = field(default_factory=deque)
    #: positions whose rows were recorded (recomputed rows after a preemption are skipped)
    captured: int = 0

    def add_tokens(self, update: CaptureUpdate) -> None:
        have = len(self.tokens)
        if update.start > have:
            raise CaptureError(
                f"the scheduler's tokens {have}..{update.start - 1} of this request never arrived"
            )
        self.tokens.extend(update.tokens[have - update.start :])

    def take_ready(
        self, *, final: bool, hidden: bool, token_ids: bool
    ) -> list[tuple[dict[str, torch.Tensor], int]]:
        """The blocks whose every row's next token is known, as step outputs
        ``(tensors, generated tokens)``, in position order. ``final``: the request ended and
        ``tokens`` is its whole output; rows past the last generated token's own position
        (never part of the request, see the module docstring) are dropped."""
        prompt = self.num_prompt_tokens
        # Rows at positions < limit have their next token known.
        limit = prompt + len(self.tokens) - 1
        if final and self.captured < limit:
            raise CaptureError(
                f"rows of positions {self.captured}..{limit - 1} never arrived from the forward"
            )
        out: list[tuple[dict[str, torch.Tensor], int]] = []
        while self.blocks:
            block = self.blocks[0]
            end = block.first + block.n
            if end > limit and not final:
                break
            self.blocks.popleft()
            rows = block.rows.take(block.req_id) if block.rows is not None else None
            stop = min(end, limit)
            kept = stop - block.first
            if kept <= 0:
                continue
            step: dict[str, torch.Tensor] = {
                k: v[:kept] if kept < block.n and v.dim() and v.shape[0] == block.n else v
                for k, v in block.extras.items()
            }
            if hidden and rows is not None:
                step["hidden_states"] = rows[:kept]
            # The generated tokens these rows produced: row p -> output index p + 1 - prompt.
            lo, hi = max(block.first, prompt - 1) + 1 - prompt, stop + 1 - prompt
            new = self.tokens[lo:hi] if hi > lo else []
            if token_ids:
                step["token_ids"] = torch.tensor(new, dtype=torch.int64)
            out.append((step, len(new)))
        return out
