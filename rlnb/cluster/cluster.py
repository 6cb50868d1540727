"""The Cluster: an embedded local Dask cluster, or a remote scheduler by address, seen as device slots."""

from __future__ import annotations

import contextlib
import gc
import html
import logging
import os
import platform
import signal
import socket
import time
import uuid
import warnings
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from rlnb.cluster.placement import Placement, resolve_placement
from rlnb.cluster.script_guard import check_script_guard
from rlnb.errors import ClusterError

log = logging.getLogger("rlnb")

# Worker resources that describe capacity, not a node group.
_CAPACITY_RESOURCES = {"GPU", "CPU", "MEMORY", "gpu", "cpu", "memory", "TPU"}


def listed_workers(client) -> dict[str, dict]:
    """The scheduler's workers now (address -> info), asked of the scheduler itself. ``client.scheduler_info()``
    returns the client's cache, which the client's periodic refresh (every 2 s) rewrites with no workers listed,
    at times between that call's own fetch and its return: a healthy cluster's workers all read as gone."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def _alive(pid: int) -> bool:
    """Whether the process ``pid`` of this machine runs (a zombie does not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _descendants(pids: list[int]) -> list:
    """The processes below ``pids`` (children, theirs, ...), as ``psutil.Process`` objects."""
    import psutil

    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            found += psutil.Process(pid).children(recursive=True)
    return found


def _end_processes(procs: list, grace_s: float = 5.0) -> None:
    """SIGTERM those of ``procs`` still running, then SIGKILL what is left after ``grace_s`` (one bound for all)."""
    import psutil

    alive = [p for p in procs if p.is_running()]
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, left = psutil.wait_procs(alive, timeout=grace_s)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    if alive:
        log.info("ended %d process(es) the cluster's workers had started and left running", len(alive))


@dataclass(frozen=True)
class Slot:
    """One device: a GPU worker when the cluster has GPUs, else one CPU worker process.

    Attributes:
        rank: global slot index, 0..N-1, grouped by node.
        address: the Dask worker address that owns the slot.
        node: host name of the worker.
        device: ``"cpu"`` or ``"cuda:0"`` (dask-cuda sets ``CUDA_VISIBLE_DEVICES`` per worker).
        node_groups: node groups the worker belongs to (its non-capacity resources).
        pid: the worker process id.
        memory_limit_bytes: the worker's memory limit (0 = none).
        gpu_name: the GPU model, if any.
        daemonic: the worker process is daemonic, so code on it cannot start child processes
            (gymnasium's ``AsyncVectorEnv``, a vLLM engine).
        name: the Dask worker's name (an embedded worker its Nanny restarted keeps it).
    """

    rank: int
    address: str
    node: str
    device: str
    node_groups: tuple[str, ...] = ()
    pid: int = 0
    memory_limit_bytes: int = 0
    gpu_name: str = ""
    daemonic: bool = False
    name: str = ""

    @property
    def host(self) -> str:
        """The IP/host part of the worker address (where process groups listen)."""
        return self.address.split("://")[-1].rsplit(":", 1)[0]


def _probe_worker() -> dict:
    """Runs on each worker: what device it has."""
    import multiprocessing

    info = {
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "gpus": 0,
        "gpu_name": "",
        "daemonic": multiprocessing.current_process().daemon,
    }
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return info
    info["gpus"], info["gpu_name"] = _count_gpus()
    return info


def _count_gpus() -> tuple[int, str]:
    """GPUs visible here, via NVML (installed with dask-cuda); never imports torch."""
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)) if n else ""
        return n, name.decode() if isinstance(name, bytes) else name
    except Exception:
        return 0, ""


def _import_in_background(module: str):
    """Import ``module`` on a helper thread unless torch is in already (a first embedded cluster: the
    workers' fork server imports torch on one core while this process does on another, instead of the
    first component paying it after the cluster is up). Returns the thread, or None."""
    import sys
    import threading

    if "torch" in sys.modules:
        return None
    # torch silences the FutureWarning of its own `LeafSpec()` at import by the warning's module. While this
    # process loads a Dask module on another thread, rapids-dask-dependency's patched warnings.warn raises
    # the warning's stack level: it no longer comes from torch.utils._pytree and would show on every first
    # cluster. That one message is silenced instead (it is torch's, about torch's own code).
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )

    def run():
        from rlnb._dask import import_with_collector_paused

        with contextlib.suppress(Exception):  # an import error surfaces where the module is used
            import_with_collector_paused([module])

    thread = threading.Thread(target=run, name="rlnb-driver-imports", daemon=True)
    thread.start()
    return thread


