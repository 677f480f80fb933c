"""AR -> DiT over Mooncake's transfer engine (``stage_configs/ar_to_dit_mooncake_te.yaml``).

Real stage processes (one vLLM engine + the diffusion runner), real transfer engines over
TCP on loopback: the KV the DiT consumed is transformers' KV of the same tokens, and the
stages leave no process behind.
"""

from __future__ import annotations

import pytest
from pipeline_fixtures import ROOT, run_ar_to_dit_over

CONFIG = ROOT / "stage_configs/ar_to_dit_mooncake_te.yaml"


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.forked
@pytest.mark.long(300, "a pipeline start (vLLM engine + DiT) over Mooncake's transfer engine")
def test_ar_to_dit_over_the_mooncake_transfer_engine() -> None:
    ends = run_ar_to_dit_over(CONFIG, "MooncakeTransferEngineConnector")
    assert ends["sender"].config["protocol"] == "tcp"
