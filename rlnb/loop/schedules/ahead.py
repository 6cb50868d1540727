"""Whole batches ahead (AReaL-style asynchronous RL, ``algorithm.max_staleness`` N >= 1): the next batch is
collected, with the policy version it had, while the actor trains on this one. A batch made with version ``v`` is
trained at ``t <= v + N``: weights go to the rollout ranks only when the pipeline is empty or admission needs them.
What is in flight is drained where nothing may be (a checkpoint or an evaluation of ``run()``, its last step), and
a checkpoint written with work in flight keeps it (``in_flight.pt``), so the resumed run trains on it next."""

from __future__ import annotations

import time

from rlnb.errors import ConfigError
from rlnb.loop.checkpoint import MAX_STEP, Num
from rlnb.loop.schedules.base import Schedule


class Settled:
    """Rollout work that was in flight when a checkpoint was written, restored from it: finished, its values (one per
    rank, as its call returned them) and, for the first of a step's calls, the batches it made (one per rollout
    rank), which the loop hands to the actor ranks itself. It stands where the pending call stood (``result``,
    ``wait``, ``durations_s``), so the resumed step takes it as the uninterrupted run took the call."""

    def __init__(self, values: list, batches: list | None = None):
        self.values, self.batches = values, batches
        self.durations_s = [0.0] * len(values)

    def result(self, timeout: float | None = None) -> list:
        return self.values

    def wait(self, timeout: float | None = None) -> Settled:
        return self

    def done(self) -> bool:
        return True


class Ahead(Schedule):
    """Whole batches ahead (see the module's docstring)."""

    SEQUENTIAL = False
    STATE = {"rollout_version?": Num(0, MAX_STEP, optional=True)}

    @classmethod
    def check(cls, recipe, placement) -> None:
        check_apart(recipe, placement, "{'env,rollout': 0, actor: 1}" if "env" in placement.slots else
                    "{'rollout,reward': 0, actor: 1}")  # fmt: skip

    def reset_state(self) -> None:
        self.in_flight: list | None = None  # the collection running ahead
        self.rollout_version: int | None = None  # the newest policy version sent to the rollout ranks

    def sync_rollout(self) -> None:
        super().sync_rollout()
        self.rollout_version = self.session.step

    def sync_weights(self) -> dict:
        """Actor -> rollout weights. The schedule sends them itself when admission needs them; calling this waits
        for the batch in flight (kept for the next ``rollout()``) first."""
        self.steer.apply()
        with self.session.timed("sync") as phase:
            self.settle()
            if self.in_flight is None:
                self.sync_rollout()
            phase.metrics.update(self.paths.take_sync_stats())
            phase.metrics["version"] = self.rollout_version
        return phase.metrics

    def rollout(self) -> dict:
        """Hand over the batch collected (or in flight) and start collecting the next one at once, so that
        collection overlaps ``train()``."""
        with self.session.timed("rollout") as phase:
            if self.in_flight is None:  # an empty pipeline (first step, after a checkpoint or evaluation)
                if self.rollout_version != self.session.step:
                    self.sync_rollout()
                self.in_flight = self.family.start_collection()
            summaries, extra = self.take_ahead()
            self.family.rollout_metrics(phase, summaries, extra)
            # (the admission's weight sync ran in this phase: its bytes logged with it, under sync/)
            phase.metrics.update(self.paths.take_sync_stats("sync/"))
        return phase.metrics

    def take_ahead(self) -> tuple[list[dict], dict]:
        """Wait for the batch in flight and hand it over (its summaries, each with the ``version`` it was made with),
        then start the next at once. Returns the summaries and the mode's metrics."""
        s, pending = self.session, self.in_flight
        t_wait = time.perf_counter()
        pending[0].wait()
        wait_s = time.perf_counter() - t_wait
        busy_s = max(d or 0.0 for d in pending[0].durations_s)  # the ranks' own time for the batch
        summaries = self.family.finish_collection(
            pending, pending[0].batches if isinstance(pending[0], Settled) else None
        )
        self.in_flight = None
        # versions behind when trained (at step), from the batch's own version: an evaluation may have sent the
        # rollout ranks newer weights since it was made
        staleness = s.step - min(x["version"] for x in summaries)
        if not self.drains_at(s.step + 1):
            if (s.step + 1) - self.rollout_version > self.max_staleness:  # admission for the next batch
                self.sync_rollout()
            self.in_flight = self.family.start_collection()
        return summaries, {
            "staleness_mean": float(staleness),
            "staleness_max": staleness,
            "wait_s": wait_s,
            "overlap_frac": max(0.0, 1.0 - wait_s / busy_s) if busy_s > 0 else 0.0,  # hidden behind training
            "in_flight": int(self.in_flight is not None),
        }

    def before_evaluate(self) -> None:
        """The collection running ahead finishes first; its batch (with the policy version it was made with) is
        kept for the next ``rollout()``, and the rollout ranks then take the current weights."""
        self.settle()
        self.sync_rollout()

    # ------------------------------------------------------------------ in flight, and checkpoints
    def settle(self) -> None:
        for pending in self.in_flight or ():
            pending.wait()

    def in_flight_state(self) -> dict | None:
        """The work in flight, finished first: each call's values and the batches the rollout ranks hold."""
        if self.in_flight is None:
            return None
        self.settle()
        return {"values": [p.result() for p in self.in_flight], "batches": self.held_batches()}

    def held_batches(self) -> list[dict]:
        """The batches of a settled collection, not yet handed over (the family's :meth:`held_batches`)."""
        return self.family.held_batches()

    def restore_in_flight(self, saved: dict) -> None:
        values = saved["values"]
        self.in_flight = [Settled(v, saved["batches"] if i == 0 else None) for i, v in enumerate(values)]

    def state(self) -> dict:
        return {"rollout_version": self.rollout_version}

    def load_state(self, state: dict) -> None:
        self.settle()
        self.in_flight = None  # (a checkpoint's work in flight is restored after this: restore_in_flight)
        # the rollout ranks' weights are in their own checkpoints, or not (an LM engine's): then the next rollout()
        # sends them
        saved = self.family.ROLLOUT_WEIGHTS_IN_CHECKPOINT
        self.rollout_version = state.get("rollout_version") if saved else None

    def status(self) -> dict:
        """What is in flight and how stale: the newest policy version sent to the rollout ranks, the actor's,
        whether rollout work runs ahead now, and how many versions behind the next batch will be."""
        version = self.rollout_version
        return {
            "max_staleness": self.max_staleness,
            "actor_version": self.session.step,
            "rollout_version": version,
            "in_flight": self.in_flight is not None,
            "next_batch_staleness": None if version is None else self.session.step - version,
        }


def check_apart(recipe, placement, example: str) -> None:
    """Asynchronous mode needs rollout and actor on different slots; ``example`` is a placement that works."""
    n = recipe.algorithm.max_staleness
    shared = sorted(set(placement["rollout"]) & set(placement["actor"]))
    if shared:
        raise ConfigError(
            f"algorithm.max_staleness={n} needs rollout and actor on different slots: a worker runs one call at a "
            f"time, so rollout cannot run ahead of training on shared slot(s) {shared}. Place them apart "
            f"(component_placement={example}) or use 0",
            "algorithm.max_staleness",
        )
