"""The loop's core: set-up on a cluster (the recipe path launches components, the objects path adopts them),
the phases of one step and their metrics, and the subclass hooks. Its collaborators, one module each:
:mod:`.runner` (``run()`` and its callbacks), :mod:`.checkpoint` (save, resume, recover), :mod:`.steering`
(hyperparameters between steps, pause, stop), :mod:`.links` (weights and batches between actor and rollout)
and :mod:`.asynchronous` (rollout running ahead of training).

A loop subclass names its components and implements ``_launch``, ``rollout``, ``advantages``,
``evaluate`` and ``_log_step``; the phases stay public so a notebook can call one per cell.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np

from rlnb.cluster.cluster import Cluster, default_cpu_slots
from rlnb.cluster.placement import Placement, resolve_placement
from rlnb.config.loader import load_recipe
from rlnb.config.schema import AlgorithmConfig, Recipe, RunnerConfig
from rlnb.errors import (
    ComponentError,
    ConfigError,
    PlacementError,
    RemoteError,
)
from rlnb.loop import run_dir as run_dirs
from rlnb.loop.asynchronous import Asynchronous
from rlnb.loop.checkpoint import (
    CheckpointError,
    Checkpointing,
    TrainingDivergedError,
    complete_checkpoints,
    default_run_dir,
)
from rlnb.loop.links import Links
from rlnb.loop.runner import Runner
from rlnb.loop.steering import Steering
from rlnb.metrics import MetricLogger
from rlnb.runtime.channel import Channel
from rlnb.runtime.group import SHUTDOWN_TIMEOUT_S, Group, shutdown_groups

log = logging.getLogger("rlnb")


def count_or_default(value, name: str, default: int) -> int:
    """``value``, a count given to a loop's method (``name`` in the error), or ``default`` for ``None``.

    Raises:
        ConfigError: anything but ``None`` or an integer >= 1.
    """
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}: expected an integer >= 1, got {value!r}", name)
    return value


@dataclasses.dataclass
class Phase:
    """One phase being timed by :meth:`LoopBase.timed`."""

    name: str
    """``sync``, ``rollout``, ``advantages`` or ``train``: the record's ``{name}/...`` and ``time/{name}_s``."""
    metrics: dict
    """What the phase reports (numbers go into the step's record; ``version`` stays out)."""
    duration_s: float | None = None
    """Its time where measured elsewhere (a chain's call on the worker); else the wall time since it started."""
    started_s: float = dataclasses.field(default_factory=time.perf_counter)
    """``time.perf_counter()`` when it started."""

    def elapsed_s(self) -> float:
        """Its time so far (``duration_s`` where given)."""
        return time.perf_counter() - self.started_s if self.duration_s is None else self.duration_s


def mean_dicts(dicts: list[dict]) -> dict:
    """Per-key mean of the numeric entries that every rank reported."""
    if len(dicts) == 1:  # one rank: its numbers as they are (the per-step path of a one-slot loop)
        return {k: float(v) for k, v in dicts[0].items() if isinstance(v, (int, float))}
    keys = dicts[0].keys()
    return {
        k: float(np.mean([d[k] for d in dicts]))
        for k in keys
        if all(isinstance(d.get(k), (int, float)) for d in dicts)
    }


def objects_recipe(name: str, seed: int, runner, **sections) -> Recipe:
    """The recipe of a loop built from launched components: its runner settings, and what the loop
    reads from its components (filled in when they are composed)."""
    if runner is None or isinstance(runner, RunnerConfig):
        runner = runner or RunnerConfig()
    elif isinstance(runner, dict):
        runner = load_recipe(None, {f"runner.{k}": v for k, v in runner.items()}).runner
    else:
        raise ConfigError(f"runner: expected a RunnerConfig or a dict, got {type(runner).__name__}", "runner")
    return Recipe(name=name, seed=seed, runner=runner, **sections)


