"""Channels: named, keyed FIFO queues between components, hosted on a Dask worker.

The queue lives in an async Dask actor on one worker, so a blocking ``get`` waits on that
worker's event loop and never occupies a worker's actor thread. Large tensors and arrays put by a
process on the channel's node go through shared memory (``/dev/shm``): only a small handle
travels, and the consumer maps the pages without a copy. Across nodes, they travel by value.

Example:
    >>> ch = Channel.create(cluster, "batches", maxsize=4)   # doctest: +SKIP
    >>> ch.put({"obs": torch.zeros(8, 4)}, key="env0")      # doctest: +SKIP
    >>> ch.get(key="env0", timeout=5)["obs"].shape          # doctest: +SKIP
    torch.Size([8, 4])
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque

from rlnb.errors import ChannelClosedError, ChannelTimeoutError
from rlnb.runtime import shm
from rlnb.runtime.plugin import ensure_worker_runtime
from rlnb.runtime.shm import HOSTNAME, pack, unpack

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_MAX_BYTES = 1 << 30  # a channel's default bound on the bytes it holds (Channel.create's max_bytes)
_SENDERS: dict[tuple, object] = {}  # per process and channel: puts whose replies are read later
_SENDERS_LOCK = threading.Lock()
_UNREACHABLE: set[tuple] = set()  # direct offers this process cannot connect to (it uses Dask's rpc)


class ChannelServer:
    """The queues, in a Dask actor on one worker.

    The queue state is guarded by one ``threading.Condition``. Direct-call clients
    (:mod:`rlnb.runtime.direct`) run an operation on their connection's thread in the worker, and a
    client living in the same process calls it in-process: a blocked ``get`` wakes as soon as a
    ``put`` appends, without a hop through the event loop. The async methods are the Dask-actor
    route (``RLNB_DIRECT_CALLS=0``); blocking ones wait on a thread of their own, never on the
    worker's event loop.
    """

    def __init__(self, name: str, maxsize: int, max_bytes: int = 0, session: str = ""):
        from rlnb.runtime import direct

        self.name, self.maxsize, self.max_bytes = name, maxsize, max_bytes
        self.session = (
            session  # the driver session that made it (rlnb.Cluster.session): its direct calls' credential
        )
        self.queued_bytes = 0  # of the tensors and arrays queued, over every key (what max_bytes bounds)
        self.queues: dict[str, deque] = {}
        self._cv = threading.Condition()
        self.node = HOSTNAME
        self.closed = False
        self.counts = {
            "items": 0,
            "shm_tensors": 0,
            "shm_bytes": 0,
            "cuda_ipc_tensors": 0,
            "cuda_ipc_bytes": 0,
        }
        self._waiters = None  # threads for blocking Dask-actor calls, made on first use
        self.direct = direct.serve(self)

    # ---- the operations, thread-safe; ``direct_call`` is what the call server runs
    def direct_call(self, op: str, args: tuple):
        if op not in ("put", "get", "qsize", "keys", "stats", "close"):
            raise ValueError(f"channel {self.name!r}: unknown operation {op!r}")
        return getattr(self, f"_{op}")(*args)

    def _put(self, key: str, item, timeout_s: float | None):
        with self._cv:
            if self.closed:
                shm.release(item)
                return ("closed", 0)
            q = self.queues.setdefault(key, deque())
            size = item_bytes(item)

            def room() -> bool:
                if self.maxsize > 0 and len(q) >= self.maxsize:
                    return False
                # (an item bigger than the bound still goes into an empty channel: nothing could make room)
                return (
                    not self.max_bytes or not self.queued_bytes or self.queued_bytes + size <= self.max_bytes
                )

            if not room() and not self._cv.wait_for(lambda: room() or self.closed, timeout_s):
                shm.release(item)
                return ("timeout", len(q))
            if self.closed:
                shm.release(item)
                return ("closed", 0)
            q.append(item)
            self.queued_bytes += size
            self._cv.notify_all()
            self.counts["items"] += 1
            for ref in shm.refs(item):
                kind = "cuda_ipc" if isinstance(ref, shm._CudaRef) else "shm"
                self.counts[f"{kind}_tensors"] += 1
                self.counts[f"{kind}_bytes"] += ref.nbytes
            return ("ok", len(q))

    def _get(self, key: str, n: int, timeout_s: float | None, node: str, exact: bool = True):
        """Take ``n`` items (``exact=False``: up to ``n``, at least 1); ``timeout_s=0`` never waits."""
        need = n if exact else 1
        with self._cv:
            q = self.queues.setdefault(key, deque())
            if len(q) < need:
                if self.closed:
                    return ("closed", 0)
                if timeout_s == 0:
                    return ("empty", None)
                if not self._cv.wait_for(lambda: len(q) >= need or self.closed, timeout_s):
                    return ("timeout", len(q))
                if self.closed:  # woken by close()
                    return ("closed", 0)
            items = [q.popleft() for _ in range(min(n, len(q)))]
            self.queued_bytes -= sum(item_bytes(i) for i in items)
            self._cv.notify_all()
        if node != self.node:  # the consumer cannot see our shared memory: send values
            items = [unpack(i, host=True) for i in items]
        return ("ok", items)

    def _qsize(self, key: str | None) -> int:
        with self._cv:
            if key is None:
                return sum(len(q) for q in self.queues.values())
            return len(self.queues.get(key, ()))

    def _keys(self) -> list[str]:
        with self._cv:
            return [k for k, q in self.queues.items() if q]

    def _stats(self) -> dict:
        with self._cv:
            return dict(self.counts)

    def _close(self) -> int:
        dropped = 0
        with self._cv:
            for q in self.queues.values():
                while q:
                    shm.release(q.popleft())
                    dropped += 1
            self.queued_bytes = 0
            self.closed = True
            self._cv.notify_all()  # blocked gets and puts wake and answer "closed"
        return dropped

    def pop_after_reply(self):
        """What the direct-call server runs once it has answered a request: after ``close``, unregister, so the
        channel's connections close and nothing of it stays on the worker."""
        if not self.closed:
            return None
        from rlnb.runtime import direct

        return lambda: direct.unserve(self)

    # ---- the Dask-actor route (coroutines on the worker's event loop)
    async def _blocking(self, fn, *args):
        if self._waiters is None:
            from concurrent.futures import ThreadPoolExecutor

            # its own threads: blocked gets must never starve the loop's default executor
            self._waiters = ThreadPoolExecutor(64, thread_name_prefix=f"rlnb-channel-{self.name}")
        return await asyncio.get_running_loop().run_in_executor(self._waiters, fn, *args)

    async def contact(self) -> tuple:
        """``(node, direct offer or None)``: where the queues live and how to reach them directly."""
        return self.node, self.direct

    async def put(self, key: str, item, timeout_s: float | None):
        return await self._blocking(self._put, key, item, timeout_s)

    async def get(self, key: str, n: int, timeout_s: float | None, node: str, exact: bool = True):
        if timeout_s == 0:
            return self._get(key, n, 0, node, exact)
        return await self._blocking(self._get, key, n, timeout_s, node, exact)

    async def qsize(self, key: str | None) -> int:
        return self._qsize(key)

    async def keys(self) -> list[str]:
        return self._keys()

    async def stats(self) -> dict:
        """Items put so far, and how many tensors/bytes of them went through shared memory."""
        return self._stats()

    async def close(self) -> int:
        """Drop every queued item, freeing its shared memory. Returns how many were dropped."""
        from rlnb.runtime import direct

        dropped = self._close()
        direct.unserve(self)  # (see pop_after_reply)
        return dropped


