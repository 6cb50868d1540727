"""Actor-critic policies for vector (MLP) and image (CNN) observations, discrete or continuous actions."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Normal

from rlnb.envs.gym_envs import space_problem
from rlnb.envs.obs import layout_of
from rlnb.errors import ConfigError


def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Module:
    """Orthogonal init, as in the PPO implementation details (Huang et al. 2022)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


def _tanh_by_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x * 2).mul_(2).sub_(1)


class _SigmoidTanh(torch.autograd.Function):
    """``tanh(x) = 2 * sigmoid(2x) - 1``, with tanh's own backward (``grad * (1 - y^2)``)."""

    @staticmethod
    def forward(ctx, x):
        y = _tanh_by_sigmoid(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return torch.ops.aten.tanh_backward(grad, y)


class Tanh(nn.Module):
    """The MLPs' ``tanh`` activation: ``torch.tanh``, except for big CPU tensors, where it computes
    ``2 * sigmoid(2x) - 1``.

    torch's CPU ``tanh`` kernel runs one element at a time where its ``sigmoid`` is vectorised, several times
    slower for a ``ppo_cartpole`` minibatch (figures: ``docs/benchmarks.md``). The values differ from
    ``torch.tanh``'s by at most 2e-7 (``torch.tanh``'s own error is 5e-8); the gradient is tanh's, computed
    from the output. Below ``SIGMOID_FROM`` elements (``SIGMOID_WITH_GRAD_FROM`` under autograd, whose
    Python backward has its own cost) the few small kernels cost more than the one, so ``torch.tanh`` runs.
    """

    SIGMOID_FROM = 8192
    SIGMOID_WITH_GRAD_FROM = 16384

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad and _sigmoid_pays(x):
            return _SigmoidTanh.apply(x) if x.numel() >= self.SIGMOID_WITH_GRAD_FROM else torch.tanh(x)
        return tanh_without_grad(x)


def _sigmoid_pays(x: torch.Tensor) -> bool:
    return x.numel() >= Tanh.SIGMOID_FROM and x.device.type == "cpu" and x.is_floating_point()


def tanh_without_grad(x: torch.Tensor) -> torch.Tensor:
    """:class:`Tanh` where nothing records for autograd (a rollout's forward, the hand-derived train step of
    ``rlnb.components.fused``): ``2 * sigmoid(2x) - 1`` for big CPU tensors, else ``torch.tanh``."""
    return _tanh_by_sigmoid(x) if _sigmoid_pays(x) else torch.tanh(x)


def mlp(sizes: list[int], activation: str, out_std: float | None = None) -> nn.Sequential:
    act = {"tanh": Tanh, "relu": nn.ReLU}[activation]
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        last = i == len(sizes) - 2
        layers.append(
            layer_init(
                nn.Linear(sizes[i], sizes[i + 1]), out_std if (last and out_std is not None) else math.sqrt(2)
            )
        )
        if not last or out_std is None:
            layers.append(act())
    return nn.Sequential(*layers)


class NatureCNN(nn.Module):
    """The DQN/Atari trunk (Mnih et al. 2015) for ``(C, H, W)`` uint8 or float images."""

    def __init__(self, obs_shape: tuple[int, ...], out_dim: int = 512):
        super().__init__()
        c = obs_shape[0]
        self.conv = nn.Sequential(
            layer_init(nn.Conv2d(c, 32, 8, stride=4)), nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(),
            nn.Flatten(),
        )  # fmt: skip
        with torch.no_grad():
            n = self.conv(torch.zeros(1, *obs_shape)).shape[1]
        self.head = nn.Sequential(layer_init(nn.Linear(n, out_dim)), nn.ReLU())
        self.out_dim = out_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, out_dim)
        if x.dtype == torch.uint8:
            x = x.float() / 255.0
        return self.head(self.conv(x))


def image_encoder(shape_chw: tuple[int, int, int], out_dim: int = 256) -> nn.Module:
    """A trunk for ``(C, H, W)`` images: :class:`NatureCNN` from 36 pixels a side (its kernels need them), else
    stride-2 3x3 convolutions down to 8 pixels or fewer, then a linear layer."""
    _, h, w = shape_chw
    if min(h, w) >= 36:
        return NatureCNN(shape_chw, out_dim)
    return SmallCNN(shape_chw, out_dim)


