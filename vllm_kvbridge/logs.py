"""The ``vllm_kvbridge`` logger's handler, set up when the package is imported.

Like vLLM's own (``VLLM_CONFIGURE_LOGGING``): without it Python shows only warnings, and
the INFO lines that say what kvbridge chose for a stage (the KV cache size on CPU, a
capture stage's engine settings, a connector's cleanup) would reach no one. They go to
stderr, so to a stage's log file, in vLLM's format. ``VLLM_KVBRIDGE_CONFIGURE_LOGGING=0`` leaves
the logger to the application; ``VLLM_KVBRIDGE_LOGGING_LEVEL`` (default INFO) sets its level.
"""

from __future__ import annotations

import logging
import os

_FORMAT = "%(levelname)s %(asctime)s [kvbridge %(filename)s:%(lineno)d] %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"


def configure_logging() -> None:
    """Give the ``vllm_kvbridge`` logger one stderr handler (once per process)."""
    if os.environ.get("VLLM_KVBRIDGE_CONFIGURE_LOGGING", "1") == "0":
        return
    logger = logging.getLogger("vllm_kvbridge")
    if any(getattr(h, "_kvbridge", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, _DATE_FORMAT))
    handler._kvbridge = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("VLLM_KVBRIDGE_LOGGING_LEVEL", "INFO").upper())
    logger.propagate = False
