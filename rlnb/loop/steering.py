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
        self.applied: list[dict] = []

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

    def apply(self) -> None:
        """At a step boundary: the queued changes go to the actor ranks and into the recipe."""
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
        return not (self.stop_requested or self.save_requested or self.paused or self._queue)

    def pause(self) -> None:
        self._running.clear()

    def unpause(self) -> None:
        self._running.set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def wait_while_paused(self) -> None:
        while not self._running.wait(0.1):
            if self.stop_requested:
                return
