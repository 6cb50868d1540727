"""The dashboard's state, fed by a loop's metric stream. Plain Python: no widget imports, testable as is."""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass

from rlnb.metrics import X_COUNTERS


@dataclass(frozen=True)
class Panel:
    """One curve panel of the dashboard: its metrics and how its y axis reads."""

    title: str
    keys: tuple[str, ...]
    """The metrics drawn, when logged."""
    y_label: str
    """What the y axis measures, with its unit."""
    floor: float | None = None
    """The axis never goes below this (a quantity that cannot be negative); with none, it goes below zero only
    where the data does."""
    ceiling: float | None = None
    """The axis never goes above this (a fraction: 1)."""
    unless: str | None = None
    """Not shown where this metric is logged (a total loss, where the policy loss has its own panel)."""
    smooth: bool = False
    """Noisy metrics: each line is drawn smoothed (:func:`smoothed`, TensorBoard's), the points as logged; an
    evaluation's (``eval/``, a point every few steps) is drawn as logged."""

    def smooths(self, metric: str) -> bool:
        """Whether ``metric``'s line is drawn smoothed."""
        return self.smooth and not metric.startswith("eval/")


_KL = Panel("KL", ("train/approx_kl", "train/kl"), "KL (nats)", smooth=True)
_CLIP = Panel("clip fraction", ("train/clip_frac",), "fraction clipped", floor=0.0, ceiling=1.0, smooth=True)
_LOSS = Panel(
    "loss", ("train/loss",), "loss", unless="train/policy_loss", smooth=True
)  # (an LM actor's total)

# shown when present, in this order; losses of different sizes, and KL and clipping, each on their own axis
EMBODIED_CURVES = (
    Panel(
        "return / reward",
        ("env/episode_return_mean", "reward/mean", "eval/return_mean", "eval/accuracy", "reward/accuracy"),
        "return per episode / reward",
    ),
    Panel(
        "success rate",
        ("env/success_rate", "eval/success_rate"),
        "fraction of episodes",
        floor=0.0,
        ceiling=1.0,
    ),  # envs that say whether an episode succeeded (ManiSkill, LIBERO, PixelReach)
    Panel("policy loss", ("train/policy_loss",), "loss"),
    _LOSS,
    Panel("value loss", ("train/value_loss",), "squared error", floor=0.0),
    _KL,
    _CLIP,
    Panel("throughput", ("rollout/steps_per_s", "rollout/tokens_per_s"), "per second", floor=0.0),
    Panel(
        "staleness (versions behind)",
        ("rollout/staleness_mean", "rollout/staleness_max"),
        "policy versions",
        floor=0.0,
    ),  # max_staleness >= 1
    Panel(
        "rollout hidden behind training", ("rollout/overlap_frac",), "fraction of rollout time", 0.0, 1.0
    ),  # max_staleness >= 1
)

_ASYNC = EMBODIED_CURVES[-2:]  # staleness and overlap, when asynchronous
LM_CURVES = (
    Panel("reward", ("reward/mean",), "reward per completion", smooth=True),
    Panel(
        "accuracy",
        ("reward/accuracy", "eval/accuracy"),
        "fraction correct",
        floor=0.0,
        ceiling=1.0,
        smooth=True,
    ),
    Panel("response length", ("rollout/response_len_mean",), "tokens per completion", floor=0.0, smooth=True),
    _KL,
    Panel("entropy", ("train/entropy",), "nats per token", floor=0.0, smooth=True),
    _CLIP,
    _LOSS,
    Panel("tokens per second", ("rollout/tokens_per_s",), "tokens per second", floor=0.0),
    *_ASYNC,
)
"""The GRPO family's panels: what TRL's and veRL's users watch (reward, accuracy, response length, KL, entropy,
clipping, throughput), the noisy ones smoothed."""
SAC_CURVES = (
    EMBODIED_CURVES[0],  # return
    EMBODIED_CURVES[1],  # success rate, where the env says
    Panel("Q-values", ("train/q1_mean", "train/q2_mean"), "expected return", smooth=True),
    Panel("Q loss", ("train/q_loss",), "squared error", floor=0.0, smooth=True),
    Panel("actor loss", ("train/actor_loss",), "loss", smooth=True),
    Panel("policy entropy", ("train/entropy",), "nats (a continuous policy's may be below 0)", smooth=True),
    Panel("entropy coefficient", ("train/alpha",), "alpha", floor=0.0),
    Panel("replay buffer", ("buffer/size",), "transitions", floor=0.0),
    EMBODIED_CURVES[-3],  # throughput
    *_ASYNC,
)
"""The SAC family's panels: what SB3's and CleanRL's users watch (return, the Q-values and their loss, the policy's
entropy and its coefficient alpha), the buffer filling, throughput and staleness."""
CURVES = EMBODIED_CURVES
"""The panels a dashboard shows by default (an embodied run's; :func:`curves_for` gives a family's)."""
FAMILY_CURVES = {"ppo": EMBODIED_CURVES, "grpo": LM_CURVES, "sac": SAC_CURVES}


