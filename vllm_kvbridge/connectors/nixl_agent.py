"""One NIXL agent (UCX backend by default) as the NIXL connector uses it, and the UCX environment.

What this module owns:

* :func:`prepare_ucx_env`: the UCX environment NIXL needs, set *before* UCX is loaded (UCX
  reads ``UCX_*`` once, when its libraries load and a context is created). Two settings
  are needed on a host like this one (no RDMA NIC):

  - ``UCX_TLS`` must contain ``tcp``: NIXL's UCX backend connects workers by address, and
    ``shm``/``cma`` alone cannot, so creating the backend fails with NIXL_ERR_BACKEND.
    ``cma,tcp`` is the fast choice on one host (cma reads the peer's memory with
    ``process_vm_readv``); across hosts without RDMA it is ``tcp``.
  - ``UCX_MODULES=^ib``: with the InfiniBand module loaded on a host without IB devices,
    every process that created a UCX agent segfaults at exit (in the bundled libnl-route).

  A value the user exported is kept, except a known-broken one (``UCX_TLS`` without
  ``tcp``; ``UCX_MODULES`` that loads ``ib`` on a host without IB devices), which is
  repaired with a warning that says so.
* :class:`NixlAgent`: the agent, its memory registrations (tracked so ``close()`` leaves
  none), peers' metadata, one-sided READs with a completion notification to the peer, and
  the notifications this agent received. NIXL's Python API is used as installed
  (``nixl._api.nixl_agent``); NIXL's own descriptor (de)serialisation uses pickle, so
  nothing of it crosses a process boundary here: peers exchange only NIXL's agent metadata
  (an opaque byte string NIXL parses itself) and plain integers.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

from vllm_kvbridge.errors import ConfigError, TransferError, TransferTimeout

logger = logging.getLogger(__name__)

#: The defaults of the connector's ``ucx_tls`` / ``ucx_modules`` options (see module docstring).
DEFAULT_UCX_TLS = "cma,tcp"
DEFAULT_UCX_MODULES = "^ib"
_IB_SYSFS = "/sys/class/infiniband"


def _has_ib_devices() -> bool:
    try:
        return bool(os.listdir(_IB_SYSFS))
    except OSError:
        return False


def _ucx_loaded() -> bool:
    """True when a UCX library is mapped into this process (its settings are then fixed)."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            return any("libucs" in line for line in maps)
    except OSError:
        return False


def _tls_has_tcp(value: str) -> bool:
    tokens = [t.strip() for t in value.split(",") if t.strip()]
    if not tokens:
        return False
    if tokens[0].startswith("^"):  # an exclusion list keeps tcp unless it names it
        return "tcp" not in [t.lstrip("^") for t in tokens]
    return any(t in ("all", "tcp") for t in tokens)


def _loads_ib(value: str) -> bool:
    tokens = [t.strip() for t in value.split(",") if t.strip()]
    if not tokens or tokens[0].startswith("^"):
        return "ib" not in [t.lstrip("^") for t in tokens]
    return any(t in ("all", "ib") for t in tokens)


def prepare_ucx_env(
    ucx_tls: str | None = DEFAULT_UCX_TLS, ucx_modules: str | None = DEFAULT_UCX_MODULES
) -> dict[str, str]:
    """Set ``UCX_TLS`` / ``UCX_MODULES`` for NIXL unless the user exported them; repair broken values.

    ``None`` for an option leaves UCX's own default when the user set nothing (e.g. on an
    RDMA host: ``ucx_tls: null`` lets UCX pick ``rc``/``ud``, ``ucx_modules: null`` keeps
    the ``ib`` module). Returns the values in effect. Warns when UCX is already loaded in
    this process with other settings (the first agent's environment then applies).
    """
    before = {name: os.environ.get(name) for name in ("UCX_TLS", "UCX_MODULES")}
    loaded = _ucx_loaded()
    tls = os.environ.get("UCX_TLS")
    if tls is None:
        if ucx_tls is not None:
            os.environ["UCX_TLS"] = ucx_tls
    elif not _tls_has_tcp(tls):
        # An inclusion list gains tcp; an exclusion list that excludes tcp (or nothing at
        # all) is replaced by the default.
        plain = tls.strip() and not tls.strip().startswith("^")
        fixed = f"{tls},tcp" if plain else DEFAULT_UCX_TLS
        warnings.warn(
            f"UCX_TLS={tls!r} has no tcp transport: NIXL's UCX backend then fails to start "
            f"(NIXL_ERR_BACKEND); using UCX_TLS={fixed!r}",
            RuntimeWarning,
            stacklevel=3,
        )
        os.environ["UCX_TLS"] = fixed
    modules = os.environ.get("UCX_MODULES")
    if modules is None:
        if ucx_modules is not None:
            os.environ["UCX_MODULES"] = ucx_modules
    elif _loads_ib(modules) and not _has_ib_devices():
        # An exclusion list ("^a,b": the caret applies to the whole list) gains ib; an
        # inclusion list (or "all") becomes "^ib".
        fixed = f"{modules},ib" if modules.strip().startswith("^") else DEFAULT_UCX_MODULES
        warnings.warn(
            f"UCX_MODULES={modules!r} loads UCX's ib module on a host without InfiniBand devices: "
            f"every process that made a NIXL agent then segfaults at exit; using UCX_MODULES={fixed!r}",
            RuntimeWarning,
            stacklevel=3,
        )
        os.environ["UCX_MODULES"] = fixed
    after = {name: os.environ.get(name) for name in ("UCX_TLS", "UCX_MODULES")}
    if loaded and after != before:
        warnings.warn(
            f"UCX is already loaded in this process; UCX settings {after} apply only to "
            "libraries loaded from now on (the first NIXL agent's environment is in effect)",
            RuntimeWarning,
            stacklevel=3,
        )
    return {k: v for k, v in after.items() if v is not None}


