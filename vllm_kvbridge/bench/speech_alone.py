"""The speech pipeline's stages alone: the ceiling of ``bench speech``'s figures.

``bench speech`` measures the streaming thinker -> talker -> vocoder pipeline through the
server; this measures, in the same run and on the same inputs (prompts, ``max_tokens``,
greedy sampling, the same tiny models), what each stage does when it runs **alone**, with
its input already whole. Method: the same stage config with every payload edge switched
from ``async_chunk`` to ``full`` (a stage starts only once its producer finished and its
whole payload was sent, so for one request no two stages run at the same time) and the
talker's ``max_tokens`` set to its ``chunk_size`` (so its last code is its first chunk,
and the vocoder is handed exactly one whole chunk of codes), run as an in-process
:class:`~vllm_kvbridge.pipeline.orchestrator.Pipeline` with real vLLM engines. Per
request, from the stage records (``time.time()``, one clock for the stages of a host):

* thinker: its submission -> its ``chunk_size``-th token, when its first chunk of hidden
  states leaves (the prompt's rows and its first ``chunk_size`` tokens'): the first token's
  time plus ``chunk_size - 1`` of its own decode steps (the stage records give its first
  and last token times; a step is their gap over the tokens between);
* talker: its submission (the thinker's rows are whole by then) -> its ``chunk_size``-th
  code (its first chunk);
* vocoder: its submission (the chunk is whole) -> its first audio.

Their sum is the first-packet ceiling: the streaming pipeline cannot get its first audio
out sooner than the stages need for it alone, without HTTP, the orchestrator's hops or
each other's load. The per-code step times (thinker and talker: (last - first token) /
(tokens - 1); vocoder: its chunk's time / the chunk's codes) give the real-time-factor
ceiling: after its first chunk, a streaming request makes one code per step of its
slowest stage at best. ``concurrency`` requests are submitted together for the ceiling
of that concurrency (their stages batch, as the server's do).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class StagesAlone:
    """One request's stage times (seconds) in the sequential run."""

    thinker_chunk_s: float
    talker_chunk_s: float
    vocoder_first_s: float
    thinker_step_s: float
    talker_step_s: float
    vocoder_step_s: float

    @property
    def first_packet_s(self) -> float:
        return self.thinker_chunk_s + self.talker_chunk_s + self.vocoder_first_s

    @property
    def step_s(self) -> float:
        """The slowest stage's time per code: the streaming pipeline's pace at best."""
        return max(self.thinker_step_s, self.talker_step_s, self.vocoder_step_s)

    def request_s(self, codes: int, chunk: int) -> float:
        """The least time a streaming request of ``codes`` codes can take."""
        return self.first_packet_s + max(0, codes - chunk) * self.step_s


def sequential_config(stage_config: str | Path, out_dir: Path) -> tuple[Path, int, int]:
    """Write the config the stages run alone with (see the module docstring) into
    ``out_dir``; return its path and the thinker's and the talker's chunk sizes."""
    import yaml

    cfg = yaml.safe_load(Path(stage_config).read_text())
    stages = {int(s["stage_id"]): s for s in cfg["stages"]}
    if sorted(stages) != [0, 1, 2] or stages[2].get("kind") != "vocoder":
        raise ValueError(f"{stage_config}: bench speech wants a thinker -> talker -> vocoder config")
    for s in stages.values():
        s.setdefault("payload", {})["mode"] = "full"
    thinker_chunk = int(stages[0]["payload"].get("chunk_size", 16))
    chunk = int(stages[1]["payload"].get("chunk_size", 16))
    stages[1].setdefault("default_sampling_params", {})["max_tokens"] = chunk
    path = out_dir / "stages_alone.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path, thinker_chunk, chunk


def _times(result: Any, thinker_chunk: int) -> StagesAlone:
    st = {s.stage_id: s for s in result.stages}

    def step(s: Any) -> float:
        n = len(s.output.get("token_ids") or [])
        return (s.last_token_at - s.first_token_at) / (n - 1) if n > 1 else 0.0

    thinker = st[0]
    # its first chunk leaves at its chunk_size-th token, or with the last one if it made fewer
    chunk_at = min(thinker.first_token_at + (thinker_chunk - 1) * step(thinker), thinker.last_token_at)
    vocoder_first = st[2].first_token_at - st[2].submitted
    return StagesAlone(
        thinker_chunk_s=chunk_at - thinker.submitted,
        talker_chunk_s=st[1].last_token_at - st[1].submitted,
        vocoder_first_s=vocoder_first,
        thinker_step_s=step(st[0]),
        talker_step_s=step(st[1]),
        vocoder_step_s=vocoder_first / max(1, int(st[2].output.get("rows") or 1)),
    )


def measure_stages_alone(
    stage_config: str | Path,
    model: str,
    concurrency: list[int],
    repeats: int,
    prompt: Any,
    params: dict[str, Any] | None,
) -> tuple[dict[int, list[list[StagesAlone]]], int]:
    """Per concurrency, per repeat: each request's :class:`StagesAlone`; and the chunk size.

    ``prompt(i)`` is request ``i``'s prompt (the server's load uses the same); ``params``
    the first stage's sampling overrides. One warm-up batch per concurrency first (not counted)."""
    from vllm_kvbridge.pipeline.orchestrator import Pipeline

    out: dict[int, list[list[StagesAlone]]] = {c: [] for c in concurrency}
    with tempfile.TemporaryDirectory(prefix="kvbridge-speech-alone-") as tmp:
        path, thinker_chunk, chunk = sequential_config(stage_config, Path(tmp))
        with Pipeline.from_config(path, model=model, log_dir=Path(tmp) / "logs") as pipe:
            for c in concurrency:  # warm-up at every batch size, not counted
                pipe.generate([prompt(i) for i in range(c)], params)
            for _ in range(repeats):
                for c in concurrency:
                    results = pipe.generate([prompt(i) for i in range(c)], params)
                    out[c].append([_times(r, thinker_chunk) for r in results])
    return out, chunk


__all__ = ["StagesAlone", "measure_stages_alone", "sequential_config"]
