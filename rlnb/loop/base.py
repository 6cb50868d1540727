"""What every loop shares: placement on a cluster, weight sync and batch hand-off between actor and
rollout, ``run()`` with restarts, atomic checkpoints, exact resume, recovery, metrics and views.

A loop subclass names its components and implements ``_launch``, ``rollout``, ``advantages``,
``evaluate`` and ``_log_step``; the phases stay public so a notebook can call one per cell.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import json
import logging
import math
import os
import shutil
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import numpy as np

from rlnb.cluster.cluster import Cluster, default_cpu_slots
from rlnb.cluster.placement import Placement, resolve_placement
from rlnb.config.loader import load_recipe, to_yaml
from rlnb.config.schema import AlgorithmConfig, Recipe, RunnerConfig
from rlnb.errors import (
    ComponentError,
    ConfigError,
    PlacementError,
    RemoteError,
    RlnbError,
    WorkerLostError,
    did_you_mean,
)
from rlnb.metrics import MetricLogger
from rlnb.runtime.channel import Channel
from rlnb.runtime.group import Group, init_collective

log = logging.getLogger("rlnb")

WEIGHT_SYNC_GROUP = "rlnb-weight-sync"  # the process group of rollout.weight_sync=broadcast

STEERABLE = {
    "lr": ("actor", "lr"),
    "ent_coef": ("algorithm", "ent_coef"),
    "clip_coef": ("algorithm", "clip_coef"),
}
"""Hyperparameters :meth:`LoopBase.set_hyperparameters` changes between steps, and their recipe section."""


class CheckpointError(RlnbError, OSError):
    """A checkpoint could not be written or read; the previous complete checkpoint is untouched."""


class TrainingDivergedError(RlnbError, FloatingPointError):
    """The loss became NaN/inf; nothing was saved after it, the last good checkpoint is ``last_checkpoint``."""

    def __init__(self, message: str, step: int = -1, last_checkpoint: str | None = None):
        super().__init__(message)
        self.step, self.last_checkpoint = step, last_checkpoint


def default_run_dir(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first by step number (partial ``.tmp-*`` directories are
    ignored; ``step_1000000`` comes after ``step_999999``)."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    found = [p for p in root.glob("step_*") if (p / "COMPLETE").exists() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


class LoopBase:
    """The machinery of a loop; see :class:`rlnb.loop.Loop` and :class:`rlnb.loop.GRPOLoop`.

    Args:
        recipe: a validated :class:`rlnb.config.Recipe`.
        cluster: a :class:`rlnb.Cluster`; ``None`` starts one from ``recipe.cluster`` (and closes it on ``close()``).
        run_dir: where metrics and checkpoints go (default ``recipe.runner.run_dir`` or ``runs/<name>-<time>``).
    """

    COMPONENTS: tuple[str, ...] = ("rollout", "actor")
    ROLE_METHODS: dict[str, tuple[str, ...]] = {}  # what the loop calls on each role's component
    ROLE_BASES: dict[str, str] = {}  # the built-in class to subclass for each role
    SUMMARY_KEYS: tuple[str, ...] = ()  # metrics shown by _repr_html_ and the progress bar (first one)

    def __init__(
        self,
        recipe: Recipe,
        cluster: Cluster | None = None,
        run_dir: str | Path | None = None,
        components: dict[str, Group] | None = None,
    ):
        t0 = time.perf_counter()
        self.recipe = recipe
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
            self.run_dir = Path(run_dir or recipe.runner.run_dir or default_run_dir(recipe.name))
            self._prepare()
            if components is None:
                self._launch()
            self._compose()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "recipe.yaml").write_text(to_yaml(self.recipe))
        except BaseException:
            self.close()
            raise
        self.step = 0
        self._reset_state()
        self._pending: dict[str, float] = {}
        self._stop = False
        self._run_target: int | None = None  # the step the running run() stops at (None outside run())
        self._ahead = False  # a step running ahead on the workers, to be taken by step_once (embodied loop)
        self.restarts = 0  # lost workers run() recovered from (runner.max_restarts per run)
        self._said_lr_is_zero = False  # the warning of a step past runner.steps trained with learning rate 0
        self.logger = MetricLogger(
            self.run_dir, recipe.runner.tensorboard, recipe.runner.wandb_project, asdict(self.recipe)
        )
        self.startup_s = time.perf_counter() - t0
        if recipe.runner.resume:
            try:
                self.load_checkpoint(recipe.runner.resume)
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
    def resume(cls, run_dir: str | Path, cluster: Cluster | None = None, overrides=None):
        """Rebuild a run from its directory and continue from its latest complete checkpoint."""
        run_dir = Path(run_dir)
        if not (run_dir / "recipe.yaml").exists():
            raise CheckpointError(f"{run_dir} is not a run directory (no recipe.yaml)")
        recipe = load_recipe(
            run_dir / "recipe.yaml", [*(overrides or []), "runner.resume=auto", f"runner.run_dir={run_dir}"]
        )
        return cls(recipe, cluster, run_dir)

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

    def _launch_links(self) -> None:
        """Channels (and the weight-sync process group) for whatever is not collocated between actor and
        rollout."""
        p = self.placement
        self.batch_local = p["rollout"] == p["actor"]  # batches and weights move in-process
        self.weight_sync = "local" if self.batch_local else self._weight_sync_route()
        if not self.batch_local:
            timeout = self.groups["actor"].call_timeout_s
            self.channels["batches"] = Channel.create(
                self.cluster, "batches", slot=p["actor"][0], timeout_s=timeout
            )
            if self.weight_sync == "broadcast":
                actor, rollout = self.groups["actor"], self.groups["rollout"]
                for group, method in ((actor, "broadcast_weights"), (rollout, "receive_weights")):
                    if not callable(getattr(group.cls, method, None)):
                        raise ComponentError(
                            f"lacks method {method}, which rollout.weight_sync=broadcast calls; subclass "
                            "the built-in component or use rollout.weight_sync=channel",
                            group.name, group.cls.__name__, method,
                        )  # fmt: skip
                init_collective([actor.on(0), rollout], name=WEIGHT_SYNC_GROUP, timeout_s=timeout)
            else:
                self.channels["weights"] = Channel.create(
                    self.cluster, "weights", slot=p["rollout"][0], timeout_s=timeout
                )

    def _weight_sync_route(self) -> str:
        """``channel`` or ``broadcast`` for rollout ranks apart from the actor (``rollout.weight_sync``)."""
        choice, p, slots = self.recipe.rollout.weight_sync, self.placement, self.cluster.slots
        if choice == "channel":
            return "channel"
        rollout = [slots[s] for s in p["rollout"]]
        actor0 = slots[p["actor"][0]]
        if choice == "auto":
            on_gpus = all(s.device.startswith("cuda") for s in [actor0, *rollout])
            elsewhere = all(s.node != actor0.node for s in rollout)
            return "broadcast" if on_gpus and elsewhere and not self.max_staleness else "channel"
        if self.max_staleness:
            raise ConfigError(
                f"rollout.weight_sync=broadcast is a collective both sides enter at once, which asynchronous "
                f"mode (algorithm.max_staleness={self.max_staleness}) cannot do: the rollout takes weights "
                "between chunks while it generates. Use channel or auto",
                "rollout.weight_sync",
            )
        shared = sorted(s.rank for s in rollout if s.address == actor0.address)
        if shared:
            raise PlacementError(
                f"rollout.weight_sync=broadcast needs every rollout rank in another worker than actor rank 0 "
                f"(a process group has one rank per worker); rollout slot(s) {shared} share its worker. "
                "Use channel or auto, or place them apart",
                "rollout.weight_sync",
            )
        return "broadcast"

    @property
    def mode(self) -> str:
        """``collocated``, ``disaggregated`` or ``hybrid`` (from the placement)."""
        return self.placement.mode

    # ------------------------------------------------------------------ asynchronous RL
    @property
    def max_staleness(self) -> int:
        """``algorithm.max_staleness``: how many policy versions rollout may run ahead (0: synchronous)."""
        return self.recipe.algorithm.max_staleness

    def _settle_in_flight(self) -> None:
        """Let the rollout work in flight finish (its batch still goes to the next ``rollout()``)."""
        for pending in getattr(self, "_in_flight", None) or ():
            pending.wait()

    def _sync_rollout(self) -> None:
        """Actor -> rollout weights now (waiting for them to load), remembered as the rollout's version."""
        self._sync()
        self._rollout_version = self.step

    def _check_async_apart(self, example: str) -> None:
        """Asynchronous mode needs rollout and actor on different slots; ``example`` is a placement that works."""
        shared = sorted(set(self.placement["rollout"]) & set(self.placement["actor"]))
        if self.max_staleness and shared:
            raise ConfigError(
                f"algorithm.max_staleness={self.max_staleness} needs rollout and actor on different slots: a "
                f"worker runs one call at a time, so rollout cannot run ahead of training on shared slot(s) "
                f"{shared}. Place them apart (component_placement={example}) or use 0",
                "algorithm.max_staleness",
            )

    def rollout_status(self) -> dict:
        """What is in flight and how stale: the newest policy version sent to the rollout ranks, the
        actor's, and whether rollout work is running ahead now."""
        return {
            "max_staleness": self.max_staleness,
            "actor_version": self.step,
            "rollout_version": getattr(self, "_rollout_version", None),
            "in_flight": getattr(self, "_in_flight", None) is not None,
        }

    def _must_drain(self) -> bool:
        """Whether the step being taken ends where nothing may be in flight: a checkpoint or an evaluation
        of ``run()``, or its last step (so checkpoints resume exactly and nothing runs on unused)."""
        return self._drains_at(self.step + 1)

    def _drains_at(self, step: int) -> bool:
        """Whether step ``step`` (a step number: the steps done once it is) ends where nothing may be in
        flight (see :meth:`_must_drain`)."""
        r = self.recipe.runner
        return bool(
            (r.save_interval and step % r.save_interval == 0)
            or (r.eval_interval and step % r.eval_interval == 0)
            or (self._run_target is not None and step >= self._run_target)
        )

    # ------------------------------------------------------------------ shared phases
    def sync_weights(self) -> dict:
        """Actor -> rollout weights, stamped with the policy version (= training steps done)."""
        self._apply_steering()
        t0 = time.perf_counter()
        self._sync()
        return self._phase("sync", t0, {"version": self.step})

    def _sync(self) -> None:
        actor, rollout = self.groups["actor"], self.groups["rollout"]
        if self.batch_local:
            rollout.call_each(
                "load_from_local_actor", [(actor.name, r, self.step) for r in rollout.ranks]
            ).result()
        elif self.weight_sync == "broadcast":  # one collective: both sides enter it at once
            receiving = rollout.receive_weights(self.step, WEIGHT_SYNC_GROUP)
            actor.on(0).broadcast_weights(self.step, WEIGHT_SYNC_GROUP).result()
            receiving.result()
        else:
            ch = self.channels["weights"]
            keys = [f"w{r}" for r in rollout.ranks]
            # publish first (unbounded channel: never blocks), then load: a rollout rank sharing actor
            # rank 0's worker would otherwise hold its actor thread waiting for weights not yet sent
            actor.on(0).publish_weights(ch, keys, self.step).result()
            rollout.call_each("load_from_channel", [(ch, k) for k in keys]).result()

    def _hand_batches(self) -> list[dict]:
        """Rollout rank ``k``'s batch goes to actor rank ``k % actor ranks`` (in-process when collocated);
        with more actor than rollout ranks, it is split over several. Returns each actor rank's intake."""
        rollout, actor = self.groups["rollout"], self.groups["actor"]
        if self.batch_local:
            return actor.call_each("take_local_batches", [(rollout.name, [a]) for a in actor.ranks]).result()
        ch = self.channels["batches"]
        puts, takes = self._batch_keys()
        sent = rollout.call_each("put_batch", [(ch, key, shards) for key, shards in puts])
        # puts never block (the channel is unbounded), so a rank sharing a worker with one of the
        # other group's ranks cannot hold that worker's actor thread while waiting for it
        sent.result()
        return self._take_batches(takes)

    def _batch_keys(self) -> tuple[list[tuple[str, int]], list[list[str]]]:
        """The channel hand-off: per rollout rank ``(key, shards)`` it puts under, and per actor rank the
        keys it takes. With more actor than rollout ranks each batch is split (RLinf's hybrid)."""
        rollout, actor = self.groups["rollout"], self.groups["actor"]
        n_act, n_roll = actor.world_size, rollout.world_size
        if n_act > n_roll:
            m = n_act // n_roll
            return [(f"b{k}", m) for k in rollout.ranks], [[f"b{a // m}.{a % m}"] for a in actor.ranks]
        takes = [[f"b{k}" for k in rollout.ranks if k % n_act == a] for a in actor.ranks]
        return [(f"b{k}", 1) for k in rollout.ranks], takes

    def _take_batches(self, takes: list[list[str]]) -> list[dict]:
        ch, actor = self.channels["batches"], self.groups["actor"]
        return actor.call_each("take_channel_batches", [(ch, k) for k in takes]).result()

    def rollout(self) -> dict:
        raise NotImplementedError

    def advantages(self) -> dict:
        """Advantage estimation on each actor rank's batch (``algorithm.advantage``)."""
        t0 = time.perf_counter()
        per_rank = self.groups["actor"].compute_advantages().result()
        return self._phase("advantages", t0, mean_dicts(per_rank))

    def train(self) -> dict:
        """The update (data-parallel over actor ranks); completes and logs the step."""
        t0 = time.perf_counter()
        return self._finish_train(self.groups["actor"].train().result, t0)

    def _finish_train(self, per_rank_result, t0: float, dt: float | None = None) -> dict:
        """The train phase from its call's ``result`` (one value per actor rank): a diverged update becomes a
        :class:`TrainingDivergedError`; the metrics are averaged over ranks and the step is logged."""
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
        compile_s, compile_failed = summary.pop("compile_s", None), summary.pop("compile_failed", None)
        out = self._phase("train", t0, summary, dt)
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

    # ------------------------------------------------------------------ steering
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

    def dashboard(self, total: int | None = None, plot_every: int = 10, curves: str = "live"):
        """A live notebook dashboard of this loop (progress, curves, phase times, metrics, controls).

        ``curves="live"`` streams every step into interactive curves (zoom, pan, hover); ``"png"`` draws a
        static image every ``plot_every`` steps, for a front end without bqplot's JavaScript."""
        from rlnb.widgets import dashboard_for  # the widget layer is imported only when asked for

        return dashboard_for(
            self, total=total or self.recipe.runner.steps, plot_every=plot_every, curves=curves
        )

    def run(
        self, steps: int | None = None, progress: bool = True, live: bool = False, background: bool = False
    ):
        """Run ``steps`` steps (default: up to ``runner.steps``) with evaluation, checkpoints and early stop.

        Args:
            steps: how many steps (default: the rest of ``runner.steps``).
            progress: a text progress bar (ignored with ``live``).
            live: show the notebook dashboard (needs ipywidgets).
            background: run in a thread and return it at once; the notebook stays responsive and
                :meth:`stop` ends the run at a step boundary. :meth:`join` waits for it.

        A lost worker is recovered from up to ``runner.max_restarts`` times. Returns the step records
        (or the thread, with ``background``).
        """
        runner = self.recipe.runner
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise ConfigError(f"steps: expected an integer >= 0, got {steps!r}", "steps")
        steps = runner.steps - self.step if steps is None else steps
        if self.step + steps > runner.steps:
            self._extend_run(self.step + steps)
        if live:
            from rlnb.widgets import show_dashboard

            show_dashboard(self, total=self.step + steps)
            progress = False
        if background:
            import threading

            self._stop = False
            self._error = None

            def target():
                try:
                    self._run_steps(steps, progress=False)
                except BaseException as e:  # surfaced by join(), and logged for the dashboard
                    self._error = e
                    log.error("the background run stopped at step %d", self.step, exc_info=True)

            self._thread = threading.Thread(target=target, name=f"rlnb-{self.recipe.name}", daemon=True)
            self._thread.start()
            return self._thread
        self._stop = False
        return self._run_steps(steps, progress)

    def _write_recipe(self) -> None:
        """The run's ``recipe.yaml`` as the recipe is now (a resume continues with it)."""
        if self.run_dir is not None and self.run_dir.exists():
            (self.run_dir / "recipe.yaml").write_text(to_yaml(self.recipe))

    def _extend_run(self, steps: int) -> None:
        """``runner.steps`` grows to ``steps`` for a :meth:`run` that goes past it, and the actor learns of it:
        the learning-rate decay of ``actor.anneal_lr`` then spans the longer run, instead of holding the rate at
        0 past the old end. Written to the run's ``recipe.yaml`` (a resume continues with it)."""
        before, self.recipe.runner.steps = self.recipe.runner.steps, steps
        self.groups["actor"].set_total_steps(steps).result()
        self._write_recipe()
        log.info(
            "run() goes to step %d, past runner.steps=%d: runner.steps is now %d (with actor.anneal_lr, the "
            "learning rate decays to 0 over the %d steps)", steps, before, steps, steps
        )  # fmt: skip

    def join(self, timeout: float | None = None) -> None:
        """Wait for a background run; re-raise its error, if any."""
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"the background run is still going after {timeout} s")
        if getattr(self, "_error", None) is not None:
            err, self._error = self._error, None
            raise err

    def _run_steps(self, steps: int, progress: bool) -> list[dict]:
        runner = self.recipe.runner
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=steps, desc=self.recipe.name, unit="step")
        records = []
        restarts = 0
        target = self._run_target = self.step + steps
        try:
            while self.step < target:
                if not self._ahead:  # (steps the worker runs ahead are taken first: they are under way)
                    self._wait_while_paused()
                    if self._stop:
                        break
                try:
                    rec = self.step_once()
                    if runner.eval_interval and self.step % runner.eval_interval == 0:
                        self.evaluate()  # (never with a step ahead: step_once does not run past one)
                    if (runner.save_interval and self.step % runner.save_interval == 0) or (
                        self._save_requested and not self._ahead
                    ):
                        self._save_requested = False
                        self.save()
                except WorkerLostError as e:
                    if restarts >= runner.max_restarts:
                        raise
                    restarts += 1
                    self.restarts += 1
                    log.warning("%s; recovering (%d/%d)", e, restarts, runner.max_restarts)
                    self.recover()
                    if bar is not None:
                        bar.n = steps - (target - self.step)
                        bar.refresh()
                    continue
                records.append(rec)
                if bar is not None:
                    key = self.SUMMARY_KEYS[0] if self.SUMMARY_KEYS else None
                    value = rec.get(key) if key else None
                    bar.set_postfix_str(  # (drawn by update(), at most every 0.1 s: not twice a step)
                        f"{key.split('/')[-1]} {value:.3g}" if isinstance(value, (int, float)) else "",
                        refresh=False,
                    )
                    bar.update(1)
                if (self._solved() or self._stop) and not self._ahead:
                    break
        except BaseException:
            if self._ahead:  # (interrupted between steps) the step under way on the worker is still taken
                self._take_ahead_after_error()
            raise
        finally:
            self._run_target = None
            if bar is not None:
                bar.close()
        return records

    def _take_ahead_after_error(self) -> None:
        """``run()`` is ending on an error or an interrupt while steps run ahead on the worker: take and log
        them, so that the loop's step count and the workers' agree (a failure here is logged, not raised: the
        first error is the one to see)."""
        self._run_target = None  # (nothing further runs ahead)
        while self._ahead:
            try:
                self.step_once()
            except Exception as e:
                log.warning("a step run ahead on the worker could not be taken: %s: %s", type(e).__name__, e)

    def stop(self) -> None:
        """Ask a running ``run()`` to stop at the next step boundary (after the steps the worker already runs
        ahead, if any: ``runner.run_ahead``, about 0.1 s of them)."""
        self._stop = True

    @property
    def stopped(self) -> bool:
        """Whether the last ``run()`` ended because :meth:`stop` was called."""
        return self._stop

    # ------------------------------------------------------------------ metrics
    def _phase(self, name: str, t0: float, out: dict, dt: float | None = None) -> dict:
        """Record a phase's metrics and its time (``dt``, default: since ``t0``) for the step's record."""
        dt = time.perf_counter() - t0 if dt is None else dt
        self._pending[f"time/{name}_s"] = dt
        for k, v in out.items():
            if v is not None and k != "version" and isinstance(v, (int, float)):
                # memory/... keys are the process's, whichever phase reports them
                self._pending[k if k.startswith("memory/") else f"{name}/{k}"] = v
        out["time_s"] = dt
        return out

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

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    def save(self) -> Path:
        """Write a complete checkpoint atomically: into a temporary directory, then renamed.

        Every rank writes its own component state (big state stays on workers). A failure (disk
        full...) removes the partial directory and raises :class:`CheckpointError`; the previous
        complete checkpoint stays the latest. In asynchronous mode ``run()`` checkpoints with nothing in
        flight; a manual save while rollout runs ahead waits for it, and the batch it finished is not in
        the checkpoint: a resume from it drops that batch (a warning says so).
        """
        if getattr(self, "_in_flight", None) is not None:  # asynchronous mode, a manual save mid-pipeline
            self._settle_in_flight()
            log.warning(
                "checkpoint at step %d: rollout work was running ahead (algorithm.max_staleness); the batch it "
                "finished is not in the checkpoint, so a resume from it drops that batch (run() checkpoints "
                "with nothing in flight)",
                self.step,
            )
        final = self.checkpoint_dir / f"step_{self.step:06d}"
        tmp = self.checkpoint_dir / f".tmp-step_{self.step:06d}-{uuid.uuid4().hex[:6]}"
        for stale in self.checkpoint_dir.glob(".tmp-step_*"):  # left by a save that was killed
            shutil.rmtree(stale, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
            pending = [g.save_state(str(tmp)) for g in self.groups.values()]
            for res in pending:
                res.result()
            state = {
                "step": self.step,
                "placement": {k: list(v) for k, v in self.placement.slots.items()},
                **self._extra_state(),
            }
            _write_synced(tmp / "loop.json", json.dumps(state))
            self._save_extra(tmp)
            _write_synced(tmp / "COMPLETE", "ok\n")
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.checkpoint_dir)  # the rename itself survives a power cut
        except WorkerLostError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise  # a lost worker, not a disk problem: run() may recover from it
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"could not write checkpoint {final}: {type(e).__name__}: {e}") from e
        for old in complete_checkpoints(self.run_dir)[: -self.recipe.runner.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load_checkpoint(self, which: str | Path = "auto") -> int:
        """Restore every component and the loop state; ``"auto"`` picks the latest complete checkpoint,
        falling back (with a warning) to earlier ones if it cannot be read."""
        if str(which) != "auto":
            path = Path(which)
            if not (path / "COMPLETE").exists():
                raise CheckpointError(f"{path} is not a complete checkpoint (no COMPLETE marker)")
            return self._load_from(path)
        found = complete_checkpoints(self.run_dir)
        if not found:
            return self.step  # nothing saved yet: start fresh
        for i, path in enumerate(reversed(found)):
            try:
                return self._load_from(path)
            except CheckpointError as e:
                if i == len(found) - 1:
                    raise
                log.warning("%s; falling back to the previous complete checkpoint", e)
        raise AssertionError("unreachable")  # pragma: no cover

    def _load_from(self, path: Path) -> int:
        try:
            state = json.loads((path / "loop.json").read_text())
            for g in self.groups.values():
                g.load_state(str(path)).result()
        except RemoteError as e:
            if isinstance(e, WorkerLostError):
                raise
            raise CheckpointError(
                f"could not restore {path}: {e.component}[rank {e.rank}] failed to load "
                f"{e.component}_rank{e.rank}.pt: {e.args[0]}"
            ) from e
        except (OSError, ValueError) as e:
            raise CheckpointError(f"could not restore {path}: {type(e).__name__}: {e}") from e
        self.step = state["step"]
        self._load_extra_state(state)
        self.logger.truncate_after(self.step)
        return self.step

    def recover(self, timeout_s: float = 120.0) -> int:
        """After a lost worker: rebuild every component on the cluster's (restarted) workers and
        continue from the latest complete checkpoint (or from scratch if there is none).

        Returns the step the loop continues from.
        """
        old = dict(self.groups)
        self._free_components()
        self.cluster.refresh(timeout_s)
        if self.built_from_objects:  # the same classes and arguments, on the same slots
            self.groups = {role: g.relaunch() for role, g in old.items()}
        else:
            c = self.recipe.cluster
            self.placement = self.cluster.place(
                c.component_placement, required=self.COMPONENTS, known=self.COMPONENTS
            )
            self._launch()
        self._compose()
        self.step, self._pending = 0, {}
        self._reset_state()
        if complete_checkpoints(self.run_dir):
            return self.load_checkpoint("auto")
        self.logger.truncate_after(0)
        return 0

    # ------------------------------------------------------------------ lifecycle and display
    def _free_components(self) -> None:
        for ch in self.channels.values():
            with contextlib.suppress(Exception):  # a lost worker took its queues with it
                ch.close()
        for g in self.groups.values():
            with contextlib.suppress(Exception):
                g.shutdown()
        self.groups, self.channels = {}, {}

    def close(self) -> None:
        """Free the groups and channels (and the cluster, if this loop started it)."""
        self._free_components()
        if self.logger is not None:
            self.logger.close()
        if self._own_cluster and self.cluster is not None:
            self.cluster.close()
            self.cluster = None

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
