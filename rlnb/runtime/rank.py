"""What runs inside a Dask worker for one component rank: the host actor and the rank context."""

from __future__ import annotations

import datetime
import functools
import inspect
import os
import socket
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlnb.errors import pack_exception
from rlnb.runtime import direct
from rlnb.runtime.direct import env_flag


@dataclass(frozen=True)
class RankInfo:
    """Where a component rank lives. Passed to a component constructor that takes ``rank_info``.

    Attributes:
        component: the group name (e.g. ``"actor"``).
        rank: this rank, 0..world_size-1.
        world_size: number of ranks in the group.
        local_rank: index among the group's ranks on the same node.
        local_world_size: number of the group's ranks on this node.
        slot: global slot rank hosting this rank.
        device: ``"cpu"`` or ``"cuda:0"``.
        address: Dask worker address.
        node: host name.
        session: the driver session (one per :class:`rlnb.Cluster` object) that launched it; in-process
            peer lookups stay within it, so drivers sharing a cluster never see each other's components.
    """

    component: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    slot: int
    device: str
    address: str
    node: str
    session: str = ""


_local = threading.local()
# The rank hosts living in this worker process, by (driver session, component, rank): collocated components
# of one driver find each other's objects here and exchange data in-process (no channel hop, no copy), and a
# call chain (RankHost.chain) runs calls on several of them in one request. Weak: a host Dask lets go of (a
# group dropped without shutdown) is freed, its component with it.
_HOSTS: weakref.WeakValueDictionary[tuple[str, str, int], RankHost] = weakref.WeakValueDictionary()


def _local_host(session: str, component: str, rank: int) -> RankHost:
    try:
        return _HOSTS[(session, component, rank)]
    except KeyError:
        here = sorted(f"{c}[{r}]" for s, c, r in _HOSTS if s == session)
        raise RuntimeError(
            f"{component}[{rank}] is not in this worker process (here: {here}); "
            "only collocated components can be reached in-process"
        ) from None


def local_peer(component: str, rank: int):
    """The object of ``component`` rank ``rank`` if it lives in this process (collocated) and belongs to
    the calling rank's driver session, else raise."""
    info = current_rank()
    return _local_host(info.session if info is not None else "", component, rank).obj


def current_rank() -> RankInfo | None:
    """The :class:`RankInfo` of the component rank whose code is running now (``None`` outside)."""
    host = getattr(_local, "host", None)
    return host.info if host is not None else None


def process_group(name: str = "default"):
    """The torch process group ``name`` of the rank whose code is running now.

    Raises:
        RuntimeError: outside a rank, or if the group was not initialised with
            ``Group.init_process_group`` / ``init_collective``.
    """
    host = getattr(_local, "host", None)
    if host is None:
        raise RuntimeError("process_group() is only available inside a component rank")
    if name not in host.collectives:
        raise RuntimeError(
            f"{host.info.component}[{host.info.rank}] has no process group {name!r}; "
            f"initialised: {sorted(host.collectives) or '(none)'}"
        )
    return host.collectives[name]


@contextmanager
def _as_current(host):
    prev = getattr(_local, "host", None)
    _local.host = host
    try:
        yield
    finally:
        _local.host = prev