# embedded clusters of this process with credentials, by scheduler address: another rlnb.Cluster(address) here
# connects with them (a notebook's second driver); another process needs Cluster.save_credentials
_EMBEDDED_SECURITY: dict = {}


def load_credentials(directory: str | os.PathLike):
    """A ``distributed.security.Security`` from what :meth:`Cluster.save_credentials` wrote to ``directory``.

    Raises:
        ClusterError: the files are not there.
    """
    from distributed.security import Security

    path = Path(directory)
    files = [path / n for n in ("ca.pem", "cert.pem", "key.pem")]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ClusterError(
            f"Cluster(security={str(directory)!r}): no {', '.join(missing)} there (Cluster.save_credentials writes them)"
        )
    ca, cert, key = (str(f) for f in files)
    return Security(tls_ca_file=ca, tls_client_cert=cert, tls_client_key=key, require_encryption=True)


def _temporary_security():
    """Temporary TLS credentials for an embedded cluster (``distributed``'s, held in memory), or ``None`` with a
    warning where the ``cryptography`` package they need is missing (plain TCP, as Dask's default)."""
    from distributed.security import Security

    try:
        return Security.temporary()
    except ImportError as e:
        log.warning(
            "the embedded cluster runs plain TCP: any process on this machine that finds its port could run code in "
            "its workers. Install the cryptography package (%s) to keep it this driver's alone (TLS)",
            e,
        )
        return None


def _connect(address: str, timeout_s: float, security=None):
    """A Dask ``Client`` for ``address`` within ``timeout_s``, or a :class:`ClusterError` saying what is there.

    Dask's handshake can wait forever on a server that accepts the connection but never speaks its
    protocol (an HTTP server, say), so the client is made on a helper thread under a deadline.
    """
    import threading

    from distributed import Client

    out: dict = {}

    def make():
        try:
            out["client"] = Client(
                address, timeout=f"{timeout_s}s", direct_to_workers=True, security=security
            )
        except BaseException as e:
            # keep the words only: the traceback would keep the half-made client (and its IO loop) alive
            out["error"] = str(e) or type(e).__name__

    maker = threading.Thread(target=make, name="rlnb-connect", daemon=True)
    maker.start()
    maker.join(timeout_s + 1.0)  # Dask's own connect timeout fires first when nothing listens
    if "client" in out:
        return out["client"]
    if not maker.is_alive():
        # The half-made client is garbage now. Collect it here: left to a random later collection,
        # its __del__ can run inside the start of the *next* client's IO loop and wait 10 s on the
        # lock that start holds (Dask's LoopRunner), failing the next connect with AssertionError.
        gc.collect()
    found = _what_listens(address) if maker.is_alive() else None
    if found is not None and not found.startswith("the connection failed"):
        raise ClusterError(
            f"no Dask scheduler answered at {address!r} within {timeout_s:g} s: {found}. "
            "Is the address the scheduler's (`dask scheduler` prints it, port 8786 by default)?"
        )
    hint = "Is `dask scheduler` running there, and is the address right?"
    if address.startswith("tls://") and security is None:
        hint = "A tls:// scheduler needs credentials: pass security=distributed.security.Security(...)."
    raise ClusterError(
        f"cannot reach the Dask scheduler at {address!r} within {timeout_s:g} s ({out.get('error') or found}). {hint}"
    )


def _what_listens(address: str) -> str:
    """A short description of what accepts connections at ``address`` (for error messages)."""
    host, _, port = address.split("://")[-1].rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2.0) as sock:
            sock.settimeout(2.0)
            sock.sendall(b"HEAD / HTTP/1.0\r\n\r\n")
            first = sock.recv(200).split(b"\r\n", 1)[0].decode(errors="replace")
    except (OSError, ValueError) as e:
        return f"the connection failed ({type(e).__name__}: {e})"
    if first.startswith("HTTP/"):
        return f"an HTTP server answered there ({first!r}), not a Dask scheduler"
    return f"something accepted the connection but did not speak Dask's protocol (it sent {first!r})"


