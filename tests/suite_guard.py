"""What the suite starts and leaves behind, watched while it runs (docs/testing.md).

Three rules, each checked by ``conftest.py`` through a :class:`Watcher` and :func:`judge`:

* **A test that starts a vLLM engine says so** (``@pytest.mark.engine``): the quick tier
  (``make test-quick``, ``-m "not engine and not slow"``) must start none. Every engine,
  whoever starts it (the test itself, a stage process, a CLI or server subprocess), runs its
  core in a process titled ``VLLM::EngineCore...`` (vLLM's ``set_process_title``); a watcher
  thread in each process that runs tests sees the new ones among its descendants and names
  the test that was running. An engine lives for seconds at least (its start alone takes
  tens), so a scan every half second sees every one. An engine started in the test's own
  process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) has no such process: vLLM's ``EngineCore``
  counts it when it is built there.
* **Nothing of the suite's stays in /dev/shm.** A name is the suite's when one of the
  suite's processes mapped it or held it open while the watcher looked (how
  ``connectors/shm_owners.py`` tells a process's names, by inode: a ``sem.mp-*`` is mapped
  under a temporary name), when an owner file of one of the suite's runs recorded it, or when
  it is a ``kvbridge`` name of a run (namespace up to its first "-") already known as the
  suite's. A name another process made, before or during the run, is never counted.
* **Nothing of the suite's stays in the temp dir.** The suite runs with its own ``TMPDIR``
  (one directory per run, one sub-directory per xdist worker), so everything a test or its
  subprocesses put there is the suite's, and no other process's file can be taken for one:
  a ``kvbridge-*`` / ``kvb-*`` entry left there at the end fails the run, named with the test
  that made it. The directory is removed after the run (``KVBRIDGE_KEEP_TMP=1`` keeps it).

Each process that runs tests keeps its own watcher; an xdist worker hands what it saw to the
controller in ``workeroutput`` and the controller judges the whole run.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_kvbridge import procfs
from vllm_kvbridge.connectors import shm_owners

#: Where the run's private temp directory is, for the processes of the run.
SUITE_TMP_ENV = "KVBRIDGE_SUITE_TMP"
#: Set to 1 to keep that directory after the run (pytest's ``tmp_path`` folders are in it).
KEEP_TMP_ENV = "KVBRIDGE_KEEP_TMP"
#: What the run left fails it; set this to 0 to have it only reported (and removed), e.g.
#: while finding out which test leaves something.
STRICT_ENV = "KVBRIDGE_STRICT_LEFTOVERS"
SHM_DIR = "/dev/shm"
#: vLLM's process title of an engine core (``VLLM_PROCESS_NAME_PREFIX`` is "VLLM" by default);
#: tests/test_suite_guard.py gives its probe run another, so its stand-in engines are not
#: taken for engines of the test that runs the probe.
ENGINE_TITLE = os.environ.get("KVBRIDGE_GUARD_ENGINE_TITLE", "VLLM::EngineCore").encode()
#: Temp-dir entries of the project's code and tests (``tempfile.mkdtemp(prefix=...)``).
TMP_PREFIXES = ("kvbridge-", "kvb-")
#: A new name no process of the suite was seen with after this many scans is another's.
_FOREIGN_AFTER = 6
_TICKS = os.sysconf("SC_CLK_TCK")


def _suite_tmp() -> Path:
    """The run's private temp directory: made by the first process of a run (the controller),
    inherited by xdist workers and every subprocess through the environment."""
    root = os.environ.get(SUITE_TMP_ENV)
    if not root:
        base = os.environ.get("TMPDIR") or tempfile.gettempdir()
        root = tempfile.mkdtemp(prefix="kvbs-", dir=base)  # short: sockets are made under it
        os.environ[SUITE_TMP_ENV] = root
    return Path(root)


def use_private_tmp() -> Path:
    """Point ``TMPDIR`` (and :mod:`tempfile`) of this process and its children at the run's
    own directory; an xdist worker gets a sub-directory of its own."""
    tmp = _suite_tmp()
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        tmp = tmp / worker
        tmp.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = str(tmp)
    return tmp


def _group(name: str) -> str | None:
    """The run a ``kvbridge`` name belongs to: a segment's namespace up to its first "-"
    (``kvbridge.<run>-<edge>.…``), an owner file's run (``kvbridge-owner.<run>.<tag>``)."""
    if name.startswith(shm_owners.OWNER_PREFIX):
        return name[len(shm_owners.OWNER_PREFIX) :].split(".", 1)[0] or None
    if name.startswith("kvbridge."):
        return name.split(".", 2)[1].split("-", 1)[0] or None
    return None