@functools.cache
def tune_malloc() -> bool:
    """Let glibc keep freed memory for reuse in this worker process (once; Linux/glibc only).

    Dask's nanny starts workers with ``MALLOC_TRIM_THRESHOLD_=65536``, which also pins glibc's mmap
    threshold at 128 KiB: every tensor above that is a fresh ``mmap`` whose pages fault in again on
    each training step. Measured here on a tiny Qwen2 train step: 0.55 s in a plain process, 0.77-0.93 s
    with Dask's setting, 0.44-0.47 s after this call. It raises the mmap threshold to 32 MiB (glibc's
    maximum) and the trim threshold to 256 MiB. ``RLNB_MALLOC_TUNING=0`` leaves malloc alone.
    """
    if not env_flag("RLNB_MALLOC_TUNING"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(
            libc.mallopt(m_trim_threshold, 256 << 20)
        )
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to do
        return False


class RankHost:
    """The Dask actor hosting one rank of a component: builds it, calls it, times each call.

    Calls return ``(status, value, duration_s)`` so user exceptions travel with their traceback
    instead of as Dask errors, and the driver can tell them from a lost worker.
    """

    def __init__(self, cls, args: tuple, kwargs: dict, info: RankInfo):
        self.info = info
        self.collectives: dict[str, object] = {}
        self._stores: dict[str, object] = {}
        self.obj = None
        self.init_error: dict | None = None
        self._after_reply = None  # the chain to run ahead once the current reply is sent (see chain)
        self._ahead: list | None = None  # (replies, idle_s, duration) of each chain run ahead, until taken
        self._chain_end = 0.0  # when the last chain ended (perf_counter)
        tune_malloc()
        os.environ.update(
            RANK=str(info.rank),
            WORLD_SIZE=str(info.world_size),
            LOCAL_RANK=str(info.local_rank),
            LOCAL_WORLD_SIZE=str(info.local_world_size),
        )
        kwargs = dict(kwargs)
        try:
            if "rank_info" in inspect.signature(cls).parameters:
                kwargs["rank_info"] = info
        except (TypeError, ValueError):
            pass
        try:
            with _as_current(self):
                self.obj = cls(*args, **kwargs)
            _HOSTS[(info.session, info.component, info.rank)] = self
        except Exception as e:  # reported by ready(), with its traceback
            self.init_error = pack_exception(e)
        self.direct = direct.serve(self) if self.init_error is None else None

    @property
    def session(self) -> str:
        """The driver session (:attr:`rlnb.Cluster.session`) that launched this rank: its direct calls' credential."""
        return self.info.session

    def ready(self):
        """``{"pid", "direct"}``: the worker's process id and how to reach this host without Dask's rpc."""
        if self.init_error is not None:
            return ("err", self.init_error, 0.0)
        return ("ok", {"pid": os.getpid(), "direct": self.direct}, 0.0)

    def call(self, method: str, args: tuple, kwargs: dict):
        t0 = time.perf_counter()
        prev, _local.host = getattr(_local, "host", None), self  # (_as_current, inlined: the per-call path)
        try:
            out = getattr(self.obj, method)(*args, **kwargs)
            return ("ok", out, time.perf_counter() - t0)
        except Exception as e:
            return ("err", pack_exception(e), time.perf_counter() - t0)
        finally:
            _local.host = prev

    def chain(self, calls: list[tuple[str, int, str, tuple, dict]], then: tuple | None = None):
        """Run ``calls``, each ``(component, rank, method, args, kwargs)`` of this driver session in this
        worker process, one after another in one request, as separate calls would run them; stop at the
        first that fails. Returns ``("ok", ([(replies, None, duration)], ahead), duration)``: each call's
        ``(status, value, duration_s)``, the failed one last (the calls after it did not run), and whether
        ``then`` runs ahead (see :meth:`take_ahead`).

        ``then``: ``(chains, proceed, args)``: once this reply is sent, run each of ``chains`` (lists of calls)
        at once, one after another, without waiting for the driver, as long as every call so far succeeded and
        ``proceed`` is ``None`` or ``proceed([each call's value], *args)`` is true after each chain, this one
        first. ``args`` is the same tuple at each of these calls, so a rule can keep what it saw in it."""
        if self._ahead is not None:  # a driver that went away mid-step (interrupted) never took them
            direct.log.warning("%s[%s]: dropped the replies of a chain run ahead that were never taken",
                               self.info.component, self.info.rank)  # fmt: skip
            self._ahead = None
        replies, duration = self._run_chain(calls)
        return ("ok", ([(replies, None, duration)], self._then(then, [replies])), duration)

    def take_ahead(self, then: tuple | None = None):
        """The replies of the chains the last :meth:`chain` (or ``take_ahead``) ran ahead, as
        ``("ok", ([(replies, idle_s, duration), ...], ahead), duration)``, a triple per chain that ran:
        ``idle_s`` is how long this worker spent between the chain before it and this one (sending a reply, a
        driver that was late). ``then``: as for :meth:`chain`, after these chains."""
        if self._ahead is None:
            err = RuntimeError(
                f"{self.info.component}[{self.info.rank}] ran no chain ahead (a chain's `then` did not "
                "proceed, or its replies were taken already)"
            )
            return ("err", pack_exception(err), 0.0)
        block, self._ahead = self._ahead, None
        ahead = self._then(then, [replies for replies, _, _ in block])
        return ("ok", (block, ahead), sum(duration for _, _, duration in block))

    def pop_after_reply(self):
        """What to run on this rank's thread once the reply of the request just served is sent (the
        chain run ahead), or ``None``; the call server runs it."""
        after, self._after_reply = self._after_reply, None
        return after

    def _run_chain(self, calls) -> tuple[list, float]:
        t0 = time.perf_counter()
        replies = []
        for component, rank, method, args, kwargs in calls:
            try:
                host = _local_host(self.info.session, component, rank)
            except RuntimeError as e:
                replies.append(("err", pack_exception(e), 0.0))
            else:
                replies.append(host.call(method, args, kwargs))
            if replies[-1][0] != "ok":
                break
        self._chain_end = time.perf_counter()
        return replies, self._chain_end - t0

    def _then(self, then: tuple | None, chains_replies: list[list]) -> bool:
        """Whether ``then`` (see :meth:`chain`) runs ahead after the chains that gave ``chains_replies``; if
        so, it is set to run once the reply is sent."""
        if then is None:
            return False
        chains, proceed, args = then
        if not all(_goes_on(proceed, args, replies) for replies in chains_replies):
            return False
        self._after_reply = functools.partial(self._run_ahead, chains, proceed, args)
        return True

    def _run_ahead(self, chains: list, proceed, args: tuple) -> None:
        block = []
        for calls in chains:
            if block and not _goes_on(proceed, args, block[-1][0]):
                break
            idle_s = time.perf_counter() - self._chain_end
            replies, duration = self._run_chain(calls)
            block.append((replies, idle_s, duration))
        self._ahead = block

    # ---- checkpoints: each rank writes/reads its own component state (big state stays on workers)
    def save_state(self, path: str):
        return self._guarded(_save_state, self.obj, path)

    def load_state(self, path: str):
        return self._guarded(_load_state, self.obj, path)

    def _guarded(self, fn, *args):
        t0 = time.perf_counter()
        try:
            with _as_current(self):
                return ("ok", fn(*args), time.perf_counter() - t0)
        except (KeyboardInterrupt, SystemExit):
            raise
        except (
            BaseException
        ) as e:  # (torch's CheckpointException is a BaseException: a reply, not a dead worker)
            return ("err", pack_exception(e), time.perf_counter() - t0)

    # ---- process groups: rank 0 opens a store on a free port, then every rank joins
    def open_store(self, name: str, world_size: int, timeout_s: float):
        from torch.distributed import TCPStore

        host = self.info.address.split("://")[-1].rsplit(":", 1)[0].strip("[]") or socket.gethostname()
        # torch's store would listen on every interface: hand it a socket bound to the worker's own
        # (the cluster's) interface instead; the store owns and closes it
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, 0), family=family, backlog=max(128, world_size))
        store = TCPStore(
            host,
            listener.getsockname()[1],
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )
        self._stores[name] = store
        return ("ok", (host, store.port), 0.0)

    def join_group(self, name, host, port, rank, world_size, backend, timeout_s):
        t0 = time.perf_counter()
        try:
            pg = _join(self, name, host, port, rank, world_size, backend, timeout_s)
            self.collectives[name] = pg
            return ("ok", backend, time.perf_counter() - t0)
        except Exception as e:
            return ("err", pack_exception(e), time.perf_counter() - t0)

    def destroy_groups(self):
        import torch.distributed as dist

        direct.unserve(self)
        close = getattr(self.obj, "close", None)  # a component's own processes or files (a vLLM engine)
        if callable(close):
            try:
                close()
            except Exception as e:  # freeing the rest goes on; the failure is said, not raised
                direct.log.warning("%s[%s].close() failed: %s: %s", self.info.component, self.info.rank,
                                   type(e).__name__, e)  # fmt: skip
        if "default" in self.collectives and dist.is_initialized() and _DEFAULT_OWNER[0]() is self:
            dist.destroy_process_group()
            _DEFAULT_OWNER[0] = lambda: None
        self.collectives.clear()
        key = (self.info.session, self.info.component, self.info.rank)
        if _HOSTS.get(key) is self:
            del _HOSTS[key]
        self._stores.clear()
        return ("ok", None, 0.0)


