"""What the model-size benches share: the tiny-LM factory's models scaled up, built in a temporary directory."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

from rlnb.models.lm import build_tiny_lm


def scaled_models(sizes: list[str]) -> Iterator[tuple[str, str]]:
    """``(size, path)`` for each ``HIDDENxLAYERS`` size: a Qwen2 with heads of 64 dimensions and the character
    vocabulary, saved as a real checkpoint is; each directory is removed once the next one is asked for."""
    for size in sizes:
        hidden, layers = (int(x) for x in size.split("x"))
        with tempfile.TemporaryDirectory(prefix="rlnb-bench-") as tmp:
            path = build_tiny_lm(Path(tmp) / size, hidden_size=hidden, num_layers=layers,
                                 num_heads=max(1, hidden // 64), max_positions=256, seed=0)  # fmt: skip
            yield size, str(path)