def curves_for(family: str) -> tuple[Panel, ...]:
    """The dashboard panels of a recipe's ``family`` (an embodied run's for a family without its own)."""
    return FAMILY_CURVES.get(family, EMBODIED_CURVES)


SMOOTHING = 0.6
"""The weight of the past in :func:`smoothed` (TensorBoard's default)."""


def smoothed(values, weight: float = SMOOTHING, state: list | None = None) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start (so the first point is the
    first value); NaN and inf are left as they are and do not enter the average. ``state`` (a list, empty at
    first): where the average of earlier values is kept, so a growing series is smoothed a new value at a time.

    Example:
        >>> smoothed([1.0, 0.0, 0.0, 1.0])
        [1.0, 0.375, 0.18367346938775508, 0.5588235294117647]
    """
    if state is None:
        state = []
    if not state:
        state += [0.0, 0]  # the average so far (biased), and how many values it holds
    last, n = state
    out = []
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        last, n = last * weight + (1 - weight) * v, n + 1
        out.append(last / (1 - weight**n))
    state[:] = [last, n]
    return out


PANELS = {p.title: p for p in (*EMBODIED_CURVES, *LM_CURVES, *SAC_CURVES)}
"""Every panel by its title (a title names one panel in every family)."""


def panel_for(title: str) -> Panel:
    """The panel of that title, or a plain one (no metrics of its own, no unit) for a title not in :data:`PANELS`."""
    return PANELS.get(title) or Panel(title, (), "")


RECENT_STEPS = 20
"""The phase table shows each phase's mean over this many latest steps (one slow step does not fill it)."""


def short_name(metric: str) -> str:
    """A legend's name for a metric key: ``env/episode_return_mean`` -> ``episode return mean``,
    ``eval/return_mean`` -> ``eval return mean``, ``rollout/steps_per_s`` -> ``steps/s``.

    Example:
        >>> short_name("rollout/tokens_per_s"), short_name("eval/accuracy")
        ('tokens/s', 'eval accuracy')
    """
    section, _, name = metric.partition("/")
    name = (name or section).replace("_per_s", "/s").replace("_", " ")
    return f"eval {name}" if section == "eval" else name


def nice_ticks(lo: float, hi: float, floor: float | None = None, ceiling: float | None = None) -> list[float]:
    """The y axis's ticks for data in ``[lo, hi]``: :func:`nice_range`'s bounds and the round numbers between.

    Example:
        >>> nice_ticks(9.0, 549.0), nice_ticks(0.2, 0.9, 0.0, 1.0)
        ([0.0, 200.0, 400.0, 600.0], [0.2, 0.4, 0.6, 0.8, 1.0])
    """
    n_lo, n_hi, step = _nice(lo, hi, floor, ceiling)
    ticks = [n_lo]
    while ticks[-1] + step < n_hi - step * 1e-9:
        ticks.append(float(round(ticks[-1] + step, 12)))
    return [*ticks, n_hi]


def nice_range(lo: float, hi: float, floor: float | None = None, ceiling: float | None = None):
    """Axis bounds around ``[lo, hi]`` at round numbers (multiples of 1, 2 or 5 times a power of ten, about
    five ticks apart), not below zero unless the data is, and within ``floor``/``ceiling``.

    Example:
        >>> nice_range(9.0, 549.0), nice_range(0.013, 0.027, floor=0.0), nice_range(-31.8, 404.0)
        ((0.0, 600.0), (0.01, 0.03), (-100.0, 500.0))
    """
    n_lo, n_hi, _ = _nice(lo, hi, floor, ceiling)
    return n_lo, n_hi


def _nice(lo: float, hi: float, floor: float | None, ceiling: float | None) -> tuple[float, float, float]:
    import math

    if hi < lo:
        lo, hi = hi, lo
    span = hi - lo or max(abs(hi), 1e-3)
    raw = span / 5
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    n_lo, n_hi = math.floor(lo / step) * step, math.ceil(hi / step) * step
    if n_lo == n_hi:
        n_lo, n_hi = n_lo - step, n_hi + step
    if lo >= 0 > n_lo:
        n_lo = 0.0
    if floor is not None:
        n_lo = max(n_lo, floor)
    if ceiling is not None:
        n_hi = min(n_hi, ceiling)
    return float(round(n_lo, 12)), float(round(n_hi, 12)), step


PHASES = ("sync", "rollout", "advantages", "train", "compile", "eval", "sft")


