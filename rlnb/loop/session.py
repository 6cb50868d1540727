"""A run's session: what it has on the cluster and on disk, from launch (or adoption of launched components) to
close. The cluster (started here, or given), the placement, the groups and channels, the run directory and its
lock, the metric logger, and the step count with the metrics of the step under way.

Families and schedules work through it; none of them owns the cluster or the run directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from rlnb.cluster.cluster import Cluster, default_cpu_slots
from rlnb.cluster.placement import Placement, resolve_placement
from rlnb.config.loader import load_recipe, to_yaml
from rlnb.config.schema import Recipe, RunnerConfig
from rlnb.errors import ComponentError, ConfigError, PlacementError, RemoteError
from rlnb.files import write_private
from rlnb.loop import run_dir as run_dirs
from rlnb.loop.phase import Phase
from rlnb.metrics import MetricLogger
from rlnb.runtime.channel import Channel
from rlnb.runtime.group import SHUTDOWN_TIMEOUT_S, Group, shutdown_groups

log = logging.getLogger("rlnb")


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


# a phase's metrics logged under their own names, not the phase's (sync/: a weight sync run inside another phase)
QUALIFIED = ("memory/", "rollout/is_", "sync/", "cluster/")


class Session:
    """A run's cluster, components, run directory, logger and step.

    Args:
        recipe: the validated recipe (the session and the loop share it; steering changes it as the run goes on).
        run_dir: where metrics and checkpoints go (default ``recipe.runner.run_dir`` or ``runs/<name>-<time>``).
        read_only: open ``run_dir`` without writing to it: no lock, no metrics, no recipe written, no checkpoint.

    Attributes:
        cluster, placement, groups, channels: the run's components on the cluster (``groups``: role -> group).
        step: training steps done. pending: the metrics of the step under way (``{phase}/...``, ``time/...``).
        run_target: the step the running ``run()`` stops at (``None`` outside ``run()``).
    """

    def __init__(self, recipe: Recipe, run_dir: str | Path | None = None, read_only: bool = False):
        from rlnb.loop.checkpoint import default_run_dir

        self.recipe, self.read_only = recipe, read_only
        self.cluster: Cluster | None = None
        self.own_cluster = False
        self.placement: Placement | None = None
        self.groups: dict[str, Group] = {}
        self.channels: dict[str, Channel] = {}
        self.logger: MetricLogger | None = None
        self.step = 0
        self.pending: dict[str, float] = {}
        self.run_target: int | None = None
        self.run_dir = Path(run_dir or recipe.runner.run_dir or default_run_dir(recipe.name))
        self.lock: run_dirs.RunDirLock | None = None

    def lock_run_dir(self) -> None:
        """Check, create and lock the run directory, before anything starts (see :mod:`rlnb.loop.run_dir`)."""
        r = self.recipe.runner
        if not self.read_only:
            self.lock = run_dirs.take(self.run_dir, r.resume, r.overwrite)

    # ------------------------------------------------------------------ the cluster and the components
    def start_cluster(self, cluster: Cluster | None, roles: tuple[str, ...], check_layout) -> None:
        """Use ``cluster``, or start one from ``recipe.cluster`` (closed with the session), checking the planned
        placement with ``check_layout(slots)`` before it starts."""
        c = self.recipe.cluster
        if cluster is None:
            if c.address is None:
                planned = resolve_placement(
                    c.component_placement, c.slots or default_cpu_slots(), required=roles, known=roles
                )
                check_layout(planned.slots)
            cluster = Cluster(c.address, slots=c.slots)
            self.own_cluster = True
        self.cluster = cluster

    def place(self, roles: tuple[str, ...]) -> None:
        """The recipe's placement on the cluster, and the devices it asks of the actor and rollout."""
        c, cluster = self.recipe.cluster, self.cluster
        # a cluster object handed in may have lost or gained workers since it read its slots (a scale, a restart)
        _, gone = cluster.update_slots()
        self.placement = cluster.place(c.component_placement, required=roles, known=roles)
        left = sorted({i for slots in self.placement.slots.values() for i in slots} & set(gone))
        if left:
            raise PlacementError(
                f"component_placement: slot(s) {left} have no worker now (it left the cluster, and none took its "
                f"place); the cluster's workers: {cluster.num_slots - len(gone)} of {cluster.num_slots} slots",
                "component_placement",
            )
        for key, dev in (
            ("actor.device", self.recipe.actor.device),
            ("rollout.device", self.recipe.rollout.device),
        ):
            cluster.check_device(dev, key)

    def adopt(self, components: dict, roles: dict[str, tuple[type, str]]) -> None:
        """Take groups launched by the user (``Env.launch(...)``...): each a launched group of a class that has
        the methods of its role (``roles``: role -> ``(protocol, built-in to subclass)``), on one cluster, under
        distinct names."""
        from rlnb.loop.roles import check_role

        names: dict[str, str] = {}
        for role, (protocol, builtin) in roles.items():
            group = components.get(role)
            if group is None:
                raise ConfigError(
                    f"missing component {role!r}; pass {role}=<Cls>.launch(cluster, slots, ...)", role
                )
            if not isinstance(group, Group):
                raise ComponentError(
                    f"expected a launched group (e.g. {role}=PolicyRollout.launch(cluster, '0', ...)), "
                    f"got {type(group).__name__}; rlnb.launch(MyClass, cluster, slots, ...) places a class of your own",
                    role, type(group).__name__, role,
                )  # fmt: skip
            check_role(group, role, protocol, builtin)
            if group.name in names:
                raise ConfigError(
                    f"{role} and {names[group.name]} are both named {group.name!r}; launch one with name=...",
                    role,
                )
            names[group.name] = role
        if len({id(components[r].cluster) for r in roles}) > 1:
            raise ConfigError("components were launched on different clusters; use one cluster", "cluster")
        self.groups = {role: components[role] for role in roles}
        self.placement = Placement({role: tuple(i.slot for i in g.infos) for role, g in self.groups.items()})
        self.cluster = next(iter(self.groups.values())).cluster

    def record_components(self, **sections) -> None:
        """Objects path: the recipe records what the launched components were built with (the actor's
        algorithm, ``sections`` read from others, the placement)."""
        from rlnb.config.schema import AlgorithmConfig

        described = self.groups["actor"].on(0).describe().result()[0]
        algorithm = AlgorithmConfig(**described["algorithm"])
        algorithm.advantage, algorithm.policy_loss = described["advantage"], described["policy_loss"]
        if described.get("actor") is not None:  # what the actor trains with, not the schema's defaults
            sections.setdefault("actor", described["actor"])
        self.recipe = dataclasses.replace(self.recipe, algorithm=algorithm, **sections)
        self.recipe.cluster.component_placement = {
            k: ",".join(map(str, v)) for k, v in self.placement.slots.items()
        }

    def bind_checked(self, results) -> list:
        """Results of set-up calls on the user's components; a :class:`ComponentError` raised on a worker is
        raised here as itself (it names the component, the object and what does not fit)."""
        try:
            return [r.result() for r in results]
        except RemoteError as e:
            if isinstance(e.__cause__, ComponentError):
                raise e.__cause__ from None
            if isinstance(e.__cause__, ConfigError):
                raise ConfigError(f"{e.component}: {e.__cause__}", e.__cause__.key) from None
            raise

    def open_logger(self) -> None:
        r = self.recipe.runner
        self.logger = MetricLogger(self.run_dir, r.tensorboard, r.wandb_project, asdict(self.recipe),
                                   read_only=self.read_only)  # fmt: skip

    def write_recipe(self) -> None:
        """The run's ``recipe.yaml`` as the recipe is now (a resume continues with it)."""
        if not self.read_only and self.run_dir.exists():
            write_private(self.run_dir / "recipe.yaml", to_yaml(self.recipe))

    # ------------------------------------------------------------------ the step's metrics
    @contextlib.contextmanager
    def timed(self, name: str, duration_s: float | None = None, **metrics) -> Iterator[Phase]:
        """Time one phase of the step: the ``with`` block fills in ``phase.metrics``; on leaving it they and the
        phase's time go into the step's record as ``{name}/...`` and ``time/{name}_s`` (``phase.metrics`` gets
        ``time_s``). ``duration_s``: the time where it was measured elsewhere (a chain's call on the worker),
        else the block's wall time. A phase that raises records nothing.

        Example:
            >>> with session.timed("sync", version=session.step) as phase:  # doctest: +SKIP
            ...     paths.sync(session.step)
        """
        phase = Phase(name, dict(metrics), duration_s)
        yield phase
        dt = phase.elapsed_s()
        self.pending[f"time/{name}_s"] = dt
        for k, v in phase.metrics.items():
            if v is not None and k != "version" and isinstance(v, (int, float)):
                # memory/... keys are the process's, whichever phase reports them; rollout/is_... the engine's
                # mismatch, measured where the actor trains
                self.pending[k if k.startswith(QUALIFIED) else f"{name}/{k}"] = v
        phase.metrics["time_s"] = dt

    def log_record(self, record: dict) -> dict:
        """Merge the pending phase metrics (train/, time/, advantages/...) into ``record`` and log it."""
        p = self.pending
        record = {**record, "time/step_s": sum(v for k, v in p.items() if k.startswith("time/"))}
        for k, v in p.items():
            if k.startswith(("train/", "time/", "advantages/", "steer/", "sync/", *QUALIFIED)):
                record[k] = v
        self.pending = {}
        return self.logger.log(self.step, record)

    # ------------------------------------------------------------------ lifecycle
    def free_components(self) -> None:
        """Close the channels and shut the groups down, all within one deadline (a hung worker's included)."""
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for ch in self.channels.values():
            with contextlib.suppress(Exception):  # a lost worker took its queues with it
                ch.close(timeout_s=max(0.1, deadline - time.monotonic()))
        shutdown_groups(list(self.groups.values()), max(0.1, deadline - time.monotonic()))
        self.groups, self.channels = {}, {}

    def close(self) -> None:
        """Free the groups and channels, the logger, the cluster if the session started it, and the lock."""
        self.free_components()
        if self.logger is not None:
            self.logger.close()
        if self.own_cluster and self.cluster is not None:
            self.cluster.close()
            self.cluster = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None
