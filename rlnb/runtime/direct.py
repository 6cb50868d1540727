"""Direct calls: the driver talks to rank hosts over their own sockets instead of Dask's rpc.

A Dask actor call costs ~1-2 ms on a 2-core VM, most of it in Dask's comm layer and event-loop
hops. Group calls are the per-step heartbeat of a training loop, so each worker process also runs
a small :class:`CallServer`: one thread per driver connection reads a request, runs it on the
worker's **actor thread** (exactly where Dask runs actor methods, with the same thread state, so a
component sees no difference and calls from both paths never overlap), and writes the reply.

A host with a thread-safe ``direct_call(op, args)`` (a channel's queue server) is called on the
connection's thread instead: a blocked ``get`` there is woken by a ``put`` on another connection
without any hop through the actor thread or the event loop.

A request starts with ``!32s16s`` (host key, operation). Then, in both directions: ``!IQ`` (number
of out-of-band buffers, pickle length), one ``!Q`` length per buffer, the pickle (protocol 5; the
standard pickler, or cloudpickle for what it cannot send), then the buffers: arrays and large CPU
tensors travel as raw bytes, outside the pickle, without a copy on the sending side. A connection starts
with the server's random token (handed out through Dask, in ``RankHost.ready``), so the port
accepts nothing that could not already talk to the Dask worker. ``tls://`` clusters keep Dask's
rpc (the direct port is not encrypted), as does ``RLNB_DIRECT_CALLS=0``.

Limits, so a stray or hostile client cannot exhaust a worker: the token must arrive within
``TOKEN_TIMEOUT_S``; at most ``RLNB_DIRECT_MAX_CONNECTIONS`` (256) connections are served at once
(more are closed on accept); a message may not exceed ``RLNB_MAX_MESSAGE_BYTES`` (8 GiB), checked on
its header before anything is allocated, and by the sender before anything is sent. Every send
from the driver has a deadline (the call's timeout). Authentication and protocol failures are logged
once per worker.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import pickle
import secrets
import select
import socket
import struct
import sys
import threading
import time
import uuid
import weakref

import cloudpickle

from rlnb import _dask
from rlnb.errors import RlnbError, pack_exception

log = logging.getLogger("rlnb")
_REQ = struct.Struct("!32s16s")  # a request starts with the host's key and the operation
_HEAD = struct.Struct("!IQ")
_LEN = struct.Struct("!Q")
TOKEN_BYTES = 16
TOKEN_TIMEOUT_S = 10.0  # a connection that has not sent its token by then is closed
MAX_BUFFERS = 1 << 16  # out-of-band buffers in one message
OUT_OF_BAND_MIN_BYTES = 64 * 1024  # tensors this big travel outside the pickle
RANK_OPS = frozenset(
    {"call", "ready", "save_state", "load_state", "open_store", "join_group", "destroy_groups"}
)


def env_flag(name: str) -> bool:
    """An on-by-default switch from the environment: ``0``, ``false``, ``no`` or ``off`` turn it off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def enabled() -> bool:
    """Whether the driver should use direct calls (``RLNB_DIRECT_CALLS=0`` turns them off)."""
    return env_flag("RLNB_DIRECT_CALLS")


def max_connections() -> int:
    """Connections a worker's call server serves at once (``RLNB_DIRECT_MAX_CONNECTIONS``, 256)."""
    return int(os.environ.get("RLNB_DIRECT_MAX_CONNECTIONS", "256"))


def max_message_bytes() -> int:
    """The largest message either side accepts (``RLNB_MAX_MESSAGE_BYTES``, default 8 GiB)."""
    return int(os.environ.get("RLNB_MAX_MESSAGE_BYTES", str(8 << 30)))


class MessageTooLarge(RlnbError, ValueError):
    """A message over :func:`max_message_bytes` (refused before it is sent or allocated)."""


def _check_size(nbytes: int, what: str) -> None:
    limit = max_message_bytes()
    if nbytes > limit:
        raise MessageTooLarge(
            f"{what} of {nbytes:,} bytes exceeds the maximum of {limit:,} (RLNB_MAX_MESSAGE_BYTES); "
            "move bulk data through a Channel or a file, or raise the limit on driver and workers"
        )


