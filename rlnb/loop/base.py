"""The loop's facade: the public phases (one per notebook cell), ``run()`` with its callbacks, steering, checkpoints
and views, over four objects, each with one job:

- a :class:`~rlnb.loop.session.Session`: the cluster, the groups and channels, the placement, the run directory and
  its lock, the logger, the step;
- the :class:`~rlnb.loop.paths.DataPaths`: how weights and batches move between actor and rollout, chosen once from
  the placement;
- a :mod:`family <rlnb.loop.families>`: what the algorithm's phases do (embodied PPO, LM GRPO, one of your own);
- a :mod:`schedule <rlnb.loop.schedules>`: when they run (synchronous, chained, whole batches ahead, streaming),
  chosen once from the recipe by :func:`~rlnb.loop.schedules.choose_schedule`.

:class:`rlnb.Loop` and :class:`rlnb.GRPOLoop` are this facade with their family and their constructors.
"""

from __future__ import annotations

import html
import logging
import time
from pathlib import Path

from rlnb.cluster.cluster import Cluster
from rlnb.config.loader import load_recipe
from rlnb.config.schema import Recipe
from rlnb.errors import ConfigError
from rlnb.loop.checkpoint import CheckpointError, Checkpoints, complete_checkpoints
from rlnb.loop.families import Family
from rlnb.loop.paths import DataPaths, weight_sync_route
from rlnb.loop.phase import Phase, count_or_default, mean_dicts
from rlnb.loop.roles import Capabilities
from rlnb.loop.runner import Callback, EvaluateEvery, Runner, SaveEvery, view
from rlnb.loop.schedules import choose_schedule
from rlnb.loop.session import Session, objects_recipe
from rlnb.loop.steering import Steering

log = logging.getLogger("rlnb")

__all__ = ["LoopBase", "Phase", "count_or_default", "mean_dicts", "objects_recipe"]