def import_nixl() -> Any:
    """``nixl._api`` (NIXL's Python API); a clear ImportError when NIXL is not installed."""
    try:
        from nixl import _api
    except ImportError as exc:
        raise ImportError(
            "the NIXL connector needs NIXL: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1 "
            f"(make setup installs it; a plain 'pip install nixl' pulls another torch) ({exc})"
        ) from exc
    if not os.environ.get("NIXL_LOG_LEVEL"):
        # NIXL logs every agent creation at INFO on stdout; keep stdout for results.
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return _api


#: The default of the connector's ``progress_delay_us`` (see :func:`new_agent`).
DEFAULT_PROGRESS_DELAY_US = 1000
_CONFIG_LOCK = threading.Lock()


def new_agent(api: Any, name: str, config: Any, progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US) -> Any:
    """``api.nixl_agent(name, config)`` whose progress thread waits ``progress_delay_us``
    between rounds instead of spinning.

    Why: NIXL's Python API hard-codes ``pthrDelay = 0``, and the UCX backend's progress
    thread then polls its workers with a zero timeout, forever: every agent keeps one core
    busy, idle or not (measured here: 1.0 s of CPU per second per process). On the 2-core
    CI machine the sender's agent, the receiver's and a bench probe's took both cores from
    the copies they were meant to overlap (a 64 MB put took 25 ms instead of 11). The
    thread waits on the workers' event descriptors with ``pthrDelay`` as the timeout, so a
    READ, a notification or a connection wakes it at once; the delay only bounds how
    long an idle agent sleeps (measured: 64 KB-64 MB transfers as fast with 1 ms as with
    100 ms, and faster than with 0 on this machine).

    The API builds its ``nixlAgentConfig`` inside ``nixl_agent.__init__``; this swaps in,
    for that one call, a config type whose ``pthrDelay`` keeps ``progress_delay_us``.
    ``progress_delay_us=0`` gives NIXL's own behaviour (a spinning progress thread:
    lowest latency where cores are to spare, as vLLM's NixlConnector runs it).
    """
    bind = getattr(api, "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    if progress_delay_us <= 0:
        return api.nixl_agent(name, config)
    if not isinstance(getattr(base, "pthrDelay", None), property):
        # Another NIXL than the one this was written against (1.5): run it as it comes.
        logger.warning("this NIXL's agent config has no pthrDelay; its progress thread may spin")
        return api.nixl_agent(name, config)

    class _Config(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            base.pthrDelay.__set__(self, progress_delay_us)

        # The API's ``pthrDelay = 0`` lands here and is ignored; NIXL reads the stored value.
        pthrDelay = property(lambda self: base.pthrDelay.__get__(self), lambda self, _value: None)

    with _CONFIG_LOCK:
        bind.nixlAgentConfig = _Config
        try:
            return api.nixl_agent(name, config)
        finally:
            bind.nixlAgentConfig = base


#: Owners of agents (connectors) not closed yet. A process that exits with one open closes it
#: at exit, before the interpreter tears down: an agent destroyed during that teardown (its
#: progress thread still joinable, or the server thread inside NIXL) aborts the process
#: ("terminate called without an active exception"; seen here once in ~35 such exits).
_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()


def close_at_exit(owner: Any) -> None:
    """Have ``owner.close()`` called at interpreter exit unless :func:`closed_normally` first."""
    _OPEN.add(owner)


def closed_normally(owner: Any) -> None:
    _OPEN.discard(owner)


@atexit.register
def _close_open_owners() -> None:
    for owner in list(_OPEN):
        try:
            owner.close()
        except Exception:
            pass


class _PeerLock:
    """Many transfers to a peer at once, or one metadata reload that invalidates the peer."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    def acquire_read(self) -> None:
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._readers += 1

    def release_read(self) -> None:
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    def acquire_write(self) -> None:
        with self._cond:
            while self._writer or self._readers:
                self._cond.wait()
            self._writer = True

    def release_write(self) -> None:
        with self._cond:
            self._writer = False
            self._cond.notify_all()


class NixlAgent:
    """A NIXL agent with tracked registrations and peers; every method is thread-safe.

    ``generation`` counts registrations and deregistrations, ``dereg_generation`` only the
    latter: a peer that loaded this agent's metadata at generation ``g`` must reload it to
    reach memory registered later, and must drop it first when something was deregistered
    since (a stale region could shadow a new one at the same address; on RDMA its key is void).
    """

    def __init__(
        self,
        backends: list[str],
        backend_params: Mapping[str, Mapping[str, str]] | None = None,
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
    ) -> None:
        api = import_nixl()
        self._api = api
        self.name = f"kvbridge-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.backends = list(backends)
        config = api.nixl_agent_config(
            enable_prog_thread=True,
            enable_listen_thread=False,
            backends=[],
            # Several threads use one agent (puts, gets, the server thread's notifications);
            # every call holds self._lock instead of NIXL's own RW lock: with that lock, a
            # thread polling a READ starved the progress thread that completes it (a 1 MiB
            # READ took 9-30 ms instead of 0.3 ms here).
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE,
        )
        agent = new_agent(api, self.name, config, progress_delay_us)
        missing = [b for b in self.backends if b not in agent.get_plugin_list()]
        if missing:
            raise ConfigError(
                f"NIXL backend(s) {missing} not available (installed plugins: {agent.get_plugin_list()})"
            )
        try:
            for backend in self.backends:
                agent.create_backend(backend, dict((backend_params or {}).get(backend, {})))
        except Exception as exc:
            raise TransferError(
                f"NIXL could not start backend(s) {self.backends} "
                f"(UCX_TLS={os.environ.get('UCX_TLS')!r}): {exc}"
            ) from exc
        self._agent: Any = agent
        self._lock = threading.Lock()
        self._regs: dict[int, tuple[Any, int]] = {}  # ptr -> (nixlRegDList, nbytes)
        self.generation = 0
        self.dereg_generation = 0
        #: Peer metadata loads, and how many of them dropped the peer first (it deregistered).
        self.peer_loads = 0
        self.peer_invalidations = 0
        self._peers: dict[str, tuple[_PeerLock, list[int]]] = {}  # name -> (lock, [gen, dgen])

    # -- memory -------------------------------------------------------------------------
    def register(self, ptr: int, nbytes: int) -> int:
        """Register host memory with every backend; 0 on success (the pool's callable contract)."""
        with self._lock:
            if self._agent is None:
                return -1
            descs = self._agent.register_memory([(ptr, nbytes, 0, "")], "DRAM")
            self._regs[ptr] = (descs, nbytes)
            self.generation += 1
        return 0

    def unregister(self, ptr: int) -> int:
        """Deregister memory from :meth:`register`; 0 (also when unknown or closed: nothing to do)."""
        with self._lock:
            entry = self._regs.pop(ptr, None)
            if entry is None or self._agent is None:
                return 0
            self._agent.deregister_memory(entry[0])
            self.generation += 1
            self.dereg_generation += 1
        return 0

    @property
    def registered(self) -> tuple[int, int]:
        """``(regions, bytes)`` registered right now."""
        with self._lock:
            return len(self._regs), sum(n for _, n in self._regs.values())

    def metadata(self) -> tuple[bytes, int, int]:
        """This agent's metadata (for peers' :meth:`load_peer`) and the generations it reflects."""
        with self._lock:
            self._check()
            return self._agent.get_agent_metadata(), self.generation, self.dereg_generation

    # -- peers --------------------------------------------------------------------------
    def peer_generation(self, name: str) -> tuple[int, int] | None:
        with self._lock:
            entry = self._peers.get(name)
            return None if entry is None else (entry[1][0], entry[1][1])

    def load_peer(self, name: str, metadata: bytes, generation: int, dereg_generation: int) -> None:
        """Load (or refresh) a peer's metadata; drops it first when it deregistered memory since."""
        with self._lock:
            self._check()
            entry = self._peers.setdefault(name, (_PeerLock(), [-1, -1]))
        lock, gens = entry
        lock.acquire_write()
        try:
            with self._lock:
                self._check()
                if gens[0] >= generation and gens[1] == dereg_generation:
                    return  # another thread loaded it (or newer) meanwhile
                if gens[0] >= 0 and gens[1] != dereg_generation:
                    self._agent.remove_remote_agent(name)
                    gens[0] = gens[1] = -1  # not loaded, should the load below fail
                    self.peer_invalidations += 1
                loaded = self._agent.add_remote_agent(metadata)
                self.peer_loads += 1
                loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
                if loaded != name:
                    self._agent.remove_remote_agent(loaded)
                    raise TransferError(f"NIXL peer metadata names agent {loaded!r}, expected {name!r}")
                gens[0], gens[1] = generation, dereg_generation
        finally:
            lock.release_write()

    def read(
        self, peer: str, remote_ptr: int, local_ptr: int, nbytes: int, notif: bytes, timeout_s: float
    ) -> None:
        """READ ``nbytes`` at ``remote_ptr`` of ``peer`` into ``local_ptr``; ``notif`` reaches the peer after.

        Raises :class:`TransferError` when NIXL reports an error (a dead peer: the connection
        is reset) and :class:`TransferTimeout` when it did not finish within ``timeout_s``;
        in both cases the local memory may still be written by the transport, so the caller
        must not reuse it (see :meth:`_release`).
        """
        with self._lock:
            self._check()
            entry = self._peers.get(peer)
        if entry is None:
            raise TransferError(f"NIXL peer {peer!r} has no metadata loaded")
        lock = entry[0]
        lock.acquire_read()
        try:
            with self._lock:
                self._check()
                agent = self._agent
                local = agent.get_xfer_descs([(local_ptr, nbytes, 0)], "DRAM")
                remote = agent.get_xfer_descs([(remote_ptr, nbytes, 0)], "DRAM")
                try:
                    handle = agent.initialize_xfer("READ", local, remote, peer, notif, self.backends)
                except Exception as exc:
                    raise TransferError(f"NIXL READ from {peer!r} could not be set up: {exc}") from exc
            try:
                self._wait(handle, peer, nbytes, timeout_s)
            except TransferError:
                raise
            except Exception as exc:  # e.g. nixlRemoteDisconnectError: the peer is gone
                raise TransferError(f"NIXL READ of {nbytes} bytes from {peer!r} failed: {exc!r}") from exc
            finally:
                self._release(handle)
        finally:
            lock.release_read()

    def _wait(self, handle: Any, peer: str, nbytes: int, timeout_s: float) -> None:
        """Post the READ and poll it; every agent call holds ``_lock`` (see ``__init__``)."""
        give_up = time.monotonic() + timeout_s
        with self._lock:
            self._check()
            state = self._agent.transfer(handle)  # cma: large reads complete right here
        delay = 0.00002
        while state == "PROC":
            if time.monotonic() >= give_up:
                raise TransferTimeout(
                    f"NIXL READ of {nbytes} bytes from {peer!r} did not finish in {timeout_s:.1f} s"
                )
            time.sleep(delay)  # the backend's progress thread completes it meanwhile
            delay = min(delay * 2, 0.001)
            with self._lock:
                self._check()
                state = self._agent.check_xfer_state(handle)
        if state != "DONE":
            raise TransferError(
                f"NIXL READ of {nbytes} bytes from {peer!r} failed (peer dead or unreachable?)"
            )

    @staticmethod
    def _release(handle: Any) -> None:
        try:
            handle.release()
        except Exception:  # an active transfer that cannot be cancelled: NIXL keeps it
            pass

    def notifications(self) -> list[bytes]:
        """Notifications received since the last call (from any peer)."""
        with self._lock:
            if self._agent is None:
                return []
            notifs = self._agent.get_new_notifs()
        return [msg for msgs in notifs.values() for msg in msgs]

    # -- lifecycle ----------------------------------------------------------------------
    def _check(self) -> None:
        if self._agent is None:
            raise TransferError(f"NIXL agent {self.name} is closed")

    def close(self) -> None:
        """Deregister everything, forget peers, destroy the agent (its threads and sockets). Idempotent."""
        with self._lock:
            agent, self._agent = self._agent, None
            regs, self._regs = list(self._regs.values()), {}
            peers, self._peers = list(self._peers), {}
            if agent is None:
                return
            for descs, _ in regs:
                try:
                    agent.deregister_memory(descs)
                except Exception:
                    pass
            for name in peers:
                try:
                    agent.remove_remote_agent(name)
                except Exception:
                    pass
        # The C++ agent (progress thread, UCX workers, their fds) goes with the last
        # reference: this one, unless a READ handle on another thread still holds one.
        del agent


__all__ = ["DEFAULT_UCX_MODULES", "DEFAULT_UCX_TLS", "NixlAgent", "import_nixl", "prepare_ucx_env"]
