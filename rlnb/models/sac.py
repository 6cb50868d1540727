"""SAC's networks (CleanRL's ``sac_continuous_action.py`` and ``sac_atari.py``, SB3's ``[256, 256]`` ReLU MLPs):
a tanh-squashed Gaussian policy rescaled to the action box, or a categorical one over discrete actions, and twin
Q-networks with target copies. Shapes: ``[M, D]`` observations, ``[M, A]`` continuous actions, ``[M]`` discrete
ones, ``[M, K]`` one value per discrete action."""

from __future__ import annotations

import copy
import math

import gymnasium as gym
import torch
from torch import nn

from rlnb.errors import ConfigError

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0  # CleanRL's bounds on the policy's log std (SB3: -20, 2)


def _mlp(sizes: list[int]) -> nn.Sequential:
    """ReLU layers with torch's default initialisation, as SB3's and CleanRL's SAC (``policies.mlp`` initialises
    orthogonally, as PPO does)."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def flat_dim(space: gym.Space, key: str) -> int:
    """The size of a flat vector observation; other spaces refused naming ``key``."""
    if not isinstance(space, gym.spaces.Box) or len(space.shape) != 1:
        raise ConfigError(f"{key}: SAC's MLPs take flat vector observations (a 1-D Box); got {space}", key)
    return int(space.shape[0])


class SquashedGaussianActor(nn.Module):
    """``a = scale tanh(u) + bias``, ``u ~ N(mu(s), sigma(s))``, over a bounded action box; ``log pi(a|s)`` with
    tanh's change of variables (Haarnoja et al. 2018, appendix C)."""

    def __init__(self, obs_dim: int, action_space: gym.spaces.Box, hidden: tuple[int, ...] = (256, 256)):
        super().__init__()
        if not (isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1):
            raise ConfigError(
                f"env.id: continuous SAC takes a 1-D Box of actions; got {action_space}", "env.id"
            )
        low, high = action_space.low.astype("float32"), action_space.high.astype("float32")
        if not (torch.isfinite(torch.as_tensor(low)).all() and torch.isfinite(torch.as_tensor(high)).all()):
            raise ConfigError(
                f"env.id: SAC squashes actions into their box, and this one is unbounded ({action_space}); wrap the "
                "env to rescale its actions into finite bounds",
                "env.id",
            )
        act_dim = int(action_space.shape[0])
        self.trunk = _mlp([obs_dim, *hidden])
        self.trunk.append(nn.ReLU())
        self.mean = nn.Linear(hidden[-1], act_dim)
        self.log_std = nn.Linear(hidden[-1], act_dim)
        self.register_buffer("scale", torch.as_tensor((high - low) / 2.0))
        self.register_buffer("bias", torch.as_tensor((high + low) / 2.0))

    def _dist(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(obs)  # [M, H]
        log_std = torch.tanh(self.log_std(h))  # CleanRL's soft clamp into [LOG_STD_MIN, LOG_STD_MAX]
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)
        return self.mean(h), log_std.exp()

    def sample(
        self, obs: torch.Tensor, generator: torch.Generator | None = None, mode: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A reparameterised action ``[M, A]`` and its log-probability ``[M]`` (``generator``: the noise's, else
        torch's global one); ``mode``: the Gaussian's mean instead of a draw (an exported agent's greedy action)."""
        mean, std, u = self._draw(obs, generator, mode)
        y = torch.tanh(u)  # [M, A]
        logp = torch.distributions.Normal(mean, std).log_prob(u)
        logp = logp - torch.log(self.scale * (1 - y.pow(2)) + 1e-6)  # tanh's and the rescaling's Jacobian
        return y * self.scale + self.bias, logp.sum(-1)

    def act(self, obs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The action :meth:`sample` draws (the same noise), without its log-probability: a collector's step, where
        the log-probability's distribution object cost more than the network (0.57 ms against 0.23 for one env)."""
        _, _, u = self._draw(obs, generator, False)
        return torch.tanh(u) * self.scale + self.bias

    def _draw(self, obs: torch.Tensor, generator: torch.Generator | None, mode: bool):
        """The Gaussian's ``mean``, ``std`` and the pre-squash action ``u`` (a draw, or the mean), each ``[M, A]``."""
        mean, std = self._dist(obs)
        if mode:
            return mean, std, mean
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        return mean, std, mean + std * noise

    def deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        """The action at the Gaussian's mean (evaluation)."""
        mean, _ = self._dist(obs)
        return torch.tanh(mean) * self.scale + self.bias


class CategoricalActor(nn.Module):
    """``pi(.|s)`` over ``K`` discrete actions: logits ``[M, K]``."""

    def __init__(self, obs_dim: int, n: int, hidden: tuple[int, ...] = (256, 256)):
        super().__init__()
        self.net = _mlp([obs_dim, *hidden, n])

    def probs_logp(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``pi(.|s)`` and ``log pi(.|s)``, ``[M, K]`` each."""
        logp = torch.log_softmax(self.net(obs), -1)
        return logp.exp(), logp

    def sample(self, obs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        probs = torch.softmax(self.net(obs), -1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # [M]

    def deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs).argmax(-1)


class TwinQ(nn.Module):
    """Two Q-networks: continuous ``Q(s, a)`` -> ``[M]`` each, or discrete ``Q(s, .)`` -> ``[M, K]`` each."""

    def __init__(self, obs_dim: int, action_space: gym.Space, hidden: tuple[int, ...] = (256, 256)):
        super().__init__()
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        inp, out = (
            (obs_dim, int(action_space.n)) if self.discrete else (obs_dim + math.prod(action_space.shape), 1)
        )
        self.q1, self.q2 = _mlp([inp, *hidden, out]), _mlp([inp, *hidden, out])

    def forward(self, obs: torch.Tensor, actions: torch.Tensor | None = None):
        if self.discrete:
            return self.q1(obs), self.q2(obs)
        x = torch.cat([obs, actions], -1)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)


class SACPolicy(nn.Module):
    """A trained SAC agent as :class:`rlnb.export.TrainedPolicy` plays it: the policy with its twin Q-networks,
    ``act(obs, generator, deterministic) -> (actions, logprob, value)`` as the actor-critic's, where the value is
    ``min(Q1, Q2)`` of the action taken (SAC has no state-value network). ``config`` rebuilds it with the spaces."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, hidden_sizes=(256, 256)):
        super().__init__()
        hidden = tuple(int(h) for h in hidden_sizes)
        self.config = {"hidden_sizes": list(hidden)}
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        self.policy = make_policy(observation_space, action_space, hidden)
        self.q = TwinQ(flat_dim(observation_space, "env.observation_space"), action_space, hidden)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, generator: torch.Generator | None = None, deterministic: bool = True):
        """Actions ``[M(, A)]`` for observations ``[M, D]``, their log-probabilities ``[M]`` and Q-values ``[M]``."""
        obs = obs.float()
        if self.discrete:
            probs, logp = self.policy.probs_logp(obs)  # [M, K] each
            a = probs.argmax(-1) if deterministic else torch.multinomial(probs, 1, generator=generator)[:, 0]
            q1, q2 = self.q(obs)
            pick = a[:, None]
            return a, logp.gather(1, pick)[:, 0], torch.minimum(q1, q2).gather(1, pick)[:, 0]
        a, logp = self.policy.sample(obs, generator, mode=deterministic)
        return a, logp, torch.minimum(*self.q(obs, a))


def agent_weights(policy_state: dict, q_state: dict) -> dict:
    """:class:`SACPolicy`'s state dict from the policy's and the twin Q-networks' (as the learner holds them)."""
    return {
        **{f"policy.{k}": v for k, v in policy_state.items()},
        **{f"q.{k}": v for k, v in q_state.items()},
    }


def make_policy(obs_space: gym.Space, action_space: gym.Space, hidden: tuple[int, ...]) -> nn.Module:
    """SAC's policy for these spaces: categorical over discrete actions, else a squashed Gaussian (the learner's
    and the collectors' alike, so weights load from one into the other)."""
    obs_dim = flat_dim(obs_space, "env.observation_space")
    if isinstance(action_space, gym.spaces.Discrete):
        return CategoricalActor(obs_dim, int(action_space.n), hidden)
    if isinstance(action_space, gym.spaces.Box):
        return SquashedGaussianActor(obs_dim, action_space, hidden)
    raise ConfigError(f"env.id: SAC takes a box or discrete actions; got {action_space}", "env.id")


def target_copy(module: nn.Module) -> nn.Module:
    """A frozen copy for the targets (moved by :func:`rlnb.algorithms.sac.polyak_`)."""
    target = copy.deepcopy(module)
    for p in target.parameters():
        p.requires_grad_(False)
    return target


__all__ = [
    "CategoricalActor",
    "SACPolicy",
    "SquashedGaussianActor",
    "TwinQ",
    "flat_dim",
    "make_policy",
    "target_copy",
]
