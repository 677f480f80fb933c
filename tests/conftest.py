"""Fixtures shared by every test area.

Area-specific fixtures live in ``tests/<area>_fixtures.py`` and are pulled in by the
test modules that need them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import suite_guard

# No VLLM_CPU_KVCACHE_SPACE here: it would override the KV cache size every stage gets
# (config/cpu_kv_cache.py); engines a test starts itself size theirs the same way.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# tests/gpu needs a CUDA device and runs through `make test-gpu` / `make gpu-check`
# (scripts/gpu_check.py sets KVBRIDGE_GPU_TESTS=1), where a missing device is a failure, not
# a skip. `make test` runs on machines without one and leaves the folder out.
collect_ignore = [] if os.environ.get("KVBRIDGE_GPU_TESTS") == "1" else ["gpu"]

# The run's own temp directory (tests/suite_guard.py): set before any test or fixture makes
# a temp file, inherited by xdist workers and every subprocess.
_SUITE_TMP = suite_guard.use_private_tmp()
_SHM_AT_START = suite_guard._inodes()
_watcher: suite_guard.Watcher | None = None
_seen: list[suite_guard.Seen] = []
_problems: list[str] = []
_leftovers: list[str] = []
_cost: list[str] = []


def _runs_tests(config: pytest.Config) -> bool:
    """This process runs tests itself (not an xdist controller, not --collect-only)."""
    controller = not hasattr(config, "workerinput") and getattr(config.option, "dist", "no") != "no"
    return not config.getoption("collectonly") and not controller


#: The suite's default per-test timeout (pyproject.toml's ``timeout``): a test that needs more
#: says so, and why, with ``@pytest.mark.long(seconds, "why")`` (docs/testing.md).
DEFAULT_TIMEOUT_S = 120


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules longest first (tests/module_seconds.json), so the two xdist workers do not end
    with one long module alone, and those marked ``engines_in_process`` after all others;
    within a module pytest's order is kept (shared fixtures, parametrized rows).
    ``long(seconds, why)`` becomes the test's timeout; a bare ``timeout`` above the default is
    refused, so every test allowed more time carries its reason."""
    import json

    seconds = json.loads((Path(__file__).parent / "module_seconds.json").read_text())

    def order(item: pytest.Item) -> tuple[bool, float]:
        # Modules that run vLLM engines in the test process go last: vLLM's CPU worker leaves
        # that process unfit for what comes after (a forked test's child aborts in torch),
        # and an xdist worker's last module has nothing after it.
        last = item.get_closest_marker("engines_in_process") is not None
        return last, -seconds.get(item.nodeid.split("::", 1)[0], 0)

    items.sort(key=order)  # stable: a module's own order is kept
    bare = []
    for item in items:
        long = item.get_closest_marker("long")
        if long is not None:
            seconds, why = [*long.args, None, None][:2]
            if not isinstance(seconds, int) or seconds <= DEFAULT_TIMEOUT_S or not why:
                raise pytest.UsageError(f"{item.nodeid}: long(seconds > {DEFAULT_TIMEOUT_S}, why) wanted")
            item.add_marker(pytest.mark.timeout(seconds))
            continue
        timeout = item.get_closest_marker("timeout")
        if timeout is not None and timeout.args and timeout.args[0] > DEFAULT_TIMEOUT_S:
            bare.append(item.nodeid)
    if bare:
        raise pytest.UsageError(
            f"timeout above {DEFAULT_TIMEOUT_S} s without a reason (use @pytest.mark.long(seconds, why)): "
            + ", ".join(bare)
        )


def pytest_configure(config: pytest.Config) -> None:
    global _watcher
    if _runs_tests(config):
        _watcher = suite_guard.Watcher(Path(os.environ["TMPDIR"]))
        _watcher.start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    # Runs in the process that runs the test (a forked test's parent included), around
    # setup, call and teardown: what the watcher sees meanwhile is this test's.
    if _watcher is not None:
        _watcher.set_test(item.nodeid, item.get_closest_marker("engine") is not None)
    yield
    if _watcher is not None:
        _watcher.end_test()
    torch = sys.modules.get("torch")
    if torch is not None and torch.set_num_threads is not torch._C.set_num_threads:
        # vLLM's CPU worker does this in its own process; in a test's process every later
        # forked test of this worker would hang in torch (its fork-safety fixture no-op'd).
        where = _watcher.seen.problems if _watcher is not None else _problems
        where.append(f"replaced torch.set_num_threads and left it so: {item.nodeid}")
        torch.set_num_threads = torch._C.set_num_threads


def pytest_testnodedown(node, error) -> None:  # an xdist worker finished: what it saw
    seen = getattr(node, "workeroutput", {}).get("kvbridge_seen")
    if seen is not None:
        _seen.append(suite_guard.Seen(**seen))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import dataclasses

    if _watcher is not None:
        seen = _watcher.stop()
        if hasattr(session.config, "workerinput"):  # an xdist worker: the controller judges
            session.config.workeroutput["kvbridge_seen"] = dataclasses.asdict(seen)
            return
        _seen.append(seen)
    if hasattr(session.config, "workerinput"):
        return
    _cost.extend(suite_guard.cost_table(_seen))
    verdict = suite_guard.judge(_seen, _SUITE_TMP, _SHM_AT_START)
    _problems.extend(verdict.problems)
    if os.environ.get(suite_guard.STRICT_ENV, "1") != "0":
        _problems.extend(verdict.leftovers)
    else:
        _leftovers.extend(verdict.leftovers)
    if _problems and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    kept = suite_guard.clean(verdict, _SUITE_TMP)
    if kept:
        _leftovers.append(f"(the run's temp directory is kept, as {suite_guard.KEEP_TMP_ENV}=1 asks: {kept})")


def pytest_terminal_summary(terminalreporter) -> None:
    if _cost and len(_seen) and sum(len(s.cost) for s in _seen) > 50:  # a whole run, not one test
        terminalreporter.section("where the CPU went (tests/suite_guard.py)")
        for line in _cost:
            terminalreporter.write_line(line)
    if _leftovers:
        terminalreporter.section(
            f"what the suite left (removed now; {suite_guard.STRICT_ENV}=0 let it pass)", yellow=True
        )
        for line in _leftovers:
            terminalreporter.write_line(line)
    if _problems:
        terminalreporter.section("what the suite left or started unmarked (tests/suite_guard.py)", red=True)
        for line in _problems:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny random-weight Llama model (seed 0), built once per test session."""
    from vllm_kvbridge.models.tiny_lm import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed=0)


_SESSION_PID = os.getpid()


@pytest.fixture(autouse=True)
def _fork_safe_torch() -> None:
    """In a ``@pytest.mark.forked`` child, run torch single-threaded.

    The parent may already have started OpenMP's thread pool, which does not survive
    ``fork``: the child's first parallel region can hang. One thread is always safe.
    """
    if os.getpid() != _SESSION_PID:
        import torch

        torch.set_num_threads(1)