class LoopBase(Steering, Runner, Checkpointing, Links, Asynchronous):
    """The machinery of a loop; see :class:`rlnb.loop.Loop` and :class:`rlnb.loop.GRPOLoop`.

    Args:
        recipe: a validated :class:`rlnb.config.Recipe`.
        cluster: a :class:`rlnb.Cluster`; ``None`` starts one from ``recipe.cluster`` (and closes it on ``close()``).
        run_dir: where metrics and checkpoints go (default ``recipe.runner.run_dir`` or ``runs/<name>-<time>``).
        read_only: open ``run_dir`` without writing to it (``rlnb eval``, ``rlnb export``): no lock, no metrics
            or TensorBoard files, no recipe written, no checkpoint saved.
    """

    COMPONENTS: tuple[str, ...] = ("rollout", "actor")
    ROLE_METHODS: dict[str, tuple[str, ...]] = {}  # what the loop calls on each role's component
    ROLE_BASES: dict[str, str] = {}  # the built-in class to subclass for each role
    SUMMARY_KEYS: tuple[str, ...] = ()  # metrics shown by _repr_html_ and the progress bar (first one)
    STATE: dict | None = (
        None  # the keys of _extra_state() in loop.json, checked on resume (checkpoint.check_state)
    )

    def __init__(
        self,
        recipe: Recipe,
        cluster: Cluster | None = None,
        run_dir: str | Path | None = None,
        components: dict[str, Group] | None = None,
        read_only: bool = False,
    ):
        t0 = time.perf_counter()
        self.recipe = recipe
        self.read_only = read_only
        # steering between steps (the dashboard's controls, or cells while run() goes on in the background)
        self._steer_lock = threading.Lock()
        self._steer_queue: dict[str, float] = {}
        self._running = threading.Event()
        self._running.set()
        self._save_requested = False
        self.steering: list[dict] = []  # applied changes: {"step": first step using them, name: value}
        c = recipe.cluster
        comps = self.COMPONENTS
        self.built_from_objects = components is not None
        self.cluster = None
        self._own_cluster = False
        self.groups: dict[str, Group] = {}
        self.channels: dict[str, Channel] = {}
        self.logger = None
        if components is None:
            self._check_here()
        self.run_dir = Path(run_dir or recipe.runner.run_dir or default_run_dir(recipe.name))
        # the run directory is checked and locked before anything starts (see rlnb.loop.run_dir)
        self._run_dir_lock = (
            None if read_only else run_dirs.take(self.run_dir, recipe.runner.resume, recipe.runner.overwrite)
        )
        if components is not None:
            cluster = self._adopt(components)
        elif cluster is None:
            # check the placement against the cluster we are about to start, before starting it
            if c.address is None:
                planned = resolve_placement(
                    c.component_placement, c.slots or default_cpu_slots(), required=comps, known=comps
                )
                self.check_layout(planned.slots)
            cluster = Cluster(c.address, slots=c.slots)
            self._own_cluster = True
        self.cluster = cluster
        try:
            if components is None:
                self.placement = cluster.place(c.component_placement, required=comps, known=comps)
                for key, dev in (
                    ("actor.device", recipe.actor.device),
                    ("rollout.device", recipe.rollout.device),
                ):
                    cluster.check_device(dev, key)
                self._check_rank_counts()
                self._check_cluster()
            self._prepare()
            if components is None:
                self._launch()
            self._compose()
            self._write_recipe()
        except BaseException:
            self.close()
            raise
        self.step = 0
        self._reset_state()
        self._pending: dict[str, float] = {}
        self._stop = False
        self._run_target: int | None = None  # the step the running run() stops at (None outside run())
        self._ahead = False  # a step running ahead on the workers, to be taken by step_once (embodied loop)
        self.resumed_from: Path | None = None  # the checkpoint this loop was restored from, if any
        self.restarts = 0  # lost workers run() recovered from (runner.max_restarts per run)
        self._said_lr_is_zero = False  # the warning of a step past runner.steps trained with learning rate 0
        self.logger = MetricLogger(
            self.run_dir,
            recipe.runner.tensorboard,
            recipe.runner.wandb_project,
            asdict(self.recipe),
            read_only=read_only,
        )
        self.startup_s = time.perf_counter() - t0
        if recipe.runner.resume:
            try:
                self.load_checkpoint(recipe.runner.resume, fallback=recipe.runner.resume_fallback)
            except BaseException:
                self.close()  # a failed resume leaves no components (and no embedded cluster) running
                raise

    def _adopt(self, components: dict) -> Cluster:
        """Take groups launched by the user (``Env.launch(...)``...): check each is a launched group of a
        class with the methods its role needs, on one cluster, under distinct names."""
        names = {}
        for role in self.COMPONENTS:
            group = components.get(role)
            if group is None:
                raise ConfigError(
                    f"{type(self).__name__}: missing component {role!r}; pass {role}=<Cls>.launch(cluster, slots, ...)",
                    role,
                )
            if not isinstance(group, Group):
                raise ComponentError(
                    f"expected a launched group (e.g. {role}=PolicyRollout.launch(cluster, '0', ...)), "
                    f"got {type(group).__name__}; rlnb.launch(MyClass, cluster, slots, ...) places a class of your own",
                    role, type(group).__name__, role,
                )  # fmt: skip
            missing = [
                m for m in self.ROLE_METHODS.get(role, ()) if not callable(getattr(group.cls, m, None))
            ]
            if missing:
                raise ComponentError(
                    f"lacks method(s) {', '.join(missing)} that the {role} of {type(self).__name__} calls; "
                    f"subclass the built-in {self.ROLE_BASES.get(role, role)} and override what you change",
                    group.name, group.cls.__name__, missing[0],
                )  # fmt: skip
            if group.name in names:
                raise ConfigError(
                    f"{role} and {names[group.name]} are both named {group.name!r}; launch one with name=...",
                    role,
                )
            names[group.name] = role
        clusters = {id(g.cluster) for g in components.values()}
        if len(clusters) > 1:
            raise ConfigError("components were launched on different clusters; use one cluster", "cluster")
        self.groups = {role: components[role] for role in self.COMPONENTS}
        self.placement = Placement({role: tuple(i.slot for i in g.infos) for role, g in self.groups.items()})
        return next(iter(components.values())).cluster

    def _record_components(self, **sections) -> None:
        """Objects path: the recipe records what the launched components were built with (the actor's
        algorithm, ``sections`` the loop read from others, the placement); then the checks the recipe
        path makes before launching run on it."""
        described = self.groups["actor"].on(0).describe().result()[0]
        algorithm = AlgorithmConfig(**described["algorithm"])
        algorithm.advantage, algorithm.policy_loss = described["advantage"], described["policy_loss"]
        if described.get("actor") is not None:  # what the actor trains with, not the schema's defaults
            sections.setdefault("actor", described["actor"])
        self.recipe = dataclasses.replace(self.recipe, algorithm=algorithm, **sections)
        self.recipe.cluster.component_placement = {
            k: ",".join(map(str, v)) for k, v in self.placement.slots.items()
        }
        self._check_rank_counts()
        self._check_cluster()

    def _bind_checked(self, results) -> list:
        """Results of set-up calls on the user's components; a :class:`ComponentError` raised on a worker
        is raised here as itself (it names the component, the object and what does not fit)."""
        try:
            return [r.result() for r in results]
        except RemoteError as e:
            if isinstance(e.__cause__, ComponentError):
                raise e.__cause__ from None
            if isinstance(e.__cause__, ConfigError):
                raise ConfigError(f"{e.component}: {e.__cause__}", e.__cause__.key) from None
            raise

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

    # ------------------------------------------------------------------ subclass hooks
    def _prepare(self) -> None:
        """Driver-side set-up before the components start (data, model files...)."""

    def _launch(self) -> None:
        """Recipe path: launch each component through its public ``launch`` into ``self.groups``."""
        raise NotImplementedError

    def _compose(self) -> None:
        """Wire launched components into this loop (both paths): spaces, process groups, channels."""
        raise NotImplementedError

    def _reset_state(self) -> None:
        """Loop-side state of a fresh run (episode windows, counters...)."""

    def _extra_state(self) -> dict:
        """Loop-side state saved in checkpoints (JSON)."""
        return {}

    def _load_extra_state(self, state: dict) -> None:
        pass

    def _save_extra(self, directory: Path) -> None:
        """Extra files in a checkpoint being written (e.g. a Hugging Face export)."""

    def summary(self) -> str:
        """One line for the CLI at the end of a run."""
        return f"step {self.step}"

    def _solved(self) -> bool:
        return False

    @classmethod
    def check_layout(cls, slots) -> None:
        """Refuse, before anything starts, a placement (component -> slots) this loop cannot run."""

    def _check_here(self) -> None:
        """Refuse, before anything starts or launches, what the recipe's own objects built here show (the
        recipe path only)."""

    def _check_cluster(self) -> None:
        """Refuse settings this cluster cannot serve, before launching anything (child processes on
        daemonic workers, GPU-only backends on CPU slots)."""

    def _check_rank_counts(self) -> None:
        n_roll, n_act = len(self.placement["rollout"]), len(self.placement["actor"])
        if n_roll % n_act and n_act % n_roll:
            raise PlacementError(
                f"component_placement: {n_roll} rollout rank(s) cannot feed {n_act} actor rank(s) evenly; "
                "place one on a multiple of the other's slots", "component_placement"
            )  # fmt: skip
        if self.placement["rollout"] != self.placement["actor"]:
            self._weight_sync_route()  # refuses a rollout.weight_sync this placement cannot serve

    @property
    def mode(self) -> str:
        """``collocated``, ``disaggregated`` or ``hybrid`` (from the placement)."""
        return self.placement.mode

    # ------------------------------------------------------------------ shared phases
    def sync_weights(self) -> dict:
        """Actor -> rollout weights, stamped with the policy version (= training steps done)."""
        self._apply_steering()
        with self.timed("sync", version=self.step) as phase:
            self._sync()
        return phase.metrics

    def rollout(self) -> dict:
        raise NotImplementedError

    def advantages(self) -> dict:
        """Advantage estimation on each actor rank's batch (``algorithm.advantage``)."""
        with self.timed("advantages") as phase:
            phase.metrics.update(mean_dicts(self.groups["actor"].compute_advantages().result()))
        return phase.metrics

    def train(self) -> dict:
        """The update (data-parallel over actor ranks); completes and logs the step."""
        with self.timed("train") as phase:
            compiled = self._train_summary(self.groups["actor"].train().result, phase)
        return self._finish_step(phase.metrics, compiled)

    def _train_summary(self, per_rank_result, phase: Phase) -> tuple:
        """The train phase's metrics into ``phase``, from its call's ``result`` (one value per actor rank),
        averaged over ranks; a diverged update becomes a :class:`TrainingDivergedError`. Returns the first
        step's compile time and whether compiling failed (both ``None`` if it did not compile)."""
        try:
            per_rank = per_rank_result()
        except RemoteError as e:
            if e.cause_type != "FloatingPointError":
                raise
            found = complete_checkpoints(self.run_dir)
            last = str(found[-1]) if found else None
            raise TrainingDivergedError(
                f"training diverged at step {self.step + 1}: {e.args[0]}. Nothing was saved after it; "
                f"last good checkpoint: {last or 'none'} (lower actor.lr or check the rewards)",
                self.step + 1,
                last,
            ) from e
        summary = mean_dicts(per_rank)
        if summary.get("lr") == 0.0 and self.step >= self.recipe.runner.steps and not self._said_lr_is_zero:
            self._said_lr_is_zero = True
            log.warning(
                "step %d trained with learning rate 0: actor.anneal_lr decays it to 0 at runner.steps=%d, and "
                "this step is past it; loop.run(n) extends runner.steps (and the decay) to the steps it runs, "
                "or set actor.anneal_lr: false", self.step + 1, self.recipe.runner.steps
            )  # fmt: skip
        compiled = summary.pop("compile_s", None), summary.pop("compile_failed", None)
        phase.metrics.update(summary)
        return compiled

    def _finish_step(self, out: dict, compiled: tuple) -> dict:
        """After the train phase: the first step's compile time apart from training's, the step counted and
        logged."""
        compile_s, compile_failed = compiled
        if compile_s is not None:  # the first step compiled the train step: its own time, not training's
            self._pending["time/compile_s"] = compile_s
            self._pending["time/train_s"] = max(0.0, self._pending["time/train_s"] - compile_s)
            if compile_failed:
                reason = self.groups["actor"].on(0).compile_stats().result()[0]["fallback"]
                log.warning(
                    "actor.compile: torch.compile failed on the actor's workers (%s); training eager", reason
                )
        self.step += 1
        self._log_step(out)
        return out

    def step_once(self) -> dict:
        """All phases of one step; returns the step's metric record."""
        self._apply_steering()
        self.sync_weights()
        self.rollout()
        self.advantages()
        self.train()
        return self.logger.history[-1]

    def evaluate(self, *args, **kwargs) -> dict:
        raise NotImplementedError

    # ------------------------------------------------------------------ metrics
    @contextlib.contextmanager
    def timed(self, name: str, duration_s: float | None = None, **metrics) -> Iterator[Phase]:
        """Time one phase of the step: the ``with`` block fills in ``phase.metrics``; on leaving it they and the
        phase's time go into the step's record as ``{name}/...`` and ``time/{name}_s`` (``phase.metrics`` gets
        ``time_s``). ``duration_s``: the time where it was measured elsewhere (a chain's call on the worker),
        else the block's wall time. A phase that raises records nothing.

        Example:
            >>> with loop.timed("sync", version=loop.step) as phase:  # doctest: +SKIP
            ...     loop._sync()
        """
        phase = Phase(name, dict(metrics), duration_s)
        yield phase
        dt = phase.elapsed_s()
        self._pending[f"time/{name}_s"] = dt
        for k, v in phase.metrics.items():
            if v is not None and k != "version" and isinstance(v, (int, float)):
                # memory/... keys are the process's, whichever phase reports them
                self._pending[k if k.startswith("memory/") else f"{name}/{k}"] = v
        phase.metrics["time_s"] = dt

    def _log_step(self, train_out: dict) -> None:
        self._log_record({})

    def _log_record(self, record: dict) -> dict:
        """Merge the pending phase metrics (train/, time/, advantages/...) into ``record`` and log it."""
        p = self._pending
        record = {**record, "time/step_s": sum(v for k, v in p.items() if k.startswith("time/"))}
        for k, v in p.items():
            if k.startswith(("train/", "time/", "advantages/", "steer/", "memory/")):
                record[k] = v
        self._pending = {}
        return self.logger.log(self.step, record)

    @property
    def history(self) -> list[dict]:
        return self.logger.history

    # ------------------------------------------------------------------ lifecycle and display
    def _free_components(self) -> None:
        deadline = (
            time.monotonic() + SHUTDOWN_TIMEOUT_S
        )  # (one bound for all of it, a hung worker's included)
        for ch in self.channels.values():
            with contextlib.suppress(Exception):  # a lost worker took its queues with it
                ch.close(timeout_s=max(0.1, deadline - time.monotonic()))
        shutdown_groups(list(self.groups.values()), max(0.1, deadline - time.monotonic()))
        self.groups, self.channels = {}, {}

    def close(self) -> None:
        """Free the groups and channels (and the cluster, if this loop started it)."""
        self._free_components()
        if self.logger is not None:
            self.logger.close()
        if self._own_cluster and self.cluster is not None:
            self.cluster.close()
            self.cluster = None
        if self._run_dir_lock is not None:
            self._run_dir_lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"<rlnb.{type(self).__name__} {self.recipe.name} step={getattr(self, 'step', 0)} mode={self.placement.mode}>"

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
