"""The driver's side of direct calls: its connections to the workers' call servers
(:class:`rlnb.runtime.direct.CallServer`), one pooled :class:`DirectLink` per rank host, the calls in flight
(:class:`PendingCall`) and the fire-now-read-later sender of channels (:class:`OrderedSender`). The bytes are
laid out by :mod:`rlnb.runtime.wire`."""

from __future__ import annotations

import contextlib
import errno
import socket
import threading

from rlnb.errors import pack_exception
from rlnb.runtime.wire import (
    _REQ,
    READ_BYTES,
    _failure,
    _Reader,
    dumps,
    env_flag,
    loads,
    readable,
    recv_message,
    send_within,
)

BIG_REQUEST_BYTES = 128 * 1024  # a request above this goes on a connection of its own (DirectLink.send)
CONNECT_TIMEOUT_S = 5.0
_UNREACHABLE_ERRNOS = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ETIMEDOUT, errno.EHOSTDOWN}


class Unreachable(ConnectionError):
    """A direct-call port cannot be reached from here (unlike a refused connection, which means the
    process behind it is gone): the caller should use Dask's rpc instead."""


class DirectLink:
    """The driver's connections to one rank host: a pool of sockets, one per call in flight."""

    def __init__(
        self,
        ip: str,
        port: int,
        token: bytes,
        key: str,
        unix_name: str | None = None,
        *,
        rank: bool = False,
    ):
        self.address, self.token, self.key = (ip, port), token, key
        self.rank = rank  # a rank host: its worker's actor thread reads its pooled connections
        # the worker's Unix socket, while it answers from here (a worker on another host does not)
        self.unix_name = unix_name if env_flag("RLNB_DIRECT_UNIX") else None
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def connect(self, timeout_s: float | None = None) -> socket.socket:
        """A new connection: to the worker's Unix socket when it is on this host, else over TCP.
        Raises :class:`Unreachable` when the port cannot be reached at all (no route, or a firewall
        dropping packets) rather than refused (the process is gone)."""
        timeout_s = timeout_s or CONNECT_TIMEOUT_S
        sock = self._connect_unix(timeout_s) if self.unix_name else None
        if sock is None:
            try:
                sock = socket.create_connection(self.address, timeout=timeout_s)
            except (TimeoutError, OSError) as e:
                if isinstance(e, TimeoutError) or e.errno in _UNREACHABLE_ERRNOS:
                    raise Unreachable(f"{self.address[0]}:{self.address[1]}: {e}") from e
                raise
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(self.token)  # (still under the connect timeout)
        sock.settimeout(None)
        return sock

    def _connect_unix(self, timeout_s: float) -> socket.socket | None:
        """A connection to the worker's Unix socket, or ``None`` (from now on) if there is none
        here: the worker is on another host or in another network namespace."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect("\0" + self.unix_name)
        except OSError:
            sock.close()
            self.unix_name = None
            return None
        return sock

    def send(self, op: str, args: tuple | list, timeout_s: float | None = None) -> PendingCall:
        """Send one request (``args``: a tuple, or already :func:`dumps`-encoded); read the reply
        from the returned :class:`PendingCall`. A send still blocked after ``timeout_s`` seconds (a
        hung or stopped worker no longer reading) gives the reply ``("timeout", error, 0)``."""
        parts = [
            _REQ.pack(self.key.encode(), op.encode()),
            *(args if isinstance(args, list) else dumps(args)),
        ]
        # A rank's pooled connection is read by the worker's actor thread, only once it is free. A
        # request bigger than a socket's buffer goes on a new connection instead: the worker's
        # connection thread reads it while the rank is still busy, so the send holds neither this
        # thread nor the requests to other ranks. That connection is closed after its reply.
        big = self.rank and sum(memoryview(p).nbytes for p in parts) > BIG_REQUEST_BYTES
        sock = None
        if not big:
            with self._lock:
                sock = self._idle.pop() if self._idle else None
            # closed by the worker meanwhile (its host was unregistered)
            if sock is not None and _ended(sock):
                sock.close()
                sock = None
        try:
            sock = sock or self.connect()
            send_within(sock, parts, timeout_s)
        except Unreachable as e:
            return PendingCall(self, None, ("unreachable", e, 0.0))
        except OSError as e:
            if sock is not None:
                sock.close()
            return PendingCall(self, None, (_failure(e), e, 0.0))
        return PendingCall(self, sock, None, pooled=not big)

    def give_back(self, sock: socket.socket) -> None:
        with self._lock:
            self._idle.append(sock)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()


def _ended(sock: socket.socket) -> bool:
    """Whether an idle connection was closed by the other end (one non-blocking peek: EOF)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class PendingCall:
    """One request in flight on its own socket; ``read()`` blocks for the reply."""

    def __init__(self, link: DirectLink, sock: socket.socket | None, reply, pooled: bool = True):
        self.link, self.sock, self.reply, self.pooled = link, sock, reply, pooled

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
            sock, self.sock = self.sock, None
            try:
                got = sock.recv(READ_BYTES)  # (one read for a small reply, header and all)
                if not got:
                    raise ConnectionResetError("connection closed by the other end")
                payload, buffers = recv_message(sock, got=got)
            except (OSError, EOFError) as e:
                sock.close()
                self.reply = ("lost", e, 0.0)
                return self.reply
            except Exception as e:  # half a message read (too large, garbled): the socket is unusable
                sock.close()
                self.reply = ("err", pack_exception(e), 0.0)
                return self.reply
            if self.pooled:  # (the whole reply is read: the socket can carry the next call)
                self.link.give_back(sock)
            else:
                sock.close()
            try:
                self.reply = loads(payload, buffers)
            except Exception as e:  # a reply that cannot be unpickled in the driver
                self.reply = ("err", pack_exception(e), 0.0)
        return self.reply

    def discard(self) -> None:
        """Drop a call whose reply will not be read: its socket is closed, never reused."""
        sock, self.sock = self.sock, None
        if sock is not None:
            # no module globals here (contextlib is one): at interpreter exit __del__ may run after they are cleared
            try:  # noqa: SIM105
                sock.close()
            except OSError:
                pass

    def __del__(self):
        self.discard()


class OrderedSender:
    """Requests sent on one connection now, their replies read later in order ("fire now, check
    later"). The server handles a connection's requests one after another, so order is kept."""

    MAX_UNREAD = 64

    def __init__(self, link: DirectLink):
        self.link, self.sock, self.unread = link, None, 0
        self.reader: _Reader | None = None  # replies come back to back: read a batch of them per recv
        self.lock = threading.Lock()

    def send(self, op: str, args: tuple, timeout_s: float) -> list:
        """Send a request; returns the replies that had to be read first to bound the backlog."""
        parts = [_REQ.pack(self.link.key.encode(), op.encode()), *dumps(args)]
        with self.lock:
            replies = self._drain(timeout_s) if self.unread >= self.MAX_UNREAD else []
            try:
                if self.sock is None:
                    self.sock = self.link.connect()
                    self.reader = _Reader(self.sock, b"", None, buffered=True)
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
                if not self.reader.leftover() and not readable([self.sock], timeout_s):
                    raise TimeoutError(f"no reply within {timeout_s:g} s")
                payload, buffers = self.reader.message()
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
        self.sock, self.reader, self.unread = None, None, 0


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


def drop_link(offer: tuple) -> None:
    """Close and forget this process's link to ``offer`` (its worker is going away)."""
    with _LINKS_LOCK:
        link = _LINKS.pop(tuple(offer), None)
    if link is not None:
        link.close()
