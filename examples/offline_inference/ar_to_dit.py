"""Text -> KV cache -> tiny DiT image, through the Python API.

python examples/offline_inference/ar_to_dit.py [--config stage_configs/ar_to_dit_zmq.yaml]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_kvbridge.models.tiny_lm import ensure_tiny_model
from vllm_kvbridge.pipeline import Pipeline
from vllm_kvbridge.pipeline.images import encode_png


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="stage_configs/ar_to_dit_shm.yaml")
    parser.add_argument("--out", default="kvbridge-example")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    with Pipeline.from_config(args.config, model=str(ensure_tiny_model()), progress=print) as pipe:
        for r in pipe.generate(["A cute cat", "A diffusion transformer paints the moon"]):
            path = out / f"{r.request_id}.png"
            path.write_bytes(encode_png(r.image))
            kv = next(t for t in r.transfers if t.what == "kv")
            print(f"{r.prompt!r}: {kv.nbytes} KV bytes in {kv.seconds * 1e3:.1f} ms -> {path}")


if __name__ == "__main__":
    main()
