"""The chained schedule: synchronous, where all of a step's calls go to one worker (env, rollout and actor
collocated on one slot): they go as one chain, one round trip a step, and inside ``run()`` the worker runs the next
steps ahead while the driver logs this one."""

from __future__ import annotations

import math
import time
from collections import deque

from rlnb.loop.families.env import EPISODE_WINDOW
from rlnb.loop.families.ppo import PPO
from rlnb.loop.phase import mean_dicts
from rlnb.loop.schedules.sync import Sync
from rlnb.runtime.chain import RunAhead, chain, take_run_ahead

# the steps a worker runs ahead of the driver in one block (see Chained.step_once): about this long in all, and at
# most this many
RUN_AHEAD_S = 0.1
RUN_AHEAD_MAX_STEPS = 16
CHAINED_PHASES = (
    "start_collection",
    "finish_collection",
    "collect",
    "rollout_metrics",
    "advantages",
    "train",
)


def _not_solved(values: list, window: deque, stop_return: float | None) -> bool:
    """On the worker, after a step's chain (``values``: its calls' values, the collection's second): whether the
    family's ``solved()`` will still be false once the driver adds the step's finished episodes to its ``window``,
    i.e. whether ``run()`` will go on to the next step. ``window`` (the driver's last episodes, ``maxlen``
    ``EPISODE_WINDOW``) takes them here too: the next chain's call sees them."""
    if stop_return is None:
        return True
    window.extend(values[1]["episodes"])
    return not (
        len(window) >= EPISODE_WINDOW and math.fsum(e[0] for e in window) / len(window) >= stop_return
    )


