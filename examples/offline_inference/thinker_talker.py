"""Thinker hidden states -> talker, through the Python API.

python examples/offline_inference/thinker_talker.py [--config stage_configs/thinker_talker_async_chunk.yaml]
python examples/offline_inference/thinker_talker.py --config stage_configs/thinker_talker_vocoder.yaml

The default config hands the talker the thinker's hidden states as prompt embeddings once
per request; thinker_talker_async_chunk.yaml streams them and the built-in tiny talker is
conditioned on them position by position while the thinker still generates;
thinker_talker_vocoder.yaml streams end to end: the tiny talker, fed per step, streams its
codes to a vocoder stage that turns them into audio chunk by chunk while the thinker and
the talker still generate (one WAV per prompt here).
"""

from __future__ import annotations

import argparse

from vllm_kvbridge.models.tiny_lm import ensure_tiny_model
from vllm_kvbridge.pipeline import Pipeline
from vllm_kvbridge.pipeline.audio import encode_wav


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="stage_configs/thinker_talker_full_payload.yaml")
    args = parser.parse_args()
    with Pipeline.from_config(args.config, model=str(ensure_tiny_model()), progress=print) as pipe:
        for r in pipe.generate(["A cute cat", "Once upon a time"]):
            thinker = r.stages[0].output
            if r.audio is None:
                print(f"{r.prompt!r}: thinker said {thinker['text']!r}; talker said {r.text!r}")
                continue
            path = f"{r.request_id}.wav"  # a vocoder's audio (thinker_talker_vocoder.yaml)
            with open(path, "wb") as f:
                f.write(encode_wav(r.audio, r.sample_rate))
            print(f"{r.prompt!r}: thinker said {thinker['text']!r}; {len(r.audio)} samples -> {path}")


if __name__ == "__main__":
    main()
