"""The private Dask internals rlnb relies on, each in one place.

Dask has no public extension point for these needs: run a function on a worker's **actor
thread** (exactly as Dask runs actor methods), call an actor method without the per-call closure of
``Actor.__getattr__``, and bind an actor handle to a chosen client. If a Dask release changes them,
``tests/test_dask_internals.py`` fails with the name of what moved, before anything else breaks.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time


def run_on_actor_thread(worker, fn, args: tuple, name: str):
    """Submit ``fn(*args)`` to ``worker``'s actor executor with Dask's per-task thread state (what
    ``get_worker()`` and actor methods see). Returns a ``concurrent.futures.Future``.

    Private: ``distributed.worker._run_actor``, ``Worker.executors["actor"]``,
    ``Worker.execution_state``, ``Worker.active_threads(_lock)``.
    """
    from distributed.worker import _run_actor

    return worker.executors["actor"].submit(
        _run_actor,
        fn,
        args,
        {},
        worker.execution_state,
        name,
        worker.active_threads,
        worker.active_threads_lock,
    )


@contextlib.contextmanager
def as_actor_thread(worker, name: str):
    """Give the calling thread, for as long as it lasts, the thread state Dask gives an actor
    method (what ``get_worker()`` and ``thread_state`` report). For the thread that *is* the
    worker's actor thread (:class:`rlnb.runtime.actor_thread.ActorThread`): setting it once
    instead of per call, as ``_run_actor`` does, saves that work at every call.

    Private: ``distributed.utils.set_thread_state``, ``distributed.worker._worker_cvar``,
    ``Worker.execution_state``.
    """
    from distributed.utils import set_thread_state
    from distributed.worker import _worker_cvar

    with set_thread_state(
        start_time=time.time(), execution_state=worker.execution_state, key=name, actor=True
    ):
        token = _worker_cvar.set(worker)
        try:
            yield
        finally:
            _worker_cvar.reset(token)


def mark_active(worker, key: str | None) -> None:
    """Record the calling thread as running ``key`` (``None``: as idle again), where Dask's profiler
    and its "long-running task" reports look. Private: ``Worker.active_threads(_lock)``."""
    ident = threading.get_ident()
    with worker.active_threads_lock:
        if key is None:
            worker.active_threads.pop(ident, None)
        else:
            worker.active_threads[ident] = key


def replace_actor_executor(worker, make):
    """Put ``make(thread_name)`` in place of ``worker``'s actor executor, where Dask runs every actor
    method, and return it; ``None`` (nothing replaced) if that executor already started its thread:
    an actor method that ran there must not see its next call on another thread.

    Private: ``Worker.executors["actor"]`` (a one-thread ``distributed.threadpoolexecutor.
    ThreadPoolExecutor``, its ``_threads``, ``_thread_name_prefix``).
    """
    from distributed.threadpoolexecutor import ThreadPoolExecutor

    current = worker.executors.get("actor")
    if type(current) is not ThreadPoolExecutor or current._threads:
        return None
    executor = make(f"{current._thread_name_prefix}-rlnb")
    worker.executors["actor"] = executor
    current.shutdown(wait=False)
    return executor


async def actor_execute(actor, op: str, args: tuple) -> dict:
    """One actor method call over the worker rpc: Dask's reply message (``status``, ``result`` or
    ``exception``). Private: ``Actor._worker_rpc`` and the worker's ``actor_execute`` handler."""
    from distributed.protocol import to_serialize

    return await actor._worker_rpc.actor_execute(
        function=op, actor=actor.key, args=[to_serialize(a) for a in args], kwargs={}
    )


def bind_actor(actor, client) -> None:
    """Make ``client`` hold and serve ``actor`` (Dask binds a handle to the process's default client).
    Private: ``Actor._client``, ``Actor._future``."""
    from distributed import Future

    actor._future = Future(actor.key, client)  # held by this client before the previous one lets go
    actor._client = client


def actor_client(actor):
    """The client an actor handle is bound to (``None`` on a worker). Private: ``Actor._client``."""
    return getattr(actor, "_client", None)


def actor_worker(actor):
    """The worker an actor handle lives in, if any. Private: ``Actor._worker``."""
    return getattr(actor, "_worker", None)


# What every worker of an embedded cluster (CPU or GPU) imports before it does anything. Not torch._dynamo (~1 s
# here): an embodied run never needs it (rlnb.components.optim builds and steps Adam without it), and what
# compiles imports it then.
WORKER_PRELOAD = ("distributed", "numpy", "torch", "gymnasium", "rlnb.components")


