"""The embodied loop's chained mode: where all of a step's calls go to one worker (env, rollout and actor
collocated on one slot, synchronous), they go as one chain, one round trip a step, and inside ``run()`` the
worker runs the next steps ahead while the driver logs this one."""

from __future__ import annotations

import math
import time
from collections import deque

from rlnb.loop.base import mean_dicts
from rlnb.runtime.chain import RunAhead, chain, take_run_ahead

EPISODE_WINDOW = 20  # episode statistics over the last 20 finished training episodes, as SB3 reports them
# the steps a worker runs ahead of the driver in one block (see Loop.step_once): about this long in all, and at
# most this many
RUN_AHEAD_S = 0.1
RUN_AHEAD_MAX_STEPS = 16


def _not_solved(values: list, window: deque, stop_return: float | None) -> bool:
    """On the worker, after a step's chain (``values``: its calls' values, the collection's second): whether
    :meth:`Loop._solved` will still be false once the driver adds the step's finished episodes to its
    ``window``, i.e. whether ``run()`` will go on to the next step. ``window`` (the driver's last episodes,
    ``maxlen`` ``EPISODE_WINDOW``) takes them here too: the next chain's call sees them."""
    if stop_return is None:
        return True
    window.extend(values[1]["episodes"])
    return not (
        len(window) >= EPISODE_WINDOW and math.fsum(e[0] for e in window) / len(window) >= stop_return
    )


