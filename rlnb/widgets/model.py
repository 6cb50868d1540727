"""The dashboard's state, fed by a loop's metric stream. Plain Python: no widget imports, testable as is."""

from __future__ import annotations

import logging
import time
import weakref
from collections import defaultdict, deque

# Curves shown when present, in this order: (panel title, metric keys)
CURVES = (
    (
        "return / reward",
        ("env/episode_return_mean", "reward/mean", "eval/return_mean", "eval/accuracy", "reward/accuracy"),
    ),
    ("losses", ("train/policy_loss", "train/value_loss", "train/loss")),
    ("KL / clipping", ("train/approx_kl", "train/kl", "train/clip_frac")),
    ("throughput", ("rollout/steps_per_s", "rollout/tokens_per_s")),
    (
        "staleness (versions behind)",
        ("rollout/staleness_mean", "rollout/staleness_max"),
    ),  # max_staleness >= 1
    ("rollout hidden behind training", ("rollout/overlap_frac",)),  # max_staleness >= 1
)
PHASES = ("sync", "rollout", "advantages", "train", "compile", "eval", "sft")


class DashboardModel:
    """Progress, curves, phase times and latest metrics of a run, updated one metric record at a time.

    Example:
        >>> m = DashboardModel(total=10)
        >>> m.update({"step": 1, "time/step_s": 0.5, "env/episode_return_mean": 20.0})
        >>> m.step, m.series["env/episode_return_mean"]
        (1, [(1, 20.0)])
    """

    def __init__(self, total: int | None = None, start_step: int = 0):
        self.total, self.start_step = total, start_step
        self.step = start_step
        self.series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.phase_s: dict[str, float] = {}
        self.latest: dict[str, float] = {}
        self.started = time.perf_counter()
        self.updates = 0
        self.done = False
        self.messages: deque[str] = deque(maxlen=5)  # the latest warnings and errors, newest last
        self._listeners = []

    def observe(self, fn) -> None:
        """Call ``fn(model)`` after every update (the view re-renders)."""
        self._listeners.append(fn)

    def update(self, record: dict) -> None:
        step = int(record.get("step", self.step))
        self.step = max(self.step, step)
        for k, v in record.items():
            if k in ("step", "wall_time") or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            self.latest[k] = float(v)
            if k.startswith("time/") and k.endswith("_s"):
                phase = k[len("time/") : -2]
                if phase in PHASES:
                    self.phase_s[phase] = float(v)
            self.series[k].append((step, float(v)))
        self.updates += 1
        if self.total is not None and self.step >= self.total:
            self.done = True
        self._notify()

    def _notify(self) -> None:
        for fn in list(self._listeners):
            fn(self)

    def note(self, message: str) -> None:
        """Keep a warning or error (a worker's, forwarded to the driver, or a failed step's traceback)."""
        self.messages.append(message)
        self._notify()

    @property
    def fraction(self) -> float:
        if not self.total or self.total <= self.start_step:
            return 0.0
        return min(1.0, (self.step - self.start_step) / (self.total - self.start_step))

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the pace so far (``None`` before the first step)."""
        done = self.step - self.start_step
        if not self.total or done <= 0:
            return None
        return (time.perf_counter() - self.started) / done * (self.total - self.step)

    def curves(self) -> list[tuple[str, dict[str, list[tuple[int, float]]]]]:
        """Panels with data: ``[(title, {metric: [(step, value), ...]})]``."""
        out = []
        for title, keys in CURVES:
            data = {k: self.series[k] for k in keys if self.series.get(k)}
            if data:
                out.append((title, data))
        return out

    def progress_text(self) -> str:
        total = f"/{self.total}" if self.total else ""
        eta = self.eta_s
        eta_txt = "" if eta is None else f" · ETA {eta:.0f} s"
        return f"step {self.step}{total}{eta_txt}{' · done' if self.done else ''}"


class MessageHandler(logging.Handler):
    """Feeds the ``rlnb`` logger's warnings and errors (workers' ones are forwarded to the driver by the
    embedded cluster) into a :class:`DashboardModel`, tracebacks included."""

    def __init__(self, model: DashboardModel, logger: logging.Logger):
        super().__init__(logging.WARNING)
        # a weak reference: a dashboard that is gone takes its handler off the logger at the next record,
        # so handlers of old dashboards do not pile up on the logger
        self.model = weakref.ref(model)
        self.logger = logger
        self.setFormatter(logging.Formatter("%(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        model = self.model()
        if model is None:
            self.logger.removeHandler(self)
            return
        worker = getattr(record, "worker", None)
        text = self.format(record)
        model.note(f"{text} [{worker}]" if worker else text)


def watch_messages(model: DashboardModel, logger: str = "rlnb") -> MessageHandler:
    """Attach a :class:`MessageHandler` for ``model`` to ``logger``; returns it (``removeHandler`` to stop)."""
    target = logging.getLogger(logger)
    handler = MessageHandler(model, target)
    target.addHandler(handler)
    return handler
