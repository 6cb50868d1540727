"""Files written whole or not at all."""

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
        with open(tmp, "wb") as f:
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
