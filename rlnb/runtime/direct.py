"""Direct calls: the driver talks to rank hosts over their own sockets instead of Dask's rpc.

A Dask actor call spends most of its time in Dask's comm layer and event-loop hops (figures:
``docs/benchmarks.md``). Group calls are the per-step heartbeat of a training loop, so each worker process also runs
a small :class:`CallServer`. A thread per new connection checks its token and reads its first
request; a connection to a rank is then handed to the worker's **actor thread**
(:class:`rlnb.runtime.actor_thread.ActorThread`, which takes the place of Dask's actor executor).
That thread reads each request, runs it and writes the reply itself, between the actor methods
Dask gives it: exactly where Dask runs actor methods, with the same thread state, so a component
sees no difference, calls from both paths never overlap, and no thread hop is paid per call. A
worker whose actor thread had already run something before rlnb's plugin was set up keeps it, and
calls hop to it from the connection's thread.

A host with a thread-safe ``direct_call(op, args)`` (a channel's queue server) is called on the
connection's thread instead: a blocked ``get`` there is woken by a ``put`` on another connection
without any hop through the actor thread or the event loop.

A driver on the worker's host connects over a Unix socket in Linux's abstract namespace (no file;
``RLNB_DIRECT_UNIX=0`` turns it off), anything else over TCP on the worker's own interface.

A request starts with ``!32s16s`` (host key, operation). Then, in both directions: ``!IQ`` (number
of out-of-band buffers, pickle length), one ``!Q`` length per buffer, the pickle (protocol 5; the
standard pickler, or cloudpickle for what it cannot send), then the buffers: arrays and large CPU
tensors travel as raw bytes, outside the pickle, without a copy on the sending side. A connection starts
with a random token of the driver session (:class:`rlnb.Cluster`) that launched the host it calls, handed to
that driver through Dask (``RankHost.ready``), so the port accepts nothing that could not already talk to the Dask
worker; and a connection reaches only its own session's hosts: one driver can neither call nor steer another's
components on a shared worker, even knowing their keys (any Dask client can still run code in the workers: a
closed cluster, as the embedded one is, keeps others out of both). ``tls://`` clusters keep Dask's
rpc (the direct port is not encrypted), but for the embedded cluster, whose workers listen on loopback only,
as does ``RLNB_DIRECT_CALLS=0``.

Limits, so a stray or hostile client cannot exhaust a worker: the whole token must arrive within
``TOKEN_TIMEOUT_S`` of the connection (not each byte of it); at most ``RLNB_DIRECT_MAX_CONNECTIONS`` (256)
connections are served at once (more are closed on accept), and of those at most an eighth may still be
authenticating: past that, the oldest one not yet authenticated is closed to admit the new one, so connections
that never authenticate cannot starve drivers (a driver sends its token at once); a message may not exceed
``RLNB_MAX_MESSAGE_BYTES`` (8 GiB), checked on
its header before anything is allocated, and by the sender before anything is sent (a message of
at most 64 KiB always passes). Every send from the driver has a deadline (the call's timeout). The
actor thread never waits on a socket: a request still arriving is read, and a reply the driver is
not reading yet is written, by a helper thread (each piece of a request within ``STALL_S``).
Authentication and protocol failures are logged once per worker.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import socket
import struct
import sys
import termios
import threading
import time
import uuid
import weakref
from collections.abc import Callable

from rlnb import _dask
from rlnb.errors import pack_exception
from rlnb.runtime.actor_thread import DETACHED, DROP, KEEP, ActorThread
from rlnb.runtime.wire import (  # the wire format this module serves and calls over
    READ_BYTES,
    STALL_S,
    MessageTooLarge,
    _read_request,
    _Reader,
    dumps,
    enabled,
    env_flag,
    loads,
    max_connections,
    recv_request,
    request_complete,
    send_nowait,
    send_parts,
)

log = logging.getLogger("rlnb")
TOKEN_BYTES = 16
TOKEN_TIMEOUT_S = 10.0  # a connection that has not sent its token by then is closed
KEPT_SESSIONS = 1024  # driver sessions' tokens kept before those with no host left are dropped
RANK_OPS = frozenset(
    {
        "call",
        "chain",
        "take_ahead",
        "ready",
        "save_state",
        "load_state",
        "open_store",
        "join_group",
        "destroy_groups",
    }
)


class CallServer:
    """One per Dask worker: answers direct calls to the rank hosts living on it."""

    def __init__(self, worker):
        self.worker = worker
        # a token per driver session (rlnb.Cluster.session): what a connection authenticates with
        self._tokens: dict[str, bytes] = {}
        # weak: a host lives as long as Dask keeps its actor (a group or channel dropped without
        # shutdown is freed as usual; a call to it then gets "shut down")
        self.hosts: weakref.WeakValueDictionary[str, object] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self.connections = 0  # being served now
        # connections serving a thread-safe host (a channel), by its key: closed when it is unregistered, so a
        # closed channel leaves no connection or thread behind on its worker
        self._host_conns: dict[str, set[socket.socket]] = {}
        self._busy: set[socket.socket] = set()  # of those, the ones answering a request now
        # accepted, token not read yet: oldest first, with the token's bytes its thread has read
        self._pending: dict[socket.socket, int] = {}
        self._evicted: set[socket.socket] = set()  # closed as the oldest pending, their threads not done yet
        # the driver session each authenticated connection speaks for
        self._sessions: dict[socket.socket, str] = {}
        self._logged: set[str] = set()  # kinds of failure already logged (each is logged once)
        ip = worker.address.split("://", 1)[1].rsplit(":", 1)[0].strip("[]")
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        self.sock = _listen(ip, family)
        self.address = (ip, self.sock.getsockname()[1])
        # a driver on this host (and network namespace) connects here instead: a Unix socket in the
        # abstract namespace (no file to leave behind) is quicker a round trip than TCP loopback
        self.unix_sock, self.unix_name = _listen_unix()
        self._closing = False
        # rank calls are answered on the worker's actor thread itself where rlnb runs it (no hop)
        self.actor_thread = _dask.replace_actor_executor(
            worker,
            lambda name: ActorThread(name, context=lambda: _dask.as_actor_thread(worker, "rlnb-direct-call")),
        )
        _SERVERS[worker.address] = self
        for sock in (self.sock, self.unix_sock):
            if sock is not None:
                threading.Thread(
                    target=self._accept, args=(sock,), name="rlnb-direct-accept", daemon=True
                ).start()

    def close(self) -> None:
        """Stop accepting (connections being served end with their driver)."""
        self._closing = True
        _SERVERS.pop(self.worker.address, None)
        for sock in (self.sock, self.unix_sock):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
                sock.close()

    def register(self, host) -> tuple:
        """Serve ``host`` (of driver session ``host.session``); the offer that reaches it: ``(ip, port, token,
        key, unix_name)``, the token its session's."""
        key = uuid.uuid4().hex  # 32 characters, as the request header expects
        with self._lock:
            self.hosts[key] = host
            if host.session not in self._tokens and len(self._tokens) >= KEPT_SESSIONS:
                self._forget_idle_sessions()
            token = self._tokens.setdefault(host.session, secrets.token_bytes(TOKEN_BYTES))
        return (*self.address, token, key, self.unix_name)

    def _forget_idle_sessions(self) -> None:
        """Drop the tokens of sessions with no host here any more (under ``_lock``). A session's token outlives its
        hosts until then, so that a late request of its driver (a closed channel's reader) is answered "shut
        down", not refused as a stranger's."""
        live = {h.session for h in list(self.hosts.values())}
        for session in [s for s in self._tokens if s not in live]:
            del self._tokens[session]

    def unregister(self, host) -> None:
        with self._lock:
            keys = [k for k, h in list(self.hosts.items()) if h is host]
            for key in keys:
                del self.hosts[key]
            # idle ones: shut down now (wakes the thread reading its next request: it ends, and closes it); one
            # answering a request (a get woken by the close) ends once its reply is sent
            conns = [c for key in keys for c in self._host_conns.pop(key, ()) if c not in self._busy]
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _bind(self, key: str, conn: socket.socket) -> bool:
        """Note that ``conn`` serves the thread-safe host ``key`` and is answering a request now; False if
        that host is gone meanwhile."""
        with self._lock:
            if key not in self.hosts:
                return False
            self._host_conns.setdefault(key, set()).add(conn)
            self._busy.add(conn)
            return True

    def _answered(self, key: str, conn: socket.socket) -> bool:
        """``conn`` answered its request for host ``key``; False if that host was unregistered meanwhile (the
        connection then ends)."""
        with self._lock:
            self._busy.discard(conn)
            return key in self.hosts

    def _host(self, key: str, conn: socket.socket):
        """The host ``key`` names if ``conn`` may reach it (a host of the session it authenticated for), else
        ``None``: answered as a host that is not here, whether it is or not."""
        host = self.hosts.get(key)
        if host is None or host.session != self._sessions.get(conn):
            return None
        return host

    def _authenticate(self, token: bytes) -> str | None:
        """The driver session whose token ``token`` is, or ``None``."""
        with self._lock:
            tokens = list(self._tokens.items())
        found = None
        for session, known in tokens:  # (each compared in full: no early exit that times the match)
            if secrets.compare_digest(token, known):
                found = session
        return found

    def _unbind(self, conn: socket.socket) -> None:
        with self._lock:
            self._busy.discard(conn)
            for conns in self._host_conns.values():
                conns.discard(conn)

    def _accept(self, sock: socket.socket):
        delay_s = 0.0
        while True:
            try:
                conn, _ = sock.accept()
            except OSError as e:
                if self._closing or sock.fileno() < 0:  # closed: the worker is shutting down
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
                evicted = None
                if len(self._pending) >= max(1, max_connections() // 8):
                    evicted = self._slowest_pending()
                if evicted is not None:
                    del self._pending[evicted]
                    # uncounted now, not when its thread gets round to closing it: under load that came after
                    # the next accept, which found the cap full and refused a driver's connection
                    self.connections -= 1
                    self._evicted.add(evicted)
                full = self.connections >= max_connections()
                self.connections += not full
                if not full:
                    self._pending[conn] = 0
            if evicted is not None:  # (its thread's read fails: it ends and closes it)
                self._log_once("evict", "too many connections authenticating at once; closing the oldest")
                with contextlib.suppress(OSError):
                    evicted.shutdown(socket.SHUT_RDWR)
            if full:  # one thread per connection: refuse rather than grow without bound
                self._log_once(
                    "cap",
                    "%d connections open (RLNB_DIRECT_MAX_CONNECTIONS); refusing more",
                    max_connections(),
                )
                conn.close()
                continue
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="rlnb-direct-conn", daemon=True).start()

    def _slowest_pending(self) -> socket.socket | None:
        """(Under the lock.) The oldest pending connection whose token has not all arrived, or ``None``. One
        whose token is there is only waiting for its thread: under load a driver's was evicted by the backlog of
        the other listening socket, accepted after it (a WorkerLostError on CI)."""
        for conn, read in self._pending.items():
            try:
                waiting = struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.FIONREAD, b"\0" * 4))[0]
            except OSError:  # (closed under us: as good as gone)
                return conn
            if read + waiting < TOKEN_BYTES:
                return conn
        return None

    def _recv_token(self, conn: socket.socket, deadline: float) -> bytes:
        """The connection's token, whole by ``deadline`` (``time.monotonic()``): one byte every few seconds does
        not keep a connection open. Each part is taken off the socket under the lock, and counted, so that the
        accepting thread sees every byte sent (in the socket or read) when it picks a connection to evict."""
        got = b""
        while len(got) < TOKEN_BYTES:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("token deadline")
            conn.settimeout(left)
            if not conn.recv(1, socket.MSG_PEEK):  # (waits for a byte, taking none)
                raise EOFError("closed before its token")
            with self._lock:
                chunk = conn.recv(TOKEN_BYTES - len(got), socket.MSG_DONTWAIT)
                if conn in self._pending:
                    self._pending[conn] += len(chunk)
            if not chunk:
                raise EOFError("closed before its token")
            got += chunk
        return got

    def _log_once(self, kind: str, message: str, *args) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("direct-call server on %s:%s: " + message + " (logged once)", *self.address, *args)

    def _serve(self, conn: socket.socket):
        adopted = False
        try:
            adopted = self._serve_connection(conn)
        finally:
            if not adopted:
                self._drop(conn)

    def _closed_connection(self, conn: socket.socket) -> None:
        with self._lock:
            if conn in self._evicted:  # (uncounted when it was evicted)
                self._evicted.discard(conn)
            else:
                self.connections -= 1
            self._sessions.pop(conn, None)

    def _drop(self, conn: socket.socket) -> None:
        """Close ``conn``, which no thread serves any more."""
        conn.close()
        self._closed_connection(conn)

    def _adopt(self, conn: socket.socket, first: tuple | None = None) -> bool:
        """Hand ``conn`` to the actor thread (``first``: a request already read from it); False if
        that thread is shutting down."""
        return self.actor_thread.adopt(
            conn, self._serve_on_actor_thread, self._closed_connection, first=first
        )

    def _ended(self, conn: socket.socket, error: Exception) -> None:
        """What serving ``conn`` ending with ``error`` calls for, before it is closed."""
        if isinstance(error, MessageTooLarge):  # say why (the payload cannot be skipped)
            self._log_once("size", "%s", error)
            with contextlib.suppress(OSError):
                send_parts(conn, dumps(("err", pack_exception(error), 0.0)))
        # an OSError or EOFError: the driver went away, or the worker is closing (nothing to say)
        elif not isinstance(error, (OSError, EOFError)):
            self._log_once("protocol", "closed a connection after %s: %s", type(error).__name__, error)

    def _serve_connection(self, conn: socket.socket, first: tuple | None = None) -> bool:
        """Serve ``conn`` on this thread until it ends (False), or hand it to the actor thread after
        its first request for a rank (True: the actor thread owns it now)."""
        if first is None:
            try:
                token = self._recv_token(conn, time.monotonic() + TOKEN_TIMEOUT_S)
            except (OSError, EOFError) as e:
                why = f"no token within {TOKEN_TIMEOUT_S:g} s" if isinstance(e, TimeoutError) else str(e)
                self._log_once("auth", "a connection closed before authenticating (%s)", why)
                return False
            finally:
                with self._lock:
                    self._pending.pop(conn, None)
            session = self._authenticate(token)
            if session is None:
                self._log_once("auth", "a connection sent a wrong token; closed")
                return False
            with self._lock:
                self._sessions[conn] = session
            conn.settimeout(None)  # an authenticated connection may idle in the driver's pool
        reader = _Reader(conn, b"", None, buffered=True)  # (a channel's puts may come back to back)
        try:
            while True:
                request, first = first or _read_request(reader), None
                host = self._host(request[0], conn)
                if host is not None and hasattr(host, "direct_call") and not self._bind(request[0], conn):
                    host = None  # unregistered between the two lookups: answered as gone, below
                if host is not None and hasattr(host, "direct_call"):
                    send_parts(conn, self._execute_here(host, *request[1:]))
                    after = host.pop_after_reply() if hasattr(host, "pop_after_reply") else None
                    if after is not None:
                        after()
                    if not self._answered(request[0], conn):
                        return False
                elif (
                    self.actor_thread is not None
                    and not reader.leftover()  # (a rank's connection carries one request at a time)
                    and self._adopt(conn, request)
                ):
                    return True
                else:
                    reply, after = _dask.run_on_actor_thread(
                        self.worker, self._execute, (host, *request[1:]), "rlnb-direct-call"
                    ).result()
                    send_parts(conn, reply)
                    if after is not None:  # (on the rank's thread, as everything of the rank runs)
                        _dask.run_on_actor_thread(self.worker, after, (), "rlnb-run-ahead")
        except Exception as e:
            self._ended(conn, e)
        finally:
            self._unbind(conn)
        return False

    def _serve_on_actor_thread(self, conn: socket.socket, request: tuple | None) -> str:
        """Answer one request on the actor thread (:class:`ActorThread` calls it when ``conn`` has
        data): read it, run it there, send the reply. A reply the driver is not reading yet, or a
        request for a thread-safe host, goes on on a thread of its own. A chain run ahead
        (:meth:`RankHost.chain`) runs here once its reply is sent; then the actor thread answers what waits on
        every connection in turn, as after any request (the request taking its replies comes with them)."""
        try:
            if request is None:
                try:
                    got = conn.recv(READ_BYTES, socket.MSG_DONTWAIT)
                except BlockingIOError:  # (woken for nothing)
                    return KEEP
                if not got:  # the driver closed it
                    return DROP
                if not request_complete(got):  # still arriving (or big): read on a thread of its own
                    self._spawn(self._read_then_adopt, conn, got)
                    return DETACHED
                request = recv_request(conn, got=got)
            host = self._host(request[0], conn)
            # a thread-safe host's operation runs on a thread of its own: a blocking get must not hold this one
            if host is not None and hasattr(host, "direct_call"):
                self._spawn(self._serve_connection, conn, request)
                return DETACHED
            _dask.mark_active(self.worker, "rlnb-direct-call")
            try:
                reply, after = self._execute(host, *request[1:])
            finally:
                _dask.mark_active(self.worker, None)
            rest = send_nowait(conn, reply)
        except Exception as e:
            self._ended(conn, e)
            return DROP
        if rest:
            self._spawn(self._finish_reply, conn, rest)
        if after is not None:  # a chain run ahead: the driver has its reply (or is being sent it) meanwhile
            _dask.mark_active(self.worker, "rlnb-run-ahead")
            try:
                after()
            finally:
                _dask.mark_active(self.worker, None)
        return DETACHED if rest else KEEP

    def _read_then_adopt(self, conn: socket.socket, got: bytes) -> None:
        """Read the rest of a request still arriving (each piece within ``STALL_S``), then give
        ``conn`` back to the actor thread to answer it."""
        try:
            request = recv_request(conn, STALL_S, got)
        except Exception as e:
            self._ended(conn, e)
        else:
            if self._adopt(conn, request):
                return
        self._drop(conn)

    def _finish_reply(self, conn: socket.socket, rest: list) -> None:
        """Send the rest of a reply (as long as the driver takes to read it), then give ``conn``
        back to the actor thread."""
        try:
            send_parts(conn, rest)
        except OSError:
            pass
        else:
            if self._adopt(conn):
                return
        self._drop(conn)

    def _spawn(self, target, conn: socket.socket, arg) -> None:
        def run():
            if target(conn, arg) is False:  # (_serve_connection: the connection is over)
                self._drop(conn)

        threading.Thread(target=run, name="rlnb-direct-conn", daemon=True).start()

    def _execute(self, host, op: str, payload, buffers) -> tuple[list, Callable | None]:
        """On the actor thread (where Dask runs actor methods): decode, run, encode the reply. Also returns
        what to run on this thread once the reply is sent (a chain run ahead, :meth:`RankHost.chain`)."""
        t0 = time.perf_counter()
        after = None
        try:
            if host is None:
                reply = ("lost", "it was shut down (or freed) on this worker", 0.0)
            elif op not in RANK_OPS:
                raise ValueError(f"unknown rank-host operation {op!r}")
            else:  # arguments are unpickled here too: Dask actor handles in them bind to this worker
                reply = getattr(host, op)(*loads(payload, buffers))
                after = host.pop_after_reply()
        except Exception as e:  # e.g. an argument that cannot be unpickled here
            reply = ("err", pack_exception(e), time.perf_counter() - t0)
        return _encode_reply(reply), after

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


