"""The direct-call wire format and its socket I/O (:mod:`rlnb.runtime.direct` serves and calls over it).

A request starts with ``!32s16s`` (host key, operation). Then, in both directions: ``!IQ`` (number of out-of-band
buffers, pickle length), one ``!Q`` length per buffer, the pickle (protocol 5; the standard pickler, or
cloudpickle for what it cannot send), then the buffers: arrays and large CPU tensors travel as raw bytes, outside
the pickle, without a copy on the sending side. A message may not exceed ``RLNB_MAX_MESSAGE_BYTES`` (8 GiB),
checked on its header before anything is allocated, and by the sender before anything is sent.
"""

from __future__ import annotations

import contextlib
import copyreg
import io
import os
import pickle
import select
import socket
import struct
import sys

import cloudpickle

from rlnb.errors import RlnbError

_REQ = struct.Struct("!32s16s")  # a request starts with the host's key and the operation
_HEAD = struct.Struct("!IQ")
_LEN = struct.Struct("!Q")
MAX_BUFFERS = 1 << 16  # out-of-band buffers in one message
_IOV_MAX = 512  # buffers per sendmsg (Linux takes up to 1024)
ALWAYS_ACCEPTED_BYTES = 64 * 1024  # a message this small passes whatever RLNB_MAX_MESSAGE_BYTES says
READ_BYTES = 64 * 1024  # a reply or a request is read in one go up to this size
STALL_S = 60.0  # on a worker's actor thread, the longest wait for the rest of a request
OUT_OF_BAND_MIN_BYTES = 64 * 1024  # tensors this big travel outside the pickle


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
    if nbytes <= ALWAYS_ACCEPTED_BYTES:  # (reading the limit from the environment costs a call ~1%)
        return
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
    """CPU tensors as raw bytes (torch's own pickling is slow even for a tiny tensor), big
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


def _reduce_tensor_or_default(obj):
    """For the standard pickler's dispatch table (a C-level lookup by exact type, so ints, strings
    and containers never reach Python code, unlike ``reducer_override``)."""
    out = _reduce_tensor(obj)
    return obj.__reduce_ex__(5) if out is None else out


_DISPATCH: tuple = (None, None)  # (the key it was built for, the table)


def _dispatch_table() -> dict:
    """copyreg's dispatch table plus CPU tensors as raw bytes (once torch is imported). Copied again
    when torch arrives or a type is registered (the table's size changes); a type registered anew
    with another reducer keeps the one copied (torch alone registers ~400 types: comparing every
    entry per message would cost more than the dispatch table saves)."""
    global _DISPATCH
    torch = sys.modules.get("torch")
    key = (torch is not None, len(copyreg.dispatch_table))
    if _DISPATCH[0] != key:
        table = dict(copyreg.dispatch_table)
        if torch is not None:
            table[torch.Tensor] = _reduce_tensor_or_default
        _DISPATCH = (key, table)
    return _DISPATCH[1]


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
        pickler = pickle.Pickler(f, protocol=5, buffer_callback=buffers.append)
        pickler.dispatch_table = _dispatch_table()
        pickler.dump(obj)
        payload = f.getvalue()  # (a memoryview would test for an int, not a substring)
        fast = b"__main__" not in payload and not any(
            m.encode() in payload for m in cloudpickle.list_registry_pickle_by_value()
        )
    except Exception:
        fast = False
    if not fast:
        buffers, f = [], io.BytesIO()
        _CloudPickler(f, protocol=5, buffer_callback=buffers.append).dump(obj)
        payload = f.getvalue()
    if not buffers:
        _check_size(len(payload), "a message")
        return [_HEAD.pack(0, len(payload)), payload]
    raws = [b.raw() for b in buffers]
    _check_size(len(payload) + sum(r.nbytes for r in raws), "a message")
    head = _HEAD.pack(len(raws), len(payload)) + b"".join(_LEN.pack(r.nbytes) for r in raws)
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
    parts = send_nowait(sock, parts)  # most messages fit the socket's buffer: one syscall, no timeout set
    if not parts:
        return None
    sock.settimeout(max(timeout_s, 0.001))
    try:
        send_parts(sock, parts)
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(None)


def _failure(error: OSError) -> str:
    """The reply status for a failed send: ``"timeout"`` past its deadline, else ``"lost"``."""
    return "timeout" if isinstance(error, TimeoutError) else "lost"


def _recv_into(sock: socket.socket, view: memoryview, stall_s: float | None) -> None:
    """Fill ``view`` from ``sock``. With ``stall_s``, on a blocking socket: never wait more than
    ``stall_s`` seconds for the next piece (``TimeoutError``), so a peer that stops halfway
    through a message cannot hold the reading thread."""
    got, n = 0, view.nbytes
    while got < n:
        if stall_s is None:
            k = sock.recv_into(view[got:])
        else:
            try:
                k = sock.recv_into(view[got:], 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if not readable([sock], stall_s):
                    raise TimeoutError(f"a message stopped arriving for {stall_s:g} s") from None
                continue
        if k == 0:
            raise ConnectionResetError("connection closed by the other end")
        got += k


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), None)
    return buf


class ProtocolError(ValueError):
    """Bytes on a connection that do not follow the protocol (e.g. more than the one message due)."""


class _Reader:
    """Exact-size reads from a socket, starting with bytes already read from it (``got``).

    ``buffered``: a small read takes whatever the socket has, up to ``READ_BYTES``, and keeps what
    is past it for the next read (a connection whose requests may come back to back: one ``recv``
    per request instead of one per header). Big reads go straight into their buffer.
    """

    def __init__(self, sock: socket.socket, got: bytes, stall_s: float | None, buffered: bool = False):
        self.sock, self.got, self.at, self.stall_s, self.buffered = sock, got, 0, stall_s, buffered

    def exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        take = min(n, len(self.got) - self.at)
        if take:
            buf[:take] = memoryview(self.got)[self.at : self.at + take]
            self.at += take
        view = memoryview(buf)[take:]
        if not self.buffered or view.nbytes >= READ_BYTES:
            if view.nbytes:
                _recv_into(self.sock, view, self.stall_s)
            return buf
        while view.nbytes:
            data = self.sock.recv(READ_BYTES)
            if not data:
                raise ConnectionResetError("connection closed by the other end")
            k = min(len(data), view.nbytes)
            view[:k] = data[:k]
            view = view[k:]
            self.got, self.at = data, k  # (what is past this read stays for the next)
        return buf

    def leftover(self) -> int:
        """Bytes read from the socket and not yet taken."""
        return len(self.got) - self.at

    def message(self, head: bytes | None = None) -> tuple:
        """One message's ``(payload, buffers)``; ``head``: its header, already read."""
        nbufs, plen = _HEAD.unpack(head if head is not None else self.exact(_HEAD.size))
        if nbufs > MAX_BUFFERS:
            raise MessageTooLarge(f"a message header announces {nbufs:,} buffers (at most {MAX_BUFFERS:,})")
        lens = struct.unpack(f"!{nbufs}Q", self.exact(_LEN.size * nbufs)) if nbufs else ()
        _check_size(plen + sum(lens), "an incoming message")
        payload = self.exact(plen)
        return payload, [self.exact(n) for n in lens]

    def done(self) -> None:
        if self.leftover():
            raise ProtocolError(f"{self.leftover()} bytes past the end of a message")


def recv_message(sock: socket.socket, stall_s: float | None = None, got: bytes = b""):
    """One message: ``(payload, buffers)``. Raises ``ConnectionError`` when the peer is gone and
    :class:`MessageTooLarge` when its header announces more than the limit (nothing allocated yet).
    ``got``: its first bytes, already read (and nothing past it)."""
    reader = _Reader(sock, got, stall_s)
    out = reader.message()
    reader.done()
    return out


def recv_request(sock: socket.socket, stall_s: float | None = None, got: bytes = b"") -> tuple:
    """One request: ``(host key, operation, payload, buffers)`` (``got``: as for :func:`recv_message`)."""
    reader = _Reader(sock, got, stall_s)
    out = _read_request(reader)
    reader.done()
    return out


def _read_request(reader: _Reader) -> tuple:
    start = reader.exact(_REQ.size + _HEAD.size)  # (one read for both fixed-size headers)
    key, op = (b.rstrip(b"\0").decode() for b in _REQ.unpack_from(start))
    return (key, op, *reader.message(head=start[_REQ.size :]))


def request_complete(data: bytes) -> bool:
    """Whether ``data`` holds a whole request (reading it from there needs no wait)."""
    fixed = _REQ.size + _HEAD.size
    if len(data) < fixed:
        return False
    nbufs, plen = _HEAD.unpack_from(data, _REQ.size)
    lens_end = fixed + _LEN.size * nbufs
    if lens_end > len(data):
        return False
    return len(data) >= lens_end + plen + sum(struct.unpack_from(f"!{nbufs}Q", data, fixed))


def send_nowait(sock: socket.socket, parts: list) -> list:
    """Send what ``sock`` takes now without waiting (a blocking socket); returns what is left."""
    views = [memoryview(p).cast("B") for p in parts]
    views = [v for v in views if v.nbytes]
    while views:
        try:
            sent = sock.sendmsg(views[:_IOV_MAX], [], socket.MSG_DONTWAIT)
        except BlockingIOError:
            return views
        i = 0
        while sent and sent >= views[i].nbytes:
            sent -= views[i].nbytes
            i += 1
        views = views[i:]
        if sent:
            views[0] = views[0][sent:]
    return views


# ---------------------------------------------------------------------------------- worker side


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
