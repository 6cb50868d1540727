"""Vector envs computed in torch on any device: simulation, observations and resets never leave the GPU.

:class:`TorchCartPole` is gymnasium's CartPole-v1 batched in torch (registered as
``rlnb/TorchCartPole-v1`` with a ``vector_entry_point``; ``env.kwargs: {device: cuda}`` runs it on the
GPU). It stands for GPU simulators such as ManiSkill: it returns torch tensors on its device, resets
finished episodes on the same step (the last observation in ``info["final_obs"]``), and checkpoints
through its own ``state_dict()`` / ``load_state_dict()`` (state, step counters, RNG), never by pickling.

Example:
    >>> env = TorchCartPole(num_envs=4, device="cpu")
    >>> obs, _ = env.reset(seed=0)
    >>> obs.shape, obs.device.type
    (torch.Size([4, 4]), 'cpu')
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch


class TorchCartPole(gym.vector.VectorEnv):
    """``num_envs`` CartPole-v1 copies (same dynamics, reward and 500-step limit) as one batched tensor.

    Args:
        num_envs: environments in the batch.
        device: where the state lives and the observations are returned (``cpu``, ``cuda``...).
        max_episode_steps: truncation length.
    """

    gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    theta_threshold = 12 * 2 * math.pi / 360
    x_threshold = 2.4

    def __init__(self, num_envs: int = 1, device: str = "cpu", max_episode_steps: int = 500):
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.max_episode_steps = max_episode_steps
        high = np.array([self.x_threshold * 2, np.inf, self.theta_threshold * 2, np.inf], dtype=np.float32)
        self.single_observation_space = gym.spaces.Box(-high, high, dtype=np.float32)
        self.single_action_space = gym.spaces.Discrete(2)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self.generator = torch.Generator(self.device).manual_seed(0)
        self.state = torch.zeros(num_envs, 4, device=self.device)
        self.elapsed_steps = torch.zeros(num_envs, dtype=torch.int64, device=self.device)

    def _initial(self, n: int) -> torch.Tensor:
        return torch.rand(n, 4, generator=self.generator, device=self.device) * 0.1 - 0.05

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self.generator.manual_seed(seed[0] if isinstance(seed, (list, tuple)) else int(seed))
        self.state = self._initial(self.num_envs)
        self.elapsed_steps.zero_()
        return self.state.clone(), {}

    def step(self, actions):
        a = torch.as_tensor(actions, device=self.device)
        x, x_dot, theta, theta_dot = self.state.unbind(1)
        force = torch.where(a == 1, self.force_mag, -self.force_mag)
        cos, sin = torch.cos(theta), torch.sin(theta)
        polemass_length, total_mass = self.masspole * self.length, self.masspole + self.masscart
        temp = (force + polemass_length * theta_dot**2 * sin) / total_mass
        theta_acc = (self.gravity * sin - cos * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * cos**2 / total_mass)
        )
        x_acc = temp - polemass_length * theta_acc * cos / total_mass
        x, x_dot = x + self.tau * x_dot, x_dot + self.tau * x_acc
        theta, theta_dot = theta + self.tau * theta_dot, theta_dot + self.tau * theta_acc
        self.state = torch.stack([x, x_dot, theta, theta_dot], dim=1)
        self.elapsed_steps += 1
        terminated = (x.abs() > self.x_threshold) | (theta.abs() > self.theta_threshold)
        truncated = (self.elapsed_steps >= self.max_episode_steps) & ~terminated
        reward = torch.ones(self.num_envs, device=self.device)
        info: dict = {}
        done = terminated | truncated
        if bool(done.any()):  # same-step autoreset, as our gymnasium vector envs do
            info["final_obs"], info["_final_obs"] = self.state.clone(), done
            self.state = torch.where(done[:, None], self._initial(self.num_envs), self.state)
            self.elapsed_steps = torch.where(done, 0, self.elapsed_steps)
        return self.state.clone(), reward, terminated, truncated, info

    def state_dict(self) -> dict:
        """The simulation's state, step counters and RNG (CPU copies): what an exact resume needs."""
        return {
            "state": self.state.detach().to("cpu", copy=True),
            "elapsed_steps": self.elapsed_steps.to("cpu", copy=True),
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.state = state["state"].to(self.device)
        self.elapsed_steps = state["elapsed_steps"].to(self.device)
        self.generator.set_state(state["generator"])

    def __getstate__(self):
        raise TypeError(
            "TorchCartPole holds device state and is not pickled: checkpoint it with state_dict(), "
            "as rlnb's Env component does"
        )

    def close(self, **kwargs):
        pass


if "rlnb/TorchCartPole-v1" not in gym.registry:
    gym.register(
        "rlnb/TorchCartPole-v1",
        vector_entry_point=TorchCartPole,  # batched only: no single-env entry point
        max_episode_steps=500,
        reward_threshold=475.0,
    )