# ---------------------------------------------------------------------------------- encoding
def _tensor_from_bytes(buf, dtype: str, shape: tuple):
    import torch

    flat = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).view(shape)


def _reduce_tensor(obj):
    """CPU tensors as raw bytes (torch's own pickling is slow: ~50 us even for a tiny tensor), big
    ones out of band; ``None`` (pickle as usual) for anything else, e.g. a tensor that needs grad."""
    torch = sys.modules.get("torch")
    if (
        torch is None
        or type(obj) is not torch.Tensor
        or obj.layout != torch.strided
        or obj.device.type != "cpu"
        or obj.requires_grad
        or obj.is_quantized
        or obj.is_conj()
        or obj.is_neg()
    ):
        return None
    t = obj.contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy()
    data = pickle.PickleBuffer(raw) if raw.nbytes >= OUT_OF_BAND_MIN_BYTES else bytearray(raw)
    return _tensor_from_bytes, (data, str(t.dtype).removeprefix("torch."), tuple(t.shape))


class _FastPickler(pickle.Pickler):
    """The standard pickler, with tensors as raw bytes."""

    def reducer_override(self, obj):
        out = _reduce_tensor(obj)
        return NotImplemented if out is None else out


class _CloudPickler(cloudpickle.Pickler):
    """cloudpickle, for what the standard pickler cannot send (lambdas, classes and functions defined
    in a notebook travel by value, as with Dask), with tensors as raw bytes."""

    def reducer_override(self, obj):
        out = _reduce_tensor(obj)
        return super().reducer_override(obj) if out is None else out


def dumps(obj) -> list:
    """``obj`` as a list of byte-like parts ready to send (header, pickle, raw buffers).

    Like Dask: the standard pickler first, cloudpickle when that fails or refers to ``__main__``
    (which the receiving process does not have) or to a module registered with
    ``cloudpickle.register_pickle_by_value`` (the receiver may not have it either).
    """
    buffers: list[pickle.PickleBuffer] = []
    f = io.BytesIO()
    try:
        _FastPickler(f, protocol=5, buffer_callback=buffers.append).dump(obj)
        data = f.getvalue()  # (a memoryview would test for an int, not a substring)
        fast = b"__main__" not in data and not any(
            m.encode() in data for m in cloudpickle.list_registry_pickle_by_value()
        )
    except Exception:
        fast = False
    if not fast:
        buffers, f = [], io.BytesIO()
        _CloudPickler(f, protocol=5, buffer_callback=buffers.append).dump(obj)
    payload = f.getbuffer()
    raws = [b.raw() for b in buffers]
    _check_size(payload.nbytes + sum(r.nbytes for r in raws), "a message")
    head = _HEAD.pack(len(raws), payload.nbytes) + b"".join(_LEN.pack(r.nbytes) for r in raws)
    return [head, payload, *raws]


def loads(payload, buffers):
    return pickle.loads(payload, buffers=buffers)


def send_parts(sock: socket.socket, parts: list) -> None:
    total = sum(memoryview(p).nbytes for p in parts)
    if total <= 256 * 1024:  # one syscall for small messages
        sock.sendall(b"".join(parts))
    else:
        for p in parts:
            sock.sendall(p)


def send_within(sock: socket.socket, parts: list, timeout_s: float | None) -> None:
    """:func:`send_parts` with a deadline for the whole send (``TimeoutError`` past it: the socket
    is then unusable, its peer may have half a message)."""
    if timeout_s is None:
        return send_parts(sock, parts)
    sock.settimeout(max(timeout_s, 0.001))
    try:
        send_parts(sock, parts)
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(None)


def _failure(error: OSError) -> str:
    """The reply status for a failed send: ``"timeout"`` past its deadline, else ``"lost"``."""
    return "timeout" if isinstance(error, TimeoutError) else "lost"


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionResetError("connection closed by the other end")
        got += k
    return buf