class Chained(Sync):
    """One round trip a step, and steps run ahead inside ``run()`` (see :meth:`step_once`)."""

    def reset_state(self) -> None:
        self._ahead = False  # whether steps ran or run ahead that step_once has not taken yet
        self.running_ahead: RunAhead | None = None  # the block of steps the worker runs ahead now
        self.taken: deque = deque()  # steps answered by the worker, not yet finished here: (ChainResult, s)
        self.paced: tuple | None = None  # (when, step) at the last request for steps (take_steps)
        self.steps_ahead = 0  # steps the worker ran ahead of the driver

    @property
    def ahead(self) -> bool:
        return self._ahead

    def step_once(self, loop) -> dict:
        """All phases of one step; returns the step's record.

        Where all of a step's calls go to one worker (env, rollout and actor collocated on one slot, this loop's
        and family's own phases), they go as one chain (:func:`rlnb.runtime.chain.chain`): the same calls, run one
        after another as separate calls would run them, stopping at the first failure, in one round trip instead
        of four. Each phase is then finished here as its own call would finish it; its time is the call's time on
        the worker, and the sync phase's also carries the round trip, so that the phases still add up to the
        step's wall time.

        Inside ``run()``, the worker also starts the next steps as soon as it has answered this one
        (:class:`rlnb.runtime.chain.RunAhead`), where ``run()`` would take them anyway: not past the run's last
        step, a checkpoint or an evaluation, nor once the last 20 episodes reach ``runner.stop_return`` (the worker
        checks that on the episodes of each step), nor with a stop, pause, save or steering request waiting. It runs
        them as a block of about ``RUN_AHEAD_S`` (0.1 s) of steps, all taken with one request
        (:func:`rlnb.runtime.chain.take_run_ahead`) as the block after them starts. A step run ahead has for sync
        phase the time the worker spent between it and the step before."""
        if not self.one_round_trip(loop):
            return super().step_once(loop)
        s, family = self.session, self.family
        if not self.taken:
            self.take_steps()
        done, outside = self.taken.popleft()
        self._ahead = bool(self.taken) or self.running_ahead is not None
        self.steps_ahead += done.idle_s is not None
        # a chain ends at its first failure, whose result() raises: each call is taken once those before it passed
        sync, *rest = done
        with s.timed("sync", sync.duration_s + outside, version=s.step):
            sync.result()
        collect, *rest = rest
        with s.timed("rollout", collect.duration_s) as phase:
            summary = collect.result()
            family.episodes.extend(summary.pop("episodes"))
            family.rollout_metrics(phase, [summary], {})
        advantages, *rest = rest
        with s.timed("advantages", advantages.duration_s) as phase:
            phase.metrics.update(mean_dicts([advantages.result()]))
        (train,) = rest
        with s.timed("train", train.duration_s) as phase:
            compiled = family.train_summary(lambda: [train.result()], phase)
        family.finish_step(phase.metrics, compiled, self.SEQUENTIAL)
        return s.logger.history[-1]

    def take_steps(self) -> None:
        """Have the worker run the next step (or take the block of steps it ran ahead), and let it run the block
        after them ahead where :meth:`may_run_ahead`; queue the steps' replies for :meth:`step_once`, each with the
        time the step spent outside its calls (for a step run ahead, the worker's time before it; else the round
        trip)."""
        s, family = self.session, self.family
        running, self.running_ahead = self.running_ahead, None  # (set again once the reply is in)
        self._ahead = False  # (likewise: a request that fails leaves nothing to take)
        taking = len(running.chains) if running is not None else 1
        now, paced = time.perf_counter(), self.paced
        self.paced = (now, s.step)
        pace_s = (now - paced[0]) / (s.step - paced[1]) if paced and s.step > paced[1] else None
        then = None
        if self.may_run_ahead(taking):
            first = s.step + taking  # the block's first version, after the steps taken now
            more = range(first + 1, first + self.run_ahead_steps(first + 1, pace_s))
            window = deque(family.episodes, maxlen=EPISODE_WINDOW)
            then = RunAhead(
                family.chain_calls(first), _not_solved, (window, s.recipe.runner.stop_return),
                [family.chain_calls(v) for v in more],
            )  # fmt: skip
        t0 = time.perf_counter()
        if running is not None:  # these steps already ran on the worker, ahead of this call
            block = take_run_ahead(running, then=then)
        else:
            self.steer.apply()
            block = [chain(family.chain_calls(s.step), then=then)]
        wall = time.perf_counter() - t0
        self.running_ahead = then if block[-1].ahead else None
        for done in block:
            inside = sum(c.duration_s for c in done)
            self.taken.append(
                (done, wall - inside if done.idle_s is None else done.idle_s + done.duration_s - inside)
            )

    def run_ahead_steps(self, first: int, pace_s: float | None) -> int:
        """How many steps the worker runs ahead in one block from step ``first`` (a step number): about
        ``RUN_AHEAD_S`` of them at the last step's time, or at the driver's pace since its last request (``pace_s``
        a step: a driver slower than the worker, e.g. a heavy listener), whichever is slower; none past a
        checkpoint, an evaluation or the run's end (the block ends there)."""
        history = self.session.logger.history
        last_s = history[-1].get("time/step_s") if history else None
        last_s = max(last_s, pace_s or 0.0) if last_s else None
        steps = max(1, min(RUN_AHEAD_MAX_STEPS, int(RUN_AHEAD_S / last_s))) if last_s else 1
        return next((i + 1 for i in range(steps) if self.drains_at(first + i)), steps)

    def may_run_ahead(self, taking: int) -> bool:
        """Whether the worker may start the steps after the ``taking`` it is asked for before the driver asks (see
        :meth:`step_once`): only inside ``run()``, where ``run()`` would go on to them at once."""
        s = self.session
        return bool(
            s.run_target is not None
            and s.recipe.runner.run_ahead
            and s.step + taking + 1 <= s.run_target
            and not self.drains_at(s.step + taking)
            and self.steer.quiet
            and type(self.family).solved is PPO.solved
            and not self.family.solved()  # (a run() called again once solved takes one step, as it does without)
        )

    def one_round_trip(self, loop) -> bool:
        """Whether :meth:`step_once` can send the step as one chain (see there): every group one rank on one worker,
        over direct calls, and neither the loop's phases nor the family's replaced by a subclass."""
        groups = self.session.groups
        if any(g.world_size != 1 or g.transport != "direct" for g in groups.values()):
            return False
        if len({g.infos[0].address for g in groups.values()}) != 1:
            return False
        family_own = all(getattr(type(self.family), name) is getattr(PPO, name) for name in CHAINED_PHASES)
        return loop.own_phases() and family_own and isinstance(self.family, PPO)

    def take_after_error(self, loop) -> None:
        """``run()`` is ending on an error or an interrupt while steps run ahead on the worker: take and log them,
        so that the loop's step count and the workers' agree (a failure here is logged, not raised: the first error
        is the one to see)."""
        import logging

        self.session.run_target = None  # (nothing further runs ahead)
        while self._ahead:
            try:
                self.step_once(loop)
            except Exception as e:
                logging.getLogger("rlnb").warning(
                    "a step run ahead on the worker could not be taken: %s: %s", type(e).__name__, e
                )
