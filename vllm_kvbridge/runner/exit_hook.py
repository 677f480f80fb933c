"""``ExitHook``: run a shutdown callable at process exit unless cancelled first."""

from __future__ import annotations

import atexit
import multiprocessing.util
from collections.abc import Callable


class ExitHook:
    """Runs ``shutdown`` at process exit (``atexit`` and multiprocessing's exit finalizers,
    which a ``multiprocessing`` child runs before ``os._exit``) unless :meth:`cancel` ran.

    It holds ``shutdown`` (and so its object) strongly on purpose: an object dropped
    without shutdown still owns live threads and connectors (and their named segments),
    which only its shutdown releases; the shutdown cancels the hook.
    """

    def __init__(self, shutdown: Callable[[], None]) -> None:
        self._shutdown: Callable[[], None] | None = shutdown
        self._finalizer = multiprocessing.util.Finalize(None, self, exitpriority=100)
        atexit.register(self)

    def __call__(self) -> None:
        shutdown, self._shutdown = self._shutdown, None
        self.cancel()
        if shutdown is not None:
            shutdown()

    def cancel(self) -> None:
        self._shutdown = None
        atexit.unregister(self)
        self._finalizer.cancel()