class DashboardModel:
    """Progress, curves, phase times and latest metrics of a run, updated one metric record at a time.

    Example:
        >>> m = DashboardModel(total=10)
        >>> m.update({"step": 1, "time/step_s": 0.5, "env/episode_return_mean": 20.0})
        >>> m.step, m.series["env/episode_return_mean"]
        (1, [(1, 20.0)])
    """

    def __init__(self, total: int | None = None, start_step: int = 0, panels: tuple[Panel, ...] = CURVES):
        self.total, self.start_step = total, start_step
        self.panels = panels  # the family's curve panels (curves_for)
        self.completions: list[
            dict
        ] = []  # the latest logged group of completions (an LM run's), with its step
        self.step = start_step
        self.series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.phase_s: dict[str, float] = {}  # each phase's mean seconds over the last RECENT_STEPS steps
        self.eval_s: float | None = None  # the latest evaluation's seconds (apart: it is not every step's)
        self._recent: dict[str, deque] = defaultdict(lambda: deque(maxlen=RECENT_STEPS))
        self.latest: dict[str, float] = {}
        self.started = time.perf_counter()
        self.paused_since: float | None = None  # while the run is paused (the dashboard's button): since when
        self.paused_s = 0.0  # the seconds this run spent paused, left out of its pace
        self.updates = 0
        self.done = False
        self.outcome: str | None = None  # how the run ended (rlnb.loop.RUN_OUTCOMES), once it has
        self.wall_s: float | None = None  # the run's seconds, once it has ended
        self.run_watch = None  # the RunWatch telling it of the loop's runs (dashboard_for)
        self.run_dir = None  # where the run's files are (dashboard_for): the videos' paths are relative to it
        self.video: tuple[int, str] | None = None  # (step, path) of the latest evaluation episode's video
        # training step -> env steps or completions by then (X_COUNTERS)
        self.x_counts: dict[int, float] = {}
        self._x_label = "step"
        self.messages: deque[str] = deque(maxlen=5)  # the latest warnings and errors, newest last
        self._listeners = []

    def observe(self, fn) -> None:
        """Call ``fn(model)`` after every update (the view re-renders)."""
        self._listeners.append(fn)

    def update_rows(self, table: str, step: int, rows: list[dict]) -> None:
        """A logged group of rows (:meth:`rlnb.metrics.MetricLogger.log_rows`): the ``completions`` an LM run
        trained on replace those shown."""
        if table == "completions":
            self.completions = [{"step": step, **r} for r in rows]
            self.updates += 1
            for fn in list(self._listeners):
                fn(self)

    def update(self, record: dict) -> None:
        step = int(record.get("step", self.step))
        for counter, label in X_COUNTERS.items():  # env steps (embodied) or completions (GRPO) so far
            if isinstance(record.get(counter), (int, float)):
                self.x_counts[step], self._x_label = float(record[counter]), label
        self.step = max(self.step, step)
        if isinstance(record.get("eval/video"), str):  # (loop.record_episode, runner.video_interval)
            self.video = (step, record["eval/video"])
        for k, v in record.items():
            if k in ("step", "wall_time") or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            self.latest[k] = float(v)
            if k.startswith("time/") and k.endswith("_s"):
                phase = k[len("time/") : -2]
                if phase == "eval":
                    self.eval_s = float(v)
                elif phase in PHASES:
                    self._recent[phase].append(float(v))
                    self.phase_s[phase] = sum(self._recent[phase]) / len(self._recent[phase])
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
        self.paused_since, self.paused_s = None, 0.0
        self._notify()

    def set_paused(self, paused: bool) -> None:
        """The run holds at its next step (``True``) or goes on: no ETA while it holds, and the time it held
        is not counted in its pace."""
        now = time.perf_counter()
        if paused and self.paused_since is None:
            self.paused_since = now
        elif not paused and self.paused_since is not None:
            self.paused_s += now - self.paused_since
            self.paused_since = None
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
        """Seconds left at the pace so far, paused time left out (``None`` before the first step and while
        paused)."""
        done = self.step - self.start_step
        if not self.total or done <= 0 or self.paused_since is not None:
            return None
        return (time.perf_counter() - self.started - self.paused_s) / done * (self.total - self.step)

    @property
    def x_label(self) -> str:
        """What the curves' x axis counts: ``env steps`` where the loop logs them (SB3's, CleanRL's and
        TensorBoard's x), ``completions`` for GRPO (TRL's samples), else training ``step``s."""
        return self._x_label

    def x(self, step: int) -> float:
        """The x of a metric logged at training ``step``: its env steps where they are known (a step logged
        before any, such as a first evaluation, at the pace so far), else the step itself."""
        if not self.x_counts:
            return float(step)
        if step in self.x_counts:
            return self.x_counts[step]
        last = max(self.x_counts)
        return self.x_counts[last] / last * step if last else float(step)

    def panel(self, title: str) -> Panel:
        """The panel of that title among this model's (:func:`panel_for` for another)."""
        return next((p for p in self.panels if p.title == title), None) or panel_for(title)

    def curves(self) -> list[tuple[str, dict[str, list[tuple[int, float]]]]]:
        """Panels with data: ``[(title, {metric: [(step, value), ...]})]``."""
        out = []
        for panel in self.panels:
            if panel.unless is not None and self.series.get(panel.unless):
                continue
            data = {k: self.series[k] for k in panel.keys if self.series.get(k)}
            if data:
                out.append((panel.title, data))
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
        held = " · paused" if self.paused_since is not None and not self.done else ""
        return f"step {self.step}{total}{eta_txt}{held}{' · done' if self.done else ''}"


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