def _goes_on(proceed, args: tuple, replies: list) -> bool:
    """After a chain that gave ``replies``: whether a chain may run ahead after it (see
    :meth:`RankHost.chain`). Every call succeeded, and ``proceed`` says so."""
    if any(r[0] != "ok" for r in replies):
        return False
    if proceed is None:
        return True
    try:
        return bool(proceed([r[1] for r in replies], *args))
    except Exception as e:  # (the loop's own rule: a bug, not the user's) run nothing ahead
        direct.log.warning("a chain's `then` rule failed (%s: %s); nothing runs ahead", type(e).__name__, e)
        return False


def _save_state(obj, path: str) -> int:
    """A rank's part of a checkpoint: the component's own ``save_state_to(path)`` where it has one (a sharded
    actor's DCP shards), else its ``state_dict()`` into ``path``."""
    own = getattr(obj, "save_state_to", None)
    return own(path) if own is not None else save_state_file(obj, obj.state_dict(), path)


def save_state_file(obj, state: dict, path: str) -> int:
    """``state`` (``obj``'s) into the rank file ``path``, atomically; refused at once if it holds anything
    :func:`rlnb.files.torch_load_safe` will not load. Returns the bytes written."""
    from rlnb.files import torch_save_atomic, unsafe_globals

    size = torch_save_atomic(state, path)  # (on disk before the checkpoint is marked complete)
    unsafe = unsafe_globals(path)
    if unsafe:  # refused now, at the first save, rather than at the resume that needs it
        raise TypeError(
            f"{type(obj).__name__}.state_dict() holds {', '.join(unsafe)}; a checkpoint holds only tensors, "
            "numpy arrays and plain data (numbers, strings, lists, tuples, dicts), because loading anything "
            "else could run code. Return those (e.g. an object's fields as a dict) and rebuild the object in "
            "load_state_dict"
        )
    return size


