"""The off-policy loop: collectors fill a replay buffer that a learner samples (the facade of :mod:`rlnb.loop.base`
with SAC's family, :mod:`rlnb.loop.families.sac`).

Example (one phase per notebook cell):
    >>> loop = SACLoop.from_recipe("sac_pendulum")   # doctest: +SKIP
    >>> loop.sync_weights(); loop.rollout(); loop.train()   # doctest: +SKIP
    >>> loop.buffer.sample(5)                           # doctest: +SKIP
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import numpy as np

from rlnb.config.schema import AlgorithmConfig, Recipe
from rlnb.config.sections_lm import RolloutConfig
from rlnb.errors import ConfigError
from rlnb.loop.base import LoopBase
from rlnb.loop.families.sac import SAC
from rlnb.loop.phase import count_or_default
from rlnb.loop.session import objects_recipe


class BufferView:
    """The run's replay buffer seen from a cell: what it holds, without changing what the run samples."""

    def __init__(self, group):
        self._rank0 = group.on(0)

    def sample(self, n: int = 5, seed: int = 0) -> dict[str, np.ndarray]:
        """``n`` transitions drawn uniformly (a generator of their own, ``seed``): ``obs``, ``actions``,
        ``rewards``, ``terminated``, ``truncated``, ``next_obs``, ``discount``, ``[n, ...]`` each."""
        return self._rank0.peek(count_or_default(n, "n", 5), seed).result()[0]

    def last(self, n: int = 5) -> dict[str, np.ndarray]:
        """The ``n`` transitions stored last, oldest first."""
        return self._rank0.last(count_or_default(n, "n", 5)).result()[0]

    def stats(self) -> dict:
        """``size``, ``capacity``, ``added`` (ever) and ``bytes``."""
        return self._rank0.stats().result()[0]

    def __len__(self) -> int:
        return int(self.stats()["size"])

    def __repr__(self) -> str:
        s = self.stats()
        return (f"ReplayBuffer({s['size']:,} of {s['capacity']:,} transitions, {s['added']:,} added, "
                f"{s['bytes'] / 2**20:.1f} MiB)")  # fmt: skip


class SACLoop(LoopBase):
    """SAC, phase by phase: ``sync_weights()`` (learner -> collectors) -> ``rollout()`` (collect, into the buffer)
    -> ``advantages()`` (nothing: SAC's targets are made in each update) -> ``train()`` (``sac.utd_ratio`` updates a
    transition); ``evaluate()`` plays the policy's mean action; ``buffer`` shows the replay buffer.

    Build it from a recipe (``SACLoop.from_recipe("sac_pendulum")``) or from components you launched::

        env = rlnb.Env.launch(cluster, "0", make_env="Pendulum-v1", num_envs=4)
        rollout = SACCollector.launch(cluster, "0", random_steps=250)
        buffer = ReplayBuffer.launch(cluster, "1", obs_space=..., action_space=..., capacity=100_000, num_envs=4)
        actor = SACActor.launch(cluster, "1", learning_starts=1000)
        loop = rlnb.SACLoop(env=env, rollout=rollout, buffer=buffer, actor=actor, steps_per_rollout=50)

    Args:
        recipe, cluster, run_dir, read_only: the recipe path, as :class:`rlnb.loop.Loop`.
        env, rollout, buffer, actor: launched groups (the objects path); the loop owns them from then on.
        steps_per_rollout: objects path: env steps per env per training step.
        max_staleness: objects path: as ``algorithm.max_staleness`` (>= 1: the collectors run ahead of the
            learner, on slots of their own).
        runner, name, seed: as for :class:`rlnb.loop.Loop`.
    """

    FAMILY = SAC

    def __init__(self, recipe: Recipe | None = None, cluster=None, run_dir=None, *, env=None, rollout=None,
                 buffer=None, actor=None, steps_per_rollout: int = 1, max_staleness: int = 0, runner=None,
                 name: str = "custom", seed: int = 1, read_only: bool = False):  # fmt: skip
        components = {"env": env, "rollout": rollout, "buffer": buffer, "actor": actor}
        if recipe is None:
            if all(c is None for c in components.values()):
                raise ConfigError(
                    "SACLoop: pass a recipe (SACLoop.from_recipe('sac_pendulum')) or env=, rollout=, buffer=, "
                    "actor= groups", "recipe",
                )  # fmt: skip
            recipe = objects_recipe(
                name, seed, runner, family="sac", rollout=RolloutConfig(steps_per_rollout=steps_per_rollout),
                algorithm=AlgorithmConfig(max_staleness=max_staleness),
            )  # fmt: skip
            errs = recipe.check()
            if errs:
                raise ConfigError(errs[0], errs[0].split(":")[0])
            super().__init__(recipe, None, run_dir, components=components)
        elif any(c is not None for c in components.values()):
            raise ConfigError("SACLoop: pass either a recipe or env=, rollout=, buffer=, actor= groups, not both",
                              "recipe")  # fmt: skip
        else:
            super().__init__(recipe, cluster, run_dir, read_only=read_only)

    @property
    def buffer(self) -> BufferView:
        """The replay buffer: ``loop.buffer.sample(5)``, ``.last(5)``, ``.stats()``, ``len(loop.buffer)``."""
        return BufferView(self.groups["buffer"])

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
        return self.family.spaces

    def episode_stats(self) -> dict:
        return self.family.episode_stats()

    def export(self, path=None) -> Path:
        """Write the trained agent to ``path`` (default ``<run_dir>/policy.pt``), atomically: the policy, the twin
        Q-networks (``inspect_episode``'s values are ``min(Q1, Q2)`` of each action) and the env's spaces.
        :func:`rlnb.load_policy` reads it in any process, with no cluster; ``predict`` plays the policy's mean
        action, as :meth:`evaluate` does. Returns the path.

        Example:
            >>> policy = rlnb.load_policy(loop.export())                              # doctest: +SKIP
            >>> action = policy.predict(obs)  # obs from gymnasium.make(...).reset()   # doctest: +SKIP
        """
        return self.family.export(path)

    def sample(self, n: int = 4) -> dict:
        """The first ``n`` time steps of collector rank 0's last batch (``[n, N, ...]``)."""
        return self.family.sample(n)


__all__ = ["BufferView", "SACLoop"]