def recv_message(sock: socket.socket):
    """One message: ``(payload, buffers)``. Raises ``ConnectionError`` when the peer is gone and
    :class:`MessageTooLarge` when its header announces more than the limit (nothing allocated yet)."""
    nbufs, plen = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    if nbufs > MAX_BUFFERS:
        raise MessageTooLarge(f"a message header announces {nbufs:,} buffers (at most {MAX_BUFFERS:,})")
    lens = [_LEN.unpack_from(b)[0] for b in (_recv_exact(sock, _LEN.size) for _ in range(nbufs))]
    _check_size(plen + sum(lens), "an incoming message")
    payload = _recv_exact(sock, plen)
    return payload, [_recv_exact(sock, n) for n in lens]


# ---------------------------------------------------------------------------------- worker side
class CallServer:
    """One per Dask worker: answers direct calls to the rank hosts living on it."""

    def __init__(self, worker):
        self.worker = worker
        self.token = secrets.token_bytes(TOKEN_BYTES)
        # weak: a host lives as long as Dask keeps its actor (a group or channel dropped without
        # shutdown is freed as usual; a call to it then gets "shut down")
        self.hosts: weakref.WeakValueDictionary[str, object] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self.connections = 0  # being served now
        self._logged: set[str] = set()  # kinds of failure already logged (each is logged once)
        ip = worker.address.split("://", 1)[1].rsplit(":", 1)[0].strip("[]")
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        self.sock = _listen(ip, family)
        self.address = (ip, self.sock.getsockname()[1])
        self._closing = False
        _SERVERS[worker.address] = self
        threading.Thread(target=self._accept, name="rlnb-direct-accept", daemon=True).start()

    def close(self) -> None:
        """Stop accepting (connections being served end with their driver)."""
        self._closing = True
        _SERVERS.pop(self.worker.address, None)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self.sock.close()

    def register(self, host) -> tuple:
        key = uuid.uuid4().hex  # 32 characters, as the request header expects
        with self._lock:
            self.hosts[key] = host
        return (*self.address, self.token, key)

    def unregister(self, host) -> None:
        with self._lock:
            for key in [k for k, h in list(self.hosts.items()) if h is host]:
                del self.hosts[key]

    def _accept(self):
        delay_s = 0.0
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError as e:
                if self._closing or self.sock.fileno() < 0:  # closed: the worker is shutting down
                    return
                # transient (too many open files, a connection reset before accept...): back off and
                # keep serving; one bad moment must not stop direct calls on this worker for good
                delay_s = min(1.0, max(0.01, delay_s * 2))
                if delay_s == 0.01 or delay_s == 1.0:
                    log.warning("direct-call server on %s: accept failed (%s); retrying", self.address, e)
                time.sleep(delay_s)
                continue
            delay_s = 0.0
            with self._lock:
                full = self.connections >= max_connections()
                self.connections += not full
            if full:  # one thread per connection: refuse rather than grow without bound
                self._log_once(
                    "cap",
                    "%d connections open (RLNB_DIRECT_MAX_CONNECTIONS); refusing more",
                    max_connections(),
                )
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="rlnb-direct-conn", daemon=True).start()

    def _log_once(self, kind: str, message: str, *args) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("direct-call server on %s:%s: " + message + " (logged once)", *self.address, *args)

    def _serve(self, conn: socket.socket):
        try:
            with conn:
                self._serve_connection(conn)
        finally:
            with self._lock:
                self.connections -= 1

    def _serve_connection(self, conn: socket.socket):
        try:
            conn.settimeout(TOKEN_TIMEOUT_S)
            token = bytes(_recv_exact(conn, TOKEN_BYTES))
        except (OSError, EOFError) as e:
            why = f"no token within {TOKEN_TIMEOUT_S:g} s" if isinstance(e, TimeoutError) else str(e)
            self._log_once("auth", "a connection closed before authenticating (%s)", why)
            return
        if not secrets.compare_digest(token, self.token):
            self._log_once("auth", "a connection sent a wrong token; closed")
            return
        conn.settimeout(None)  # an authenticated connection may idle in the driver's pool
        try:
            while True:
                key, op = (b.rstrip(b"\0").decode() for b in _REQ.unpack(_recv_exact(conn, _REQ.size)))
                payload, buffers = recv_message(conn)
                host = self.hosts.get(key)
                if host is not None and hasattr(host, "direct_call"):
                    send_parts(conn, self._execute_here(host, op, payload, buffers))
                    continue
                reply = _dask.run_on_actor_thread(
                    self.worker, self._execute, (host, op, payload, buffers), "rlnb-direct-call"
                )
                send_parts(conn, reply.result())
        except MessageTooLarge as e:  # say why before closing (the payload cannot be skipped)
            self._log_once("size", "%s", e)
            with contextlib.suppress(OSError):
                send_parts(conn, dumps(("err", pack_exception(e), 0.0)))
        except (OSError, EOFError):  # the driver went away, or the worker is closing: it sees EOF
            return
        except Exception as e:  # a bug or a garbled request: log it, close the connection
            self._log_once("protocol", "closed a connection after %s: %s", type(e).__name__, e)

    def _execute(self, host, op: str, payload, buffers) -> list:
        """On the actor thread (where Dask runs actor methods): decode, run, encode the reply."""
        t0 = time.perf_counter()
        try:
            if host is None:
                reply = ("lost", "it was shut down (or freed) on this worker", 0.0)
            elif op not in RANK_OPS:
                raise ValueError(f"unknown rank-host operation {op!r}")
            else:  # arguments are unpickled here too: Dask actor handles in them bind to this worker
                reply = getattr(host, op)(*loads(payload, buffers))
        except Exception as e:  # e.g. an argument that cannot be unpickled here
            reply = ("err", pack_exception(e), time.perf_counter() - t0)
        return _encode_reply(reply)

    def _execute_here(self, host, op: str, payload, buffers) -> list:
        """Run a thread-safe host's operation on this connection's thread."""
        t0 = time.perf_counter()
        try:
            reply = ("ok", host.direct_call(op, loads(payload, buffers)), time.perf_counter() - t0)
        except Exception as e:
            reply = ("err", pack_exception(e), time.perf_counter() - t0)
        return _encode_reply(reply)


