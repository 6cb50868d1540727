"""What the model-size benches share: the tiny-LM factory's models scaled up, built in a temporary directory, and
the best time of a GPU or CPU operation."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from rlnb.models.lm import build_tiny_lm


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


def scaled_models(sizes: list[str]) -> Iterator[tuple[str, str]]:
    """``(size, path)`` for each ``HIDDENxLAYERS`` size: a Qwen2 with heads of 64 dimensions and the character
    vocabulary, saved as a real checkpoint is; each directory is removed once the next one is asked for."""
    for size in sizes:
        hidden, layers = (int(x) for x in size.split("x"))
        with tempfile.TemporaryDirectory(prefix="rlnb-bench-") as tmp:
            path = build_tiny_lm(Path(tmp) / size, hidden_size=hidden, num_layers=layers,
                                 num_heads=max(1, hidden // 64), max_positions=256, seed=0)  # fmt: skip
            yield size, str(path)