def _listen_unix() -> tuple[socket.socket | None, str | None]:
    """A listening Unix socket in Linux's abstract namespace (reachable only from this host's network
    namespace, and leaving no file), or ``(None, None)``: not Linux, or ``RLNB_DIRECT_UNIX=0``."""
    if not sys.platform.startswith("linux") or not env_flag("RLNB_DIRECT_UNIX"):
        return None, None
    name = f"rlnb-direct-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
        sock.listen(128)
    except OSError:
        sock.close()
        return None, None
    return sock, name


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


def local_host(offer: tuple):
    """The host object behind ``offer`` if it lives in this very process (and the offer's token is its
    session's), else ``None``."""
    ip, port, token, key, *_ = offer
    for server in list(_SERVERS.values()):
        if server.address == (ip, port):
            host = server.hosts.get(key)
            known = None if host is None else server._tokens.get(host.session)
            return host if known is not None and secrets.compare_digest(token, known) else None
    return None


def copy_by_pickle(obj):
    """A copy of ``obj`` made the way a direct call would send it (for in-process calls)."""
    _head, payload, *buffers = dumps(obj)
    return loads(payload, [bytearray(b) for b in buffers])


def unserve(host) -> None:
    for server in list(_SERVERS.values()):
        server.unregister(host)


from rlnb.runtime.link import (  # noqa: E402  (the driver side, in its own module)
    BIG_REQUEST_BYTES,
    DirectLink,
    OrderedSender,
    PendingCall,
    Unreachable,
    drop_link,
    link_for,
)

__all__ = [
    "BIG_REQUEST_BYTES",
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