def _inodes() -> dict[str, int]:
    found = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(SHM_DIR):
            with contextlib.suppress(OSError):
                found[entry.name] = entry.inode()
    return found


def _open_inodes(pid: int) -> set[int]:
    """Inodes of the files under /dev/shm process ``pid`` has open or maps."""
    found = {ino for _dev, ino in shm_owners.mapped_files(pid, SHM_DIR)}
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(SHM_DIR + "/"):
                    found.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
    return found


def _is_engine(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read(len(ENGINE_TITLE)) == ENGINE_TITLE
    except OSError:
        return False


@dataclass
class Seen:
    """What one process's watcher saw (JSON-able, for xdist's ``workeroutput``)."""

    #: engine core pid -> the test running when it was first seen, and whether that test is
    #: marked ``engine``
    engines: dict[str, list[Any]] = field(default_factory=dict)
    #: /dev/shm name -> [inode, test]
    shm: dict[str, list[Any]] = field(default_factory=dict)
    #: runs (``_group``) known as the suite's
    runs: list[str] = field(default_factory=list)
    #: temp-dir entry (path) -> test
    tmp: dict[str, str] = field(default_factory=dict)
    #: test -> [wall seconds, CPU seconds of this process and its descendants meanwhile]
    cost: dict[str, list[float]] = field(default_factory=dict)
    #: what the process running the tests found wrong with itself after a test (conftest.py)
    problems: list[str] = field(default_factory=list)
    #: every descendant pid the watcher saw (a segment's name carries its creator's pid)
    pids: list[int] = field(default_factory=list)


class _EngineCoreHook(importlib.abc.MetaPathFinder):
    """Calls ``on_engine()`` whenever vLLM's ``EngineCore`` is built in this process (an
    engine started in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no engine core process
    to see), by wrapping its ``__init__`` when ``vllm.v1.engine.core`` is imported."""

    MODULE = "vllm.v1.engine.core"

    def __init__(self, on_engine: Any) -> None:
        self.on_engine = on_engine

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module, on_engine = spec.loader.exec_module, self.on_engine

        def exec_and_wrap(module: Any) -> None:
            exec_module(module)
            init = module.EngineCore.__init__

            def counted_init(core: Any, *args: Any, **kwargs: Any) -> None:
                on_engine()
                init(core, *args, **kwargs)

            module.EngineCore.__init__ = counted_init

        spec.loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec


class Watcher:
    """Scans this process's descendants, /dev/shm and its temp dir every ``interval`` s."""

    def __init__(self, tmp: Path, interval: float = 0.5) -> None:
        self.root = os.getpid()
        self.tmp = tmp
        self.interval = interval
        self.seen = Seen()
        self._before = _inodes()
        self._tmp_before = set(os.listdir(tmp))
        self._pending: dict[str, int] = {}  # new name -> scans it went unclaimed
        self._engine_pids: set[int] = set()
        self._test: tuple[str, bool] = ("(between tests)", True)
        self._test_start = time.monotonic()
        self._ticks: dict[int, int] = {}  # descendant -> its CPU ticks at the last scan
        self._own_cpu = self._cpu_now()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="suite-guard", daemon=True)

    def start(self) -> None:
        if _EngineCoreHook.MODULE in sys.modules:  # too late to see in-process engines
            raise RuntimeError(f"{_EngineCoreHook.MODULE} was imported before the suite guard")
        sys.meta_path.insert(0, _EngineCoreHook(self._in_process_engine))
        self._thread.start()

    def _in_process_engine(self) -> None:
        with self._lock:
            test, marked = self._test
            self.seen.engines[f"in-process {len(self.seen.engines)}"] = [test, marked]

    def set_test(self, nodeid: str, engine_marked: bool) -> None:
        with self._lock:
            self.scan()  # what happened before this test is not this test's
            self._test = (nodeid, engine_marked)
            self._test_start = time.monotonic()

    def end_test(self) -> None:
        with self._lock:
            self.scan()
            test = self._test[0]
            self.seen.cost.setdefault(test, [0.0, 0.0])[0] += time.monotonic() - self._test_start
            self._test = ("(between tests)", True)

    @staticmethod
    def _cpu_now() -> float:
        t = os.times()
        return t.user + t.system

    def _count_cpu(self, pids: list[int], test: str) -> None:
        """CPU seconds since the last scan, of this process and of each descendant (read
        while it lives, or as a zombie: the last half second of a process reaped between two
        scans is missed, so the figures are a lower bound)."""
        spent = self._cpu_now() - self._own_cpu
        self._own_cpu += spent
        for pid in pids:
            fields = procfs._fields(pid)
            if fields is None:
                continue
            with contextlib.suppress(ValueError, IndexError):
                ticks = int(fields[11]) + int(fields[12])  # utime + stime
                spent += (ticks - self._ticks.get(pid, 0)) / _TICKS
                self._ticks[pid] = ticks
        self.seen.cost.setdefault(test, [0.0, 0.0])[1] += spent

    def stop(self) -> Seen:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            self.scan()
            self.seen.pids = sorted({self.root, *self._ticks})
        return self.seen

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                try:
                    self.scan()
                except Exception as exc:  # a watcher that dies would pass every check
                    self.seen.engines.setdefault("watcher", [f"suite guard failed: {exc!r}", False])

    def scan(self) -> None:
        test, marked = self._test
        every = procfs.descendants(self.root)
        self._count_cpu(every, test)  # also remembers every pid seen (self._ticks)
        pids = [p for p in every if procfs.state(p) not in (None, "Z")]
        for pid in pids:
            if pid not in self._engine_pids and _is_engine(pid):
                self._engine_pids.add(pid)
                self.seen.engines[str(pid)] = [test, marked]
        self._scan_shm([self.root, *pids], test)
        for entry in os.listdir(self.tmp):
            if entry.startswith(TMP_PREFIXES) and entry not in self._tmp_before:
                self.seen.tmp.setdefault(str(self.tmp / entry), test)

    def _scan_shm(self, pids: list[int], test: str) -> None:
        now = _inodes()
        runs = set(self.seen.runs)
        new = {
            n: ino
            for n, ino in now.items()
            if self._before.get(n) != ino and self.seen.shm.get(n, [None])[0] != ino
        }
        unclaimed = {n: ino for n, ino in new.items() if _group(n) not in runs or _group(n) is None}
        if unclaimed:
            ours: set[int] = set()
            for pid in pids:
                ours |= _open_inodes(pid)
            for n, ino in unclaimed.items():
                if ino in ours:
                    self._claim(n, ino, test, runs)
                else:
                    tries = self._pending[n] = self._pending.get(n, 0) + 1
                    if tries >= _FOREIGN_AFTER:  # never ours: another process's name
                        self._before[n] = ino
                        self._pending.pop(n)
        for n, ino in new.items():
            if n not in self.seen.shm and _group(n) in runs:
                self._claim(n, ino, test, runs)
        self.seen.runs = sorted(runs)

    def _claim(self, name: str, ino: int, test: str, runs: set[str]) -> None:
        self.seen.shm[name] = [ino, test]
        self._pending.pop(name, None)
        group = _group(name)
        if group:
            runs.add(group)