def _encode_reply(reply: tuple) -> list:
    try:
        return dumps(reply)
    except Exception as e:
        err = TypeError(f"the result could not be sent back: {type(e).__name__}: {e}")
        return dumps(("err", pack_exception(err), reply[2]))


def _listen(ip: str, family) -> socket.socket:
    """A listening socket on ``ip``: a free port, or the first free one of ``RLNB_DIRECT_PORTS``
    (``"9100-9199"``) for clusters whose firewalls only open known ports."""
    spec = os.environ.get("RLNB_DIRECT_PORTS", "").strip()
    if not spec:
        return socket.create_server((ip, 0), family=family)
    lo, _, hi = spec.partition("-")
    try:
        ports = range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise ValueError(
            f"RLNB_DIRECT_PORTS: expected a port or a range like 9100-9199, got {spec!r}"
        ) from None
    for port in ports:
        try:
            return socket.create_server((ip, port), family=family)
        except OSError:
            continue
    raise OSError(f"RLNB_DIRECT_PORTS={spec}: no free port on {ip}")


# The call servers of this process, by worker address: an index only (weak); each server's life
# belongs to its worker's :class:`rlnb.runtime.plugin.WorkerRuntime` (set up and torn down by Dask).
_SERVERS: weakref.WeakValueDictionary[str, CallServer] = weakref.WeakValueDictionary()


def serve(host) -> tuple | None:
    """Register a rank host with its worker's call server.

    Returns ``(ip, port, token, key)`` for the driver, or ``None`` when direct calls cannot be
    offered (not inside a Dask worker, a worker without rlnb's plugin, a non-TCP comm such as
    ``tls://``, or no socket): the host is then reached through Dask's rpc.
    """
    try:
        from distributed import get_worker

        worker = get_worker()
    except (ImportError, ValueError):
        return None
    server = _SERVERS.get(worker.address)
    return None if server is None else server.register(host)