class SmallCNN(nn.Module):
    """Stride-2 3x3 convolutions (32 channels) until the image is 8 pixels a side or fewer, for small images."""

    def __init__(self, obs_shape: tuple[int, ...], out_dim: int = 256):
        super().__init__()
        c, h, w = obs_shape
        layers: list[nn.Module] = []
        while max(h, w) > 8:
            layers += [layer_init(nn.Conv2d(c, 32, 3, stride=2, padding=1)), nn.ReLU()]
            c, h, w = 32, (h + 1) // 2, (w + 1) // 2
        self.conv = nn.Sequential(*layers, nn.Flatten())
        self.head = nn.Sequential(layer_init(nn.Linear(c * h * w, out_dim)), nn.ReLU())
        self.out_dim = out_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, out_dim)
        if x.dtype == torch.uint8:
            x = x.float() / 255.0
        return self.head(self.conv(x))


class MultiInputEncoder(nn.Module):
    """The trunk of dict observations (packed, :class:`rlnb.envs.obs.PackedBox`), as SB3's
    ``CombinedExtractor`` and ManiSkill's ``ppo_rgb.py`` build it: a CNN for each image part (``H x W x C``,
    :func:`image_encoder`), the vector parts as they are, concatenated. Text parts (an instruction) are not read:
    a policy that reads them is a vision-language one."""

    def __init__(self, layout, image_dim: int = 256):
        super().__init__()
        self.layout = layout
        self.cnns = nn.ModuleList(
            image_encoder((p.shape[2], p.shape[0], p.shape[1]), image_dim) for p in layout.images
        )
        self.vector_dim = sum(int(np.prod(p.shape)) for p in layout.vectors)
        self.out_dim = image_dim * len(self.cnns) + self.vector_dim

    def forward(self, rows: torch.Tensor) -> torch.Tensor:  # (B, nbytes) uint8 -> (B, out_dim)
        parts = self.layout.unpack(rows)
        feats = [cnn(parts[p.key].permute(0, 3, 1, 2)) for cnn, p in zip(self.cnns, self.layout.images)]
        feats += [parts[p.key].reshape(rows.shape[0], -1) for p in self.layout.vectors]
        return torch.cat(feats, -1)


def check_spaces(obs_space: gym.Space, act_space: gym.Space) -> None:
    """Raise :class:`~rlnb.errors.ConfigError` (key ``env.id``) unless the built-in policy takes these spaces
    (:func:`rlnb.envs.gym_envs.space_problem`). The driver checks this on a probe env before anything starts
    (:func:`rlnb.envs.gym_envs.probe_env`), the policy again where it is built."""
    problem = space_problem(obs_space, act_space)
    if problem is None:
        return
    which, expected, got = problem
    message = f"env.id: expected {expected}, got {got}"
    if which.startswith("observation_space["):
        message = f"env.id: {which}: the built-in policy (actor.model) takes {expected}, got {got}"
    elif which == "observation_space":
        message = (
            f"env.id: the built-in policy (actor.model) takes {expected}, got {got}; flatten them "
            "(gymnasium.wrappers.FlattenObservation, in an env class of your own) or give a policy of your own "
            "(rollout and actor policy=...)"
        )
    raise ConfigError(message, "env.id")