class LoopBase:
    """The steppable facade (see the module's docstring); :class:`rlnb.Loop` and :class:`rlnb.GRPOLoop` give it a family.

    Args:
        recipe: a validated :class:`rlnb.config.Recipe`.
        cluster: a :class:`rlnb.Cluster`; ``None`` starts one from ``recipe.cluster`` (closed on ``close()``).
        run_dir: where metrics and checkpoints go (default ``recipe.runner.run_dir`` or ``runs/<name>-<time>``).
        components: the objects path: role -> launched group (the loop owns them from then on).
        read_only: open ``run_dir`` without writing to it (``rlnb eval``, ``rlnb export``).
        family: the family class (default the loop's ``FAMILY``); ``family_args``: its further arguments.
    """

    FAMILY: type[Family] = Family

    def __init__(self, recipe: Recipe, cluster: Cluster | None = None, run_dir=None, components: dict | None = None,
                 read_only: bool = False, family: type[Family] | None = None, family_args: dict | None = None):  # fmt: skip
        t0 = time.perf_counter()
        self.session = session = Session(recipe, run_dir, read_only)
        self.paths = DataPaths(session)
        self.family = (family or self.FAMILY)(session, self.paths, **(family_args or {}))
        self.steer = Steering(session)
        self.runner = Runner(self)
        self.schedule, self.checkpoints = None, None
        self.built_from_objects = components is not None
        self.resumed_from: Path | None = None  # the checkpoint this loop was restored from, if any
        self.restarts = 0  # lost workers run() recovered from (runner.max_restarts per run)
        if components is None:
            self.family.check_here()
        session.lock_run_dir()
        try:
            if components is not None:
                session.adopt(components, self.family.ROLES)
            else:
                session.start_cluster(cluster, self.family.roles, self.family.check_layout)
                session.place(self.family.roles)
                self._check_placement()
            self.family.prepare()
            if components is None:
                self.family.launch()
            self._compose()
            session.write_recipe()
        except BaseException:
            self.close()
            raise
        session.step = 0
        self.family.reset_state()
        self.schedule.reset_state()
        session.open_logger()
        self.startup_s = time.perf_counter() - t0
        if self.recipe.runner.resume:
            try:
                self.load_checkpoint(self.recipe.runner.resume, fallback=self.recipe.runner.resume_fallback)
            except BaseException:
                self.close()  # a failed resume leaves no components (and no embedded cluster) running
                raise

    def _check_placement(self, capabilities: Capabilities | None = None) -> type:
        """Refuse, before a step, a placement the family or the schedule cannot run; returns the schedule."""
        s = self.session
        schedule = choose_schedule(s.recipe, self.family.name, s.placement, capabilities)
        self.family.check_placement()
        schedule.check(s.recipe, s.placement)
        if s.placement["rollout"] != s.placement["actor"]:  # refuses a rollout.weight_sync this cannot serve
            weight_sync_route(s.recipe, s.placement, s.cluster.slots, s.recipe.algorithm.asynchronous)
        self.family.check_cluster()
        return schedule

    def _compose(self) -> None:
        """Both paths: the family wires its components; the schedule is chosen once, from the recipe."""
        family, s = self.family, self.session
        family.bind()
        family.capabilities = capabilities = Capabilities.of(self.groups)
        if self.built_from_objects:  # (the recipe path checked its placement before launching)
            family.record_components()
            schedule = self._check_placement(capabilities)
        else:
            schedule = choose_schedule(s.recipe, family.name, s.placement, capabilities)
        family.compose(self.recipe.algorithm.asynchronous)
        self.schedule = schedule(self.session, self.paths, family, self.steer)
        self.checkpoints = Checkpoints(self.session, family, self.schedule)

    @classmethod
    def from_recipe(cls, recipe, overrides=None, cluster: Cluster | None = None, run_dir=None):
        """Build from a recipe file or bundled name plus dotted overrides."""
        if not isinstance(recipe, Recipe):
            recipe = load_recipe(recipe, overrides)
        elif overrides:
            raise ConfigError(
                "pass overrides with a recipe path, or edit the Recipe object directly", "overrides"
            )
        return cls(recipe, cluster, run_dir)

    @classmethod
    def resume(
        cls, run_dir: str | Path, cluster: Cluster | None = None, overrides=None, read_only: bool = False
    ):
        """Rebuild a run from its directory and continue from its latest complete checkpoint.

        Args:
            run_dir: the run's directory (it holds ``recipe.yaml``).
            cluster: a cluster to run on (default: one started from the recipe, closed with the loop).
            overrides: dotted overrides of the recorded recipe, e.g. ``["runner.steps=200"]``.
            read_only: only evaluate or export the checkpoint (``rlnb eval``, ``rlnb export``): the run directory
                is left as it is, and a live run may go on writing to it meanwhile.
        """
        run_dir = Path(run_dir)
        if not (run_dir / "recipe.yaml").exists():
            raise CheckpointError(f"{run_dir} is not a run directory (no recipe.yaml)")
        recipe = load_recipe(
            run_dir / "recipe.yaml", [*(overrides or []), "runner.resume=auto", f"runner.run_dir={run_dir}"]
        )
        return cls(recipe, cluster, run_dir, read_only=read_only)

    # ------------------------------------------------------------------ what the loop is made of
    @property
    def recipe(self) -> Recipe:
        return self.session.recipe

    @property
    def step(self) -> int:
        return self.session.step

    @property
    def groups(self) -> dict:
        return self.session.groups

    @property
    def channels(self) -> dict:
        return self.session.channels

    @property
    def cluster(self) -> Cluster | None:
        return self.session.cluster

    @property
    def placement(self):
        return self.session.placement

    @property
    def run_dir(self) -> Path:
        return self.session.run_dir

    @property
    def read_only(self) -> bool:
        return self.session.read_only

    @property
    def logger(self):
        return self.session.logger

    @property
    def history(self) -> list[dict]:
        return self.session.logger.history

    @property
    def mode(self) -> str:
        """``collocated``, ``disaggregated`` or ``hybrid`` (from the placement)."""
        return self.session.placement.mode

    @property
    def weight_sync(self) -> str:
        """How weights reach the rollout ranks: ``local``, ``channel`` or ``broadcast``."""
        return self.paths.weight_sync

    @property
    def SUMMARY_KEYS(self) -> tuple:  # (the progress bar and views read it as the loops used to define it)
        return self.family.SUMMARY_KEYS

    # ------------------------------------------------------------------ the phases, one per cell
    def sync_weights(self) -> dict:
        """Actor -> rollout weights, stamped with the policy version (= training steps done)."""
        return self.schedule.sync_weights()

    def rollout(self) -> dict:
        """Collect a batch and hand it to the actor ranks (the family's collection, when the schedule says)."""
        return self.schedule.rollout()

    def advantages(self) -> dict:
        """Advantage estimation on each actor rank's batch (``algorithm.advantage``)."""
        with self.session.timed("advantages") as phase:
            self.family.advantages(phase)
        return phase.metrics

    def train(self) -> dict:
        """The update (data-parallel over actor ranks); completes and logs the step."""
        with self.session.timed("train") as phase:
            compiled = self.family.train(phase)
        return self.family.finish_step(phase.metrics, compiled, self.schedule.SEQUENTIAL)

    def step_once(self) -> dict:
        """All phases of one step; returns the step's metric record."""
        return self.schedule.step_once(self)

    def own_phases(self) -> bool:
        """Whether this loop's phases are the facade's own (not replaced by a subclass)."""
        cls = type(self)
        return all(
            getattr(cls, name) is getattr(LoopBase, name)
            for name in ("sync_weights", "rollout", "advantages", "train")
        )

    def evaluate(self, n: int | None = None) -> dict:
        """The family's evaluation with the current weights (work running ahead finishes first, and is kept)."""
        self.schedule.before_evaluate()
        return self.family.evaluate(n)

    def rollout_status(self) -> dict:
        """What is in flight and how stale: the newest policy version sent to the rollout ranks, the actor's, and
        whether rollout work is running ahead now."""
        return self.schedule.status()

    def summary(self) -> str:
        """One line for the CLI at the end of a run: how the last ``run()`` ended where it ended early (``solved
        at step 32 of 100 (runner.stop_return 475 reached)``, stopped, interrupted), then the family's figures."""
        line, outcome, runner = self.family.summary(), self.run_outcome, self.recipe.runner
        if outcome == "solved":
            return f"solved at step {self.step} of {runner.steps} (runner.stop_return {runner.stop_return:g} reached); {line}"
        if outcome in ("stopped", "interrupted"):
            return f"{outcome} at step {self.step} of {runner.steps}; {line}"
        return line

    def _solved(self) -> bool:
        return self.family.solved()

    # ------------------------------------------------------------------ run() and steering
    def run(self, steps: int | None = None, progress: bool = True, live: bool = False, background: bool = False,
            callbacks: list[Callback] | None = None):  # fmt: skip
        """Run ``steps`` steps (default: up to ``runner.steps``) with evaluation, checkpoints and early stop.

        Args:
            steps: how many steps (default: the rest of ``runner.steps``).
            progress: a text progress bar (ignored with ``live``).
            live: show the notebook dashboard (needs ipywidgets).
            background: run in a thread and return it at once; the notebook stays responsive and :meth:`stop` ends
                the run at a step boundary. :meth:`join` waits for it.
            callbacks: :class:`Callback` objects called around each step, after evaluation and saving.

        A lost worker is recovered from up to ``runner.max_restarts`` times. Returns the step records (or the
        thread, with ``background``).

        Example:
            >>> loop.run(50, live=True)                                    # doctest: +SKIP
        """
        return self.runner.run(steps, progress, live, background, callbacks)

    def join(self, timeout: float | None = None) -> None:
        """Wait for a background run; re-raise its error, if any."""
        self.runner.join(timeout)

    @property
    def run_outcome(self) -> str | None:
        """How the latest ``run()`` ended (:data:`rlnb.loop.runner.RUN_OUTCOMES`; ``None`` before or during one)."""
        return self.runner.run_outcome

    def watch(self, callback: Callback) -> None:
        """Call ``callback`` in every later ``run()`` too, for as long as something else holds it (weakly held)."""
        self.runner.watch(callback)

    def unwatch(self, callback: Callback) -> None:
        self.runner.unwatch(callback)

    def dashboard(self, total: int | None = None, plot_every: int = 10, curves: str = "live"):
        """A live notebook dashboard of this loop (progress, curves, phase times, metrics, controls);
        ``curves="png"`` draws a static image every ``plot_every`` steps, for a front end without bqplot."""
        total = total or self.recipe.runner.steps
        return view("dashboard_for")(self, total=total, plot_every=plot_every, curves=curves)

    def _default_callbacks(self) -> list[Callback]:
        """What every ``run()`` does after each step: the family's own first, then evaluate, then checkpoint."""
        return [*self.family.default_callbacks(), EvaluateEvery(), SaveEvery()]

    def _extend_run(self, steps: int) -> None:
        """``runner.steps`` grows to ``steps`` for a :meth:`run` that goes past it, and the actor learns of it (the
        learning-rate decay of ``actor.anneal_lr`` then spans the longer run); written to ``recipe.yaml``."""
        before, self.recipe.runner.steps = self.recipe.runner.steps, steps
        self.groups["actor"].set_total_steps(steps).result()
        self.session.write_recipe()
        log.info("run() goes to step %d, past runner.steps=%d: runner.steps is now %d (with actor.anneal_lr, the "
                 "learning rate decays to 0 over the %d steps)", steps, before, steps, steps)  # fmt: skip

    def set_hyperparameters(self, **values: float) -> dict:
        """Change ``lr``, ``ent_coef`` or ``clip_coef`` between steps (from a cell while ``run()`` goes on in the
        background, or the dashboard): checked now, applied at the next step boundary, logged as
        ``steer/<name>`` on the first step that uses it and written to ``recipe.yaml``. Returns what is queued.

        Example:
            >>> loop.set_hyperparameters(lr=1e-4, ent_coef=0.01)   # doctest: +SKIP
        """
        return self.steer.set_hyperparameters(**values)

    @property
    def steering(self) -> list[dict]:
        """The changes applied so far: ``{"step": first step using them, name: value}``."""
        return self.steer.applied

    def pause(self) -> None:
        """Hold a running ``run()`` at the next step boundary until :meth:`unpause` (or :meth:`stop`); steps the
        worker already runs ahead (``runner.run_ahead``, about 0.1 s of them) are finished first."""
        self.steer.pause()

    def unpause(self) -> None:
        self.steer.unpause()

    @property
    def paused(self) -> bool:
        return self.steer.paused

    def request_save(self) -> None:
        """Have ``run()`` write a checkpoint at the end of the step in progress (the dashboard's "save now")."""
        self.steer.save_requested = True

    def stop(self) -> None:
        """Ask a running ``run()`` to stop at the next step boundary (after steps the worker already runs ahead)."""
        self.steer.stop_requested = True

    @property
    def stopped(self) -> bool:
        """Whether the last ``run()`` ended because :meth:`stop` was called."""
        return self.steer.stop_requested

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """Write a complete checkpoint atomically: into a temporary directory, then renamed.

        Every rank writes its own component state (big state stays on workers). A failure (disk full...) removes
        the partial directory and raises :class:`CheckpointError`; the previous complete checkpoint stays the
        latest. In asynchronous mode ``run()`` checkpoints with nothing in flight at its save steps; a save while
        rollout runs ahead (a run stopped by a signal or ``stop()``, a notebook's own) waits for that work and keeps
        it in the checkpoint (``in_flight.pt``), so a resume trains on it next, as the uninterrupted run would have.
        """
        return self.checkpoints.save()

    def load_checkpoint(self, which: str | Path = "auto", fallback: bool = False) -> int:
        """Restore every component and the loop state from ``which`` (a checkpoint directory, or ``"auto"``: the
        latest complete checkpoint of the run); with ``fallback`` and ``"auto"``, the newest earlier one that can be
        read (with a warning). Returns the step the loop is at.

        Raises:
            CheckpointError: it cannot be read; the message names the earlier complete checkpoints.
        """
        path = self.checkpoints.load(which, fallback)
        if path is not None:
            self.resumed_from = path
        return self.step

    def recover(self, timeout_s: float = 120.0) -> int:
        """After a lost worker: rebuild every component on the cluster's (restarted) workers and continue from the
        latest complete checkpoint (or from scratch if there is none). Returns the step the loop continues from."""
        s, old = self.session, dict(self.groups)
        s.free_components()
        s.cluster.refresh(timeout_s)
        if self.built_from_objects:  # the same classes and arguments, on the same slots
            s.groups = {role: g.relaunch() for role, g in old.items()}
        else:
            s.place(self.family.roles)
            self.family.launch()
        self._compose()
        s.step, s.pending = 0, {}
        self.family.reset_state()
        self.schedule.reset_state()
        if complete_checkpoints(s.run_dir):
            return self.load_checkpoint("auto", fallback=True)  # (what the lost worker may have half-written)
        s.logger.truncate_after(0)
        return 0

    # ------------------------------------------------------------------ lifecycle and display
    def close(self) -> None:
        """Free the groups and channels (and the cluster, if this loop started it)."""
        self.session.close()

    def detach(self, timeout_s: float | None = None):
        """Hand the run to a driver of its own that outlives this notebook's kernel: a checkpoint now, this loop
        closed, and ``rlnb run --detach`` resuming the run exactly from that checkpoint in a session of its own
        (its cluster as the recipe says). Returns its :class:`rlnb.AttachedRun` to steer and watch it; any notebook
        (or ``rlnb attach``) reaches it later with ``rlnb.attach(run_dir)``. A loop built from objects cannot
        detach: a new process rebuilds a run from its recipe.

        Example:
            >>> run = loop.detach(); run.dashboard()                                   # doctest: +SKIP
        """
        import subprocess
        import sys

        from rlnb.errors import ConfigError
        from rlnb.loop.control import attach

        if self.built_from_objects:
            raise ConfigError(
                "detach: a loop built from objects cannot be rebuilt by another process; build it from a recipe "
                "(Loop.from_recipe) to detach it", "detach",
            )  # fmt: skip
        if self.session.read_only:
            raise ConfigError(
                "detach: this loop is read-only (an evaluation's): there is no run to hand on", "detach"
            )
        run_dir = self.run_dir
        self.save()
        self.close()
        argv = [sys.executable, "-m", "rlnb.cli", "run", str(run_dir / "recipe.yaml"), "runner.resume=auto",
                "--run-dir", str(run_dir), "--detach"]  # fmt: skip
        deadline = timeout_s if timeout_s is not None else self.recipe.cluster.start_timeout_s + 180
        done = subprocess.run(argv, capture_output=True, text=True, timeout=deadline)
        if done.returncode != 0:
            raise RuntimeError(
                f"detach: the run's own driver did not start (exit {done.returncode}):\n{done.stderr[-3000:]}"
            )
        return attach(run_dir)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        mode = self.placement.mode if self.placement is not None else "?"
        return f"<rlnb.{type(self).__name__} {self.recipe.name} step={self.step} mode={mode}>"

    def _repr_html_(self) -> str:
        last = self.history[-1] if self.history else {}
        rows = "".join(
            f"<tr><td>{html.escape(c)}</td><td>{', '.join(map(str, s))}</td></tr>"
            for c, s in self.placement.slots.items()
        )
        metrics = "".join(
            f"<tr><td>{k}</td><td>{last[k]:.4g}</td></tr>"
            for k in self.SUMMARY_KEYS
            if isinstance(last.get(k), (int, float))
        )
        return (
            f"<div><b>rlnb {type(self).__name__}</b> <code>{html.escape(self.recipe.name)}</code> · step {self.step} · "
            f"{self.placement.mode} · run dir <code>{html.escape(str(self.run_dir))}</code>"
            f"<table><tr><th>component</th><th>slots</th></tr>{rows}</table>"
            f"<table><tr><th>metric</th><th>last</th></tr>{metrics}</table></div>"
        )
