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
        self.outcome: str | None = None  # how the run ended (rlnb.loop.RUN_OUTCOMES), once it has
        self.wall_s: float | None = None  # the run's seconds, once it has ended
        self.run_watch = None  # the RunWatch telling it of the loop's runs (dashboard_for)
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

    def start_run(self, total: int, start_step: int) -> None:
        """A ``run()`` begins: progress and ETA count from ``start_step`` to ``total`` (curves carry on)."""
        self.total, self.start_step, self.step = total, start_step, max(self.step, start_step)
        self.started, self.done, self.outcome, self.wall_s = time.perf_counter(), False, None, None
        self._notify()

    def finish(self, outcome: str, step: int | None = None) -> None:
        """The run ended (``outcome``: ``done``, ``solved``, ``stopped``, ``interrupted`` or ``failed``): the
        view says so, with the final step and the wall time, and steers no more."""
        if step is not None:
            self.step = step
        self.done, self.outcome = True, outcome
        self.wall_s = time.perf_counter() - self.started
        self._notify()

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
        """``step 12/390 · ETA 80 s`` while running; once ended, how, where and after how long:
        ``solved at step 124 of 390 · 57 s``."""
        if self.outcome is not None:
            of = f" of {self.total}" if self.total and self.step < self.total else ""
            return f"{self.outcome} at step {self.step}{of} · {_duration(self.wall_s or 0.0)}"
        total = f"/{self.total}" if self.total else ""
        eta = self.eta_s
        eta_txt = "" if eta is None else f" · ETA {_duration(eta)}"
        return f"step {self.step}{total}{eta_txt}{' · done' if self.done else ''}"


def _duration(seconds: float) -> str:
    """``57 s``, ``12 min 5 s``, ``2 h 3 min``."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


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