class ActorCritic(nn.Module):
    """Policy and value heads over MLP trunks (shared or separate), a CNN trunk, or for dict observations a
    :class:`MultiInputEncoder` feeding an MLP each.

    ``forward(obs, actions)`` returns ``(logprob [B], entropy [B], value [B])``, the one call a
    train step needs (so ``DistributedDataParallel`` can wrap the module).
    """

    def __init__(
        self,
        obs_space: gym.Space,
        act_space: gym.Space,
        kind="mlp",
        hidden_sizes=(64, 64),
        activation="tanh",
        shared_trunk=False,
    ):
        super().__init__()
        # (what rebuilds it: a policy file holds these and the weights, never the pickled module)
        self.config = {"kind": kind, "hidden_sizes": list(hidden_sizes), "activation": activation,
                       "shared_trunk": bool(shared_trunk)}  # fmt: skip
        check_spaces(obs_space, act_space)
        self.discrete = isinstance(act_space, gym.spaces.Discrete)
        act_dim = int(act_space.n) if self.discrete else int(np.prod(act_space.shape))
        self.act_shape = () if self.discrete else tuple(act_space.shape)
        sizes = list(hidden_sizes)
        layout = layout_of(obs_space)
        if layout is not None:  # dict observations: their encoder, then an MLP each for actor and critic
            self.trunk = MultiInputEncoder(layout)
            self.actor_trunk = mlp([self.trunk.out_dim, *sizes], activation)
            self.critic_trunk = mlp([self.trunk.out_dim, *sizes], activation)
            feat = sizes[-1]
        elif kind == "cnn":
            trunk = NatureCNN(tuple(obs_space.shape))
            self.trunk, self.actor_trunk, self.critic_trunk = trunk, nn.Identity(), nn.Identity()
            feat = trunk.out_dim
        else:
            obs_dim = int(np.prod(obs_space.shape))
            if shared_trunk:
                self.trunk = mlp([obs_dim, *sizes], activation)
                self.actor_trunk, self.critic_trunk = nn.Identity(), nn.Identity()
            else:
                self.trunk = nn.Flatten()
                self.actor_trunk = mlp([obs_dim, *sizes], activation)
                self.critic_trunk = mlp([obs_dim, *sizes], activation)
            feat = sizes[-1]
        self.actor_head = layer_init(nn.Linear(feat, act_dim), std=0.01)
        self.critic_head = layer_init(nn.Linear(feat, 1), std=1.0)
        if not self.discrete:
            self.log_std = nn.Parameter(torch.zeros(act_dim))

    def _features(self, obs: torch.Tensor):
        h = self.trunk(obs.flatten(1) if isinstance(self.trunk, nn.Flatten) else obs)
        return self.actor_trunk(h), self.critic_trunk(h)

    def _normal(self, actor_feat: torch.Tensor) -> Normal:
        mean = self.actor_head(actor_feat)  # (B, act_dim)
        return Normal(mean, self.log_std.exp().expand_as(mean), validate_args=False)

    def value(self, obs: torch.Tensor) -> torch.Tensor:  # (B, ...) -> (B,)
        # a subclass's own features, as act computes them
        if type(self)._features is not ActorCritic._features:
            return self.critic_head(self._features(obs)[1]).squeeze(-1)
        # the critic's path of _features only: the actor's trunk has no part in a value
        h = self.trunk(obs.flatten(1) if isinstance(self.trunk, nn.Flatten) else obs)
        return self.critic_head(self.critic_trunk(h)).squeeze(-1)

    def act(self, obs: torch.Tensor, generator: torch.Generator | None = None, deterministic: bool = False):
        """Sample actions: ``(actions, logprob [B], value [B])``; ``generator`` makes sampling reproducible."""
        actor_feat, critic_feat = self._features(obs)
        if self.discrete:  # categorical by hand: torch.distributions costs more than the network here
            logp_all = torch.log_softmax(self.actor_head(actor_feat), dim=-1)  # (B, n)
            if deterministic:
                actions = logp_all.argmax(-1)
            else:
                actions = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(-1)
            logprob = logp_all.gather(-1, actions[:, None]).squeeze(-1)
        else:
            dist = self._normal(actor_feat)
            if deterministic:  # no draw: evaluating must not move the sampling generator of training
                actions = dist.mean
            else:
                noise = torch.randn(dist.mean.shape, generator=generator, device=dist.mean.device)
                actions = dist.mean + dist.stddev * noise  # (B, act_dim)
            logprob = dist.log_prob(actions).sum(-1)
        return actions, logprob, self.critic_head(critic_feat).squeeze(-1)

    def forward(self, obs: torch.Tensor, actions: torch.Tensor):
        """``(logprob [B], entropy [B], value [B])`` of given actions."""
        actor_feat, critic_feat = self._features(obs)
        if self.discrete:
            logp_all = torch.log_softmax(self.actor_head(actor_feat), dim=-1)  # (B, n)
            logprob = logp_all.gather(-1, actions.long()[:, None]).squeeze(-1)
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        else:
            dist = self._normal(actor_feat)
            logprob, entropy = dist.log_prob(actions).sum(-1), dist.entropy().sum(-1)
        return logprob, entropy, self.critic_head(critic_feat).squeeze(-1)