class Channel:
    """Client handle of a channel; picklable, so it can be passed into components.

    Methods block (with a timeout) and have ``a``-prefixed async twins for notebooks and async code.
    """

    def __init__(
        self,
        server,
        name: str,
        node: str,
        maxsize: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        direct_offer: tuple | None = None,
    ):
        self._server, self.name, self.node, self.maxsize = server, name, node, maxsize
        self.max_bytes = 0  # (set by create)
        self.timeout_s = timeout_s
        self._direct = direct_offer
        self._closed = False  # closed through this handle
        self._route_cache = None  # chosen on first use in each process (see _route)
        self._cluster = None  # the driver's cluster that made it (a weak reference; None elsewhere)

    @classmethod
    def create(
        cls,
        cluster,
        name: str = "channel",
        maxsize: int = 0,
        slot: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> Channel:
        """Create a channel hosted on the worker of ``slot``.

        Args:
            maxsize: items each key's queue holds at most (0: no count bound).
            max_bytes: bytes of tensors and arrays the channel holds at most, over every key (default 1 GiB;
                0: no bound): a ``put`` waits (up to its timeout) while one more item would pass it. An item
                bigger than the bound still goes into an empty channel.
        """
        if not isinstance(maxsize, int) or maxsize < 0:
            raise ValueError(f"Channel maxsize: expected an int >= 0, got {maxsize!r}")
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise ValueError(f"Channel max_bytes: expected an int >= 0 (0: no bound), got {max_bytes!r}")
        address = cluster.slots[slot].address
        ensure_worker_runtime(cluster)
        fut = cluster.client.submit(
            ChannelServer,
            name,
            maxsize,
            max_bytes,
            cluster.session,
            actor=True,
            workers=[address],
            allow_other_workers=False,
            pure=False,
        )
        server = cluster.bind(fut.result(timeout=60))
        node, offer = _resolve(server.contact(), 60)
        channel = cls(server, name, node, maxsize, timeout_s, offer)
        channel.max_bytes = max_bytes
        cluster.close_with(channel)
        channel._cluster = weakref.ref(cluster)
        return channel

    @staticmethod
    def empty(shape, dtype=None):
        """An uninitialised CPU tensor in this process's shared memory: fill it and :meth:`put` it, and a
        channel on this node sends it with no copy (the reader maps the same pages). Once put it is the
        reader's: do not write to it again. See :func:`rlnb.runtime.shm.shared_empty`.

        Example:
            >>> obs = channel.empty((64, 3, 84, 84))  # doctest: +SKIP
            >>> env.render_into(obs); channel.put(obs, key="obs")  # doctest: +SKIP
        """
        return shm.shared_empty(shape, dtype)

    # ---- sync API
    def put(self, item, key: str = "default", timeout: float | None = None) -> None:
        """Append ``item`` to queue ``key``; waits while the queue holds ``maxsize`` items.

        Raises:
            ChannelClosedError: the channel was closed. (A put to an unbounded channel from another
                process does not wait for its answer: it raises at that handle's next operation.)
            ChannelTimeoutError: the queue stayed full for ``timeout`` seconds.
        """
        if self._closed:
            raise self._closed_error(key)
        timeout = self.timeout_s if timeout is None else timeout
        args = (key, pack(item, self.node), timeout)
        # no count bound: the answer may be read later (a byte bound holds the worker's connection thread, and so,
        # through the socket's buffers, this sender)
        if self.maxsize == 0:
            answer = self._call(lambda route: route.put_unbounded(args, timeout + 30))
            if answer is None:
                return
        else:
            answer = self._ask("put", args, timeout + 30)
        status, size = self._put_status(answer, key)
        if status == "timeout":
            raise ChannelTimeoutError(
                f"channel {self.name!r} key {key!r}: queue stayed full ({size} item(s), maxsize {self.maxsize}, "
                f"max_bytes {self.max_bytes}) for {timeout:g} s"
            )

    def get(self, key: str = "default", timeout: float | None = None):
        """Remove and return the oldest item of queue ``key``, waiting up to ``timeout`` seconds."""
        return self.get_batch(1, key, timeout)[0]

    def get_nowait(self, key: str = "default"):
        """Like :meth:`get` but raises ``queue.Empty`` at once when the queue is empty."""
        import queue

        status, items = self._ask("get", (key, 1, 0, HOSTNAME), 30)
        if status == "closed":
            raise self._closed_error(key)
        if status != "ok":
            raise queue.Empty(f"channel {self.name!r} key {key!r} is empty")
        return unpack(items[0])

    def get_batch(self, n: int, key: str = "default", timeout: float | None = None) -> list:
        """Remove and return ``n`` items of queue ``key`` in order, waiting until there are ``n``."""
        timeout = self.timeout_s if timeout is None else timeout
        status, items = self._ask("get", (key, n, timeout, HOSTNAME), timeout + 30)
        if status == "closed":
            raise self._closed_error(key)
        if status == "timeout":
            raise ChannelTimeoutError(
                f"channel {self.name!r} key {key!r}: waited {timeout:g} s for {n} item(s), {items} queued"
            )
        return [unpack(i) for i in items]

    def qsize(self, key: str | None = "default") -> int:
        """Items queued under ``key`` (``None``: all keys)."""
        return self._ask("qsize", (key,), 30)

    def keys(self) -> list[str]:
        """Keys that have queued items."""
        return self._ask("keys", (), 30)

    def stats(self) -> dict:
        """Counters: items put, tensors and bytes moved through shared memory."""
        return self._ask("stats", (), 30)

    def close(self, timeout_s: float = 30.0) -> int:
        """Drop queued items and free their shared memory; blocked readers and writers wake with
        :class:`~rlnb.errors.ChannelClosedError`, as does every later ``put`` or ``get``. ``timeout_s``: how long
        its worker may take to answer."""
        if self._closed:
            return 0
        dropped = self._ask("close", (), timeout_s)
        self._closed = True
        self.release_links()
        cluster = self._cluster() if self._cluster is not None else None
        if cluster is not None:  # (the driver's handle held the queue server's actor: freed now)
            cluster.forget_channel(self)
            self._server = None
        return dropped

    def _closed_error(self, key: str) -> ChannelClosedError:
        return ChannelClosedError(f"channel {self.name!r} key {key!r}: the channel was closed")

    def _put_status(self, reply: tuple, key: str) -> tuple:
        if reply[0] == "closed":
            raise self._closed_error(key)
        return reply

    def release_links(self) -> None:
        """Close this process's sockets to the channel's worker (``Cluster.close`` calls it)."""
        route, self._route_cache = self._route_cache, None
        if route is not None:
            route.release()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_route_cache": None, "_cluster": None}  # each process chooses its own route

    def _route(self):
        """How this process reaches the queues, chosen once per handle and process: in-process when
        they live here, the worker's direct socket when offered and reachable, else Dask's rpc."""
        from rlnb.runtime import direct

        if self._route_cache is None:
            offer = self._direct
            if offer is None or not direct.enabled() or offer in _UNREACHABLE:
                self._route_cache = _DaskChannelRoute(self._server)
            elif (here := direct.local_host(offer)) is not None:
                self._route_cache = _LocalChannelRoute(here)
            else:
                self._route_cache = _DirectChannelRoute(offer, self)
        return self._route_cache

    def _call(self, fn):
        """``fn(route)``; when the direct port turns out unreachable from here, once more through
        Dask's rpc (and this process keeps using Dask's rpc for this channel)."""
        try:
            return fn(self._route())
        except _Unreachable as e:
            import logging

            logging.getLogger("rlnb").warning(
                "channel %r: its worker's direct-call port is unreachable from here (%s); using Dask's rpc",
                self.name,
                e,
            )
            _UNREACHABLE.add(self._direct)
            self._route_cache = _DaskChannelRoute(self._server)
            return fn(self._route_cache)

    def _ask(self, op: str, args: tuple, timeout: float):
        """Run ``op`` on the queue server and return its value (or raise its typed error)."""
        if self._closed and self._server is None:  # closed by this driver, its queue server freed
            raise ChannelClosedError(f"channel {self.name!r}: the channel was closed")
        return self._call(lambda route: route.ask(op, args, timeout))

    # ---- async API
    async def aput(self, item, key: str = "default", timeout: float | None = None) -> None:
        await asyncio.to_thread(self.put, item, key, timeout)

    async def aget(self, key: str = "default", timeout: float | None = None):
        return await asyncio.to_thread(self.get, key, timeout)

    async def aget_batch(self, n: int, key: str = "default", timeout: float | None = None) -> list:
        return await asyncio.to_thread(self.get_batch, n, key, timeout)

    def __repr__(self) -> str:
        return f"<rlnb.Channel {self.name!r} on {self.node} maxsize={self.maxsize}>"

    def _repr_html_(self) -> str:  # local state only: the queues live on a worker (.stats() asks it)
        import html

        bound = "unbounded" if self.maxsize == 0 else f"maxsize {self.maxsize}"
        state = " · closed" if self._closed else ""
        return (
            f"<div><b>rlnb Channel</b> <code>{html.escape(self.name)}</code> on {html.escape(self.node)} · {bound}"
            f"{state} · <code>.stats()</code> for its queues</div>"
        )


def item_bytes(item) -> int:
    """Bytes of the tensors and arrays in a queued item: those parked in shared memory (their handles) and those
    carried inline."""
    total = 0
    if isinstance(item, dict):
        return sum(item_bytes(v) for v in item.values())
    if isinstance(item, (list, tuple)):
        return sum(item_bytes(v) for v in item)
    for ref in shm.refs(item):
        total += ref.nbytes
    nbytes = getattr(item, "nbytes", None)
    if total == 0 and isinstance(nbytes, int):  # a numpy array (or a tensor's numpy view)
        total = nbytes
    elif total == 0 and hasattr(item, "element_size") and hasattr(item, "numel"):  # a torch tensor
        total = item.element_size() * item.numel()
    return total


class _Unreachable(ConnectionError):
    """The channel's direct port cannot be reached from this process."""


class _DaskChannelRoute:
    """The queues through Dask's actor rpc."""

    def __init__(self, server):
        self.server = server

    def ask(self, op: str, args: tuple, timeout: float):
        return _resolve(getattr(self.server, op)(*args), timeout)

    def put_unbounded(self, args: tuple, timeout: float):
        return self.ask("put", args, timeout)

    def release(self) -> None:
        pass


class _LocalChannelRoute:
    """The queues live in this very process: call them (items are still copied, as a send would)."""

    def __init__(self, host):
        self.host = host

    def ask(self, op: str, args: tuple, timeout: float):
        from rlnb.runtime import direct

        return self.host.direct_call(op, direct.copy_by_pickle(args) if op == "put" else args)

    def put_unbounded(self, args: tuple, timeout: float):
        return self.ask("put", args, timeout)

    def release(self) -> None:
        pass


class _DirectChannelRoute:
    """The queues over their worker's direct-call socket. Puts to an unbounded channel go out on one
    ordered connection and their answers are read later (before the next other operation, so a
    handle reads its own writes)."""

    def __init__(self, offer: tuple, channel: Channel):
        self.offer, self.channel = offer, channel

    @property
    def _sender(self):
        return _SENDERS.get(self.offer)

    def ask(self, op: str, args: tuple, timeout: float):
        from rlnb.runtime import direct

        self._read_puts(timeout)
        pending = direct.link_for(self.offer).send(op, args, timeout)
        if pending.reply is not None and pending.reply[0] == "unreachable":
            raise _Unreachable(pending.reply[1])
        if not pending.wait(timeout):
            pending.discard()
            raise ChannelTimeoutError(
                f"channel {self.channel.name!r}: no answer from its worker within {timeout:g} s"
            )
        return self._value(op, pending.read())

    def put_unbounded(self, args: tuple, timeout: float):
        from rlnb.runtime import direct

        with _SENDERS_LOCK:  # one ordered connection per process and channel, shared by its handles
            sender = _SENDERS.get(self.offer)
            if sender is None:
                sender = _SENDERS[self.offer] = direct.OrderedSender(direct.link_for(self.offer))
        replies = sender.send("put", args, timeout)
        unreachable = bool(replies) and replies[-1][0] == "unreachable"
        for reply in replies[:-1] if unreachable else replies:
            self._earlier_put(reply)
        if unreachable:
            raise _Unreachable(replies[-1][1])
        return None  # answered later

    def _read_puts(self, timeout: float) -> None:
        if self._sender is not None and self._sender.unread:
            for reply in self._sender.drain(timeout):
                self._earlier_put(reply)

    def _earlier_put(self, reply: tuple) -> None:
        """The answer to a put sent earlier without waiting: raise what it says went wrong."""
        status, size = self.channel._put_status(self._value("put", reply), "?")
        if status == "timeout":
            ch = self.channel
            raise ChannelTimeoutError(
                f"channel {ch.name!r}: an earlier put waited past its timeout for room (max_bytes {ch.max_bytes}; "
                f"{size} item(s) queued under its key) and its item was dropped"
            )

    def _value(self, op: str, reply: tuple):
        """The value of a direct reply ``(status, value, duration_s)``, or its typed error."""
        status, value, _ = reply
        if status == "ok":
            return value
        if status == "lost" and isinstance(value, str):  # its worker answered: the channel is gone from it
            raise ChannelClosedError(f"channel {self.channel.name!r}: the channel was closed (or freed)")
        from rlnb.errors import remote_error

        where = f"tcp://{self.offer[0]}:{self.offer[1]} (direct)"
        raise remote_error(status, value, f"channel {self.channel.name!r}", 0, where, op)

    def release(self) -> None:
        from rlnb.runtime import direct

        with _SENDERS_LOCK:
            sender = _SENDERS.pop(self.offer, None)
        if sender is not None:
            sender.close()
        direct.drop_link(self.offer)


def _resolve(fut, timeout: float):
    """Wait for an actor call's result from any context (notebook, worker thread, same-worker fast path)."""
    if asyncio.iscoroutine(fut):  # Dask's same-worker fast path hands back the coroutine itself
        from distributed import get_worker

        loop = get_worker().loop.asyncio_loop
        return asyncio.run_coroutine_threadsafe(fut, loop).result(timeout)
    try:
        return fut.result(timeout=timeout)
    except TimeoutError:
        raise ChannelTimeoutError(f"no answer from the channel's worker within {timeout:g} s") from None