class RoundTrips:
    """A mixin of :class:`rlnb.loop.embodied.Loop`: its ``_reset_state`` sets ``_taken``, ``_running_ahead``,
    ``_paced`` and ``steps_ahead``."""

    @staticmethod
    def _phases_class() -> type:
        """The loop whose own phases a chain runs: a subclass overriding one of them takes a round trip a call."""
        from rlnb.loop.embodied import Loop

        return Loop

    def step_once(self) -> dict:
        """All phases of one step; returns the step's record.

        Where all of a step's calls go to one worker (env, rollout and actor collocated on one slot,
        synchronous, this class's own phases), they go as one chain (:func:`rlnb.runtime.chain.chain`):
        the same calls, run one after another as separate calls would run them, stopping at the first
        failure, in one round trip instead of four. Each phase is then finished here as its own call would
        finish it; its time is the call's time on the worker, and the sync phase's also carries the round
        trip, so that the phases still add up to the step's wall time.

        Inside :meth:`run`, the worker also starts the next steps as soon as it has answered this one
        (:class:`rlnb.runtime.chain.RunAhead`), where ``run()`` would take them anyway: not past the run's
        last step, a checkpoint or an evaluation, nor once the last 20 episodes reach ``runner.stop_return``
        (the worker checks that on the episodes of each step), nor with a stop, pause, save or steering
        request waiting. It runs them as a block of about ``RUN_AHEAD_S`` (0.1 s) of steps, all taken with
        one request (:func:`rlnb.runtime.chain.take_run_ahead`) as the block after them starts: the driver's
        own work between steps overlaps the worker's next steps, and the worker reads one request and writes
        one reply a block. A step run ahead has for sync phase the time the worker spent between it and the
        step before."""
        if not self._one_round_trip():
            return super().step_once()
        if not self._taken:
            self._take_steps()
        done, outside = self._taken.popleft()
        self._ahead = bool(self._taken) or self._running_ahead is not None
        self.steps_ahead += done.idle_s is not None
        # a chain ends at its first failure, whose result() raises: each call is taken once those before it passed
        sync, *rest = done
        with self.timed("sync", sync.duration_s + outside, version=self.step):
            sync.result()
        collect, *rest = rest
        with self.timed("rollout", collect.duration_s) as phase:
            summary = collect.result()
            self.episodes.extend(summary.pop("episodes"))
            self._rollout_metrics(phase, [summary], {})
        advantages, *rest = rest
        with self.timed("advantages", advantages.duration_s) as phase:
            phase.metrics.update(mean_dicts([advantages.result()]))
        (train,) = rest
        with self.timed("train", train.duration_s) as phase:
            compiled = self._train_summary(lambda: [train.result()], phase)
        self._finish_step(phase.metrics, compiled)
        return self.logger.history[-1]

    def _take_steps(self) -> None:
        """Have the worker run the next step (or take the block of steps it ran ahead), and let it run the
        block after them ahead where :meth:`_may_run_ahead`; queue the steps' replies for :meth:`step_once`,
        each with the time the step spent outside its calls (for a step run ahead, the worker's time before
        it; else the round trip)."""
        env, rollout, actor = self.groups["env"], self.groups["rollout"], self.groups["actor"]

        def calls(version: int) -> list:
            return [
                (rollout, "load_from_local_actor", (actor.name, 0, version)),
                (rollout, "collect", (self.recipe.rollout.steps_per_rollout, env.name, actor.name)),
                (actor, "compute_advantages", ()),
                (actor, "train", ()),
            ]

        running, self._running_ahead = self._running_ahead, None  # (set again once the reply is in)
        self._ahead = False  # (likewise: a request that fails leaves nothing to take)
        taking = len(running.chains) if running is not None else 1
        now, paced = time.perf_counter(), self._paced
        self._paced = (now, self.step)
        pace_s = (now - paced[0]) / (self.step - paced[1]) if paced and self.step > paced[1] else None
        then = None
        if self._may_run_ahead(taking):
            first = self.step + taking  # the block's first version, after the steps taken now
            more = range(first + 1, first + self._run_ahead_steps(first + 1, pace_s))
            window = deque(self.episodes, maxlen=EPISODE_WINDOW)
            then = RunAhead(
                calls(first), _not_solved, (window, self.recipe.runner.stop_return), [calls(v) for v in more]
            )
        t0 = time.perf_counter()
        if running is not None:  # these steps already ran on the worker, ahead of this call
            block = take_run_ahead(running, then=then)
        else:
            self._apply_steering()
            block = [chain(calls(self.step), then=then)]
        wall = time.perf_counter() - t0
        self._running_ahead = then if block[-1].ahead else None
        for done in block:
            inside = sum(c.duration_s for c in done)
            self._taken.append(
                (done, wall - inside if done.idle_s is None else done.idle_s + done.duration_s - inside)
            )

    def _run_ahead_steps(self, first: int, pace_s: float | None) -> int:
        """How many steps the worker runs ahead in one block from step ``first`` (a step number): about
        ``RUN_AHEAD_S`` of them at the last step's time, or at the driver's pace since its last request
        (``pace_s`` a step: a driver slower than the worker, e.g. a heavy listener), whichever is slower; none
        past a checkpoint, an evaluation or the run's end (the block ends there)."""
        last_s = self.logger.history[-1].get("time/step_s") if self.logger.history else None
        last_s = max(last_s, pace_s or 0.0) if last_s else None
        steps = max(1, min(RUN_AHEAD_MAX_STEPS, int(RUN_AHEAD_S / last_s))) if last_s else 1
        return next((i + 1 for i in range(steps) if self._drains_at(first + i)), steps)

    def _may_run_ahead(self, taking: int) -> bool:
        """Whether the worker may start the steps after the ``taking`` it is asked for before the driver asks
        (see :meth:`step_once`): only inside ``run()``, where ``run()`` would go on to them at once."""
        return bool(
            self._run_target is not None
            and self.recipe.runner.run_ahead
            and self.step + taking + 1 <= self._run_target
            and not self._drains_at(self.step + taking)
            and not (self._stop or self._save_requested or self.paused or self._steer_queue)
            and type(self)._solved is self._phases_class()._solved
            and not self._solved()  # (a run() called again once solved takes one step, as it does without)
        )

    def _one_round_trip(self) -> bool:
        """Whether :meth:`step_once` can send the step as one chain (see there)."""
        if self.max_staleness or not (self.env_local and self.batch_local):
            return False
        if any(g.world_size != 1 or g.transport != "direct" for g in self.groups.values()):
            return False
        if len({g.infos[0].address for g in self.groups.values()}) != 1:
            return False
        cls = type(self)
        return all(
            getattr(cls, name) is getattr(self._phases_class(), name)
            for name in ("sync_weights", "rollout", "advantages", "train")
        )
