"""A vLLM worker tests can wedge (its own module: importing it imports vLLM).

While ``llm_hold`` exists in ``$KVBRIDGE_TEST_GATES`` every step of :class:`GatedWorker`
waits in ``execute_model``, as a worker stuck in a forward or a collective would: its engine
core waits on it, and so does the stage process, which keeps beating. ``llm_wedged`` is
touched once a step is held, so a test knows the request is stuck there.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from vllm_kvbridge.runner.worker import KVBridgeCPUWorker


class GatedWorker(KVBridgeCPUWorker):
    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        gates = Path(os.environ["KVBRIDGE_TEST_GATES"])
        if (gates / "llm_hold").exists():
            (gates / "llm_wedged").touch()
            while (gates / "llm_hold").exists():
                time.sleep(0.05)
        return super().execute_model(*args, **kwargs)
