"""Metric logging: ``metrics.jsonl`` always; TensorBoard and Weights & Biases when available.

Observers (the notebook dashboard, progress bars) subscribe with ``add_listener``; the logger
never imports widgets.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path


class MetricLogger:
    """Writes one JSON object per step to ``<run_dir>/metrics.jsonl`` and fans out to listeners.

    Example:
        >>> log = MetricLogger("/tmp/run", tensorboard=False)   # doctest: +SKIP
        >>> log.log(1, {"env/episode_return_mean": 20.0})        # doctest: +SKIP
    """

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        config: dict | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.history: list[dict] = []
        self._listeners: list[Callable[[dict], None]] = []
        self._tb = None
        self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:
                self._tb = None
        if wandb_project:
            import wandb

            self._wandb = wandb.init(project=wandb_project, dir=str(self.run_dir), config=config or {})

    def add_listener(self, fn: Callable[[dict], None]) -> None:
        """Call ``fn(record)`` after each logged step (dashboards, progress bars)."""
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[dict], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def log(self, step: int, metrics: dict) -> dict:
        record = {"step": step, "wall_time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.history.append(record)
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "wall_time") and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=step)
        for fn in list(self._listeners):
            fn(record)
        return record

    def truncate_after(self, step: int) -> None:
        """On resume: drop records of steps after ``step`` (they will be recomputed)."""
        if not self.path.exists():
            return
        kept = [
            line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step
        ]
        self.path.write_text("".join(line + "\n" for line in kept))
        self.history = [json.loads(line) for line in kept]

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _plain(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else v
    return v


def read_metrics(run_dir: str | Path) -> list[dict]:
    """All records of a run's ``metrics.jsonl``."""
    path = Path(run_dir) / "metrics.jsonl"
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )
