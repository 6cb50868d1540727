"""The embodied RL loop: env, rollout and actor groups placed on a cluster, stepped one phase at a time.

Example (one phase per notebook cell):
    >>> loop = Loop.from_recipe("ppo_cartpole")   # doctest: +SKIP
    >>> loop.sync_weights(); loop.rollout(); loop.advantages(); loop.train()   # doctest: +SKIP
    >>> loop.run(50)                                # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import html
import json
import logging
import os
import shutil
import time
import uuid
from collections import deque
from dataclasses import asdict
from pathlib import Path

import numpy as np

from rlnb.cluster.cluster import Cluster, default_cpu_slots
from rlnb.cluster.placement import COLLOCATED, resolve_placement
from rlnb.components.actor import PPOActor
from rlnb.components.env import Env
from rlnb.components.rollout import PolicyRollout
from rlnb.config.loader import load_recipe, to_yaml
from rlnb.config.schema import Recipe
from rlnb.errors import ConfigError, PlacementError, RemoteError, RlnbError, WorkerLostError
from rlnb.metrics import MetricLogger
from rlnb.runtime.channel import Channel
from rlnb.runtime.group import Group

log = logging.getLogger("rlnb")
COMPONENTS = ("env", "rollout", "actor")
EPISODE_WINDOW = 20  # episode statistics over the last 20 finished training episodes, as SB3 reports them


class CheckpointError(RlnbError, OSError):
    """A checkpoint could not be written or read; the previous complete checkpoint is untouched."""


class TrainingDivergedError(RlnbError, FloatingPointError):
    """The loss became NaN/inf; nothing was saved after it, the last good checkpoint is ``last_checkpoint``."""

    def __init__(self, message: str, step: int = -1, last_checkpoint: str | None = None):
        super().__init__(message)
        self.step, self.last_checkpoint = step, last_checkpoint


def default_run_dir(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


class Loop:
    """One RL step = ``sync_weights()`` -> ``rollout()`` -> ``advantages()`` -> ``train()``; each public.

    Args:
        recipe: a validated :class:`rlnb.config.Recipe`.
        cluster: a :class:`rlnb.Cluster`; ``None`` starts one from ``recipe.cluster`` (and closes it on ``close()``).
        run_dir: where metrics and checkpoints go (default ``recipe.runner.run_dir`` or ``runs/<name>-<time>``).
    """

    def __init__(self, recipe: Recipe, cluster: Cluster | None = None, run_dir: str | Path | None = None):
        t0 = time.perf_counter()
        self.recipe = recipe
        c = recipe.cluster
        if (
            cluster is None
        ):  # check the placement against the cluster we are about to start, before starting it
            expected = c.slots or default_cpu_slots()
            if c.address is None:
                resolve_placement(c.component_placement, expected, required=COMPONENTS, known=COMPONENTS)
            cluster = Cluster(c.address, slots=c.slots)
            self._own_cluster = True
        else:
            self._own_cluster = False
        self.cluster = cluster
        self.groups: dict[str, Group] = {}
        self.channels: dict[str, Channel] = {}
        try:
            self.placement = cluster.place(c.component_placement, required=COMPONENTS, known=COMPONENTS)
            for dev in (recipe.actor.device, recipe.rollout.device):
                cluster.check_device(dev)
            self._check_rank_counts()
            self.run_dir = Path(run_dir or recipe.runner.run_dir or default_run_dir(recipe.name))
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "recipe.yaml").write_text(to_yaml(recipe))
            self._launch()
        except BaseException:
            self.close()
            raise
        self.step = 0
        self.global_step = 0
        self.episodes: deque = deque(maxlen=EPISODE_WINDOW)
        self._pending: dict[str, float] = {}
        self._stop = False
        self.logger = MetricLogger(
            self.run_dir, recipe.runner.tensorboard, recipe.runner.wandb_project, asdict(recipe)
        )
        self.startup_s = time.perf_counter() - t0
        if recipe.runner.resume:
            self.load_checkpoint(recipe.runner.resume)

    @classmethod
    def from_recipe(cls, recipe, overrides=None, cluster: Cluster | None = None, run_dir=None) -> Loop:
        """Build from a recipe file or bundled name (``"ppo_cartpole"``) plus dotted overrides."""
        if not isinstance(recipe, Recipe):
            recipe = load_recipe(recipe, overrides)
        elif overrides:
            raise ConfigError(
                "pass overrides with a recipe path, or edit the Recipe object directly", "overrides"
            )
        return cls(recipe, cluster, run_dir)

    @classmethod
    def resume(cls, run_dir: str | Path, cluster: Cluster | None = None, overrides=None) -> Loop:
        """Rebuild a run from its directory and continue from its latest complete checkpoint."""
        run_dir = Path(run_dir)
        if not (run_dir / "recipe.yaml").exists():
            raise CheckpointError(f"{run_dir} is not a run directory (no recipe.yaml)")
        recipe = load_recipe(
            run_dir / "recipe.yaml", [*(overrides or []), "runner.resume=auto", f"runner.run_dir={run_dir}"]
        )
        return cls(recipe, cluster, run_dir)

    # ------------------------------------------------------------------ set-up
    def _check_rank_counts(self) -> None:
        p, e = self.placement, self.recipe
        n_env, n_roll, n_act = len(p["env"]), len(p["rollout"]), len(p["actor"])
        if n_env % n_roll:
            raise PlacementError(
                f"component_placement: {n_env} env rank(s) cannot be shared evenly by {n_roll} rollout rank(s); "
                "use a multiple", "component_placement"
            )  # fmt: skip
        if n_roll % n_act:
            raise PlacementError(
                f"component_placement: {n_roll} rollout rank(s) cannot feed {n_act} actor rank(s) evenly; "
                "place rollout on a multiple of the actor's slots", "component_placement"
            )  # fmt: skip
        per_actor = e.rollout.steps_per_rollout * e.env.num_envs * n_env // n_act
        if per_actor < e.algorithm.num_minibatches:
            raise ConfigError(
                f"algorithm.num_minibatches: {e.algorithm.num_minibatches} minibatches of a {per_actor}-sample batch "
                "per actor rank; lower it or raise rollout.steps_per_rollout x env.num_envs", "algorithm.num_minibatches"
            )  # fmt: skip

    def _launch(self) -> None:
        r, cl = self.recipe, self.cluster
        p = self.placement
        timeout = r.cluster.call_timeout_s
        self.env_local = p["env"] == p["rollout"]  # the rollout steps its env rank in-process
        self.batch_local = p["rollout"] == p["actor"]  # batches and weights move in-process
        self.groups["env"] = env = Group.launch(
            Env, cl, p["env"], kwargs={"config": asdict(r.env), "seed": r.seed, "gamma": r.algorithm.gamma},
            name="env", call_timeout_s=timeout,
        )  # fmt: skip
        obs_space, act_space = env.on(0).spaces().result()[0]
        self.groups["rollout"] = Group.launch(
            PolicyRollout, cl, p["rollout"], name="rollout", call_timeout_s=timeout,
            kwargs={"model": asdict(r.actor.model), "obs_space": obs_space, "act_space": act_space,
                    "gamma": r.algorithm.gamma, "seed": r.seed, "torch_threads": r.actor.torch_threads,
                    "device": r.rollout.device},
        )  # fmt: skip
        self.groups["actor"] = actor = Group.launch(
            PPOActor, cl, p["actor"], name="actor", call_timeout_s=timeout,
            kwargs={"actor": asdict(r.actor), "algorithm": asdict(r.algorithm), "obs_space": obs_space,
                    "act_space": act_space, "total_steps": r.runner.steps, "seed": r.seed},
        )  # fmt: skip
        if actor.world_size > 1:
            actor.init_process_group(timeout_s=min(timeout, 300))
            actor.setup_data_parallel().result()
        if not self.env_local:
            slot = p["rollout"][0]  # on the rollout's worker: its gets/puts skip the network
            self.channels["obs"] = Channel.create(cl, "obs", slot=slot, timeout_s=timeout)
            self.channels["actions"] = Channel.create(cl, "actions", slot=slot, timeout_s=timeout)
        if not self.batch_local:
            self.channels["batches"] = Channel.create(cl, "batches", slot=p["actor"][0], timeout_s=timeout)
            self.channels["weights"] = Channel.create(cl, "weights", slot=p["rollout"][0], timeout_s=timeout)

    @property
    def mode(self) -> str:
        """``collocated``, ``disaggregated`` or ``hybrid`` (from the placement)."""
        return self.placement.mode

    # ------------------------------------------------------------------ phases
    def sync_weights(self) -> dict:
        """Actor -> rollout weights, stamped with the policy version (= training steps done)."""
        t0 = time.perf_counter()
        actor, rollout = self.groups["actor"], self.groups["rollout"]
        if self.batch_local:
            rollout.call_each(
                "load_from_local_actor", [("actor", r, self.step) for r in rollout.ranks]
            ).result()
        else:
            ch = self.channels["weights"]
            keys = [f"w{r}" for r in rollout.ranks]
            done = rollout.call_each("load_from_channel", [(ch, k) for k in keys])
            actor.on(0).publish_weights(ch, keys, self.step).result()
            done.result()
        return self._phase("sync", t0, {"version": self.step})

    def rollout(self) -> dict:
        """Collect ``rollout.steps_per_rollout`` steps on every env; hand the batches to the actor ranks."""
        t0 = time.perf_counter()
        r = self.recipe
        T = r.rollout.steps_per_rollout
        env, rollout = self.groups["env"], self.groups["rollout"]
        if self.env_local and self.batch_local:  # the fast path: one call per rank does it all
            summaries = rollout.collect(T, "env", "actor").result()
            for s in summaries:
                self.episodes.extend(s.pop("episodes"))
        else:
            if self.env_local:
                summaries = rollout.collect(T, "env").result()
            else:
                obs_ch, act_ch = self.channels["obs"], self.channels["actions"]
                n_roll = rollout.world_size
                env_run = env.call_each("run", [(T, obs_ch, act_ch, f"env{e}") for e in env.ranks])
                served = rollout.call_each(
                    "serve",
                    [(T, obs_ch, act_ch, [f"env{e}" for e in env.ranks if e % n_roll == k], r.env.pipeline_stages)
                     for k in rollout.ranks],
                )  # fmt: skip
                summaries = served.result()
                env_run.result()
            for finished in env.pop_episodes().result():
                self.episodes.extend(finished)
            self._hand_batches()
        steps = sum(s["steps"] for s in summaries)
        self.global_step += steps
        dt = time.perf_counter() - t0
        out = {
            "steps": steps,
            "steps_per_s": steps / dt,
            "version": summaries[0]["version"],
            "episodes_finished": len(self.episodes),
        }
        out.update(self.episode_stats())
        return self._phase("rollout", t0, out)

    def _hand_batches(self) -> None:
        rollout, actor = self.groups["rollout"], self.groups["actor"]
        n_act = actor.world_size
        if self.batch_local:
            actor.call_each("take_local_batches", [("rollout", [a]) for a in actor.ranks]).result()
            return
        ch = self.channels["batches"]
        sent = rollout.call_each("put_batch", [(ch, f"b{k}") for k in rollout.ranks])
        actor.call_each(
            "take_channel_batches",
            [(ch, [f"b{k}" for k in rollout.ranks if k % n_act == a]) for a in actor.ranks],
        ).result()
        sent.result()

    def advantages(self) -> dict:
        """Advantage estimation on each actor rank's batch (``algorithm.advantage``)."""
        t0 = time.perf_counter()
        per_rank = self.groups["actor"].compute_advantages().result()
        return self._phase("advantages", t0, _mean_dicts(per_rank))

    def train(self) -> dict:
        """The update (epochs x minibatches, data-parallel over actor ranks); completes and logs the step."""
        t0 = time.perf_counter()
        try:
            per_rank = self.groups["actor"].train().result()
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
        out = self._phase("train", t0, _mean_dicts(per_rank))
        self.step += 1
        self._log_step(out)
        return out

    def step_once(self) -> dict:
        """All four phases; returns the step's metric record."""
        self.sync_weights()
        self.rollout()
        self.advantages()
        self.train()
        return self.logger.history[-1]

    def run(self, steps: int | None = None, progress: bool = True, live: bool = False) -> list[dict]:
        """Run ``steps`` steps (default ``runner.steps``) with evaluation, checkpoints and early stop.

        ``live=True`` shows the notebook dashboard (needs ipywidgets); ``progress`` a text progress bar.
        """
        r = self.recipe.runner
        steps = r.steps - self.step if steps is None else steps
        bar = None
        if live:
            from rlnb.widgets import show_dashboard

            show_dashboard(self, total=self.step + steps)
        elif progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=steps, desc=self.recipe.name, unit="step")
        self._stop = False
        records = []
        restarts = 0
        target = self.step + steps
        try:
            while self.step < target:
                try:
                    rec = self.step_once()
                    if r.eval_interval and self.step % r.eval_interval == 0:
                        self.evaluate()
                    if r.save_interval and self.step % r.save_interval == 0:
                        self.save()
                except WorkerLostError as e:
                    if restarts >= r.max_restarts:
                        raise
                    restarts += 1
                    log.warning("%s; recovering (%d/%d)", e, restarts, r.max_restarts)
                    self.recover()
                    if bar is not None:
                        bar.n = steps - (target - self.step)
                        bar.refresh()
                    continue
                records.append(rec)
                if bar is not None:
                    ret = rec.get("env/episode_return_mean")
                    bar.set_postfix_str(f"return {ret:.1f}" if ret is not None else "")
                    bar.update(1)
                if self._solved() or self._stop:
                    break
        finally:
            if bar is not None:
                bar.close()
        return records

    def stop(self) -> None:
        """Ask a running ``run()`` to stop at the next step boundary."""
        self._stop = True

    @property
    def stopped(self) -> bool:
        """Whether the last ``run()`` ended because :meth:`stop` was called."""
        return self._stop

    def _solved(self) -> bool:
        target = self.recipe.runner.stop_return
        stats = self.episode_stats()
        return (
            target is not None
            and len(self.episodes) >= EPISODE_WINDOW
            and stats["episode_return_mean"] >= target
        )

    def evaluate(self, episodes: int | None = None) -> dict:
        """Deterministic episodes on fresh envs (seeded apart from training); logs ``eval/return_mean``."""
        t0 = time.perf_counter()
        n = episodes or self.recipe.runner.eval_episodes
        res = (
            self.groups["rollout"]
            .on(0)
            .evaluate(asdict(self.recipe.env), n, self.recipe.seed + 1_000_003)
            .result()[0]
        )
        record = {f"eval/{k}": v for k, v in res.items()}
        record["time/eval_s"] = time.perf_counter() - t0
        self.logger.log(self.step, record)
        return record

    # ------------------------------------------------------------------ metrics
    def episode_stats(self) -> dict:
        if not self.episodes:
            return {"episode_return_mean": None, "episode_len_mean": None}
        return {
            "episode_return_mean": float(np.mean([e[0] for e in self.episodes])),
            "episode_len_mean": float(np.mean([e[1] for e in self.episodes])),
        }

    def _phase(self, name: str, t0: float, out: dict) -> dict:
        dt = time.perf_counter() - t0
        self._pending[f"time/{name}_s"] = dt
        for k, v in out.items():
            if v is not None and k != "version":
                self._pending[f"{name}/{k}"] = v
        out["time_s"] = dt
        return out

    def _log_step(self, train_out: dict) -> None:
        p = self._pending
        stats = self.episode_stats()
        record = {
            "global_step": self.global_step,
            "env/episode_return_mean": stats["episode_return_mean"],
            "env/episode_len_mean": stats["episode_len_mean"],
            "rollout/steps_per_s": p.get("rollout/steps_per_s"),
            "time/step_s": sum(v for k, v in p.items() if k.startswith("time/")),
        }
        for k, v in p.items():
            if k.startswith(("train/", "time/", "advantages/")):
                record[k] = v
        self.logger.log(self.step, record)
        self._pending = {}

    @property
    def history(self) -> list[dict]:
        return self.logger.history

    def sample(self, n: int = 4) -> dict:
        """The first ``n`` steps of rollout rank 0's last batch, to inspect in a notebook."""
        return self.groups["rollout"].on(0).sample(n).result()[0]

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    def save(self) -> Path:
        """Write a complete checkpoint atomically: into a temporary directory, then renamed.

        A failure (disk full...) removes the partial directory and raises :class:`CheckpointError`;
        the previous complete checkpoint stays the latest.
        """
        final = self.checkpoint_dir / f"step_{self.step:06d}"
        tmp = self.checkpoint_dir / f".tmp-step_{self.step:06d}-{uuid.uuid4().hex[:6]}"
        try:
            tmp.mkdir(parents=True)
            pending = [g.save_state(str(tmp)) for g in self.groups.values()]
            for res in pending:
                res.result()
            state = {
                "step": self.step,
                "global_step": self.global_step,
                "episodes": list(self.episodes),
                "placement": {k: list(v) for k, v in self.placement.slots.items()},
            }
            (tmp / "loop.json").write_text(json.dumps(state))
            (tmp / "COMPLETE").write_text("ok\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except WorkerLostError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise  # a lost worker, not a disk problem: run() may recover from it
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"could not write checkpoint {final}: {type(e).__name__}: {e}") from e
        self._prune_checkpoints()
        return final

    def _prune_checkpoints(self) -> None:
        complete = complete_checkpoints(self.run_dir)
        for old in complete[: -self.recipe.runner.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)

    def load_checkpoint(self, which: str | Path = "auto") -> int:
        """Restore every component and the loop state; ``"auto"`` picks the latest complete checkpoint."""
        if str(which) == "auto":
            found = complete_checkpoints(self.run_dir)
            if not found:
                return self.step  # nothing saved yet: start fresh
            path = found[-1]
        else:
            path = Path(which)
            if not (path / "COMPLETE").exists():
                raise CheckpointError(f"{path} is not a complete checkpoint (no COMPLETE marker)")
        try:
            state = json.loads((path / "loop.json").read_text())
            for g in self.groups.values():
                g.load_state(str(path)).result()
        except RemoteError as e:
            raise CheckpointError(
                f"could not restore {path}: {e.component}[rank {e.rank}] failed to load "
                f"{e.component}_rank{e.rank}.pt: {e.args[0]}"
            ) from e
        except (OSError, ValueError) as e:
            raise CheckpointError(f"could not restore {path}: {type(e).__name__}: {e}") from e
        self.step, self.global_step = state["step"], state["global_step"]
        self.episodes = deque((tuple(x) for x in state["episodes"]), maxlen=EPISODE_WINDOW)
        self.logger.truncate_after(self.step)
        return self.step

    def recover(self, timeout_s: float = 120.0) -> int:
        """After a lost worker: rebuild every component on the cluster's (restarted) workers and
        continue from the latest complete checkpoint (or from scratch if there is none).

        Returns the step the loop continues from.
        """
        for ch in self.channels.values():
            with contextlib.suppress(Exception):
                ch.close()
        for g in self.groups.values():
            with contextlib.suppress(Exception):
                g.shutdown()
        self.groups, self.channels = {}, {}
        self.cluster.refresh(timeout_s)
        c = self.recipe.cluster
        self.placement = self.cluster.place(c.component_placement, required=COMPONENTS, known=COMPONENTS)
        self._launch()
        self.step, self.global_step, self.episodes = 0, 0, deque(maxlen=EPISODE_WINDOW)
        self._pending = {}
        return (
            self.load_checkpoint("auto")
            if complete_checkpoints(self.run_dir)
            else self._restart_from_scratch()
        )

    def _restart_from_scratch(self) -> int:
        self.logger.truncate_after(0)
        return 0

    # ------------------------------------------------------------------ lifecycle and display
    def close(self) -> None:
        """Free the groups and channels (and the cluster, if this loop started it)."""
        for ch in self.channels.values():
            with contextlib.suppress(Exception):  # a lost worker took its queues with it
                ch.close()
        for g in self.groups.values():
            g.shutdown()
        self.groups, self.channels = {}, {}
        if getattr(self, "logger", None) is not None:
            self.logger.close()
        if self._own_cluster and self.cluster is not None:
            self.cluster.close()
            self.cluster = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"<rlnb.Loop {self.recipe.name} step={getattr(self, 'step', 0)} mode={self.placement.mode}>"

    def _repr_html_(self) -> str:
        last = self.history[-1] if self.history else {}
        rows = "".join(
            f"<tr><td>{html.escape(c)}</td><td>{', '.join(map(str, s))}</td></tr>"
            for c, s in self.placement.slots.items()
        )
        keys = (
            "env/episode_return_mean",
            "train/policy_loss",
            "train/value_loss",
            "train/approx_kl",
            "rollout/steps_per_s",
        )
        metrics = "".join(
            f"<tr><td>{k}</td><td>{last[k]:.4g}</td></tr>"
            for k in keys
            if isinstance(last.get(k), (int, float))
        )
        return (
            f"<div><b>rlnb Loop</b> <code>{html.escape(self.recipe.name)}</code> · step {self.step} · "
            f"{self.global_step} env steps · {self.placement.mode} · run dir <code>{html.escape(str(self.run_dir))}</code>"
            f"<table><tr><th>component</th><th>slots</th></tr>{rows}</table>"
            f"<table><tr><th>metric</th><th>last</th></tr>{metrics}</table></div>"
        )


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (partial ``.tmp-*`` directories are ignored)."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    return sorted(p for p in root.glob("step_*") if (p / "COMPLETE").exists())


def _mean_dicts(dicts: list[dict]) -> dict:
    keys = dicts[0].keys()
    return {
        k: float(np.mean([d[k] for d in dicts]))
        for k in keys
        if all(isinstance(d.get(k), (int, float)) for d in dicts)
    }


__all__ = ["COLLOCATED", "CheckpointError", "Loop", "TrainingDivergedError", "complete_checkpoints"]
