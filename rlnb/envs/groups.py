"""Episodes for embodied GRPO (SimpleVLA-RL's and RLinf's): the envs of a group start each episode from the same
state, and every episode lasts the same number of steps, so that the k-th episodes of a group's envs are samples
from one initial state and end on the same step (``rlnb.algorithms.advantages.episode_grpo`` compares them).

    >>> import gymnasium as gym
    >>> a, b = (GroupedEpisodes(gym.make("rlnb/PixelReach-v0")) for _ in range(2))
    >>> [(x.reset(seed=7)[0] == y.reset(seed=7)[0]).all() for x, y in [(a, b)]]
    [np.True_]
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from rlnb.errors import ConfigError

KEY = "algorithm.advantage"


def group_misfit(num_envs: int, stages: int, group_size: int) -> str | None:
    """Why ``num_envs`` envs in ``stages`` pipeline stages cannot be split into groups of ``group_size`` (a group may
    not straddle two stages), or ``None``."""
    if group_size > 1 and (num_envs // stages) % group_size:
        return (
            f"env.num_envs: {num_envs} envs in {stages} pipeline stage(s) of {num_envs // stages} cannot be split "
            f"into groups of algorithm.group_size={group_size}; use a multiple of {group_size * stages}"
        )
    return None


def episode_horizon(env: gym.Env | None = None, env_id=None, kwargs: dict | None = None) -> int | None:
    """The fixed length of an env's episodes: ``env.kwargs.max_episode_steps``, else its registration's (``None``
    where neither says)."""
    steps = (kwargs or {}).get("max_episode_steps")
    if steps is None and env is not None and env.spec is not None:
        steps = env.spec.max_episode_steps
    if steps is None and isinstance(env_id, str) and env_id in gym.registry:
        steps = gym.registry[env_id].max_episode_steps
    return steps


class GroupedEpisodes(gym.Wrapper):
    """Each episode ``horizon`` steps long, from a state its group's envs share.

    ``reset(seed=s)`` starts from ``s`` (the env component gives a group's envs the same ``s``); each later reset
    reseeds with ``(s, episode index)``, so a group's envs reset alike again, whatever their episodes did. An
    episode that ends early (a success, a failure, a time limit) holds its last observation with reward 0 until
    ``horizon`` steps, then ends (``terminated``: a fixed-length episode is not bootstrapped) with the info of its
    real end (its success). A held step's info says ``held: True``: its action did nothing, so the rollout leaves
    it out of the loss (the batch's ``loss_mask``, as SimpleVLA-RL and RLinf mask the steps after an episode's
    end)."""

    def __init__(self, env: gym.Env, horizon: int | None = None):
        super().__init__(env)
        self.horizon = horizon or episode_horizon(env)
        if not self.horizon:
            raise ConfigError(
                f"{KEY}: the envs of a group are compared over episodes of one fixed length, and this env has none; "
                "give one with env.kwargs.max_episode_steps",
                KEY,
            )
        self.first_seed: int | None = None
        self.episode, self.t = 0, 0
        self.held: tuple | None = None  # (last observation, last info) of an episode that ended early

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self.first_seed, self.episode = int(seed), 0
        else:
            self.episode += 1
        if self.first_seed is not None:  # (an episode's own seed: one draw from the pair, not seed + k)
            seed = int(np.random.SeedSequence([self.first_seed, self.episode]).generate_state(1)[0])
        self.t, self.held = 0, None
        return self.env.reset(seed=seed, options=options)

    def step(self, action):
        self.t += 1
        if self.held is None:
            obs, reward, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                self.held = (obs, info)
            last = self.t >= self.horizon
            return obs, reward, last, False, (info if last or self.held is None else {})
        (obs, info), last = self.held, self.t >= self.horizon
        return obs, 0.0, last, False, {**info, "held": True} if last else {"held": True}


def grouped(make, group_horizon: int | None = None) -> gym.Env:
    """``make()`` wrapped in :class:`GroupedEpisodes` (a picklable factory for the vector envs)."""
    return GroupedEpisodes(make(), group_horizon)
