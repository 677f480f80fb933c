"""AR -> DiT over NIXL (``stage_configs/ar_to_dit_nixl.yaml``).

Real stage processes (one vLLM engine + the diffusion runner), real NIXL agents (UCX over
cma/tcp on loopback) at both ends of the edge: the KV the DiT consumed is transformers' KV
of the same tokens, and the stages leave no process behind.
"""

from __future__ import annotations

import pytest
from pipeline_fixtures import ROOT, run_ar_to_dit_over

CONFIG = ROOT / "stage_configs/ar_to_dit_nixl.yaml"


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.forked
@pytest.mark.long(300, "a pipeline start (vLLM engine + DiT) over NIXL")
def test_ar_to_dit_over_nixl() -> None:
    ends = run_ar_to_dit_over(CONFIG, "NixlConnector")
    assert ends["sender"].config["ucx_tls"] == "cma,tcp"
