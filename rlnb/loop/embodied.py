"""The embodied RL loop: env, rollout and actor groups placed on a cluster, stepped one phase at a time (the
facade of :mod:`rlnb.loop.base` with the PPO family, :mod:`rlnb.loop.families.ppo`, or one of your own).

Example (one phase per notebook cell):
    >>> loop = Loop.from_recipe("ppo_cartpole")   # doctest: +SKIP
    >>> loop.sync_weights(); loop.rollout(); loop.advantages(); loop.train()   # doctest: +SKIP
    >>> loop.run(50)                                # doctest: +SKIP
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

from rlnb.config.schema import Recipe
from rlnb.config.sections_lm import RolloutConfig
from rlnb.errors import ConfigError
from rlnb.loop.base import LoopBase
from rlnb.loop.checkpoint import CheckpointError, TrainingDivergedError, complete_checkpoints
from rlnb.loop.families import Family
from rlnb.loop.families.ppo import PPO
from rlnb.loop.schedules.chained import Chained
from rlnb.loop.session import objects_recipe


class Loop(LoopBase):
    """One RL step = ``sync_weights()`` -> ``rollout()`` -> ``advantages()`` -> ``train()``; each public.

    Placement decides the data paths: env and rollout on the same slots step in-process (the fast path); otherwise
    observations and actions flow through channels, with ``env.pipeline_stages`` stages interleaved. Actor and
    rollout on the same slots swap weights and batches in-process.

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
        env, rollout, actor: launched groups (the objects path); the loop owns them from then on (``close()`` shuts
            them down). Subclasses of the built-ins, or classes with the same methods (:mod:`rlnb.loop.roles`).
        steps_per_rollout: objects path: env steps per env per training step (T).
        runner: objects path: a :class:`rlnb.config.RunnerConfig` (or dict): steps, checkpoints, stop_return...
        name: objects path: the run's name (run directory, views).
        seed: objects path: seed of evaluation episodes.
        read_only: open ``run_dir`` without writing to it (see :class:`rlnb.loop.base.LoopBase`).
        family: a family class of one's own (a subclass of :class:`rlnb.loop.families.ppo.PPO`, or any
            :class:`rlnb.loop.families.Family` for these roles); default PPO. Its schedule comes from the actor's
            ``algorithm.max_staleness`` (the objects path) or the recipe's.
    """

    FAMILY = PPO

    def __init__(self, recipe: Recipe | None = None, cluster=None, run_dir=None, *, env=None, rollout=None,
                 actor=None, steps_per_rollout: int = 128, runner=None, name: str = "custom", seed: int = 1,
                 read_only: bool = False, family: type[Family] | None = None):  # fmt: skip
        components = {"env": env, "rollout": rollout, "actor": actor}
        if recipe is None:
            if all(c is None for c in components.values()):
                raise ConfigError(
                    "Loop: pass a recipe (Loop.from_recipe('ppo_cartpole')) or env=, rollout=, actor= groups "
                    "(Env.launch(cluster, '0', ...)...)",
                    "recipe",
                )
            recipe = objects_recipe(name, seed, runner, family="ppo",
                                    rollout=RolloutConfig(steps_per_rollout=steps_per_rollout))  # fmt: skip
            super().__init__(recipe, None, run_dir, components=components, family=family)
        elif any(c is not None for c in components.values()):
            raise ConfigError(
                "Loop: pass either a recipe or env=, rollout=, actor= groups, not both", "recipe"
            )
        else:
            super().__init__(recipe, cluster, run_dir, read_only=read_only, family=family)

    # ------------------------------------------------------------------ the PPO family's own
    @property
    def global_step(self) -> int:
        """Env steps collected so far, over every env."""
        return self.family.global_step

    @property
    def episodes(self) -> deque:
        """The last (up to 20) finished training episodes: ``(return, length[, success])``."""
        return self.family.episodes

    @property
    def spaces(self) -> tuple:
        """The env's observation and action spaces."""
        return self.family.spaces

    @property
    def env_spec(self) -> dict:
        return self.family.env_spec

    @property
    def steps_ahead(self) -> int:
        """Steps the worker ran ahead of the driver (the chained schedule, ``runner.run_ahead``)."""
        return self.schedule.steps_ahead if isinstance(self.schedule, Chained) else 0

    def episode_stats(self) -> dict:
        """Mean return and length of the last (up to) 20 finished training episodes, ``None`` before any."""
        return self.family.episode_stats()

    def warm_start(self, demos: dict | None = None, episodes: int | None = None, epochs: int | None = None,
                   lr: float | None = None) -> dict:  # fmt: skip
        """Behaviour cloning before RL: the policy learns the expert's actions on every actor rank (for a VLA the
        sum over an action's tokens, OpenVLA's loss), so RL starts from a policy that sometimes succeeds; the
        rollout gets the weights at the next :meth:`sync_weights`. ``demos``: ``{"obs": [N, ...], "actions": [N,
        ...]}`` of your own; by default ``episodes`` of the env's scripted expert (``actor.warm_start.*`` for what
        is not given). ``run()`` does it before step 1 when ``actor.warm_start.episodes`` > 0 and no cell did.
        Logs ``warm_start/nll`` (the last epoch's negative log-likelihood) and ``warm_start/expert_match`` (how
        often the greedy action is the expert's).

        Example:
            >>> loop.warm_start(episodes=300, epochs=20)                              # doctest: +SKIP
        """
        return self.family.warm_start(demos, episodes, epochs, lr)

    def evaluate(self, episodes: int | None = None) -> dict:
        """Deterministic episodes on fresh envs (seeded apart from training); logs ``eval/return_mean``.
        ``episodes``: default ``runner.eval_episodes``. In asynchronous mode a collection running ahead (a run
        stopped early, a notebook stepping) is let finish first, and its batch kept for the next step."""
        return super().evaluate(episodes)

    def export(self, path=None) -> Path:
        """Write the trained policy to ``path`` (default ``<run_dir>/policy.pt``), atomically, with what acts on an
        env's raw observations: the env's observation normalisation as it is now, frozen (``env.normalize_obs``),
        and its spaces. :func:`rlnb.load_policy` reads it in any process, with no cluster. Returns the path.

        Example:
            >>> path = loop.export()                                                  # doctest: +SKIP
            >>> policy = rlnb.load_policy(path)                                       # doctest: +SKIP
            >>> action = policy.predict(obs)  # obs from gymnasium.make(...).reset()   # doctest: +SKIP
        """
        return self.family.export(path)

    def capture(self) -> dict:
        """The batch actor rank 0 holds now (after :meth:`rollout`), whole, as plain CPU tensors: ``obs``,
        ``actions``, ``logprobs``, ``values``, ``rewards``, ``dones``, ``last_values`` and the policy ``version``
        that collected it; keep it, look at it, and give it to :meth:`replay`.

        Example:
            >>> loop.rollout(); batch = loop.capture()                               # doctest: +SKIP
        """
        return self.family.capture()

    def replay(self, batch: dict, **overrides) -> dict:
        """Re-run the update on ``batch`` (:meth:`capture`) on actor rank 0, from its state now, twice: as the run
        would (``as_run``) and under ``overrides`` (the algorithm's fields, ``clip_coef=0.1``, ``ent_coef``,
        ``policy_loss``, ``update_epochs``...; and ``lr``), without rolling out again. Returns each one's metrics
        (loss, gradient norm, KL, clip fraction, ``param_change_norm``: how far the update moved the policy) and
        their ``difference``. Nothing of the run changes: weights, optimizer, RNGs, step and settings stay as they
        were.

        Example:
            >>> what_if = loop.replay(batch, clip_coef=0.1)                          # doctest: +SKIP
            >>> what_if["difference"]                                                 # doctest: +SKIP
        """
        return self.family.replay(batch, overrides)

    def inspect_episode(self, seed: int | None = None, max_steps: int = 1000):
        """Play one deterministic evaluation episode with the current weights, step by step: a
        ``pandas.DataFrame`` with a row a step, the ``action``, the critic's ``value``, the action's ``logprob``,
        the ``reward`` and ``done``. Nothing in the run changes (a fresh env in this process, no sampling draws).

        Example:
            >>> loop.inspect_episode(max_steps=50)                                    # doctest: +SKIP
        """
        return self.family.inspect_episode(seed, max_steps)

    def record_episode(self, path=None, seed: int | None = None, max_steps: int = 1000, fps: int = 20):
        """Play one deterministic evaluation episode with the current weights and write its video (MP4, the
        ``video`` extra) to ``path``, by default ``<run_dir>/videos/step_<step>.mp4``. The frames are the
        observations' camera images, or the env's ``render()`` where it has none. Returns an
        :class:`rlnb.video.EpisodeVideo`: the last expression of a cell, it plays there.

        Example:
            >>> loop.record_episode()                                                 # doctest: +SKIP
            EpisodeVideo('runs/.../videos/step_000060.mp4', return=0.96, length=5, success=True)
        """
        return self.family.record_episode(path, seed, max_steps, fps)

    def obs_normalization(self):
        """Env rank 0's observation statistics as they are now (``env.normalize_obs``), else ``None``."""
        return self.family.obs_normalization()

    def sample(self, n: int = 4) -> dict:
        """The first ``n`` time steps of the batch actor rank 0 trains on (``[n, N, ...]``), to inspect in a
        notebook: ``obs``, ``actions``, ``logprobs``, ``values``, ``rewards``, ``dones`` and, after
        :meth:`advantages`, ``advantages`` and ``returns``. (Rollout rank 0's batch, for an actor class without
        ``sample``.)"""
        return self.family.sample(n)


__all__ = ["CheckpointError", "Loop", "TrainingDivergedError", "complete_checkpoints"]
