"""Files written whole or not at all (and readable by their user alone), loaded without running code, and never
reached through a symbolic link that leads out of the run directory.

A run directory is a boundary: rlnb opens the files it writes there with ``O_NOFOLLOW`` (a link planted in
their place is refused, never written through), accepts only regular files (a FIFO or a device is refused, never
read or written), and resolves every path it reads from a checkpoint inside the run directory
(:func:`check_tree`).
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from pathlib import Path


class UnsafePathError(OSError):
    """A path rlnb will not write or read: a symbolic link where a run's file goes, a link that leads out of the
    run directory, a FIFO or a device where a regular file should be, a directory owned by another user."""


def open_regular(
    path: str | os.PathLike, flags: int = os.O_RDONLY, mode: int = 0o600, follow: bool = False
) -> int:
    """``os.open`` of a regular file only: a symbolic link at ``path`` is refused (unless ``follow``), and so is
    anything but a regular file (a FIFO is opened without blocking, then refused). Returns the descriptor.

    Raises:
        UnsafePathError: a link (``follow`` off) or not a regular file.
        OSError: as ``os.open`` (missing, no permission...).
    """
    extra = os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags | extra, mode)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise UnsafePathError(
                errno.ELOOP,
                f"{path} is a symbolic link: rlnb never writes or reads a run's files through one",
            ) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = (
            "a directory"
            if stat.S_ISDIR(st.st_mode)
            else "a FIFO"
            if stat.S_ISFIFO(st.st_mode)
            else (
                "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file"
            )
        )
        raise UnsafePathError(errno.EINVAL, f"{path} is {kind}: expected a regular file")
    os.set_blocking(fd, True)
    return fd


def check_inside(path: str | os.PathLike, root: str | os.PathLike) -> Path:
    """``path`` resolved (links followed), refused unless it lies inside ``root`` (resolved too).

    Raises:
        UnsafePathError: it leads out of ``root``.
    """
    resolved, base = Path(path).resolve(), Path(root).resolve()
    if resolved != base and base not in resolved.parents:
        raise UnsafePathError(errno.EXDEV, f"{path} leads out of {root} (to {resolved}): refused")
    return resolved


def check_tree(directory: str | os.PathLike, root: str | os.PathLike) -> None:
    """Every entry under ``directory`` (itself included) is a directory, a regular file, or a symbolic link
    that resolves inside ``root``: what a checkpoint may hold before any of it is read.

    Raises:
        UnsafePathError: naming the first entry that is not.
    """
    directory = Path(directory)
    check_inside(directory, root)
    for here, dirs, files in os.walk(directory, followlinks=False):
        for name in [*dirs, *files]:
            path = Path(here) / name
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                check_inside(path, root)
            elif not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise UnsafePathError(errno.EINVAL, f"{path} is not a regular file or directory: refused")


def check_owned(directory: str | os.PathLike, key: str = "directory") -> None:
    """``directory`` belongs to this user and nobody else can write into it (as OpenSSH's ``StrictModes``
    checks ``~/.ssh``): another user could otherwise plant links or files in it.

    Raises:
        UnsafePathError: owned by another user, or writable by its group or by others.
    """
    st = os.stat(directory)
    me = os.geteuid()
    if st.st_uid != me:
        raise UnsafePathError(
            errno.EPERM,
            f"{key}: {directory} belongs to user {_user(st.st_uid)}, not to this user ({_user(me)}); a run "
            "directory must be its user's own: choose another directory",
        )
    if st.st_mode & 0o022:
        raise UnsafePathError(
            errno.EPERM,
            f"{key}: {directory} is writable by {'its group' if st.st_mode & 0o020 else 'others'} (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): another user could plant files or links in it; "
            f"`chmod go-w {directory}`, or choose another directory",
        )


def _user(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def torch_save_atomic(obj, path: str | os.PathLike, pickle_module=None) -> int:
    """``torch.save(obj)`` to ``path`` atomically: into a temporary file beside it, flushed to disk, then renamed,
    so a reader sees the old file or the whole new one. ``pickle_module``: as ``torch.save`` takes it (e.g.
    ``cloudpickle``, for classes defined in ``__main__``). Returns the file's size in bytes."""
    import torch

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:6]}")
    try:
        # (its user's alone; O_EXCL: a link planted at the temporary name is refused, not followed)
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as f:
            try:
                if pickle_module is None:
                    torch.save(obj, f)
                else:
                    torch.save(obj, f, pickle_module=pickle_module)
                f.flush()
                os.fsync(f.fileno())
            except RuntimeError as e:  # torch's writer says "unexpected pos ..." where the disk is full
                _raise_if_full(path, e)
                raise
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def _raise_if_full(path: Path, error: BaseException) -> None:
    """Raise ``ENOSPC`` naming ``path`` if its file system is (nearly) full: what a failed write there means,
    whatever words the writer used."""
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return
    if st.f_bavail * st.f_frsize < (1 << 20):
        raise OSError(errno.ENOSPC, f"No space left on device writing {path}") from error


