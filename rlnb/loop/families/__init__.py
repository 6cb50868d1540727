"""Families: what an algorithm's phases do. A family is the unit of extension: one module (this package's
:mod:`.ppo` and :mod:`.grpo`, or a class defined in a notebook cell) plus its components and its config section.

A family is bound to a run's :class:`~rlnb.loop.session.Session` (the cluster, the groups, the step, the metrics
of the step under way) and :class:`~rlnb.loop.paths.DataPaths` (weights and batches between actor and rollout).
It never decides *when* things run: a :mod:`schedule <rlnb.loop.schedules>` calls its phases (synchronously, with
whole batches ahead, streaming, chained on one worker), and the loop's facade (:class:`rlnb.loop.Loop`) exposes
them one per notebook cell.

What a family implements (everything has a default but the collection):

- ``ROLES``: role -> ``(protocol, built-in to subclass)`` (:mod:`rlnb.loop.roles`), checked when components are
  adopted; ``STATE``: the keys of :meth:`Family.state` in ``loop.json`` (checked on resume).
- set-up: :meth:`Family.check_placement`, :meth:`Family.launch` (the recipe path), :meth:`Family.compose`.
- phases: :meth:`Family.start_collection` and :meth:`Family.finish_collection` (a batch collected and handed to the
  actor ranks), :meth:`Family.rollout_metrics`, :meth:`Family.advantages`, :meth:`Family.train`,
  :meth:`Family.evaluate`, :meth:`Family.log_step`.

Example (a family of one's own: REINFORCE, see ``tests/test_families.py``)::

    class Reinforce(rlnb.loop.families.ppo.PPO):
        def advantages(self, phase):
            phase.metrics.update(mean_dicts(self.session.groups["actor"].returns_to_go().result()))

    loop = rlnb.Loop(env=env, rollout=rollout, actor=actor, family=Reinforce)
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import ClassVar

from rlnb.errors import ConfigError, PlacementError, RemoteError
from rlnb.loop.phase import Phase, mean_dicts

log = logging.getLogger("rlnb")


class Family:
    """What an algorithm's phases do (see the module's docstring). ``session`` and ``paths`` are the run's."""

    name: ClassVar[str] = "family"
    ROLES: ClassVar[dict[str, tuple[type, str]]] = {}
    STATE: ClassVar[dict | None] = None
    SUMMARY_KEYS: ClassVar[tuple[str, ...]] = ()
    ROLLOUT_WEIGHTS_IN_CHECKPOINT: ClassVar[bool] = (
        True  # its rollout ranks' state_dict() holds their weights
    )

    def __init__(self, session, paths):
        self.session, self.paths = session, paths
        self.capabilities = None  # (rlnb.loop.roles.Capabilities, once composed)
        self._said_lr_is_zero = False

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self.ROLES)

    # ------------------------------------------------------------------ set-up
    @classmethod
    def check_layout(cls, slots) -> None:
        """Refuse, before anything starts, a placement (component -> slots) this family cannot run."""

    def check_here(self) -> None:
        """Recipe path: refuse, before the cluster starts, what the recipe's own objects built here show."""

    def check_placement(self) -> None:
        """Refuse rank counts this family cannot split its work over (both paths, before any step)."""
        p = self.session.placement
        n_roll, n_act = len(p["rollout"]), len(p["actor"])
        if n_roll % n_act and n_act % n_roll:
            raise PlacementError(
                f"component_placement: {n_roll} rollout rank(s) cannot feed {n_act} actor rank(s) evenly; place "
                "one on a multiple of the other's slots",
                "component_placement",
            )

    def check_cluster(self) -> None:
        """Refuse settings this cluster cannot serve (child processes on daemonic workers...), before launch."""

    def prepare(self) -> None:
        """Driver-side set-up before the components start (data, model files...)."""

    def launch(self) -> None:
        """The recipe path: launch each role's component into ``session.groups``."""
        raise ConfigError(
            f"family {self.name!r} runs from launched components only (no recipe path)", "family"
        )

    def bind(self) -> None:
        """Both paths, before the objects path records its recipe: what the components learn of each other first
        (an env's spaces)."""

    def compose(self, asynchronous: bool) -> None:
        """Wire the launched components together (spaces, process groups, :meth:`DataPaths.open`)."""
        self.paths.open(asynchronous)

    def record_components(self) -> None:
        """Objects path: the recipe records what the components were built with (see
        :meth:`Session.record_components`)."""
        self.session.record_components()

    def reset_state(self) -> None:
        """The family's own state for a fresh run."""

    def state(self) -> dict:
        """The family's state for ``loop.json`` (plain data; its keys in ``STATE``)."""
        return {}

    def load_state(self, state: dict) -> None:
        """Restore :meth:`state`."""

    def save_extra(self, directory: Path) -> None:
        """Extra files in a checkpoint being written (e.g. a Hugging Face export)."""

    # ------------------------------------------------------------------ phases
    def start_collection(self) -> list:
        """Start collecting the next batch (the pending calls); it stays on the rollout ranks."""
        raise NotImplementedError

    def finish_collection(self, pending: list, batches: list | None = None) -> list[dict]:
        """Wait for a started collection and hand its batches to the actor ranks (``batches``: restored from a
        checkpoint, handed instead); its summaries, one per rollout rank, each with the ``version`` it was made
        with."""
        summaries = pending[0].result()
        for other in pending[1:]:
            other.result()
        self.paths.hand_batches(batches)
        return summaries

    def held_batches(self) -> list[dict]:
        """The batches of a settled collection, not yet handed over (for a checkpoint): on the rollout ranks, or
        where an elastic run's ranks put them (the channel)."""
        return self.paths.ranks.held_batches()

    def collect(self, phase: Phase) -> None:
        """A synchronous collection, its metrics into ``phase``."""
        self.rollout_metrics(phase, self.finish_collection(self.start_collection()), {})

    def rollout_metrics(self, phase: Phase, summaries: list[dict], extra: dict) -> None:
        """The rollout phase's metrics into ``phase``, from the ranks' summaries (``extra``: the schedule's own)."""
        phase.metrics.update(extra)

    def advantages(self, phase: Phase) -> None:
        """Advantage estimation on each actor rank's batch (``algorithm.advantage``)."""
        phase.metrics.update(mean_dicts(self.session.groups["actor"].compute_advantages().result()))

    def train(self, phase: Phase) -> tuple:
        """The update, data-parallel over the actor ranks; its metrics into ``phase``. Returns the first step's
        compile time and whether compiling failed (both ``None`` if it did not compile)."""
        return self.train_summary(self.session.groups["actor"].train().result, phase)

    def train_summary(self, per_rank_result, phase: Phase) -> tuple:
        """The train phase's metrics into ``phase``, from its call's ``result`` (one value per actor rank), averaged
        over ranks; a diverged update becomes a :class:`TrainingDivergedError`. Returns what :meth:`train` does."""
        from rlnb.loop.checkpoint import TrainingDivergedError, complete_checkpoints

        s = self.session
        try:
            per_rank = per_rank_result()
        except RemoteError as e:
            if e.cause_type != "FloatingPointError":
                raise
            found = complete_checkpoints(s.run_dir)
            last = str(found[-1]) if found else None
            raise TrainingDivergedError(
                f"training diverged at step {s.step + 1}: {e.args[0]}. Nothing was saved after it; last good "
                f"checkpoint: {last or 'none'} (lower actor.lr or check the rewards)",
                s.step + 1,
                last,
            ) from e
        summary = mean_dicts(per_rank)
        if summary.get("lr") == 0.0 and s.step >= s.recipe.runner.steps and not self._said_lr_is_zero:
            self._said_lr_is_zero = True
            log.warning(
                "step %d trained with learning rate 0: actor.anneal_lr decays it to 0 at runner.steps=%d, and this "
                "step is past it; loop.run(n) extends runner.steps (and the decay) to the steps it runs, or set "
                "actor.anneal_lr: false", s.step + 1, s.recipe.runner.steps
            )  # fmt: skip
        compiled = summary.pop("compile_s", None), summary.pop("compile_failed", None)
        phase.metrics.update(summary)
        return compiled

    def finish_step(self, out: dict, compiled: tuple, sequential: bool) -> dict:
        """After the train phase: the first step's compile time apart from training's, the step counted and
        logged (``sequential``: the schedule ran the phases one after another)."""
        s = self.session
        compile_s, compile_failed = compiled
        if compile_s is not None:  # the first step compiled the train step: its own time, not training's
            s.pending["time/compile_s"] = compile_s
            s.pending["time/train_s"] = max(0.0, s.pending["time/train_s"] - compile_s)
            if compile_failed:
                reason = s.groups["actor"].on(0).compile_stats().result()[0]["fallback"]
                log.warning(
                    "actor.compile: torch.compile failed on the actor's workers (%s); training eager", reason
                )
        s.step += 1
        self.log_step(sequential)
        return out

    def log_step(self, sequential: bool) -> None:
        """Log the step's record (the pending phase metrics, and the family's own)."""
        self.session.log_record({})

    def evaluate(self, n: int | None = None) -> dict:
        raise NotImplementedError

    def solved(self) -> bool:
        return False

    def summary(self) -> str:
        """One line for the CLI at the end of a run."""
        return f"step {self.session.step}"

    def default_callbacks(self) -> list:
        """What this family's ``run()`` does before evaluation and checkpoints (e.g. a warm start first)."""
        return []