def _fork_server_wanted() -> bool:
    """Whether workers start from a fork server: rlnb's default where the platform has one;
    ``RLNB_WORKER_START=spawn`` keeps Dask's default."""
    import multiprocessing

    return os.environ.get("RLNB_WORKER_START", "forkserver") == "forkserver" and (
        "forkserver" in multiprocessing.get_all_start_methods()
    )


# what the fork server itself imports: WORKER_PRELOAD, with the garbage collector paused
FORK_SERVER_PRELOAD = ("rlnb._preload",)


def import_with_collector_paused(names, freeze: bool = False) -> None:
    """Import ``names`` with the garbage collector paused (~20 % faster for torch and Dask here: it would
    scan the growing heap over and over); ``freeze``: then move everything alive to the permanent generation
    (a fork server's, so forked workers never scan those objects)."""
    import gc
    import importlib

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for name in names:
            importlib.import_module(name)
    finally:
        if freeze:
            gc.freeze()
        if was_enabled:
            gc.enable()


def fork_server_preload(lm: bool = False) -> tuple[str, ...]:
    """The fork server's preload: :data:`FORK_SERVER_PRELOAD`, and for workers that will build
    ``transformers`` models (``lm``) ``rlnb._preload_lm`` too (transformers and ``torch._dynamo``)."""
    return (*FORK_SERVER_PRELOAD, "rlnb._preload_lm") if lm else FORK_SERVER_PRELOAD


def fork_workers_from_preloaded_server(preload=FORK_SERVER_PRELOAD) -> bool:
    """Make local Dask worker processes start from a fork server that has imported ``preload`` once,
    instead of each spawned process importing them again (Dask's ``multiprocessing-method:
    forkserver``). Dask sets the fork server's preload itself, once, guarded by the private
    ``distributed.utils._forkserver_preload_set``: rlnb sets its own list first. ``RLNB_WORKER_START=spawn``
    keeps Dask's default. Returns whether the fork server is used."""
    import multiprocessing

    import dask
    import distributed.utils as dask_utils

    if not _fork_server_wanted():
        dask.config.set({"distributed.worker.multiprocessing-method": "spawn"})  # Dask's default
        return False
    if not dask_utils._forkserver_preload_set:
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
        dask_utils._forkserver_preload_set = True
    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
    return True


def prestart_fork_server(preload=FORK_SERVER_PRELOAD) -> bool:
    """Start the workers' fork server now, so it imports ``preload`` (~5 s of one core here) while the
    driver goes on with its own imports on the other cores; the embedded cluster's workers then fork
    from it. Needs neither torch nor Dask imported. ``rlnb run`` calls it once the recipe asks for an
    embedded cluster (CPU or GPU). Returns whether a fork server is (now) running."""
    if not _fork_server_wanted():
        return False
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(list(preload))  # no effect once the server runs
    forkserver.ensure_running()  # returns at once: the server imports in its own process
    return True


def stop_fork_server() -> None:
    """Stop a fork server :func:`prestart_fork_server` started, at once, even mid-import (a recipe that
    failed its checks after the server started): nothing is left running behind the driver."""
    import signal
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    server._stop()  # closes its pipe and socket, reaps it
    # the resource tracker the fork server started exits on its own once the driver has, which on a
    # loaded machine is after the driver's exit: close its pipe and reap it here (a later start relaunches it)
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    if getattr(tracker, "_pid", None) is not None:
        with contextlib.suppress(ChildProcessError, OSError):
            tracker._stop()


# A signal sent to the driver's whole process group (a closed terminal's SIGHUP, `systemctl stop`, Slurm's scancel,
# `kill -- -PGID`) reaches the embedded cluster's workers too: they leave it to the driver, which checkpoints and
# then stops them (Dask's nanny stops a worker through its own queue, and SIGKILLs it if it must).
STOP_SIGNALS = ("SIGTERM", "SIGHUP")
_AT_FORK = [False]


def _left_to_driver(signum, frame) -> None:
    """A stop signal in a worker of the embedded cluster: the driver decides (see :data:`STOP_SIGNALS`)."""


def _default_stop_signals() -> None:
    import signal

    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_DFL)


def leave_stop_signals_to_driver() -> None:
    """In a worker process of an embedded cluster (its main thread): ignore :data:`STOP_SIGNALS`, and SIGINT; a
    process it forks (an env's subprocess) gets the defaults back, and one it spawns starts with them (a Python
    handler does not survive ``exec``)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), _left_to_driver)
    if not _AT_FORK[0]:
        _AT_FORK[0] = True
        os.register_at_fork(after_in_child=_default_stop_signals)
