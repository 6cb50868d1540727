"""The embodied RL loop: env, rollout and actor groups placed on a cluster, stepped one phase at a time.

Example (one phase per notebook cell):
    >>> loop = Loop.from_recipe("ppo_cartpole")   # doctest: +SKIP
    >>> loop.sync_weights(); loop.rollout(); loop.advantages(); loop.train()   # doctest: +SKIP
    >>> loop.run(50)                                # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict

import numpy as np

from rlnb.algorithms import get_advantage, get_policy_loss
from rlnb.components.actor import PPOActor
from rlnb.components.env import Env
from rlnb.components.rollout import PolicyRollout
from rlnb.errors import ConfigError, PlacementError
from rlnb.loop.base import CheckpointError, LoopBase, TrainingDivergedError, complete_checkpoints
from rlnb.runtime.channel import Channel
from rlnb.runtime.group import Group

EPISODE_WINDOW = 20  # episode statistics over the last 20 finished training episodes, as SB3 reports them


class Loop(LoopBase):
    """One RL step = ``sync_weights()`` -> ``rollout()`` -> ``advantages()`` -> ``train()``; each public.

    Placement decides the data paths: env and rollout on the same slots step in-process (the fast
    path); otherwise observations and actions flow through channels, with ``env.pipeline_stages``
    stages interleaved. Actor and rollout on the same slots swap weights and batches in-process.

    Args:
        recipe: a validated :class:`rlnb.config.Recipe`.
        cluster: a :class:`rlnb.Cluster`; ``None`` starts one from ``recipe.cluster`` (and closes it on ``close()``).
        run_dir: where metrics and checkpoints go (default ``recipe.runner.run_dir`` or ``runs/<name>-<time>``).
    """

    COMPONENTS = ("env", "rollout", "actor")
    SUMMARY_KEYS = (
        "env/episode_return_mean",
        "train/policy_loss",
        "train/value_loss",
        "train/approx_kl",
        "rollout/steps_per_s",
    )

    # ------------------------------------------------------------------ set-up
    def _check_rank_counts(self) -> None:
        super()._check_rank_counts()
        p, e = self.placement, self.recipe
        n_env, n_roll, n_act = len(p["env"]), len(p["rollout"]), len(p["actor"])
        if n_env % n_roll:
            raise PlacementError(
                f"component_placement: {n_env} env rank(s) cannot be shared evenly by {n_roll} rollout rank(s); "
                "use a multiple", "component_placement"
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
                    "act_space": act_space, "total_steps": r.runner.steps, "seed": r.seed,
                    "advantage_fn": get_advantage(r.algorithm.advantage), "loss_fn": get_policy_loss(r.algorithm.policy_loss)},
        )  # fmt: skip
        if actor.world_size > 1:
            actor.init_process_group(timeout_s=min(timeout, 300))
            actor.setup_data_parallel().result()
        if not self.env_local:
            slot = p["rollout"][0]  # on the rollout's worker: its gets/puts skip the network
            self.channels["obs"] = Channel.create(cl, "obs", slot=slot, timeout_s=timeout)
            self.channels["actions"] = Channel.create(cl, "actions", slot=slot, timeout_s=timeout)
        self._launch_links()

    def _reset_state(self) -> None:
        self.global_step = 0
        self.episodes: deque = deque(maxlen=EPISODE_WINDOW)

    def _extra_state(self) -> dict:
        return {"global_step": self.global_step, "episodes": list(self.episodes)}

    def _load_extra_state(self, state: dict) -> None:
        self.global_step = state["global_step"]
        self.episodes = deque((tuple(x) for x in state["episodes"]), maxlen=EPISODE_WINDOW)

    # ------------------------------------------------------------------ phases
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
        self._sync()  # evaluate the current weights
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

    def _log_step(self, train_out: dict) -> None:
        stats = self.episode_stats()
        self._log_record(
            {
                "global_step": self.global_step,
                "env/episode_return_mean": stats["episode_return_mean"],
                "env/episode_len_mean": stats["episode_len_mean"],
                "rollout/steps_per_s": self._pending.get("rollout/steps_per_s"),
            }
        )

    def summary(self) -> str:
        ret = self.episode_stats()["episode_return_mean"]
        return f"step {self.step}, {self.global_step} env steps; train return (last 20) " + (
            "n/a" if ret is None else f"{ret:.1f}"
        )

    def sample(self, n: int = 4) -> dict:
        """The first ``n`` steps of rollout rank 0's last batch, to inspect in a notebook."""
        return self.groups["rollout"].on(0).sample(n).result()[0]


__all__ = ["CheckpointError", "Loop", "TrainingDivergedError", "complete_checkpoints"]
