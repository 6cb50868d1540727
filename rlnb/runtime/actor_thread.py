"""A worker's actor thread that also answers direct calls, so a call to a rank needs no thread hop.

Dask runs every actor method on one thread per worker (its "actor" executor). A direct call used to
reach that thread from the thread reading its connection and come back the same way: two thread
wake-ups, about half of such a call on a small VM. :class:`ActorThread` takes the place of
Dask's actor executor (:func:`rlnb._dask.replace_actor_executor`). Its one thread runs what Dask
submits, as before, and between those it waits on the connections handed to it
(:meth:`ActorThread.adopt`): a request is read, run and answered on the thread that runs the
component, so a rank's methods still all run on that one thread, whichever route called them.

Nothing on this thread waits without a deadline: a request arriving in pieces must keep coming
(``STALL_S``), and a reply the driver is not reading yet (the socket's buffer is full) is finished
by a helper thread, which hands the connection back once the reply is out.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import os
import select
import socket
import threading

log = logging.getLogger("rlnb")

KEEP, DROP, DETACHED = "keep", "drop", "detached"  # what serving one request did to its connection
JOIN_TIMEOUT_S = 10.0  # how long shutdown(wait=True) waits for a call still running


class ActorThread(concurrent.futures.Executor):
    """A one-thread executor (Dask's actor executor's replacement) that also serves connections.

    Args:
        thread_name: the thread's name (Dask's actor thread name, so logs and profiles read the same).
        context: a context manager factory the thread runs inside, all its life (Dask's actor
            thread state, :func:`rlnb._dask.as_actor_thread`).
    """

    def __init__(self, thread_name: str, context=contextlib.nullcontext):
        self.thread_name = thread_name
        self._context = context
        self._lock = threading.Lock()
        self._tasks: collections.deque = collections.deque()
        self._adopted: collections.deque = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._closing = False
        self.served = 0  # requests answered on this thread (a test reads it)

    # ------------------------------------------------------------------ what Dask calls
    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closing:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._tasks.append((future, fn, args, kwargs))
            self._start()
        self._wake()
        return future

    def shutdown(
        self, wait: bool = True, *, cancel_futures: bool = False, timeout: float | None = None
    ) -> None:
        with self._lock:
            self._closing = True
            thread = self._thread
        self._wake()
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_TIMEOUT_S if timeout is None else timeout)

    # ------------------------------------------------------------------ connections
    def adopt(self, conn: socket.socket, serve, closed, first=None) -> bool:
        """Serve ``conn`` on this thread from now on: ``serve(conn, request)`` answers one request
        (``request`` is ``None``: read it from ``conn``) and returns ``KEEP``, ``DROP`` (the
        connection is over; ``closed(conn)`` is then called) or ``DETACHED`` (another thread has
        it now and may adopt it again). ``first`` is a request already read from ``conn``, answered
        first. False if this executor is shutting down (the caller keeps ``conn``)."""
        with self._lock:
            if self._closing:
                return False
            self._adopted.append((conn, serve, closed, first))
            self._start()
        self._wake()
        return True

    # ------------------------------------------------------------------ the thread
    def _start(self) -> None:  # (under the lock)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # full: a wake-up is pending anyway
            os.write(self._wake_w, b"\0")

    def _run(self) -> None:
        with self._context():
            self._loop()

    def _loop(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        conns: dict[int, tuple] = {}  # fd -> (conn, serve, closed)
        try:
            while True:
                with self._lock:
                    task = self._tasks.popleft() if self._tasks else None
                    adopted = list(self._adopted)
                    self._adopted.clear()
                    closing = self._closing
                for conn, serve, closed, first in adopted:
                    if first is None or self._serve(conn, serve, closed, first) == KEEP:
                        conns[conn.fileno()] = (conn, serve, closed)
                        poller.register(conn, select.POLLIN | select.POLLPRI)
                if task is not None:
                    self._run_task(*task)
                elif closing:
                    return
                # after a task, only the requests already waiting (then the next task: each waits
                # its turn, in neither order's favour); with no task, sleep until a request or a task
                for fd, _ in poller.poll(0 if task is not None else None):
                    if fd == self._wake_r:
                        with contextlib.suppress(BlockingIOError, OSError):
                            while os.read(self._wake_r, 4096):
                                pass
                        continue
                    conn, serve, closed = conns[fd]
                    if self._serve(conn, serve, closed, None) != KEEP:
                        poller.unregister(fd)
                        del conns[fd]
        finally:
            for conn, _serve, closed in conns.values():
                self._close(conn, closed)
            with self._lock:
                tasks, adopted = list(self._tasks), list(self._adopted)
                self._tasks.clear()
                self._adopted.clear()
            for future, *_ in tasks:
                future.cancel()
            for conn, _serve, closed, _first in adopted:
                self._close(conn, closed)
            os.close(self._wake_r)
            os.close(self._wake_w)

    @staticmethod
    def _run_task(future, fn, args, kwargs) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # as ThreadPoolExecutor does: the caller gets it
            future.set_exception(e)
        else:
            future.set_result(result)

    def _serve(self, conn, serve, closed, request) -> str:
        try:
            outcome = serve(conn, request)
        except Exception as e:  # a bug in serve(): never let it stop this thread
            log.warning("direct call on %s failed: %s: %s", self.thread_name, type(e).__name__, e)
            outcome = DROP
        self.served += 1
        if outcome == DROP:
            self._close(conn, closed)
        return outcome

    @staticmethod
    def _close(conn, closed) -> None:
        with contextlib.suppress(OSError):
            conn.close()
        closed(conn)


__all__ = ["DETACHED", "DROP", "KEEP", "ActorThread"]