def _recorded_by(runs: set[str]) -> set[str]:
    """Names the owner files of ``runs`` recorded (vLLM's queues and semaphores of a run)."""
    return {
        name for owner in shm_owners.owners(SHM_DIR) if _group(owner.file) in runs for name in owner.names
    }


@dataclass
class Verdict:
    #: what fails the run: engines started unmarked, a process left unfit for later tests
    problems: list[str] = field(default_factory=list)
    #: what the run left behind: reported, and removed; it fails the run too unless
    #: ``KVBRIDGE_STRICT_LEFTOVERS=0``
    leftovers: list[str] = field(default_factory=list)
    #: (name, inode) of the run's names still in /dev/shm
    shm: list[tuple[str, int]] = field(default_factory=list)


def _creator(name: str) -> int | None:
    """The pid in a segment's name (``kvbridge.<namespace>.<kind>.<pid>.<tag>``), if any."""
    parts = name.split(".")
    if len(parts) == 5 and parts[0] == "kvbridge" and parts[3].isdigit():
        return int(parts[3])
    return None


def judge(seen: list[Seen], tmp_root: Path, shm_at_start: dict[str, int] | None = None) -> Verdict:
    """The run's violations, one line each (none: the run left nothing and every engine was
    started by a test marked ``engine``)."""
    verdict = Verdict()
    problems = verdict.problems
    problems.extend(p for s in seen for p in s.problems)
    for s in seen:
        for pid, (test, marked) in sorted(s.engines.items()):
            if not marked:
                what = pid if pid.startswith("in-process") else f"pid {pid}"
                problems.append(f"started a vLLM engine ({what}) without @pytest.mark.engine: {test}")
    runs = {r for s in seen for r in s.runs}
    ours = {name: (ino, test) for s in seen for name, (ino, test) in s.shm.items()}
    now = _inodes()
    for name in sorted(_recorded_by(runs)):
        if name in now and name not in ours:
            ours[name] = (now[name], "(recorded by an owner file of the run)")
    for name in sorted(now):
        if _group(name) in runs and name not in ours:
            ours[name] = (now[name], "(a name of one of the run's namespaces)")
    # A segment made by a process of the run that lived too briefly to be seen holding it
    # (a killed child): its name says its creator's pid.
    pids = {p for s in seen for p in s.pids}
    start = shm_at_start or {}
    for name, ino in sorted(now.items()):
        if name not in ours and start.get(name) != ino and _creator(name) in pids:
            ours[name] = (ino, f"(made by pid {_creator(name)}, a process of the run)")
    for name, (ino, test) in sorted(ours.items()):
        if now.get(name) == ino:
            verdict.leftovers.append(f"left /dev/shm/{name}: {test}")
            verdict.shm.append((name, ino))
    for s in seen:
        for path, test in sorted(s.tmp.items()):
            if os.path.lexists(path):
                verdict.leftovers.append(f"left {path}: {test}")
    for entry in sorted(os.listdir(tmp_root)) if tmp_root.exists() else []:
        if entry.startswith(TMP_PREFIXES):  # not seen by a watcher: made by the controller
            path = str(tmp_root / entry)
            if not any(path in s.tmp for s in seen):
                verdict.leftovers.append(f"left {path}")
    return verdict


def cost_table(seen: list[Seen], top: int = 15) -> list[str]:
    """The modules that took the most CPU (this process and its descendants: engines, stage
    processes, servers), with their wall time: where the suite's two cores go."""
    modules: dict[str, list[float]] = {}
    for s in seen:
        for test, (wall, cpu) in s.cost.items():
            m = modules.setdefault(test.split("::", 1)[0], [0.0, 0.0])
            m[0] += wall
            m[1] += cpu
    total = sum(c for _, c in modules.values())
    rows = sorted(modules.items(), key=lambda kv: -kv[1][1])[:top]
    lines = [f"CPU seconds of the run (its processes and their children): {total:.0f}"]
    lines += [f"{cpu:8.0f} cpu s {wall:8.0f} wall s  {mod}" for mod, (wall, cpu) in rows]
    return lines


def clean(verdict: Verdict, tmp_root: Path) -> str | None:
    """Once reported, what the run left goes: its /dev/shm names that nothing maps any more
    (the reaper's rule) and its temp directory, pytest's ``tmp_path`` folders with it, unless
    ``KVBRIDGE_KEEP_TMP=1`` asks to keep that for a look (returned, to be said)."""
    mapped = shm_owners.all_mapped(SHM_DIR) if verdict.shm else set()
    for name, ino in verdict.shm:
        shm_owners.unlink_if_unused(SHM_DIR, name, ino, mapped)
    if os.environ.get(KEEP_TMP_ENV) == "1":
        return str(tmp_root)
    shutil.rmtree(tmp_root, ignore_errors=True)
    return None
