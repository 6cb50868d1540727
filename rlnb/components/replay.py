"""A replay buffer of transitions for off-policy RL (SAC): a ring of preallocated arrays, filled a batch of envs at
a time, sampled uniformly, bounded in bytes, saved and restored exactly.

Each transition keeps ``obs``, ``actions``, ``rewards``, ``terminated`` and ``truncated`` apart, ``next_obs`` (the
episode's real last observation where it ended, not the reset one) and ``discount``: ``gamma^n`` for the ``n`` env
steps its reward sums (``n_step`` returns, fewer where the episode ended first). Observations are stored as the env
gives them: a vector, an image, or a dict of them packed into one row (:class:`rlnb.envs.obs.PackedBox`).

A plain class, as every component: it works in-process, and placing it on a slot is ``ReplayBuffer.launch``.
"""

from __future__ import annotations

import math
from collections import deque

import gymnasium as gym
import numpy as np
import torch

from rlnb.components.launch import launcher
from rlnb.errors import ConfigError

FIELDS = ("obs", "actions", "rewards", "terminated", "truncated", "next_obs", "discount")


def _storage_shape(space: gym.Space, key: str) -> tuple[tuple[int, ...], np.dtype]:
    if isinstance(space, gym.spaces.Discrete):
        return (), np.dtype(np.int64)
    if isinstance(space, gym.spaces.Box) and space.dtype == np.float64:
        # (rlnb's envs hand float64 observations over as float32)
        return tuple(space.shape), np.dtype(np.float32)
    if isinstance(space, (gym.spaces.Box, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)):
        return tuple(space.shape), np.dtype(space.dtype)
    raise ConfigError(
        f"{key}: a replay buffer stores Box, Discrete, MultiDiscrete and MultiBinary spaces (dict observations "
        f"packed into one Box by rlnb's envs); got {space}",
        key,
    )


def transition_bytes(obs_space: gym.Space, action_space: gym.Space) -> int:
    """The bytes one transition takes (observation twice, action, reward, flags, discount)."""
    (o_shape, o_dtype), (a_shape, a_dtype) = (
        _storage_shape(obs_space, "env.observation_space"), _storage_shape(action_space, "env.action_space")
    )  # fmt: skip
    return 2 * math.prod(o_shape) * o_dtype.itemsize + math.prod(a_shape) * a_dtype.itemsize + 4 + 1 + 1 + 4


