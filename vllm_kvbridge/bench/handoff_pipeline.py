"""``vllm-kvbridge bench handoff --pipeline CONFIG``: the stage-to-stage handoff of a real pipeline.

Runs the config's pipeline (its engines, the tiny offline model where a stage names none)
and sends ``--requests`` requests one at a time after one warm-up, so each handoff is
measured alone. For every edge whose consumer reported when it held the producer's whole
payload (``TransferStat.ready_at``: payload edges fed as prompt embeddings, full or
async-chunk), two rows, from the producer's last token (``last_token_at``, taken in the
producer's stage process after the engine step that made it):

* ``... ready``: to the payload complete in the consumer stage. In between: the producer's
  engine runs one more step, in which the runner puts the payload (or the stream's last
  chunk); the consumer's receiver gets it (woken by the sender's doorbell); for a full
  payload, the producer's stage reports it done and the orchestrator submits the consumer
  first, so the consumer only starts receiving then;
* ``... 1st token``: to the consumer's first token, i.e. also its first engine step (the
  prefill of the prompt embeddings).

All these times are ``time.time()`` of stage processes on one host. The ceiling is the
edge's bare transport (as in :mod:`vllm_kvbridge.bench.handoff`) for the payload's size,
measured in the same run. Edges fed per step (the consumer runs before the producer ends)
and KV edges are not measured here.
"""

from __future__ import annotations

from typing import Any

from vllm_kvbridge.bench.handoff import Row, ceiling_times, make_row

PROMPT = "A cute cat"


def _alias(name: str) -> str:
    from vllm_kvbridge.connectors.registry import canonical_name

    for alias in ("shm", "zmq", "mooncake", "mooncake-te", "nixl"):
        if canonical_name(alias) == name:
            return alias
    return name


def collect(results: list[Any]) -> dict[tuple[int, int], tuple[int, list[float], list[float]]]:
    """(from, to) -> (payload bytes, last token -> ready, last token -> consumer's first token),
    seconds, over ``results`` (:class:`~vllm_kvbridge.pipeline.results.RequestResult`)."""
    out: dict[tuple[int, int], tuple[int, list[float], list[float]]] = {}
    for r in results:
        stages = {s.stage_id: s for s in r.stages}
        for t in r.transfers:
            edge = (t.from_stage, t.to_stage)
            ready = r.handoff_s(*edge)
            consumer = stages.get(t.to_stage)
            if ready is None or consumer is None or not consumer.first_token_at:
                continue
            _, readies, firsts = out.setdefault(edge, (t.nbytes, [], []))
            readies.append(ready)
            firsts.append(consumer.first_token_at - stages[t.from_stage].last_token_at)
    return out


def run_pipeline_handoff(
    config: str, requests: int, repeat: int, idle_ms: float, prompt: str = PROMPT, model: str | None = None
) -> list[Row]:
    """Rows for every measured edge of ``config``'s pipeline (see the module docstring);
    ``model`` (default: the tiny Llama) runs its LLM stages that name none."""
    from vllm_kvbridge.config.resolve import resolve
    from vllm_kvbridge.pipeline import Pipeline

    plan = resolve(config)
    if any(s.is_llm and not s.model for s in plan.stages):
        from vllm_kvbridge.models.tiny_lm import ensure_tiny_model

        plan = plan.with_model(model or str(ensure_tiny_model()))
    with Pipeline(plan) as pipe:
        pipe.generate([prompt])  # warm-up: first requests compile and fault pools in
        results = [pipe.generate([prompt])[0] for _ in range(requests)]
    connectors = {(e.from_stage, e.to_stage): e.connector.name for s in plan.stages for e in s.inputs}
    rows = []
    for (a, b), (nbytes, readies, firsts) in sorted(collect(results).items()):
        name = connectors.get((a, b), "?")
        ceiling = ceiling_times(name, nbytes, repeat, idle_ms)
        for what, times in (("ready", readies), ("1st token", firsts)):
            rows.append(
                make_row(_alias(name), f"{plan.name} {a}->{b} {what}", nbytes, times, ceiling, idle_ms)
            )
    if not rows:
        raise ValueError(
            f"{config}: no edge reported when its consumer held the payload (edges fed per step and "
            "KV edges are not measured; try a thinker_talker config fed prompt embeddings)"
        )
    return rows
