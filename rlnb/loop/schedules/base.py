"""The base every schedule refines: a family's phases one after another, weights to the rollout ranks at the start
of every step (the synchronous schedule, :class:`~rlnb.loop.schedules.sync.Sync`, is this as it is)."""

from __future__ import annotations

from rlnb.errors import ConfigError


class Schedule:
    """Phases one after another: the base every schedule refines.

    Args:
        session, paths, family: the run's (:mod:`rlnb.loop.session`, :mod:`rlnb.loop.paths`, :mod:`rlnb.loop.families`).
        steer: the loop's :class:`~rlnb.loop.steering.Steering`: its ``apply()`` at each step boundary, and whether it
            is ``quiet`` (no stop, pause, save or change waiting).
    """

    SEQUENTIAL = (
        True  # phases one after another: the loop's own share of a step is measured (time/overhead_frac)
    )
    STATE: dict = {}  # the keys of state() in loop.json

    def __init__(self, session, paths, family, steer):
        self.session, self.paths, self.family, self.steer = session, paths, family, steer

    @classmethod
    def check(cls, recipe, placement) -> None:
        """Refuse, before anything launches, a placement this schedule cannot run."""

    @property
    def max_staleness(self) -> int:
        """``algorithm.max_staleness``: policy versions rollout may run ahead (0 here)."""
        return self.session.recipe.algorithm.max_staleness

    @property
    def ahead(self) -> bool:
        """Whether steps run (or ran) ahead on a worker that ``step_once`` has not taken yet."""
        return False

    # ------------------------------------------------------------------ phases
    def sync_weights(self) -> dict:
        """Actor -> rollout weights, stamped with the policy version (= training steps done)."""
        self.steer.apply()
        s = self.session
        with s.timed("sync", version=s.step) as phase:
            self.paths.sync(s.step)
            phase.metrics.update(self.paths.take_sync_stats())
        return phase.metrics

    def rollout(self) -> dict:
        with self.session.timed("rollout") as phase:
            self.family.collect(phase)
        return phase.metrics

    def step_once(self, loop) -> dict:
        """All phases of one step through ``loop``'s own (a subclass of the loop may override any); the record."""
        self.steer.apply()
        loop.sync_weights()
        loop.rollout()
        loop.advantages()
        loop.train()
        return self.session.logger.history[-1]

    def before_evaluate(self) -> None:
        """Before an evaluation: the rollout ranks take the current weights (work in flight finishes first)."""
        self.sync_rollout()

    def sync_rollout(self) -> None:
        """Actor -> rollout weights now, waiting for them to load."""
        self.paths.sync(self.session.step)

    # ------------------------------------------------------------------ what runs ahead
    def settle(self) -> None:
        """Let work in flight finish (its batch still goes to the next ``rollout()``)."""

    def in_flight_state(self) -> dict | None:
        """The work in flight, as plain data for a checkpoint (``None``: nothing is in flight)."""
        return None

    def restore_in_flight(self, saved: dict) -> None:
        raise ConfigError("this checkpoint holds work in flight, which a synchronous run cannot take up; resume "
                          "it with its algorithm.max_staleness", "algorithm.max_staleness")  # fmt: skip

    def reset_state(self) -> None:
        """The schedule's own state for a fresh run (or after a resume, before its state is loaded)."""

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass

    def status(self) -> dict:
        """What is in flight and how stale (``loop.rollout_status()``)."""
        return {"max_staleness": self.max_staleness, "actor_version": self.session.step, "rollout_version": None,
                "in_flight": False}  # fmt: skip

    def drains_at(self, step: int) -> bool:
        """Whether step ``step`` (the steps done once it is) ends where nothing may be in flight: a checkpoint, an
        evaluation or a recorded episode of ``run()``, or its last step (so checkpoints resume exactly and nothing runs on unused)."""
        s = self.session
        r = s.recipe.runner
        return bool(
            (r.save_interval and step % r.save_interval == 0)
            or (r.eval_interval and step % r.eval_interval == 0)
            or (r.video_interval and step % r.video_interval == 0)
            or (s.run_target is not None and step >= s.run_target)
        )

    def take_after_error(self, loop) -> None:
        """``run()`` is ending on an error or an interrupt: what ran ahead is taken (see :class:`Chained`)."""
