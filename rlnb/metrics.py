"""Metric logging: ``metrics.jsonl`` always; TensorBoard and Weights & Biases when available.

Observers (the notebook dashboard, progress bars) subscribe with ``add_listener``; the logger
never imports widgets.
"""

from __future__ import annotations

import json
import math
import os
import secrets
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
            self._tb = _tensorboard_writer(self.run_dir)
        if wandb_project:
            import wandb

            # one wandb run per run directory: a resumed run continues it instead of opening another
            id_file = self.run_dir / "wandb_run_id"
            run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
            id_file.write_text(run_id)
            self._wandb = wandb.init(
                project=wandb_project, dir=str(self.run_dir), config=config or {}, id=run_id, resume="allow"
            )

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
        """On resume: drop records of steps after ``step`` (they will be recomputed), in ``metrics.jsonl``
        (rewritten atomically; a torn last line of a killed run is dropped) and in TensorBoard (its
        events from ``step + 1`` on are purged, so curves do not overlap)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = _tensorboard_writer(self.run_dir, purge_step=step + 1)
        if not self.path.exists():
            return
        kept = [r for r in read_metrics(self.run_dir) if r.get("step", 0) <= step]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)
        self.history = kept

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


def _tensorboard_writer(run_dir: Path, purge_step: int | None = None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge_step)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """All records of a run's ``metrics.jsonl``; a line that does not parse (the torn last line of a
    killed run) is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
