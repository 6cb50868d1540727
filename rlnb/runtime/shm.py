"""Shared memory for channel items: big tensors and arrays move between processes of one node through
``/dev/shm`` files (0600, named after the creating process), pooled per producer process.

A producer copies a tensor once into a pooled segment and sends a small :class:`_ShmRef`; the reader
maps the segment without a copy and hands it back (header byte 0) once its tensor is freed. A producer
that builds its tensor in a segment to begin with (:func:`shared_empty`, ``Channel.empty``) sends it with
no copy at all. One-off
files (past the pool's budget) are unlinked by their reader. :func:`sweep_dead_segments` removes
what killed processes left behind.

CUDA tensors never take a host round trip on one node: the producer sends a CUDA IPC handle
(:class:`_CudaRef`, torch's own ``reduce_tensor``) and the reader maps the producer's GPU memory,
found by the GPU's UUID (dask-cuda numbers the GPUs differently in each worker). The producer's
allocation lives until every reader freed its tensor (torch's IPC reference counting). A CUDA tensor
put from another node than the channel's arrives on the CPU (weights across nodes go by NCCL).
"""

from __future__ import annotations

import atexit
import contextlib
import math
import mmap
import os
import socket
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass

import numpy as np

SHM_MIN_BYTES = 256 * 1024  # smaller payloads are cheaper inline
SHM_PREFIX = "rlnb-ch-"
HOSTNAME = socket.gethostname()


def _shm_dir() -> str:
    return (
        "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    )


@dataclass(frozen=True)
class _ShmRef:
    """A tensor/array parked in a shared-memory segment on ``node`` (bytes from ``offset``)."""

    path: str
    node: str
    dtype: str
    shape: tuple
    numpy: bool
    nbytes: int
    offset: int = 0
    capacity: int = 0


@dataclass(frozen=True)
class _CudaRef:
    """A CUDA tensor shared by CUDA IPC from a process on ``node``: the producer's GPU (by UUID) and the
    arguments of ``torch.multiprocessing.reductions.rebuild_cuda_tensor``."""

    node: str
    gpu_uuid: str
    args: tuple
    nbytes: int


_DEVICE_ARG = 6  # rebuild_cuda_tensor's ``storage_device``: the producer's index of its GPU
_UUIDS: dict[str, int] = {}  # this process's CUDA index of each visible GPU, by UUID


def _cuda_ref(t) -> _CudaRef:
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(t.detach())
    return _CudaRef(HOSTNAME, _gpu_uuid(args[_DEVICE_ARG]), args, t.numel() * t.element_size())


def _gpu_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def _local_index(uuid: str) -> int:
    import torch

    if uuid not in _UUIDS:
        _UUIDS.update({_gpu_uuid(i): i for i in range(torch.cuda.device_count())})
    if uuid not in _UUIDS:
        raise RuntimeError(
            f"a CUDA tensor from GPU {uuid} reached a process on {HOSTNAME} that does not see that GPU "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); put it on the CPU first"
        )
    return _UUIDS[uuid]


def _open_cuda(ref: _CudaRef):
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(ref.args)
    args[_DEVICE_ARG] = _local_index(ref.gpu_uuid)
    return rebuild_cuda_tensor(*args)


HEADER = 64  # byte 0 of a pooled segment: 1 while a message occupies it, 0 once its reader copied it out
POOL_MAX_BYTES = 1 << 30  # past this a producer parks tensors in one-off files (unlinked by the reader)
# Once a channel is drained, the pool gives back what it does not need: free segments idle this long are
# removed beyond POOL_KEEP_BYTES (readers drop their mappings of removed segments as often)
POOL_KEEP_BYTES = 64 << 20
TRIM_IDLE_S = 10.0


def _new_shm_file(nbytes: int):
    """A new shared-memory file of ``nbytes`` readable by this user only (0600), named after this
    process (so :func:`sweep_dead_segments` can tell when its owner is gone), and its uint8 mapping."""
    import torch

    path = os.path.join(_shm_dir(), f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return path, torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def sweep_dead_segments() -> int:
    """Remove this user's channel segments whose creating process no longer runs (a killed worker or
    driver never unlinks its own). Returns how many were removed; run at each worker's start."""
    removed = 0
    directory = _shm_dir()
    for name in os.listdir(directory):
        if not name.startswith(SHM_PREFIX):
            continue
        pid = name[len(SHM_PREFIX) :].split("-", 1)[0]
        path = os.path.join(directory, name)
        try:
            if not pid.isdigit() or os.stat(path).st_uid != os.getuid() or _alive(int(pid)):
                continue
            os.unlink(path)
            removed += 1
        except FileNotFoundError:  # another worker swept it first
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class _SegmentPool:
    """Shared-memory segments a producer process reuses: a fresh mapping costs its page faults, several
    times a copy into an already-faulted segment (``docs/benchmarks.md``). A reader maps the
    segment without copying and clears the header byte once its tensor is freed (see
    :class:`_Lease`); the producer then reuses the segment."""

    def __init__(self):
        # (path, capacity, uint8 tensor mapping, the same bytes as numpy: its header is read per put)
        self.segments: list[tuple[str, int, object, np.ndarray]] = []
        self.total = 0
        self.last_used: dict[str, float] = {}  # path -> when it was last taken (time.monotonic())
        self._timer: threading.Timer | None = None
        # several threads of one process send at once (components, the notebook): without it two of
        # them could take the same free segment and overwrite each other's tensor
        self._lock = threading.Lock()

    def acquire(self, nbytes: int):
        with self._lock:
            segment = self._acquire(nbytes)
            if segment is not None:
                self.last_used[segment[0]] = time.monotonic()
            if self.total > POOL_KEEP_BYTES and self._timer is None:
                self._arm()
            return segment

    def _arm(self) -> None:
        self._timer = threading.Timer(TRIM_IDLE_S, self._tick)
        self._timer.daemon = True
        self._timer.start()

    def _tick(self) -> None:
        with self._lock:
            self._timer = None
            self._trim(time.monotonic() - TRIM_IDLE_S)
            if self.total > POOL_KEEP_BYTES:  # (still in use: look again later)
                self._arm()

    def trim(self, idle_s: float = 0.0) -> int:
        """Remove free segments idle for ``idle_s`` seconds beyond :data:`POOL_KEEP_BYTES`; the bytes removed."""
        with self._lock:
            return self._trim(time.monotonic() - idle_s)

    def _trim(self, idle_before: float) -> int:
        removed = 0
        for segment in sorted(self.segments, key=lambda seg: self.last_used.get(seg[0], 0.0)):
            if self.total <= POOL_KEEP_BYTES:
                break
            path, cap, _, header = segment
            if header[0] != 0 or self.last_used.get(path, 0.0) > idle_before:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # (freed once every reader dropped its mapping, too)
            self.segments.remove(segment)
            self.last_used.pop(path, None)
            self.total -= cap
            removed += cap
        return removed

    def _acquire(self, nbytes: int):
        for segment in self.segments:
            if segment[1] >= nbytes + HEADER and segment[3][0] == 0:
                segment[3][0] = 1
                return segment
        cap = max(1 << 20, 1 << (nbytes + HEADER - 1).bit_length())
        if self.total + cap > POOL_MAX_BYTES:
            return None
        path, mapping = _new_shm_file(cap)
        segment = (path, cap, mapping, mapping.numpy())
        segment[3][0] = 1
        self.segments.append(segment)
        self.total += cap
        return segment

    def close(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            for path, *_ in self.segments:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            self.segments, self.total = [], 0


_POOL = _SegmentPool()
_READ_MAPS: dict[str, mmap.mmap] = {}  # reader side: producer segments mapped once


class _Lease:
    """Holds a reader's claim on a pooled segment; freeing it (with the last tensor viewing the
    segment) hands the segment back to its producer."""

    __slots__ = ("mapping",)

    def __init__(self, mapping: mmap.mmap):
        self.mapping = mapping

    def __del__(self):
        with contextlib.suppress(ValueError):  # the mapping was closed at interpreter exit
            self.mapping[0] = 0


class _LeasedBytes(np.ndarray):
    """A uint8 view of a segment carrying its :class:`_Lease`; tensors made with ``torch.from_numpy``
    keep it (and so the lease) alive for as long as their storage lives, views included."""


def _leased_view(path: str, capacity: int, offset: int, nbytes: int) -> np.ndarray:
    mapping = _READ_MAPS.get(path)
    if mapping is None:
        with open(path, "r+b") as f:
            mapping = _READ_MAPS[path] = mmap.mmap(f.fileno(), capacity)
        _watch_read_maps()
    view = np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=offset).view(_LeasedBytes)
    view._lease = _Lease(mapping)
    return view


_READ_TIMER: list = [None]


def _watch_read_maps() -> None:
    """Drop, every :data:`TRIM_IDLE_S`, the cached mappings of segments their producer removed (the memory
    goes once the last tensor viewing it is freed); runs while any mapping is cached."""
    if _READ_TIMER[0] is not None:
        return

    def tick():
        _READ_TIMER[0] = None
        drop_removed_maps()
        if _READ_MAPS:
            _watch_read_maps()

    timer = _READ_TIMER[0] = threading.Timer(TRIM_IDLE_S, tick)
    timer.daemon = True
    timer.start()


def drop_removed_maps() -> int:
    """Forget the cached mappings of segments whose files are gone; how many."""
    gone = [p for p in list(_READ_MAPS) if not os.path.exists(p)]
    for path in gone:
        _READ_MAPS.pop(path, None)
    return len(gone)


class _Unsent:
    """A :func:`shared_empty` tensor's claim on its pooled segment until a put sends it: freed unsent
    (the tensor and its views gone), the segment goes back to the pool; once sent, the reader frees it."""

    __slots__ = ("__weakref__", "capacity", "header", "nbytes", "path", "sent")

    def __init__(self, path: str, capacity: int, nbytes: int, header: np.ndarray):
        self.path, self.capacity, self.nbytes, self.header = path, capacity, nbytes, header
        self.sent = False

    def __del__(self):
        if not self.sent:
            with contextlib.suppress(Exception):  # interpreter exit
                self.header[0] = 0


# data address of a shared_empty tensor not sent yet -> its claim (weakly: the tensor's storage owns it)
_UNSENT: weakref.WeakValueDictionary[int, _Unsent] = weakref.WeakValueDictionary()
_UNSENT_LOCK = threading.Lock()
PUT_STATS = {"copied_bytes": 0, "zero_copy_bytes": 0}
"""This process's tensors put into channels through shared memory: bytes copied into a segment, and bytes
sent where they lay (:func:`shared_empty`)."""


def shared_empty(shape, dtype=None):
    """An uninitialised CPU tensor in a pooled shared-memory segment of this process.

    Fill it and put it into a channel on this node: the channel sends a handle and the reader maps the
    same pages, so the tensor is never copied (a plain tensor is copied once into a segment). Once put, it
    belongs to the reader: do not write to it again. Freed without being put, its segment returns to the
    pool. Small tensors (under 256 KiB), and any once the pool is full, are ordinary tensors.

    Example:
        >>> import torch
        >>> t = shared_empty((1024, 1024))
        >>> t.fill_(1.0).sum().item(), t.dtype
        (1048576.0, torch.float32)
    """
    import torch

    dtype = dtype or torch.float32
    shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (int(shape),)
    nbytes = math.prod(shape) * dtype.itemsize
    seg = _POOL.acquire(nbytes) if nbytes >= SHM_MIN_BYTES else None
    if seg is None:
        return torch.empty(shape, dtype=dtype)
    path, capacity, _, header = seg
    view = header[HEADER : HEADER + nbytes].view(_LeasedBytes)
    view._lease = claim = _Unsent(path, capacity, nbytes, header)  # lives as long as the tensor's storage
    t = torch.from_numpy(view).view(dtype).view(shape)
    with _UNSENT_LOCK:
        _UNSENT[t.data_ptr()] = claim
    return t


def _take_unsent(t, nbytes: int) -> _Unsent | None:
    """The claim of ``t`` if it is a whole :func:`shared_empty` tensor not sent yet (now marked sent)."""
    with _UNSENT_LOCK:
        claim = _UNSENT.get(t.data_ptr())
        if claim is None or claim.nbytes != nbytes or not t.is_contiguous() or claim.sent:
            return None
        claim.sent = True
        # its address may come back with a later shared_empty tensor once the reader frees this one
        del _UNSENT[t.data_ptr()]
        return claim


atexit.register(_POOL.close)


def close_pool() -> None:
    """Unlink this process's pooled segments: a worker's, at its close (the atexit handler above does not run
    when Dask's nanny ends a worker process). Readers keep what they mapped."""
    _POOL.close()


def pack(item, node: str):
    """Replace big tensors/arrays by shared-memory handles and CUDA tensors by CUDA IPC handles (when
    we are on the channel's node; from another node, CUDA tensors travel as CPU tensors)."""
    import torch

    if isinstance(item, dict):
        return {k: pack(v, node) for k, v in item.items()}
    if isinstance(item, (list, tuple)) and not hasattr(item, "_fields"):
        return type(item)(pack(v, node) for v in item)
    if isinstance(item, torch.Tensor) and item.device.type == "cuda" and not item.is_sparse:
        return _cuda_ref(item) if node == HOSTNAME else item.detach().to("cpu")
    if node != HOSTNAME:
        return item
    is_np = isinstance(item, np.ndarray)
    if (is_np or isinstance(item, torch.Tensor)) and item.nbytes >= SHM_MIN_BYTES:
        t = torch.from_numpy(np.ascontiguousarray(item)) if is_np else item.detach()
        if t.device.type != "cpu" or t.is_sparse:
            return item
        nbytes = t.numel() * t.element_size()
        dtype = str(t.dtype).removeprefix("torch.")
        claim = _take_unsent(t, nbytes)
        if claim is not None:  # built in its segment: nothing to copy
            PUT_STATS["zero_copy_bytes"] += nbytes
            return _ShmRef(claim.path, node, dtype, tuple(t.shape), is_np, nbytes, HEADER, claim.capacity)
        PUT_STATS["copied_bytes"] += nbytes
        seg = _POOL.acquire(nbytes)
        if seg is not None:
            path, cap, mapping, _ = seg
            mapping[HEADER : HEADER + nbytes].view(t.dtype).copy_(t.reshape(-1))  # the producer's one copy
            return _ShmRef(path, node, dtype, tuple(t.shape), is_np, nbytes, HEADER, cap)
        path, mapping = _new_shm_file(nbytes)
        mapping.view(t.dtype).copy_(t.reshape(-1))
        return _ShmRef(path, node, dtype, tuple(t.shape), is_np, nbytes)
    return item


def unpack(item, host: bool = False):
    """Map shared-memory and CUDA IPC handles back to tensors (zero-copy) and remove their files;
    ``host=True`` (for a reader on another node) copies CUDA tensors to the CPU."""
    import torch

    if isinstance(item, _CudaRef):
        t = _open_cuda(item)
        return t.to("cpu") if host else t
    if isinstance(item, _ShmRef):
        dtype = getattr(torch, item.dtype)
        numel = int(np.prod(item.shape)) if item.shape else 1
        if item.capacity:  # a pooled segment: a zero-copy view, handed back when the tensor is freed
            raw = _leased_view(item.path, item.capacity, item.offset, item.nbytes)
            t = torch.from_numpy(raw).view(dtype).view(item.shape)
        else:  # a one-off file: map it (zero-copy) and unlink it; the pages live as long as the tensor
            t = torch.from_file(item.path, shared=True, size=numel, dtype=dtype).view(item.shape)
            os.unlink(item.path)
        return t.numpy() if item.numpy else t
    if isinstance(item, dict):
        return {k: unpack(v, host) for k, v in item.items()}
    if isinstance(item, (list, tuple)) and not hasattr(item, "_fields"):
        return type(item)(unpack(v, host) for v in item)
    return item


def refs(item):
    """The shared-memory and CUDA IPC handles in ``item``."""
    if isinstance(item, (_ShmRef, _CudaRef)):
        yield item
    elif isinstance(item, dict):
        for v in item.values():
            yield from refs(v)
    elif isinstance(item, (list, tuple)):
        for v in item:
            yield from refs(v)


def release(item) -> None:
    """Free the shared memory of an item that will never be read."""
    for ref in refs(item):
        if isinstance(ref, _CudaRef):
            _release_cuda(ref)
            continue
        with contextlib.suppress(FileNotFoundError):
            if ref.capacity:  # a pooled segment: hand it back to its producer for reuse
                with open(ref.path, "r+b") as f:
                    f.write(b"\0")
            else:
                os.unlink(ref.path)


def _release_cuda(ref: _CudaRef) -> None:
    """Tell the producer that a CUDA tensor will never be read, so its GPU memory can be freed."""
    import torch

    if ref.node != HOSTNAME or not torch.cuda.is_available():
        return  # the producer frees it when it exits
    storage_cls, counter, offset = ref.args[4], ref.args[11], ref.args[12]
    with contextlib.suppress(Exception):  # the producer may be gone already
        storage_cls._release_ipc_counter(counter, offset, device=_local_index(ref.gpu_uuid))