def build_policy(model_cfg, obs_space: gym.Space, act_space: gym.Space) -> nn.Module:
    """An :class:`ActorCritic` from a :class:`rlnb.config.ModelConfig`, or with ``kind: vla`` a
    :class:`rlnb.models.vla.VLAPolicy`."""
    if model_cfg.kind == "vla":
        from rlnb.config.schema import VLAConfig
        from rlnb.models.vla import VLAPolicy

        v = model_cfg.vla if isinstance(model_cfg.vla, VLAConfig) else VLAConfig(**model_cfg.vla)
        return VLAPolicy(
            obs_space, act_space, v.path, v.head, v.cameras, v.instruction, v.default_instruction,
            critic_detached=v.critic_detached, proprio=v.proprio,
        )  # fmt: skip
    if model_cfg.kind == "cnn" and layout_of(obs_space) is None and len(obs_space.shape) != 3:
        raise ConfigError(
            f"actor.model.kind: 'cnn' needs (C, H, W) observations, got shape {obs_space.shape}",
            "actor.model.kind",
        )
    return ActorCritic(
        obs_space,
        act_space,
        model_cfg.kind,
        model_cfg.hidden_sizes,
        model_cfg.activation,
        model_cfg.shared_trunk,
    )


class DistributionPolicy(nn.Module):
    """Adapts a module whose ``forward(obs)`` returns ``(distribution, value [B])`` to the actor-critic
    contract rlnb's rollout and actor call (``act``, ``value``, ``forward(obs, actions)``).

    ``distribution`` is any ``torch.distributions.Distribution`` over one action per row (``Categorical``
    for discrete actions, ``Normal`` with ``[B, act_dim]`` parameters for continuous ones); log-probs and
    entropies over extra action dimensions are summed. Sampling uses torch's global RNG, seeded per rank.
    """

    def __init__(self, module: nn.Module, act_space: gym.Space):
        super().__init__()
        self.module = module
        self.discrete = isinstance(act_space, gym.spaces.Discrete)

    @staticmethod
    def _per_row(x: torch.Tensor) -> torch.Tensor:  # (B, ...) -> (B,)
        return x.sum(dim=tuple(range(1, x.dim()))) if x.dim() > 1 else x

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.module(obs)[1].reshape(-1)

    def act(self, obs: torch.Tensor, generator: torch.Generator | None = None, deterministic: bool = False):
        dist, value = self.module(obs)
        actions = dist.mode if deterministic else dist.sample()
        return actions, self._per_row(dist.log_prob(actions)), value.reshape(-1)

    def forward(self, obs: torch.Tensor, actions: torch.Tensor):
        dist, value = self.module(obs)
        if self.discrete:
            actions = actions.long()
        return self._per_row(dist.log_prob(actions)), self._per_row(dist.entropy()), value.reshape(-1)


def critic_parameters(policy: nn.Module, key: str) -> list[nn.Parameter]:
    """The value function's own weights in a built-in policy: ``ActorCritic``'s critic trunk and head, a VLA's
    value head. A policy of the user's own has no such split known here: a :class:`ConfigError` naming ``key``."""
    from rlnb.models.vla import VLAPolicy

    if isinstance(policy, ActorCritic):
        return [*policy.critic_trunk.parameters(), *policy.critic_head.parameters()]
    if isinstance(policy, VLAPolicy):
        return list(policy.value_head.parameters())
    raise ConfigError(
        f"{key}: a learning rate apart for the value function needs a built-in policy (actor.model), whose "
        f"value weights are known; got {type(policy).__name__}",
        key,
    )