def default_cpu_slots() -> int:
    """One worker process per core, at least 1 and at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


# Dask settings an embedded cluster changes, where the dask config holds Dask's default: key -> (default, ours)
EMBEDDED_DASK_CONFIG = {
    # Dask's profiler: each sample walks the running call's stack twice while holding the GIL, every 10 ms a
    # share of a worker's time (docs/benchmarks.md). The Dask dashboard's profile still fills in, more slowly.
    "distributed.worker.profile.interval": ("10ms", "100ms"),
    # the event loop's health check: every 20 ms it woke each worker's event loop thread, which took the GIL
    # from the component's thread 50 times a second; a loop blocked past distributed.admin.tick.limit is still
    # reported
    "distributed.admin.tick.interval": ("20ms", "200ms"),
}


def _worker_config() -> dict:
    """The settings of :data:`EMBEDDED_DASK_CONFIG` for an embedded cluster's processes, each unless the dask
    config sets another value."""
    import dask

    return {
        key: ours
        for key, (default, ours) in EMBEDDED_DASK_CONFIG.items()
        if str(dask.config.get(key, default)) == default
    }


def _is_cluster_object(obj) -> bool:
    """A Dask cluster object (``LocalCluster``, dask-jobqueue's, ``SSHCluster``...): it has a scheduler address."""
    return isinstance(getattr(obj, "scheduler_address", None), str)


class Cluster:
    """Device slots on a Dask cluster: embedded (local) by default, or remote by address.

    Args:
        address: where the workers are. ``None`` starts an embedded cluster:
            ``dask_cuda.LocalCUDACluster`` (one worker per GPU) when GPUs exist, else a
            ``distributed.LocalCluster`` with one single-threaded worker process per slot. A
            scheduler address (``"tcp://host:8786"``, ``"tls://..."``) connects to it. A Dask cluster
            object (``LocalCluster``, dask-jobqueue's ``SLURMCluster``, dask-kubernetes, a Dask Gateway
            cluster) or a ``distributed.Client`` is used as it is: rlnb makes a client for the cluster
            object (or uses yours) and never closes what you passed.
        slots: number of CPU worker processes for the embedded CPU cluster (default: one per core).
        gpus: ``"auto"`` (use GPUs if present), ``True`` (require them) or ``False`` (CPU only).
        timeout_s: how long to wait for the scheduler and its workers.
        min_slots: for a remote scheduler, wait until this many workers are connected.
        dashboard_address: where the embedded cluster's Dask dashboard listens (loopback by
            default; ``":8787"`` to expose it on every interface, ``None`` for none).
        security: a ``distributed.security.Security`` for ``tls://`` schedulers (passed to Dask's
            client). Over TLS to a remote cluster, calls take Dask's encrypted rpc; the direct-call sockets are
            not used. For the embedded cluster: ``None`` (default) gives it temporary TLS credentials that only
            this process holds (``Security.temporary()``), so no other process on the machine, of another
            user or not, can talk to its scheduler or run code in its workers; its direct calls stay on
            loopback and the workers' Unix sockets, authenticated by tokens that travel over that TLS. ``False``:
            plain TCP, as Dask's default (anyone on the machine who finds its port can use it).

    Example:
        >>> with rlnb.Cluster(slots=2) as cluster:   # doctest: +SKIP
        ...     print(cluster)
    """

    def __init__(
        self,
        address=None,
        *,
        slots: int | None = None,
        gpus: bool | str = "auto",
        timeout_s: float = 20.0,
        min_slots: int = 1,
        dashboard_address: str | None = "127.0.0.1:0",
        security=None,
    ):
        if slots is not None and (not isinstance(slots, int) or isinstance(slots, bool) or slots < 1):
            raise ClusterError(f"Cluster(slots=...): expected a positive int, got {slots!r}")
        if gpus not in ("auto", True, False):
            raise ClusterError(f"Cluster(gpus=...): expected 'auto', True or False, got {gpus!r}")
        if address is None:
            from rlnb._dask import prestart_fork_server

            check_script_guard()
            prestart_fork_server()  # the workers' imports start now, beside this process's own (Dask's, torch)
        from distributed import Client

        self._local = None
        self._owns_client = True
        # this driver's session: what it launches is keyed and looked up under it, apart from other
        # drivers (notebooks, `rlnb run`) sharing the same scheduler
        self.session = uuid.uuid4().hex[:12]
        self._placed: dict[int, list[str]] = defaultdict(list)
        self._elastic: set[str] = set()  # components' ranks an elastic run goes on without (mark_elastic)
        self._channels: list = []  # closed with the cluster, freeing their shared memory
        self.unresponsive: set[str] = set()  # workers that let a call time out: closing does not wait on them
        self._done_once: set[str] = set()  # see once
        self.address: str
        if address is None:
            warming = _import_in_background("rlnb.loop")  # the driver's own torch import, beside the workers'
            import dask

            # (the nannies keep it for the workers they start)
            if security not in (None, False):
                raise ClusterError(
                    "Cluster(security=...): the embedded cluster makes its own temporary credentials (None) or "
                    f"runs plain TCP (False); got {type(security).__name__}. Pass Security objects with an address"
                )
            with dask.config.set(_worker_config()):
                self._local = self._start_local(slots, gpus, dashboard_address, private=security is None)
            self.address = self._local.scheduler_address
            if self._local.security.require_encryption:
                _EMBEDDED_SECURITY[self.address] = self._local.security
            self.client = Client(self._local, direct_to_workers=True)
            n = len(self._local.worker_spec)
            try:
                self.client.wait_for_workers(n, timeout=max(timeout_s, 60.0))
            except TimeoutError:
                self.close()
                raise ClusterError(
                    f"the embedded cluster's {n} worker process(es) did not start within 60 s"
                ) from None
            finally:
                if warming is not None:
                    warming.join(60.0)
            # warnings that components log on their workers (logger "rlnb") reach this process's "rlnb"
            # logger, so a notebook and the dashboard see them; only for workers this driver owns
            self.client.forward_logging("rlnb", level=logging.WARNING)
        else:
            self.client = self._adopt_or_connect(address, timeout_s, security)
            self.address = self.client.scheduler.address
            try:
                self.client.wait_for_workers(min_slots, timeout=timeout_s)
            except (TimeoutError, OSError):
                n = len(listed_workers(self.client))
                if self._owns_client:
                    self.client.close()
                asked = len(getattr(address, "worker_spec", None) or {})  # (a SpecCluster's: workers or jobs)
                if not _is_cluster_object(address):
                    how = "Start workers with `dask worker ADDRESS` (or `dask cuda worker ADDRESS` on GPU nodes)"
                elif asked < min_slots:
                    how = f"Scale it first: {type(address).__name__}.scale({min_slots}) (or .adapt(minimum={min_slots}))"
                else:
                    how = (f"It asked for {asked} (jobs submitted): see why they have not started in its job queue "
                           "(squeue, qstat) and the jobs' logs (log_directory=)")  # fmt: skip
                raise ClusterError(
                    f"the scheduler at {address!r} has {n} worker(s); waited {timeout_s:g} s for {min_slots}. {how}."
                ) from None
        self.slots: list[Slot] = self._discover_slots()
        self._closing = False
        with contextlib.suppress(Exception):  # (a scheduler without events: no warning, nothing else changes)
            self.client.subscribe_topic("all", self._on_scheduler_event)
        daemonic = [s.rank for s in self.slots if s.daemonic]
        if daemonic and self._local is None:
            log.warning(
                "slot(s) %s run in daemonic worker processes, which cannot start child processes "
                "(env.vector_mode=async, vLLM); start those workers with DASK_DISTRIBUTED__WORKER__DAEMON=False "
                "in their environment (or the dask config distributed.worker.daemon: false)",
                daemonic,
            )
        if gpus is True and not self.has_gpus:
            self.close()
            raise ClusterError(
                "Cluster(gpus=True): no worker has a GPU; use gpus='auto' or False on CPU machines"
            )

    # ------------------------------------------------------------------ start-up
    def _adopt_or_connect(self, address, timeout_s: float, security):
        """A client for ``address``: a scheduler address, a Dask cluster object or a ``Client``."""
        from distributed import Client

        self._owns_client = True
        if isinstance(address, Client):
            if address.status in ("closing", "closed"):
                raise ClusterError(
                    f"Cluster(address): the distributed.Client given is {address.status}; pass an open one"
                )
            self._owns_client = False
            return address
        if isinstance(security, (str, os.PathLike)):  # a directory Cluster.save_credentials wrote
            security = load_credentials(security)
        if isinstance(address, str):
            if "://" not in address and ":" not in address:
                raise ClusterError(
                    f"Cluster(address): expected a scheduler address like 'tcp://host:8786', got {address!r}"
                )
            if security is None:  # an embedded cluster of this process: its credentials are here
                security = _EMBEDDED_SECURITY.get(address)
            return _connect(address, timeout_s, security)
        status = getattr(address, "status", None)  # (a Dask cluster object's: distributed.core.Status)
        if type(status).__name__ == "Status" and status.name in ("closing", "closed", "failed"):
            raise ClusterError(
                f"Cluster(address): the {type(address).__name__} given is {status.name}; start a new one (or pass "
                "one that is running)"
            )
        if _is_cluster_object(address):  # LocalCluster, SLURMCluster, SSHCluster...
            return Client(address, timeout=f"{timeout_s}s", direct_to_workers=True, security=security)
        raise ClusterError(
            "Cluster(address): expected a scheduler address ('tcp://host:8786'), a Dask cluster object "
            f"(LocalCluster, SLURMCluster, ...) or a distributed.Client, got {type(address).__name__} {address!r}"
        )

    @staticmethod
    def _start_local(slots, gpus, dashboard_address, private: bool = True):
        import dask

        # Non-daemonic worker processes, so components can start children (AsyncVectorEnv, a vLLM
        # engine). Dask's Nanny reads this each time it (re)starts a worker, so it is set for the process.
        dask.config.set({"distributed.worker.daemon": False})
        from rlnb._dask import fork_workers_from_preloaded_server

        n_gpus = _count_gpus()[0] if gpus in ("auto", True) else 0
        if gpus is True and n_gpus == 0:
            raise ClusterError("Cluster(gpus=True): this machine has no GPU visible to NVML")
        # workers fork from a server that imported torch, gymnasium and rlnb once: a second cluster in
        # the same driver starts in a fraction of a second, and the first one's components bind at once.
        # GPU workers too: the server never touches CUDA, and each worker's CUDA_VISIBLE_DEVICES is set
        # before its first CUDA call (docs/gpu.md has the time to a first step).
        fork_workers_from_preloaded_server()
        # this driver's alone: TLS with credentials made here, in memory (nobody else can connect)
        security = _temporary_security() if private else None
        tls = {"protocol": "tls://", "security": security} if security is not None else {}
        if n_gpus > 0:
            try:
                from dask_cuda import LocalCUDACluster  # GPU-only path: one worker per GPU
            except ImportError as e:
                raise ClusterError(
                    f"Cluster(gpus={gpus!r}): this machine has {n_gpus} GPU(s), and a cluster on them needs "
                    f"dask-cuda, which cannot be imported ({e}): pip install 'rlnb[cuda]', or "
                    "Cluster(gpus=False) for CPU workers only"
                ) from e

            kw = {"CUDA_VISIBLE_DEVICES": list(range(slots))} if slots else {}
            if slots and slots > n_gpus:
                raise ClusterError(f"Cluster(slots={slots}): this machine has only {n_gpus} GPU(s)")
            return LocalCUDACluster(
                threads_per_worker=1,
                dashboard_address=dashboard_address,
                silence_logs=logging.ERROR,
                **kw,
                **tls,
            )
        from distributed import LocalCluster

        # (Measured: distributed's SubprocessCluster with nanny-less workers was no faster end to end
        # here, since each `dask spec` worker loads every Dask CLI entry point.)
        return LocalCluster(
            n_workers=slots or default_cpu_slots(),
            threads_per_worker=1,
            processes=True,
            dashboard_address=dashboard_address,
            silence_logs=logging.ERROR,
            scheduler_port=0,
            **tls,
        )

    def _discover_slots(self) -> list[Slot]:
        workers = listed_workers(self.client)
        probes = self.client.run(_probe_worker)
        rows = []
        for addr, w in workers.items():
            probe = probes.get(addr, {})
            groups = tuple(sorted(k for k in (w.get("resources") or {}) if k not in _CAPACITY_RESOURCES))
            name = w.get("name", addr)
            order = (0, int(name), "") if str(name).isdigit() else (1, 0, str(name))
            rows.append((w.get("host", probe.get("hostname", "")), order, addr, w, probe, groups))
        rows.sort(key=lambda r: (r[0], r[1], r[2]))
        return [
            Slot(
                rank=i,
                address=addr,
                node=probe.get("hostname", host),
                device="cuda:0" if probe.get("gpus", 0) > 0 else "cpu",
                node_groups=groups,
                pid=probe.get("pid", 0),
                memory_limit_bytes=int(w.get("memory_limit") or 0),
                gpu_name=probe.get("gpu_name", ""),
                daemonic=bool(probe.get("daemonic", False)),
                name=str(w.get("name", addr)),
            )
            for i, (host, _o, addr, w, probe, groups) in enumerate(rows)
        ]

    def _wait_for_restarted_workers(self, timeout_s: float) -> None:
        # The scheduler may still list a dead worker for a moment: counting workers alone let a refresh see
        # the dead one, then a list without it. Wait until the dead ones are gone and every worker is back.
        n, deadline = len(self._local.worker_spec), time.monotonic() + timeout_s
        dead = {s.address for s in self.slots if not _alive(s.pid)}
        freed: set[str] = set()  # (once each: a new worker could, rarely, take a dead one's port)
        while True:
            listed = set(listed_workers(self.client))
            if len(listed) >= n and not listed & dead:
                return
            self._revive_workers((listed & dead) - freed, deadline - time.monotonic())
            freed |= listed & dead
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"only {len(listed - dead)} of the {n} embedded workers came back within {timeout_s:g} s"
                )
            time.sleep(0.05)

    def _revive_workers(self, dead_listed: set[str], timeout_s: float) -> None:
        # A worker killed before its Nanny had its start-up message is unregistered under the worker before it,
        # so the scheduler keeps the dead one's name until it notices the lost connection (seconds under load);
        # the restarted worker is refused ("name taken") and its Nanny closes for good. The processes are known
        # dead here: free their names at once, and start a Nanny in place of each one that gave up.
        for address in dead_listed:
            self.client.sync(self.client.scheduler.unregister, address=address, stimulus_id="rlnb-refresh")
        from distributed.core import Status

        local = self._local

        async def replace_closed():  # (on the cluster's loop, which owns local.workers)
            gave_up = [
                name for name, w in local.workers.items() if w.status in (Status.closed, Status.failed)
            ]
            for name in gave_up:
                del local.workers[name]
            if gave_up:
                await local._correct_state()  # (opens a worker for each name of the spec without one)

        with contextlib.suppress(TimeoutError):  # (the caller's deadline says what did not come back)
            local.sync(replace_closed, callback_timeout=max(timeout_s, 0.1))

    def refresh(self, timeout_s: float = 60.0) -> list[Slot]:
        """Re-read the workers after a failure: waits for the embedded cluster's restarted workers
        (the Nanny restarts a killed worker at a new address), or for a remote cluster to have as many workers as
        before (a job its cluster object submitted in a lost one's place), then renumbers the slots.

        Raises:
            ClusterError: fewer workers than before at the deadline.
        """
        if self._local is not None:
            self._wait_for_restarted_workers(timeout_s)
        else:
            n, deadline = len(self.slots), time.monotonic() + timeout_s
            while len(listed := listed_workers(self.client)) < n:
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"only {len(listed)} of the cluster's {n} workers are there after {timeout_s:g} s (a lost "
                        "worker's replacement did not start: scale the cluster back up, or check its job queue)"
                    )
                time.sleep(0.2)
        self._placed.clear()
        self.slots = self._discover_slots()
        return self.slots

    def update_slots(self) -> tuple[list[int], list[int]]:
        """For an elastic run, between steps: ``(joined, gone)``, the slots whose worker joined since the slots
        were read and those whose worker has left. Slots keep their numbers: a worker restarted under a gone
        slot's name (an embedded worker's Nanny, a job queue's replacement of the same name) takes that slot, any
        other new worker a new slot after the others. Asks the scheduler only, unless a worker joined."""
        listed = listed_workers(self.client)
        known = {s.address for s in self.slots}
        gone = [s.rank for s in self.slots if s.address not in listed]
        if all(a in known for a in listed):
            return [], gone
        fresh = {s.address: s for s in self._discover_slots()}  # (probes every worker: only when one joined)
        joined = []
        for address, slot in fresh.items():
            if address in known:
                continue
            same_name = next((self.slots[r] for r in gone if self.slots[r].name == slot.name), None)
            rank = same_name.rank if same_name is not None else len(self.slots)
            slot = replace(slot, rank=rank)
            if same_name is not None:
                self.slots[rank] = slot
                gone.remove(rank)
                self._placed.pop(rank, None)
            else:
                self.slots.append(slot)
            joined.append(rank)
        return sorted(joined), gone

    # ------------------------------------------------------------------ queries
    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def has_gpus(self) -> bool:
        return any(s.device.startswith("cuda") for s in self.slots)

    @property
    def embedded(self) -> bool:
        return self._local is not None

    @property
    def nodes(self) -> dict[str, list[int]]:
        """Node host name -> slot ranks on it."""
        out: dict[str, list[int]] = defaultdict(list)
        for s in self.slots:
            out[s.node].append(s.rank)
        return dict(out)

    @property
    def node_groups(self) -> dict[str, list[int]]:
        """Node group -> slot ranks in it (from worker resources, e.g. ``--resources sim=1``)."""
        out: dict[str, list[int]] = defaultdict(list)
        for s in self.slots:
            for g in s.node_groups:
                out[g].append(s.rank)
        return dict(out)

    @property
    def dashboard_link(self) -> str | None:
        try:
            return self.client.dashboard_link
        except Exception:
            return None

    def place(self, spec, required=(), known=None) -> Placement:
        """Resolve a ``component_placement`` mapping against these slots (see :func:`resolve_placement`)."""
        return resolve_placement(
            spec, self.num_slots, self.node_groups, required=required, known=known, hosts=self.nodes
        )

    def check_children(self, slots, what: str) -> None:
        """Raise :class:`ClusterError` if ``what`` needs child processes on a daemonic worker among ``slots``."""
        daemonic = [s for s in slots if self.slots[s].daemonic]
        if daemonic:
            raise ClusterError(
                f"{what} starts child processes, but the worker(s) of slot(s) {daemonic} are daemonic and cannot; "
                "start them with DASK_DISTRIBUTED__WORKER__DAEMON=False in their environment (dask config "
                "distributed.worker.daemon: false), or choose another setting"
            )

    def check_device(self, device: str, what: str = "component") -> None:
        """Raise :class:`ClusterError` if ``device`` (``"cuda"``/``"cpu"``/``"auto"``) cannot be served."""
        if device.startswith("cuda") and not self.has_gpus:
            raise ClusterError(
                f"{what} asks for device {device!r} but every slot of this cluster is CPU-only; "
                "set device: auto (or cpu), or connect to a cluster with `dask cuda worker`s"
            )

    # ------------------------------------------------------------------ bookkeeping for the layers below
    def once(self, key: str, setup) -> None:
        """Run ``setup()`` the first time ``key`` is asked for on this cluster, and again after a ``setup`` that
        raised: set-up the runtime does once per cluster (registering its worker plugin) without writing the
        cluster's attributes."""
        if key not in self._done_once:
            setup()
            self._done_once.add(key)

    def close_with(self, channel) -> None:
        """Close ``channel`` when this cluster closes (its shared memory freed with it), unless it is closed
        first (:meth:`forget_channel`)."""
        self._channels.append(channel)

    def forget_channel(self, channel) -> None:
        """A channel closed on its own: this cluster no longer holds it (nor, through it, its queue server)."""
        with contextlib.suppress(ValueError):
            self._channels.remove(channel)

    def register_component(self, slot: int, label: str) -> None:
        """Show ``label`` (a component's rank) on ``slot`` in this cluster's views."""
        self._placed[slot].append(label)

    def mark_elastic(self, labels: list[str]) -> None:
        """Components' ranks (``env[1]``...) an elastic run goes on without: their worker's leaving is said as
        such, not as an error to come."""
        self._elastic.update(labels)

    def unregister_component(self, label: str) -> None:
        for labels in self._placed.values():
            if label in labels:
                labels.remove(label)

    def placed_on(self, slot: int) -> list[str]:
        return list(self._placed.get(slot, []))

    def _on_scheduler_event(self, event) -> None:
        """A worker holding this driver's components is being retired (a scale-down of a cluster object, its
        ``adapt()``, a job queue ending a job) or has left: said at once, naming the components. Components do
        not move (Dask cannot retire a worker holding actors gracefully, and a cluster object that closes it
        anyway takes them with it), so the run cannot go on without them."""
        _, msg = event
        if self._closing or not isinstance(msg, dict):
            return
        action = msg.get("action")
        if action == "retire-workers":
            leaving = [*msg.get("retired", ()), *msg.get("could-not-retire", ())]
            what = "is being retired (a scale-down: scale(), adapt(), a job's end)"
        elif action == "remove-worker":
            leaving, what = [msg.get("worker")], "left the cluster"
        else:
            return
        for address in leaving:
            slot = next((s for s in self.slots if s.address == address), None)
            held = self.placed_on(slot.rank) if slot is not None else []
            if held and all(label in self._elastic for label in held):
                log.info("worker %s (slot %d) %s while it holds %s: elastic ranks, whose work the ranks left take "
                         "over", address, slot.rank, what, ", ".join(held))  # fmt: skip
            elif held:
                log.warning(
                    "worker %s (slot %d) %s while it holds %s: components do not move, so this run's next call "
                    "to them fails (WorkerLostError) and loop.recover() resumes from the last checkpoint once "
                    "the cluster has a worker for the slot again. Keep the workers that hold components when "
                    "scaling down (%d of this cluster's), or save first (loop.save())",
                    address, slot.rank, what, ", ".join(held), len({s.address for s in self.slots
                                                                    if self.placed_on(s.rank)}),
                )  # fmt: skip

    # ------------------------------------------------------------------ lifecycle
    def bind(self, actor):
        """Tie a Dask actor handle to this cluster's client.

        Dask binds a deserialized handle to the process's *default* client: with two drivers in one
        process (two ``Cluster`` objects), that is the other one's, which could then free this
        driver's actor.
        """
        from rlnb import _dask

        if _dask.actor_worker(actor) is None and _dask.actor_client(actor) is not self.client:
            _dask.bind_actor(actor, self.client)
        return actor

    def close(self) -> None:
        """Close channels, the client, and the embedded cluster if this object started it."""
        self._closing = True  # (the workers this closes leave without a warning)
        # (before the client closes: the scheduler would send events to a closed comm)
        with contextlib.suppress(Exception):
            self.client.unsubscribe_topic("all")
        for ch in self._channels:
            with contextlib.suppress(Exception):  # its worker may be gone already
                ch.close()
            ch.release_links()
        self._channels.clear()
        try:
            if self._owns_client:
                self.client.close()
        finally:
            if self._local is not None:
                _EMBEDDED_SECURITY.pop(self.address, None)
                # a worker of ours that let a call time out (hung, stopped) would hold Dask's close for its own
                # timeout before being killed: it is killed now, as Dask would do then
                for slot in self.slots:
                    if slot.address in self.unresponsive and slot.pid:
                        with contextlib.suppress(OSError):
                            os.kill(slot.pid, signal.SIGKILL)
                # what the workers started (a vLLM engine still starting when its rank's start was given up on)
                # outlives a killed worker, holding memory and shared-memory segments: ended after the workers
                children = _descendants([slot.pid for slot in self.slots if slot.pid])
                self._local.close()
                self._local = None
                _end_processes(children)

    def save_credentials(self, directory: str | os.PathLike) -> Path:
        """Write the embedded cluster's TLS credentials into ``directory`` (created ``0700``, files ``0600``), so
        that another process of this user can connect: ``rlnb.Cluster(address, security=directory)``.

        Raises:
            ClusterError: this cluster is not an embedded one with credentials (``security=False``, or remote).
        """
        sec = self._local.security if self._local is not None else None
        if sec is None or not sec.require_encryption:
            raise ClusterError(
                "save_credentials: only an embedded cluster started with its own credentials has any"
            )
        from rlnb.files import write_private

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        for name, pem in (
            ("ca.pem", sec.tls_ca_file),
            ("cert.pem", sec.tls_client_cert),
            ("key.pem", sec.tls_client_key),
        ):
            write_private(path / name, pem)
        return path

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ display
    def info(self, dashboard: bool = True) -> str:
        """A text summary: scheduler, slots, versions (used by ``rlnb info``), and with ``dashboard`` Dask's
        dashboard address."""
        import dask
        import distributed

        kind = "embedded" if self.embedded else "remote"
        lines = [
            f"rlnb Cluster ({kind}) scheduler={self.address} slots={self.num_slots} "
            f"nodes={len(self.nodes)} gpus={'yes' if self.has_gpus else 'no'}",
            f"{'slot':>4}  {'device':<7} {'node':<20} {'worker':<28} placed",
        ]
        for s in self.slots:
            placed = ", ".join(self.placed_on(s.rank)) or "-"
            dev = s.device + (f" ({s.gpu_name})" if s.gpu_name else "")
            lines.append(f"{s.rank:>4}  {dev:<7} {s.node[:20]:<20} {s.address:<28} {placed}")
        lines.append(
            f"python {platform.python_version()}  dask {dask.__version__}  distributed {distributed.__version__}"
        )
        if dashboard and self.dashboard_link:
            lines.append(f"dashboard: {self.dashboard_link}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<rlnb.Cluster {'embedded' if self.embedded else 'remote'} {self.address} slots={self.num_slots}>"

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{s.rank}</td><td>{html.escape(s.node)}</td><td>{html.escape(s.device)}</td>"
            f"<td><code>{html.escape(s.address)}</code></td><td>{html.escape(', '.join(s.node_groups) or '-')}</td>"
            f"<td>{html.escape(', '.join(self.placed_on(s.rank)) or '-')}</td></tr>"
            for s in self.slots
        )
        link = self.dashboard_link
        dash = f' · <a href="{html.escape(link)}" target="_blank">Dask dashboard</a>' if link else ""
        return (
            f"<div><b>rlnb Cluster</b> ({'embedded' if self.embedded else 'remote'}) "
            f"<code>{html.escape(self.address)}</code> · {self.num_slots} slots{dash}"
            "<table><tr><th>slot</th><th>node</th><th>device</th><th>worker</th><th>node groups</th>"
            f"<th>placed</th></tr>{rows}</table></div>"
        )