class NonFiniteState(ValueError):
    """A component's checkpointed state holds NaN or inf where it must not (a diverged or damaged actor)."""


def _load_state(obj, path: str) -> None:
    from rlnb.files import torch_load_safe

    own = getattr(obj, "load_state_from", None)
    try:
        if own is not None:
            return own(path)
        obj.load_state_dict(torch_load_safe(path))
    except NonFiniteState as e:  # (named here: the component does not know its file)
        raise ValueError(f"{Path(path).name}: {e}") from None
    return None


def _join(host_obj: RankHost, name, host, port, rank, world_size, backend, timeout_s):
    import torch.distributed as dist
    from torch.distributed import TCPStore

    if name == "default":
        _check_default_group_free(host_obj)  # before touching the store: nothing half-made
    timeout = datetime.timedelta(seconds=timeout_s)
    store = host_obj._stores.get(name)
    if store is None:
        store = TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        host_obj._stores[name] = store
    if name == "default":
        # The torch default group, so DistributedDataParallel and dist.* work as usual. There is one
        # per process: a rank re-forming it may replace its own, never another live component's.
        _take_default_group(host_obj)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        return dist.group.WORLD
    # A standalone group (e.g. actor ranks + rollout ranks) that needs no default group.
    prefixed = dist.PrefixStore(f"rlnb/{name}/", store)
    if backend == "nccl":  # GPU-only path
        return dist.ProcessGroupNCCL(prefixed, rank, world_size)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


# The rank host holding this process's torch default process group (weak: a host freed without
# shutdown releases it).
_DEFAULT_OWNER: list = [lambda: None]


def _check_default_group_free(host_obj) -> None:
    owner = _DEFAULT_OWNER[0]()
    if owner is None or owner is host_obj:
        return
    who = f"{owner.info.component}[{owner.info.rank}]"
    if owner.info.session != host_obj.info.session:
        who += " of another driver"
    raise RuntimeError(
        f"this worker process's torch default process group belongs to {who}; a process has one default "
        "group. Use a named group (init_process_group(name=...) / init_collective) or shut that group down first."
    )


def _take_default_group(host_obj) -> None:
    import torch.distributed as dist

    _check_default_group_free(host_obj)
    if dist.is_initialized():  # this host's own earlier default group (or one nobody holds any more)
        dist.destroy_process_group()
    _DEFAULT_OWNER[0] = weakref.ref(host_obj)