def make_policy(policy, obs_space: gym.Space, act_space: gym.Space, component: str = "policy") -> nn.Module:
    """The policy module a rollout or actor runs, from what a user gave.

    Args:
        policy: ``None`` or a :class:`rlnb.config.ModelConfig` (or its dict): the built-in MLP/CNN
            :class:`ActorCritic`; an ``nn.Module`` class or a factory called as
            ``policy(obs_space, act_space)``; or an ``nn.Module`` instance (copied to each rank).
            A module with ``act``/``value``/``forward(obs, actions)`` is used as is (the
            :class:`ActorCritic` contract); one whose ``forward(obs)`` returns ``(distribution, value)``
            is wrapped in :class:`DistributionPolicy`.
        component: the component building it, named in errors.

    Raises:
        ComponentError: naming the object and what does not fit, checked on a sample observation.
    """
    from rlnb.config.schema import ModelConfig
    from rlnb.errors import ComponentError

    if policy is None or isinstance(policy, (ModelConfig, dict)):
        cfg = policy if isinstance(policy, ModelConfig) else ModelConfig(**(policy or {}))
        return build_policy(cfg, obs_space, act_space)
    label = getattr(policy, "__name__", type(policy).__name__)
    if isinstance(policy, nn.Module):
        module = policy
    elif callable(policy):
        try:
            module = policy(obs_space, act_space)
        except TypeError as e:
            raise ComponentError(
                f"expected an nn.Module class or factory called as policy(obs_space, act_space), "
                f"which raised TypeError: {e}",
                component, label, "__init__",
            ) from e  # fmt: skip
    else:
        raise ComponentError(
            f"expected an nn.Module class, factory or instance, or a ModelConfig, got {type(policy).__name__}",
            component, label, "policy",
        )  # fmt: skip
    if not isinstance(module, nn.Module):
        raise ComponentError(
            f"expected policy(obs_space, act_space) to return an nn.Module, got {type(module).__name__}",
            component, label, "__call__",
        )  # fmt: skip
    if not all(callable(getattr(module, m, None)) for m in ("act", "value")):
        module = DistributionPolicy(module, act_space)
    check_policy(module, obs_space, act_space, component, label)
    return module


def check_policy(module: nn.Module, obs_space: gym.Space, act_space: gym.Space, component: str, label: str):
    """Run a policy on two sample observations and check every output's type and shape."""
    from rlnb.errors import ComponentError

    obs = torch.as_tensor(np.stack([obs_space.sample(), obs_space.sample()]))
    if obs.dtype == torch.float64:
        obs = obs.float()
    wrapped = isinstance(module, DistributionPolicy)
    act_shape = () if isinstance(act_space, gym.spaces.Discrete) else tuple(act_space.shape)

    def fail(member: str, expected: str, got) -> None:
        raise ComponentError(f"expected {expected}, got {got}", component, label, member)

    def shape_of(x):
        return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__

    with torch.no_grad():
        if wrapped:
            try:
                out = module.module(obs)
            except Exception as e:
                fail("forward", f"forward(obs [B, {', '.join(map(str, obs_space.shape))}]) to run", repr(e))
            if not (isinstance(out, tuple) and len(out) == 2):
                fail("forward", "(distribution, value [B]) from forward(obs)", type(out).__name__)
            if not isinstance(out[0], torch.distributions.Distribution):
                fail(
                    "forward", "a torch.distributions.Distribution as the first output", type(out[0]).__name__
                )
            if not isinstance(out[1], torch.Tensor) or out[1].reshape(-1).shape != (2,):
                fail("forward", "value [B] (or [B, 1]) as the second output, B=2", shape_of(out[1]))
        try:
            actions, logprob, value = module.act(obs)
        except Exception as e:
            fail("act", "act(obs) -> (actions, logprob [B], value [B])", repr(e))
        if not isinstance(actions, torch.Tensor) or tuple(actions.shape) != (2, *act_shape):
            fail(
                "act",
                f"actions of shape {(2, *act_shape)} for the action space {act_space}",
                shape_of(actions),
            )
        for what, x in (("logprob", logprob), ("value", value)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != (2,):
                fail("act", f"{what} of shape (2,)", shape_of(x))
        out = module(obs, actions)
        if not (isinstance(out, tuple) and len(out) == 3):
            fail(
                "forward",
                "(logprob [B], entropy [B], value [B]) from forward(obs, actions)",
                type(out).__name__,
            )
        for what, x in zip(("logprob", "entropy", "value"), out):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != (2,):
                fail("forward", f"{what} of shape (2,)", shape_of(x))
