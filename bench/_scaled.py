"""What the model-size benches share: the tiny-LM factory's models scaled up, built in a temporary directory; the
best time of a GPU or CPU operation; a worker's resident memory and its peak (``/proc/self/status``)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from rlnb.models.lm import build_tiny_lm

# from this many parameters up, a model is built on the GPU where there is one and saved in bf16, as real
# checkpoints of that size are published (a 7B float32 file would be 28 GB)
BIG_PARAMETERS = 1_000_000_000


def best_seconds(device: str, fn: Callable[[], object], repeats: int = 5) -> float:
    """The shortest of ``repeats`` runs of ``fn``, waiting for the GPU's work to end on ``cuda``."""
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def scaled_models(sizes: list[str], big_in_bf16: bool = False) -> Iterator[tuple[str, str]]:
    """``(size, path)`` for each ``HIDDENxLAYERS`` size: a Qwen2 with heads of 64 dimensions and the character
    vocabulary, saved as a real checkpoint is; each directory is removed once the next one is asked for.
    ``big_in_bf16``: a model of ``BIG_PARAMETERS`` or more is made (on the GPU, if any) and saved in bf16."""
    for size in sizes:
        hidden, layers = (int(x) for x in size.split("x"))
        big = big_in_bf16 and 16 * hidden * hidden * layers >= BIG_PARAMETERS  # (a layer: 4h^2 + 3 x h x 4h)
        where = {"dtype": "bfloat16", "device": "cuda" if torch.cuda.is_available() else "cpu"} if big else {}
        with tempfile.TemporaryDirectory(prefix="rlnb-bench-") as tmp:
            path = build_tiny_lm(Path(tmp) / size, hidden_size=hidden, num_layers=layers,
                                 num_heads=max(1, hidden // 64), max_positions=256, seed=0, **where)  # fmt: skip
            if where.get("device") == "cuda":
                torch.cuda.empty_cache()
            yield size, str(path)


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB -> MiB
    raise RuntimeError(f"no {field} in /proc/self/status")


def resident_mib() -> float:
    """This process's resident memory (``VmRSS``), MiB."""
    return _status("VmRSS")


def reset_peak() -> None:
    """Start this process's peak resident memory (``VmHWM``) again from now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_mib() -> float:
    """This process's peak resident memory (``VmHWM``) since it started or :func:`reset_peak`, MiB."""
    return _status("VmHWM")


def import_what_loading_imports() -> None:
    """What an actor's first load imports (torch's distributed parts, transformers' model, PEFT), so the memory
    measured after it is the model's, not the libraries'."""
    import peft  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401
    from safetensors import safe_open  # noqa: F401
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: F401

    import rlnb.components.lm  # noqa: F401
