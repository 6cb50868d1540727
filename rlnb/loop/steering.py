"""Steering a loop between steps: hyperparameters changed from a cell or the dashboard, pause, stop, save now.
The widget layer imports :data:`STEERABLE` from here (the loop never imports the widget layer)."""

from __future__ import annotations

import logging
import math
import threading

from rlnb.errors import ComponentError, ConfigError, did_you_mean
from rlnb.loop.roles import Steerable, missing

log = logging.getLogger("rlnb")

STEERABLE = {
    "lr": ("actor", "lr"),
    "ent_coef": ("algorithm", "ent_coef"),
    "clip_coef": ("algorithm", "clip_coef"),
}
"""Hyperparameters :meth:`Steering.set_hyperparameters` changes between steps, and their recipe section."""


class Steering:
    """What a run is asked between steps: changes queued for the next step boundary, pause, stop, save now.

    Attributes:
        applied: the changes applied so far: ``{"step": first step using them, name: value}``.
        stop_requested, save_requested: asked for, not yet done.
    """

    def __init__(self, session):
        self.session = session
        self._lock = threading.Lock()
        self._queue: dict[str, float] = {}
        self._running = threading.Event()
        self._running.set()
        self.save_requested = False
        self.stop_requested = False
        # held now at a step boundary (paused, and the steps a worker ran ahead taken): what `paused` alone, a
        # request, does not say
        self.holding = False
        self.applied: list[dict] = []
        self._tasks: list[tuple] = []  # (fn, Future): run in the loop's thread between steps

    def set_hyperparameters(self, **values: float) -> dict:
        """Check ``values`` now; apply them at the next step boundary (see :meth:`rlnb.Loop.set_hyperparameters`).
        Returns the changes still queued."""
        actor = self.session.groups["actor"]
        if missing(actor.cls, Steerable):
            raise ComponentError(
                "lacks method set_hyperparameters, which steering between steps calls; subclass the built-in "
                "actor (rlnb.PPOActor, rlnb.LMActor)",
                actor.name, actor.cls.__name__, "set_hyperparameters",
            )  # fmt: skip
        for key, value in values.items():
            if key not in STEERABLE:
                raise ConfigError(
                    f"set_hyperparameters: {key!r} cannot change between steps; steerable: "
                    f"{', '.join(STEERABLE)}.{did_you_mean(key, STEERABLE)}",
                    key,
                )
            low_ok = key == "ent_coef"
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
                or (value == 0 and not low_ok)
            ):
                raise ConfigError(
                    f"set_hyperparameters: {key} expected a number {'>= 0' if low_ok else '> 0'}, got {value!r}",
                    key,
                )
        with self._lock:
            self._queue.update({k: float(v) for k, v in values.items()})
            return dict(self._queue)

    def between_steps(self, fn, timeout_s: float):
        """``fn()`` run by the loop's own thread at its next step boundary (or while it is paused), when no call of
        the run's is under way, and its result (or its exception) here within ``timeout_s``: what another thread
        (an attached client's request) asks of the components.

        Raises:
            TimeoutError: the run reached no step boundary within ``timeout_s``.
        """
        from concurrent.futures import Future
        from concurrent.futures import TimeoutError as FutureTimeout

        done: Future = Future()
        with self._lock:
            self._tasks.append((fn, done))
        try:
            return done.result(timeout_s)
        except FutureTimeout:
            with self._lock:
                self._tasks = [t for t in self._tasks if t[1] is not done]
            raise TimeoutError(f"the run reached no step boundary within {timeout_s:g} s") from None

    def run_tasks(self) -> None:
        """Run what :meth:`between_steps` queued (the loop's thread, between steps)."""
        with self._lock:
            tasks, self._tasks = self._tasks, []
        for fn, done in tasks:
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn())
                except BaseException as e:  # (the asker's to raise)
                    done.set_exception(e)

    def apply(self) -> None:
        """At a step boundary: the queued changes go to the actor ranks and into the recipe."""
        self.run_tasks()
        with self._lock:
            changes, self._queue = self._queue, {}
        if not changes:
            return
        s = self.session
        s.groups["actor"].set_hyperparameters(**changes).result()
        for key, value in changes.items():
            section, field = STEERABLE[key]
            setattr(getattr(s.recipe, section), field, value)  # the recipe describes the run as it goes on
            s.pending[f"steer/{key}"] = value
        self.applied.append({"step": s.step + 1, **changes})
        s.write_recipe()
        log.info("step %d trains with %s", s.step + 1, changes)

    @property
    def quiet(self) -> bool:
        """Nothing asked for between steps: no stop, save, pause or change waiting."""
        return not (self.stop_requested or self.save_requested or self.paused or self._queue or self._tasks)

    def pause(self) -> None:
        self._running.clear()

    def unpause(self) -> None:
        self._running.set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def wait_while_paused(self) -> None:
        if self._running.is_set():
            return
        self.holding = True
        try:
            while not self._running.wait(0.1):
                self.run_tasks()  # (held between steps: nothing of the run's under way)
                if self.stop_requested:
                    return
        finally:
            self.holding = False