def drop_link(offer: tuple) -> None:
    """Close and forget this process's link to ``offer`` (its worker is going away)."""
    with _LINKS_LOCK:
        link = _LINKS.pop(tuple(offer), None)
    if link is not None:
        link.close()


def local_host(offer: tuple):
    """The host object behind ``offer`` if it lives in this very process, else ``None``."""
    ip, port, _, key = offer
    for server in list(_SERVERS.values()):
        if server.address == (ip, port):
            return server.hosts.get(key)
    return None


def copy_by_pickle(obj):
    """A copy of ``obj`` made the way a direct call would send it (for in-process calls)."""
    _head, payload, *buffers = dumps(obj)
    return loads(payload, [bytearray(b) for b in buffers])


def unserve(host) -> None:
    for server in list(_SERVERS.values()):
        server.unregister(host)


# ---------------------------------------------------------------------------------- driver side
def readable(objs: list, timeout_s: float | None) -> list:
    """Those of ``objs`` (sockets or objects with ``fileno()``) with data or EOF to read within
    ``timeout_s`` seconds (``None``: wait forever). ``poll``, not ``select``: any fd number works."""
    poller = select.poll()
    by_fd = {}
    for o in objs:
        fd = o.fileno()
        by_fd[fd] = o
        poller.register(fd, select.POLLIN | select.POLLPRI)
    ms = None if timeout_s is None else max(0, int(timeout_s * 1000 + 0.999))
    return [by_fd[fd] for fd, _ in poller.poll(ms)]


CONNECT_TIMEOUT_S = 5.0
_UNREACHABLE_ERRNOS = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ETIMEDOUT, errno.EHOSTDOWN}


class Unreachable(ConnectionError):
    """A direct-call port cannot be reached from here (unlike a refused connection, which means the
    process behind it is gone): the caller should use Dask's rpc instead."""


class DirectLink:
    """The driver's connections to one rank host: a pool of sockets, one per call in flight."""

    def __init__(self, ip: str, port: int, token: bytes, key: str):
        self.address, self.token, self.key = (ip, port), token, key
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def connect(self, timeout_s: float | None = None) -> socket.socket:
        """A new connection. Raises :class:`Unreachable` when the port cannot be reached at all
        (no route, or a firewall dropping packets) rather than refused (the process is gone)."""
        try:
            sock = socket.create_connection(self.address, timeout=timeout_s or CONNECT_TIMEOUT_S)
        except (TimeoutError, OSError) as e:
            if isinstance(e, TimeoutError) or e.errno in _UNREACHABLE_ERRNOS:
                raise Unreachable(f"{self.address[0]}:{self.address[1]}: {e}") from e
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(self.token)  # (still under the connect timeout)
        sock.settimeout(None)
        return sock

    def send(self, op: str, args: tuple | list, timeout_s: float | None = None) -> PendingCall:
        """Send one request (``args``: a tuple, or already :func:`dumps`-encoded); read the reply
        from the returned :class:`PendingCall`. A send still blocked after ``timeout_s`` seconds (a
        hung or stopped worker no longer reading) gives the reply ``("timeout", error, 0)``."""
        parts = [
            _REQ.pack(self.key.encode(), op.encode()),
            *(args if isinstance(args, list) else dumps(args)),
        ]
        with self._lock:
            sock = self._idle.pop() if self._idle else None
        try:
            sock = sock or self.connect()
            send_within(sock, parts, timeout_s)
        except Unreachable as e:
            return PendingCall(self, None, ("unreachable", e, 0.0))
        except OSError as e:
            if sock is not None:
                sock.close()
            return PendingCall(self, None, (_failure(e), e, 0.0))
        return PendingCall(self, sock, None)

    def give_back(self, sock: socket.socket) -> None:
        with self._lock:
            self._idle.append(sock)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()


