"""Steering a loop between steps: hyperparameters changed from a cell or the dashboard, pause, stop, save now.
The widget layer imports :data:`STEERABLE` from here (the loop never imports the widget layer)."""

from __future__ import annotations

import logging
import math

from rlnb.errors import ComponentError, ConfigError, did_you_mean

log = logging.getLogger("rlnb")

STEERABLE = {
    "lr": ("actor", "lr"),
    "ent_coef": ("algorithm", "ent_coef"),
    "clip_coef": ("algorithm", "clip_coef"),
}
"""Hyperparameters :meth:`LoopBase.set_hyperparameters` changes between steps, and their recipe section."""


class Steering:
    """A mixin of :class:`rlnb.loop.base.LoopBase`: its ``__init__`` sets the queue, lock and events."""

    def set_hyperparameters(self, **values: float) -> dict:
        """Change ``lr``, ``ent_coef`` or ``clip_coef`` between steps, e.g. from a cell while ``run()`` goes on
        in the background, or from the dashboard: checked now, applied at the next step boundary (the start
        of the next :meth:`step_once` or :meth:`sync_weights`), logged as ``steer/<name>`` on the first step
        that uses it, and written to the run's ``recipe.yaml``. Returns the changes still queued.

        Example:
            >>> loop.set_hyperparameters(lr=1e-4, ent_coef=0.01)   # doctest: +SKIP
        """
        actor = self.groups["actor"]
        if not callable(getattr(actor.cls, "set_hyperparameters", None)):
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
        with self._steer_lock:
            self._steer_queue.update({k: float(v) for k, v in values.items()})
            return dict(self._steer_queue)

    def _apply_steering(self) -> None:
        with self._steer_lock:
            changes, self._steer_queue = self._steer_queue, {}
        if not changes:
            return
        self.groups["actor"].set_hyperparameters(**changes).result()
        for key, value in changes.items():
            section, field = STEERABLE[key]
            setattr(getattr(self.recipe, section), field, value)  # the recipe describes the run as it goes on
            self._pending[f"steer/{key}"] = value
        self.steering.append({"step": self.step + 1, **changes})
        self._write_recipe()
        log.info("step %d trains with %s", self.step + 1, changes)

    def pause(self) -> None:
        """Hold a running ``run()`` at the next step boundary until :meth:`unpause` (or :meth:`stop`); the
        steps the worker already runs ahead (``runner.run_ahead``, about 0.1 s of them) are finished first."""
        self._running.clear()

    def unpause(self) -> None:
        """Let a paused ``run()`` go on."""
        self._running.set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def request_save(self) -> None:
        """Have ``run()`` write a checkpoint at the end of the step in progress (the dashboard's "save now"), or
        of the last step the worker already runs ahead (``runner.run_ahead``, about 0.1 s of them)."""
        self._save_requested = True

    def _wait_while_paused(self) -> None:
        while not self._running.wait(0.1):
            if self._stop:
                return

    def stop(self) -> None:
        """Ask a running ``run()`` to stop at the next step boundary (after the steps the worker already runs
        ahead, if any: ``runner.run_ahead``, about 0.1 s of them)."""
        self._stop = True

    @property
    def stopped(self) -> bool:
        """Whether the last ``run()`` ended because :meth:`stop` was called."""
        return self._stop