class ReplayBuffer:
    """Transitions of ``num_envs`` envs stepped together (see the module's docstring).

    Args:
        obs_space, action_space: one env's spaces.
        capacity: transitions kept; the oldest are overwritten first.
        num_envs: envs whose steps :meth:`add` takes at once.
        n_step: rewards summed over this many steps into one transition (1: plain one-step targets).
        gamma: the discount those sums and ``discount`` use.
        max_bytes: refuse a ``capacity`` whose arrays would take more (``0``: no bound).
        seed: the sampler's seed.
        in_checkpoint: :meth:`state_dict` holds the transitions (exact resume); ``False``: it holds none, and a
            buffer loaded from it starts empty.
    """

    launch = launcher("buffer")

    def __init__(self, obs_space: gym.Space, action_space: gym.Space, capacity: int, num_envs: int = 1,
                 n_step: int = 1, gamma: float = 0.99, max_bytes: int = 0, seed: int = 0,
                 in_checkpoint: bool = True):  # fmt: skip
        for key, value, low in (("buffer.capacity", capacity, 1), ("buffer.n_step", n_step, 1),
                                ("env.num_envs", num_envs, 1)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{key}: expected an integer >= {low}, got {value!r}", key)
        per = transition_bytes(obs_space, action_space)
        if max_bytes and capacity * per > max_bytes:
            raise ConfigError(
                f"buffer.capacity: {capacity:,} transitions take {capacity * per / 2**20:.1f} MiB, more than the "
                f"{max_bytes / 2**20:.1f} MiB allowed; lower buffer.capacity to at most {max_bytes // per:,}",
                "buffer.capacity",
            )
        o_shape, o_dtype = _storage_shape(obs_space, "env.observation_space")
        a_shape, a_dtype = _storage_shape(action_space, "env.action_space")
        self.obs_space, self.action_space = obs_space, action_space
        self.capacity, self.num_envs, self.n_step, self.gamma = capacity, num_envs, n_step, float(gamma)
        self.data = {
            "obs": np.zeros((capacity, *o_shape), o_dtype),
            "next_obs": np.zeros((capacity, *o_shape), o_dtype),
            "actions": np.zeros((capacity, *a_shape), a_dtype),
            "rewards": np.zeros(capacity, np.float32),
            "terminated": np.zeros(capacity, np.bool_),
            "truncated": np.zeros(capacity, np.bool_),
            "discount": np.zeros(capacity, np.float32),
        }
        self.in_checkpoint = bool(in_checkpoint)
        self.pos, self.size, self.added = 0, 0, 0
        self.rng = np.random.default_rng(seed)
        # each env's last n-1 steps, waiting for the steps that complete their n-step sums
        self.windows: list[deque] = [deque() for _ in range(num_envs)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.data.values())

    def __len__(self) -> int:
        return self.size

    # ------------------------------------------------------------------ filling
    def add(self, obs, actions, rewards, terminated, truncated, next_obs) -> int:
        """One step of every env (each argument ``[N, ...]``, ``next_obs`` the real next observation, a finished
        episode's last one). Returns the transitions stored (n-step: those whose sums are complete)."""
        obs, next_obs, actions = np.asarray(obs), np.asarray(next_obs), np.asarray(actions)
        rewards = np.asarray(rewards, np.float32)
        terminated, truncated = np.asarray(terminated, bool), np.asarray(truncated, bool)
        if obs.shape[0] != self.num_envs:
            raise ValueError(f"add: {obs.shape[0]} envs' steps, this buffer takes {self.num_envs} at a time")
        if self.n_step == 1:  # every env's step at once: one slice (two where the ring wraps)
            n, d = self.num_envs, self.data
            rows = (self.pos + np.arange(n)) % self.capacity
            d["obs"][rows], d["actions"][rows], d["rewards"][rows] = obs, actions, rewards
            d["terminated"][rows], d["truncated"][rows], d["next_obs"][rows] = terminated, truncated, next_obs
            d["discount"][rows] = self.gamma
            self.pos = (self.pos + n) % self.capacity
            self.size = min(self.size + n, self.capacity)
            self.added += n
            return n
        stored = 0
        for i in range(self.num_envs):
            window = self.windows[i]
            window.append((obs[i], actions[i], rewards[i], terminated[i], truncated[i], next_obs[i]))
            ended = terminated[i] or truncated[i]
            # the oldest step's n-step sum is complete; an ended episode completes every step left
            while window and (len(window) == self.n_step or ended):
                self._store_window(window)
                window.popleft()
                stored += 1
        return stored

    def cut(self, envs: list[int]) -> int:
        """End the n-step sums in progress of ``envs`` (an elastic run's share of them now stepped by other envs):
        each pending step stored with the rewards it has and bootstrapped from its last step's next observation.
        Returns the transitions stored."""
        stored = 0
        for i in envs:
            window = self.windows[i]
            while window:
                self._store_window(window)
                window.popleft()
                stored += 1
        return stored

    def _store_window(self, window: deque) -> None:
        ret, k = 0.0, 0
        for k, (_, _, r, term, trunc, _) in enumerate(window):
            ret += (self.gamma**k) * float(r)
            if term or trunc:
                break
        o, a = window[0][0], window[0][1]
        _, _, _, term, trunc, nxt = window[k]
        self._store(o, a, ret, term, trunc, nxt, self.gamma ** (k + 1))

    def _store(self, o, a, r, term, trunc, nxt, discount) -> None:
        d, p = self.data, self.pos
        d["obs"][p], d["actions"][p], d["rewards"][p] = o, a, r
        d["terminated"][p], d["truncated"][p], d["next_obs"][p], d["discount"][p] = term, trunc, nxt, discount
        self.pos = (p + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)
        self.added += 1

    # ------------------------------------------------------------------ reading
    def sample(self, batch_size: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """``batch_size`` transitions drawn uniformly (with replacement, as SB3), as tensors by field."""
        if self.size == 0:
            raise ValueError("sample: the buffer is empty (fill it with add() first)")
        idx = self.rng.integers(0, self.size, size=batch_size)
        return {k: torch.from_numpy(v[idx]).to(device) for k, v in self.data.items()}

    def peek(self, n: int, seed: int = 0) -> dict[str, np.ndarray]:
        """``n`` transitions drawn uniformly with a generator of their own (``seed``), as arrays: what a notebook
        cell looks at (``loop.buffer.sample(5)``), the run's own sampling left as it was."""
        if self.size == 0:
            return {k: v[:0] for k, v in self.data.items()}
        idx = np.random.default_rng(seed).integers(0, self.size, size=n)
        return {k: v[idx] for k, v in self.data.items()}

    def last(self, n: int) -> dict[str, np.ndarray]:
        """The ``n`` transitions stored last, oldest first (what a notebook cell looks at)."""
        n = min(n, self.size)
        idx = (self.pos - n + np.arange(n)) % self.capacity
        return {k: v[idx] for k, v in self.data.items()}

    def stats(self) -> dict:
        return {"size": self.size, "capacity": self.capacity, "added": self.added, "bytes": self.nbytes}

    def describe(self) -> dict:
        """What it was built with (a loop built from objects records it in its recipe, ``buffer.*``)."""
        return {"capacity": self.capacity, "n_step": self.n_step, "in_checkpoint": self.in_checkpoint}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Everything to resume exactly: the filled part of the arrays, the write position, the sampler's RNG and
        the n-step windows (plain arrays and numbers: loads without running code). Built with
        ``in_checkpoint=False``: none of it (a buffer loaded from it starts empty)."""
        if not self.in_checkpoint:
            return {"kept": False}
        return {
            "data": {k: v[: self.size].copy() for k, v in self.data.items()},
            "pos": self.pos, "size": self.size, "added": self.added,
            "rng": self.rng.bit_generator.state,
            "windows": [[tuple(np.asarray(x) for x in step) for step in w] for w in self.windows],
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        if state.get("kept", True) is False:  # (saved without its transitions: empty, to be refilled)
            self.pos, self.size, self.added = 0, 0, 0
            self.windows = [deque() for _ in range(self.num_envs)]
            return
        size = int(state["size"])
        if size > self.capacity:
            raise ValueError(f"a checkpoint of {size} transitions into a buffer of {self.capacity}")
        for k, v in self.data.items():
            v[:size] = state["data"][k]
        self.pos, self.size, self.added = int(state["pos"]), size, int(state["added"])
        self.rng.bit_generator.state = state["rng"]
        self.windows = [deque(tuple(step) for step in w) for w in state["windows"]]


__all__ = ["FIELDS", "ReplayBuffer", "transition_bytes"]