class PendingCall:
    """One request in flight on its own socket; ``read()`` blocks for the reply."""

    def __init__(self, link: DirectLink, sock: socket.socket | None, reply):
        self.link, self.sock, self.reply = link, sock, reply

    def fileno(self) -> int:
        return self.sock.fileno()

    @staticmethod
    def wait_any(calls: list[PendingCall], timeout_s: float) -> list[PendingCall]:
        """Those of ``calls`` whose reply (or end of connection) is in within ``timeout_s`` seconds."""
        done = [c for c in calls if c.reply is not None]
        return done or readable(calls, max(timeout_s, 0))

    def wait(self, timeout: float | None) -> bool:
        """Whether the reply (or the end of the connection) arrives within ``timeout`` seconds."""
        return self.reply is not None or bool(readable([self], timeout))

    def read(self):
        """The host's ``(status, value, duration_s)``; status ``"lost"`` if the connection broke."""
        if self.reply is None:
            try:
                payload, buffers = recv_message(self.sock)
                self.reply = loads(payload, buffers)
            except (OSError, EOFError) as e:
                self.sock.close()
                self.sock, self.reply = None, ("lost", e, 0.0)
            except Exception as e:  # a reply that cannot be unpickled in the driver
                self.link.give_back(self.sock)
                self.sock, self.reply = None, ("err", pack_exception(e), 0.0)
            else:
                self.link.give_back(self.sock)
                self.sock = None
        return self.reply

    def discard(self) -> None:
        """Drop a call whose reply will not be read: its socket is closed, never reused."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
            self.sock = None

    def __del__(self):
        self.discard()


class OrderedSender:
    """Requests sent on one connection now, their replies read later in order ("fire now, check
    later"). The server handles a connection's requests one after another, so order is kept."""

    MAX_UNREAD = 64

    def __init__(self, link: DirectLink):
        self.link, self.sock, self.unread = link, None, 0
        self.lock = threading.Lock()

    def send(self, op: str, args: tuple, timeout_s: float) -> list:
        """Send a request; returns the replies that had to be read first to bound the backlog."""
        parts = [_REQ.pack(self.link.key.encode(), op.encode()), *dumps(args)]
        with self.lock:
            replies = self._drain(timeout_s) if self.unread >= self.MAX_UNREAD else []
            try:
                if self.sock is None:
                    self.sock = self.link.connect()
                send_within(self.sock, parts, timeout_s)
            except OSError as e:
                self._reset()
                return [*replies, ("unreachable" if isinstance(e, Unreachable) else _failure(e), e, 0.0)]
            self.unread += 1
            return replies

    def drain(self, timeout_s: float) -> list:
        """Read every reply not read yet, in order (``("lost", error, 0)`` if the connection broke)."""
        with self.lock:
            return self._drain(timeout_s)

    def _drain(self, timeout_s: float) -> list:
        replies = []
        while self.unread:
            try:
                if not readable([self.sock], timeout_s):
                    raise TimeoutError(f"no reply within {timeout_s:g} s")
                payload, buffers = recv_message(self.sock)
                replies.append(loads(payload, buffers))
                self.unread -= 1
            except (OSError, EOFError) as e:
                self._reset()
                replies.append(("lost", e, 0.0))
        return replies

    def close(self) -> None:
        with self.lock:
            self._reset()

    def _reset(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
        self.sock, self.unread = None, 0


_LINKS: dict[tuple, DirectLink] = {}
_LINKS_LOCK = threading.Lock()


def link_for(offer: tuple) -> DirectLink:
    """This process's (pooled) link to the host that made ``offer`` (see :func:`serve`)."""
    key = tuple(offer)
    with _LINKS_LOCK:
        link = _LINKS.get(key)
        if link is None:
            link = _LINKS[key] = DirectLink(*offer)
        return link


__all__ = [
    "CallServer",
    "DirectLink",
    "MessageTooLarge",
    "OrderedSender",
    "PendingCall",
    "Unreachable",
    "copy_by_pickle",
    "drop_link",
    "dumps",
    "enabled",
    "env_flag",
    "link_for",
    "loads",
    "local_host",
    "serve",
    "unserve",
]
