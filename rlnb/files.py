"""Files written whole or not at all (and readable by their user alone), and loaded without running code."""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def torch_save_atomic(obj, path: str | os.PathLike, pickle_module=None) -> int:
    """``torch.save(obj)`` to ``path`` atomically: into a temporary file beside it, flushed to disk, then renamed,
    so a reader sees the old file or the whole new one. ``pickle_module``: as ``torch.save`` takes it (e.g.
    ``cloudpickle``, for classes defined in ``__main__``). Returns the file's size in bytes."""
    import torch

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:6]}")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:  # (its user's alone)
            if pickle_module is None:
                torch.save(obj, f)
            else:
                torch.save(obj, f, pickle_module=pickle_module)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


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
    """Write ``text`` to ``path`` (``0600``: a run's files are its user's), flushed to disk if ``sync``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # (an existing file keeps its mode through O_CREAT)
    with open(fd, "w") as f:
        f.write(text)
        if sync:
            f.flush()
            os.fsync(f.fileno())