class UnsafeFileError(ValueError):
    """A file that would run code when loaded (it names classes or functions beyond tensors and plain data)."""


def safe_globals() -> list:
    """What a safe load allows beyond torch's own ``weights_only`` set: numpy arrays, scalars and dtypes
    (built from their shape, dtype and bytes; none of them runs code)."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    dtypes = [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    return [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype, *dtypes]


def unsafe_globals(path: str | os.PathLike) -> list[str]:
    """The classes and functions a ``torch.save`` file names that :func:`torch_load_safe` refuses."""
    import zipfile

    import torch

    allowed = {f"{g.__module__}.{g.__qualname__}" for g in safe_globals()}
    if zipfile.is_zipfile(path):
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    else:  # a plain pickle (torch.load reads those too)
        names = sorted(_pickle_globals(path))
    return [
        n
        for n in names
        if n not in allowed and not n.startswith(("numpy.dtypes.", "numpy._core.multiarray."))
    ]


def _pickle_globals(path) -> set[str]:
    """The ``module.name`` globals a plain pickle names, read from its opcodes (nothing in it runs)."""
    import pickletools

    found, strings = set(), []
    with open(path, "rb") as f:
        for op, arg, _ in pickletools.genops(f):
            if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                strings = [*strings[-1:], arg]
            elif op.name == "GLOBAL":
                found.add(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) == 2:
                found.add(".".join(strings))
    return found


def torch_load_safe(path: str | os.PathLike, map_location="cpu"):
    """``torch.load`` of tensors and plain data only (``weights_only=True`` with numpy allowed): a file
    that names any other class or function is refused before anything in it runs.

    Raises:
        UnsafeFileError: the file names classes or functions beyond those (listed in the message).
        OSError: it cannot be read.
    """
    import pickle

    import torch

    with torch.serialization.safe_globals(safe_globals()):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except (EOFError, RuntimeError) as e:  # empty, cut short, or pointing past its own end
            raise ValueError(
                f"{path} is not a whole file torch.save wrote ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else 'it ends too soon'})"
            ) from None
        except pickle.UnpicklingError as e:
            try:
                names = unsafe_globals(path)
            except Exception:  # not a torch file at all
                names = []
            if not names:
                raise ValueError(
                    f"{path} is not a file torch.save wrote ({str(e).splitlines()[-1][:200]})"
                ) from None
            raise UnsafeFileError(
                f"{path} names {', '.join(names)}: rlnb loads only tensors and plain data from it, because "
                "loading anything else could run code"
            ) from None


def write_private(path: str | os.PathLike, text: str, sync: bool = False) -> None:
    """Write ``text`` to ``path`` (``0600``: a run's files are its user's), flushed to disk if ``sync``; a symbolic
    link, FIFO or device at ``path`` is refused (:func:`open_regular`)."""
    fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # (never through a link planted there)
    os.fchmod(fd, 0o600)  # (an existing file keeps its mode through O_CREAT)
    with open(fd, "w") as f:
        f.write(text)
        if sync:
            f.flush()
            os.fsync(f.fileno())


def append_private(path: str | os.PathLike, buffering: int = -1):
    """``path`` opened for appending text (created ``0600``), never through a symbolic link, a regular file only
    (:func:`open_regular`)."""
    fd = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return open(fd, "a", buffering=buffering)


def read_text_regular(path: str | os.PathLike, limit_bytes: int, follow: bool = True) -> str:
    """``path``'s text (UTF-8), a regular file only (a FIFO or a device is refused, never read), of at most
    ``limit_bytes``.

    Raises:
        UnsafePathError: not a regular file (or a link, with ``follow`` off).
        ValueError: bigger than ``limit_bytes``.
        UnicodeDecodeError: not UTF-8.
    """
    fd = open_regular(path, os.O_RDONLY, follow=follow)
    with open(fd, "rb") as f:
        data = f.read(limit_bytes + 1)
    if len(data) > limit_bytes:
        raise ValueError(f"{path} is bigger than {limit_bytes} bytes")
    return data.decode("utf-8")


EXPORT_MARK = ".rlnb-export"  # in a directory rlnb exported: the one kind of directory an export replaces


def check_export_target(path: str | os.PathLike, kind: str, is_ours=None) -> None:
    """Refuse to replace at ``path`` anything an export did not write, before anything is written: ``kind``
    ``"directory"`` takes a missing path, an empty directory or one holding :data:`EXPORT_MARK`; ``"file"`` takes
    a missing path or a regular file that ``is_ours(path)`` recognises (an earlier export).

    Raises:
        UnsafePathError: naming the path and what is there.
    """
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    what = (
        "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
        else "a regular file" if stat.S_ISREG(st.st_mode) else "a device, FIFO or socket"
    )  # fmt: skip
    if kind == "directory" and stat.S_ISDIR(st.st_mode):
        if (path / EXPORT_MARK).is_file() or not any(path.iterdir()):
            return
        what = "a directory holding files rlnb did not export"
    elif kind == "file" and stat.S_ISREG(st.st_mode):
        if is_ours is not None and is_ours(path):
            return
        what = "a file rlnb did not export"
    raise UnsafePathError(
        errno.EEXIST,
        f"{path} is {what}; an export replaces only an earlier export of its own: remove it or choose another path",
    )


def replace_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Put the finished directory ``tmp`` at ``final`` (checked with :func:`check_export_target` first): an
    earlier export there is moved aside, ``tmp`` renamed into its place, then the earlier one removed."""
    import shutil

    tmp, final = Path(tmp), Path(final)
    check_export_target(final, "directory")
    (tmp / EXPORT_MARK).write_text("written by rlnb export; a later export may replace this directory\n")
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:6]}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def nonfinite(state, prefix: str = "") -> str | None:
    """The name of the first floating-point tensor or array in ``state`` (nested dicts, lists, tuples) holding a NaN
    or an infinity, or ``None``: what a diverged or damaged checkpoint holds."""
    import sys

    import numpy as np

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(state, torch.Tensor):
        bad = state.is_floating_point() and not bool(torch.isfinite(state).all())
        return prefix or "tensor" if bad else None
    if isinstance(state, np.ndarray):
        bad = np.issubdtype(state.dtype, np.floating) and not bool(np.isfinite(state).all())
        return prefix or "array" if bad else None
    items = (
        state.items()
        if isinstance(state, dict)
        else enumerate(state)
        if isinstance(state, (list, tuple))
        else ()
    )
    for k, v in items:
        found = nonfinite(v, f"{prefix}.{k}" if prefix else str(k))
        if found is not None:
            return found
    return None
