"""The embodied RL loop: env, rollout and actor groups placed on a cluster, stepped one phase at a time.

Example (one phase per notebook cell):
    >>> loop = Loop.from_recipe("ppo_cartpole")   # doctest: +SKIP
    >>> loop.sync_weights(); loop.rollout(); loop.advantages(); loop.train()   # doctest: +SKIP
    >>> loop.run(50)                                # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
from collections import deque
from pathlib import Path

from rlnb.algorithms.contract import EMBODIED, check_algorithm
from rlnb.components.actor import PPOActor
from rlnb.components.env import Env, success_rate
from rlnb.components.rollout import PolicyRollout
from rlnb.config.schema import Recipe
from rlnb.config.sections_lm import RolloutConfig
from rlnb.envs.gym_envs import probe_env
from rlnb.errors import ConfigError, PlacementError
from rlnb.loop.asynchronous import EmbodiedAsynchronous, Settled
from rlnb.loop.base import LoopBase, Phase, count_or_default, objects_recipe
from rlnb.loop.chained import EPISODE_WINDOW, RoundTrips
from rlnb.loop.checkpoint import (
    MAX_STEP,
    CheckpointError,
    ListOf,
    Num,
    TrainingDivergedError,
    complete_checkpoints,
)
from rlnb.models.policies import check_spaces
from rlnb.runtime.chain import RunAhead
from rlnb.runtime.channel import Channel


class Loop(RoundTrips, EmbodiedAsynchronous, LoopBase):
    """One RL step = ``sync_weights()`` -> ``rollout()`` -> ``advantages()`` -> ``train()``; each public.

    Placement decides the data paths: env and rollout on the same slots step in-process (the fast
    path); otherwise observations and actions flow through channels, with ``env.pipeline_stages``
    stages interleaved. Actor and rollout on the same slots swap weights and batches in-process.

    Build it from a recipe (``Loop.from_recipe("ppo_cartpole")``) or from components you launched::

        env = rlnb.Env.launch(cluster, "0", make_env=MyEnv, num_envs=8)
        rollout = rlnb.PolicyRollout.launch(cluster, "0", policy=MyPolicy)
        actor = rlnb.PPOActor.launch(cluster, "0", policy=MyPolicy, advantage="gae", lr=1e-3)
        loop = rlnb.Loop(env=env, rollout=rollout, actor=actor, steps_per_rollout=64)

    The recipe path launches the same classes through the same ``launch`` calls.

    Args:
        recipe: a validated :class:`rlnb.config.Recipe` (the recipe path).
        cluster: a :class:`rlnb.Cluster`; ``None`` starts one from ``recipe.cluster`` (and closes it on ``close()``).
        run_dir: where metrics and checkpoints go (default ``recipe.runner.run_dir`` or ``runs/<name>-<time>``).
        env, rollout, actor: launched groups (the objects path); the loop owns them from then on
            (``close()`` shuts them down). Subclasses of the built-ins, or classes with the same methods.
        steps_per_rollout: objects path: env steps per env per training step (T).
        runner: objects path: a :class:`rlnb.config.RunnerConfig` (or dict): steps, checkpoints, stop_return...
        name: objects path: the run's name (run directory, views).
        seed: objects path: seed of evaluation episodes.
        read_only: open ``run_dir`` without writing to it (see :class:`rlnb.loop.base.LoopBase`).
    """

    COMPONENTS = ("env", "rollout", "actor")
    ROLE_METHODS = {
        "env": ("spaces", "spec", "run", "pop_episodes", "current_obs", "step", "state_dict", "load_state_dict"),
        "rollout": ("bind_spaces", "collect", "serve", "load_weights", "load_from_local_actor",
                    "load_from_channel", "put_batch", "take_batch", "evaluate", "sample"),
        "actor": ("bind_spaces", "describe", "set_batch", "take_local_batches", "take_channel_batches",
                  "compute_advantages", "train", "policy_state", "publish_weights", "set_total_steps",
                  "state_dict", "load_state_dict"),
    }  # fmt: skip
    ROLE_BASES = {"env": "rlnb.Env", "rollout": "rlnb.PolicyRollout", "actor": "rlnb.PPOActor"}
    STATE = {
        "global_step": Num(0, MAX_STEP),
        "episodes": ListOf(ListOf(max_len=3), max_len=EPISODE_WINDOW),
        "rollout_version?": Num(0, MAX_STEP, optional=True),
        "in_flight_dropped?": bool,  # (checkpoints before in_flight.pt was written: the batch was dropped)
    }
    SUMMARY_KEYS = (
        "env/episode_return_mean",
        "train/policy_loss",
        "train/value_loss",
        "train/approx_kl",
        "rollout/steps_per_s",
    )

    def __init__(
        self,
        recipe: Recipe | None = None,
        cluster=None,
        run_dir=None,
        *,
        env=None,
        rollout=None,
        actor=None,
        steps_per_rollout: int = 128,
        runner=None,
        name: str = "custom",
        seed: int = 1,
        read_only: bool = False,
    ):
        components = {"env": env, "rollout": rollout, "actor": actor}
        if recipe is None:
            if all(c is None for c in components.values()):
                raise ConfigError(
                    "Loop: pass a recipe (Loop.from_recipe('ppo_cartpole')) or env=, rollout=, actor= "
                    "groups (Env.launch(cluster, '0', ...)...)",
                    "recipe",
                )
            recipe = objects_recipe(
                name,
                seed,
                runner,
                loop="embodied",
                rollout=RolloutConfig(steps_per_rollout=steps_per_rollout),
            )
            super().__init__(recipe, None, run_dir, components=components)
        elif any(c is not None for c in components.values()):
            raise ConfigError(
                "Loop: pass either a recipe or env=, rollout=, actor= groups, not both", "recipe"
            )
        else:
            super().__init__(recipe, cluster, run_dir, read_only=read_only)

    # ------------------------------------------------------------------ set-up
    @classmethod
    def check_layout(cls, slots) -> None:
        """Refuse layouts that cannot run, before anything starts: env and rollout sharing some slots
        but not all would put two blocking calls (``Env.run`` and ``PolicyRollout.serve``, which wait on
        each other through channels) on one worker's single actor thread."""
        env, rollout = set(slots["env"]), set(slots["rollout"])
        shared = sorted(env & rollout)
        if shared and env != rollout:
            raise PlacementError(
                f"component_placement: env {sorted(env)} and rollout {sorted(rollout)} share slot(s) {shared} but "
                "not all their slots; when they differ they step through channels, and two blocking calls on "
                "one worker would wait on each other. Place env and rollout on the same slots (stepped "
                "in-process) or on disjoint ones",
                "component_placement",
            )

    def _check_rank_counts(self) -> None:
        super()._check_rank_counts()
        placement, recipe = self.placement, self.recipe
        n_env, n_roll, n_act = len(placement["env"]), len(placement["rollout"]), len(placement["actor"])
        if n_env % n_roll:
            raise PlacementError(
                f"component_placement: {n_env} env rank(s) cannot be shared evenly by {n_roll} rollout rank(s); "
                "use a multiple", "component_placement"
            )  # fmt: skip
        self.check_layout(placement.slots)
        self._check_async_apart("{'env,rollout': 0, actor: 1}")
        envs_per_rollout = recipe.env.num_envs * n_env // n_roll
        if n_act > n_roll and envs_per_rollout % (n_act // n_roll):
            raise PlacementError(
                f"component_placement: each of the {n_roll} rollout rank(s) steps {envs_per_rollout} envs, which "
                f"cannot be split evenly over {n_act // n_roll} actor ranks; make env.num_envs a multiple",
                "component_placement",
            )
        per_actor = recipe.rollout.steps_per_rollout * recipe.env.num_envs * n_env // n_act
        if per_actor < recipe.algorithm.num_minibatches:
            raise ConfigError(
                f"algorithm.num_minibatches: {recipe.algorithm.num_minibatches} minibatches of a {per_actor}-sample batch "
                "per actor rank; lower it or raise rollout.steps_per_rollout x env.num_envs", "algorithm.num_minibatches"
            )  # fmt: skip

    def _check_here(self) -> None:
        """One env of the recipe built, reset and stepped here (:func:`rlnb.envs.gym_envs.probe_env`): an
        ``env.kwargs`` value of the wrong type, or spaces the built-in policy cannot take (a Dict or Tuple
        observation), is refused before the cluster starts, not where a worker builds the env."""
        env = self.recipe.env
        spaces = probe_env(env.id, env.kwargs) if isinstance(env.id, str) else None
        if spaces is not None:
            check_spaces(*spaces)

    def _check_cluster(self) -> None:
        if self.recipe.env.vector_mode == "async":
            self.cluster.check_children(
                self.placement["env"], "env.vector_mode=async (gymnasium AsyncVectorEnv)"
            )

    def _launch(self) -> None:
        """The recipe path: the same public ``launch`` calls a notebook makes."""
        r, cl, p = self.recipe, self.cluster, self.placement
        timeout = r.cluster.call_timeout_s
        self.groups["env"] = Env.launch(
            cl, p["env"], config=r.env, seed=r.seed, gamma=r.algorithm.gamma, call_timeout_s=timeout
        )
        self.groups["rollout"] = PolicyRollout.launch(
            cl, p["rollout"], model=r.actor.model, gamma=r.algorithm.gamma, seed=r.seed,
            torch_threads=r.actor.torch_threads, device=r.rollout.device, call_timeout_s=timeout,
        )  # fmt: skip
        # registry entries resolved here travel by value: ones registered in a notebook cell work too
        advantage, loss = check_algorithm(EMBODIED, r.algorithm.advantage, r.algorithm.policy_loss)
        self.groups["actor"] = PPOActor.launch(
            cl, p["actor"], actor=r.actor, algorithm=r.algorithm, total_steps=r.runner.steps, seed=r.seed,
            advantage=advantage, policy_loss=loss, call_timeout_s=timeout,
        )  # fmt: skip

    def _compose(self) -> None:
        env, rollout, actor = (self.groups[k] for k in self.COMPONENTS)
        p = self.placement
        obs_space, act_space = self.spaces = env.on(0).spaces().result()[0]
        self.env_spec = env.on(0).spec().result()[0]
        self._bind_checked(
            [rollout.bind_spaces(obs_space, act_space), actor.bind_spaces(obs_space, act_space)]
        )
        if self.built_from_objects:
            self._record_components(env=self.env_spec["config"])
        actor.set_total_steps(self.recipe.runner.steps).result()
        timeout = actor.call_timeout_s
        self.env_local = p["env"] == p["rollout"]  # the rollout steps its env rank in-process
        if actor.world_size > 1:
            actor.init_process_group(timeout_s=min(timeout, 300))
            actor.setup_data_parallel().result()
        if not self.env_local:
            slot = p["rollout"][0]  # on the rollout's worker: its gets/puts skip the network
            # (no byte bound: the loop's own protocol bounds them, one step of observations in flight per stage)
            self.channels["obs"] = Channel.create(
                self.cluster, "obs", slot=slot, timeout_s=timeout, max_bytes=0
            )
            self.channels["actions"] = Channel.create(
                self.cluster, "actions", slot=slot, timeout_s=timeout, max_bytes=0
            )
        self._launch_links()

    def _reset_state(self) -> None:
        self.global_step = 0
        self.episodes: deque = deque(maxlen=EPISODE_WINDOW)
        self._in_flight: list | None = None  # the collection running ahead (asynchronous mode)
        self._rollout_version: int | None = None  # the policy version on the rollout ranks
        self._ahead = False  # whether steps ran or run ahead that step_once has not taken yet (see there)
        self._running_ahead: RunAhead | None = None  # the block of steps the worker runs ahead now
        self._taken: deque = deque()  # steps answered by the worker, not yet finished here: (ChainResult, s)
        self._paced: tuple | None = None  # (when, self.step) at the last request for steps (_take_steps)
        self.steps_ahead = 0  # steps the worker ran ahead of the driver (step_once)

    def _extra_state(self) -> dict:
        state = {"global_step": self.global_step, "episodes": list(self.episodes)}
        if self.max_staleness:
            state["rollout_version"] = self._rollout_version
        return state

    def _load_extra_state(self, state: dict) -> None:
        self.global_step = state["global_step"]
        self.episodes = deque((tuple(x) for x in state["episodes"]), maxlen=EPISODE_WINDOW)
        self._settle_in_flight()
        self._in_flight = None  # (a checkpoint's work in flight is restored after this: _restore_in_flight)
        self._rollout_version = state.get("rollout_version")

    # ------------------------------------------------------------------ phases
    def rollout(self) -> dict:
        """Collect ``rollout.steps_per_rollout`` steps on every env; hand the batches to the actor ranks.

        With ``algorithm.max_staleness`` N >= 1 it hands over the batch already collected (or in flight)
        and starts collecting the next one at once, so that collection overlaps :meth:`train`. Weights
        reach the rollout ranks only when the pipeline is empty or admission needs them: a batch made
        by policy version ``v`` is trained at version ``t`` only if ``t - v <= N``.
        """
        with self.timed("rollout") as phase:
            if not self.max_staleness:
                self._rollout_metrics(phase, self._finish_rollout(self._start_rollout()), {})
            else:
                self._rollout_ahead(phase)
        return phase.metrics

    def _rollout_ahead(self, phase: Phase) -> None:
        """The asynchronous rollout: hand over the batch in flight, start the next
        (:meth:`rlnb.loop.asynchronous.Asynchronous._take_ahead`)."""
        if self._in_flight is None:  # an empty pipeline (first step, after a checkpoint or evaluation)
            self._sync_rollout()
            self._in_flight = self._start_rollout()
        self._rollout_metrics(phase, *self._take_ahead(self._start_rollout, self._finish_rollout))

    def _start_rollout(self) -> list:
        """Start collecting (returns the pending calls); the batches stay on the rollout ranks."""
        T = self.recipe.rollout.steps_per_rollout
        env, rollout = self.groups["env"], self.groups["rollout"]
        if self.env_local and self.batch_local:  # the fast path: one call per rank does it all
            return [rollout.collect(T, env.name, self.groups["actor"].name)]
        if self.env_local:
            return [rollout.collect(T, env.name)]
        obs_ch, act_ch = self.channels["obs"], self.channels["actions"]
        n_roll = rollout.world_size
        env_run = env.call_each("run", [(T, obs_ch, act_ch, f"env{e}") for e in env.ranks])
        served = rollout.call_each(
            "serve",
            [(T, obs_ch, act_ch, [f"env{e}" for e in env.ranks if e % n_roll == k], self.recipe.env.pipeline_stages)
             for k in rollout.ranks],
        )  # fmt: skip
        return [served, env_run]

    def _finish_rollout(self, pending: list) -> list[dict]:
        """Wait for a started collection and hand its batches to the actor ranks; its summaries."""
        summaries = pending[0].result()
        for other in pending[1:]:
            other.result()
        if self.env_local and self.batch_local:
            for s in summaries:
                self.episodes.extend(s.pop("episodes"))
            return summaries
        for finished in self.groups["env"].pop_episodes().result():
            self.episodes.extend(finished)
        self._hand_batches(pending[0].batches if isinstance(pending[0], Settled) else None)
        return summaries

    def _rollout_metrics(self, phase: Phase, summaries: list[dict], extra: dict) -> None:
        """The rollout phase's metrics into ``phase``, from the ranks' summaries (``extra``: the mode's own)."""
        steps = sum(s["steps"] for s in summaries)
        self.global_step += steps
        dt = phase.elapsed_s()
        out = {
            "steps": steps,
            "steps_per_s": steps / dt,
            "version": summaries[0]["version"],
            "episodes_finished": len(self.episodes),
            **extra,
        }
        for key in ("env_s", "inference_s"):  # the collocated path times its work (the slowest rank's)
            if all(key in s for s in summaries):
                out[key] = max(s[key] for s in summaries)
        out.update(self.episode_stats())
        phase.metrics.update(out)

    def _solved(self) -> bool:
        target = self.recipe.runner.stop_return
        stats = self.episode_stats()
        return (
            target is not None
            and len(self.episodes) >= EPISODE_WINDOW
            and stats["episode_return_mean"] >= target
        )

    def evaluate(self, episodes: int | None = None) -> dict:
        """Deterministic episodes on fresh envs (seeded apart from training); logs ``eval/return_mean``.
        ``episodes``: default ``runner.eval_episodes``. In asynchronous mode a collection running ahead (a run
        stopped early, a notebook stepping) is let finish first, and its batch kept for the next step."""
        n = count_or_default(episodes, "episodes", self.recipe.runner.eval_episodes)
        t0 = time.perf_counter()
        # asynchronous mode: the collection running ahead finishes first; its batch (with the policy version it
        # was made with) is kept for the next rollout(), and the rollout ranks then take the current weights
        self._settle_in_flight()
        self._sync_rollout()  # evaluate the current weights
        args = (self.env_spec, n, self.recipe.seed + 1_000_003)
        # observations normalised as in training: with env rank 0's statistics as they are now, frozen (not
        # passed without them, so a rollout's own evaluate of three arguments goes on working)
        normalization = self._obs_normalization()
        if normalization is not None:
            args += (normalization,)
        res = self.groups["rollout"].on(0).evaluate(*args).result()[0]
        record = {f"eval/{k}": v for k, v in res.items()}
        record["time/eval_s"] = time.perf_counter() - t0
        self.logger.log(self.step, record)
        return record

    def export(self, path=None) -> Path:
        """Write the trained policy to ``path`` (default ``<run_dir>/policy.pt``), atomically, with what acts on an
        env's raw observations: the env's observation normalisation as it is now, frozen (``env.normalize_obs``),
        and its spaces. :func:`rlnb.load_policy` reads it in any process, with no cluster. Returns the path.

        Example:
            >>> path = loop.export()                                                  # doctest: +SKIP
            >>> policy = rlnb.load_policy(path)                                       # doctest: +SKIP
            >>> action = policy.predict(obs)  # obs from gymnasium.make(...).reset()   # doctest: +SKIP
        """
        from rlnb.export import TrainedPolicy

        module = self.groups["actor"].on(0).policy_module().result()[0]
        policy = TrainedPolicy(
            module,
            *self.spaces,
            self._obs_normalization(),
            step=self.step,
            source=str(self.run_dir),
            env_spec=self.env_spec,
        )
        return policy.save(Path(path) if path is not None else self.run_dir / "policy.pt")

    def _obs_normalization(self):
        """Env rank 0's observation statistics as they are now (``env.normalize_obs``), else ``None``: what an
        evaluation and an exported policy normalise with."""
        if not self.env_spec["config"].normalize_obs:
            return None
        return self.groups["env"].on(0).obs_normalization().result()[0]

    # ------------------------------------------------------------------ metrics
    def episode_stats(self) -> dict:
        """Mean return and length of the last (up to) 20 finished training episodes, ``None`` before any
        (a few µs: the loop reads it several times a step)."""
        if not self.episodes:
            return {"episode_return_mean": None, "episode_len_mean": None, "episode_success_rate": None}
        n = len(self.episodes)
        return {
            "episode_return_mean": math.fsum(e[0] for e in self.episodes) / n,
            "episode_len_mean": math.fsum(e[1] for e in self.episodes) / n,
            "episode_success_rate": success_rate(self.episodes),
        }

    def _log_step(self, train_out: dict) -> None:
        stats = self.episode_stats()
        record = {
            "global_step": self.global_step,
            "env/episode_return_mean": stats["episode_return_mean"],
            "env/episode_len_mean": stats["episode_len_mean"],
            "rollout/steps_per_s": self._pending.get("rollout/steps_per_s"),
        }
        if stats["episode_success_rate"] is not None:  # an env that says whether its episodes succeeded
            record["env/success_rate"] = stats["episode_success_rate"]
        p = self._pending
        work = {  # seconds of the work itself inside the phases, timed where it runs (wall clock: time/)
            "time/env_s": p.pop("rollout/env_s", None),
            "time/inference_s": p.pop("rollout/inference_s", None),
            "time/advantages_compute_s": p.pop("advantages/compute_s", None),
            "time/train_compute_s": p.pop("train/compute_s", None),
        }
        record.update({k: v for k, v in work.items() if v is not None})
        if None not in work.values() and not self.max_staleness:  # collocated: one phase after another
            step_s = sum(v for k, v in p.items() if k.startswith("time/") and k != "time/compile_s")
            record["time/overhead_frac"] = max(0.0, 1.0 - sum(work.values()) / step_s) if step_s > 0 else None
        if self.max_staleness:  # versions behind, of the batch this step trained on
            record["rollout/staleness_mean"] = self._pending.get("rollout/staleness_mean")
            record["rollout/staleness_max"] = self._pending.get("rollout/staleness_max")
            record["rollout/overlap_frac"] = self._pending.get("rollout/overlap_frac")
        self._log_record(record)

    def summary(self) -> str:
        ret = self.episode_stats()["episode_return_mean"]
        return f"step {self.step}, {self.global_step} env steps; train return (last 20) " + (
            "n/a" if ret is None else f"{ret:.1f}"
        )

    def sample(self, n: int = 4) -> dict:
        """The first ``n`` time steps of the batch actor rank 0 trains on (``[n, N, ...]``), to inspect in
        a notebook: ``obs``, ``actions``, ``logprobs``, ``values``, ``rewards``, ``dones`` and, after
        :meth:`advantages`, ``advantages`` and ``returns``. (Rollout rank 0's batch, for an actor class
        without ``sample``.)"""
        n = count_or_default(n, "n", 4)
        actor = self.groups["actor"]
        if callable(getattr(actor.cls, "sample", None)):
            got = actor.on(0).sample(n).result()[0]
            if got:
                return got
        return self.groups["rollout"].on(0).sample(n).result()[0]


__all__ = ["CheckpointError", "Loop", "TrainingDivergedError", "complete_checkpoints"]
