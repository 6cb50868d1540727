"""Advantage estimators: ``get_advantage(name)(**kwargs) -> (advantages, returns)``.

Shapes: embodied rollouts are ``[T, N]`` (time, env); LM batches are ``[B]`` per sequence, or
``[B, L]`` per token when a ``response_mask [B, L]`` is given.
"""

from __future__ import annotations

import torch

from rlnb.algorithms._checks import check_choice, check_positive, check_same_shape, check_tensor
from rlnb.algorithms.registry import Registry
from rlnb.errors import ConfigError

ADVANTAGES = Registry("advantage", key="algorithm.advantage")
register_advantage = ADVANTAGES.register


def get_advantage(name: str):
    """The advantage estimator registered as ``name`` (case-insensitive)."""
    return ADVANTAGES.get(name, key="algorithm.advantage")


@register_advantage("gae", layouts=("trajectory",))
def gae(rewards, values, dones, last_values, gamma: float = 0.99, gae_lambda: float = 0.95):
    """Generalised Advantage Estimation (Schulman et al. 2016).

    Args:
        rewards, values, dones: ``[T, N]``; ``dones[t] = 1`` when step t ended the episode, so step t+1
            is not bootstrapped (truncations are bootstrapped by the env adapter, into ``rewards``).
        last_values: ``[N]``, value of the state after step T-1.

    Returns:
        ``(advantages [T, N], returns [T, N])`` with ``returns = advantages + values``.
    """
    check_tensor("rewards", rewards, 2, "[T, N]")
    check_same_shape(["rewards", "values", "dones"], [rewards, values, dones])
    check_tensor("last_values", last_values, 1, "[N]")
    if last_values.shape[0] != rewards.shape[1]:
        raise ConfigError(
            f"last_values: expected shape ({rewards.shape[1]},), got {tuple(last_values.shape)}",
            "last_values",
        )
    nonterminal = 1.0 - dones.float()  # [T, N]
    next_values = torch.cat([values[1:], last_values[None]])  # [T, N]
    deltas = rewards + gamma * next_values * nonterminal - values  # [T, N]
    decay = gamma * gae_lambda * nonterminal  # [T, N]
    advantages = torch.zeros_like(rewards, dtype=torch.float32)
    # adv[t] = delta[t] + decay[t] * adv[t + 1], backwards in time; on CPU over numpy rows (less dispatch a
    # step than torch's), the same float32 operations
    plain = deltas.device.type == "cpu" and not (deltas.requires_grad or advantages.requires_grad)
    adv, delta, k = (x.numpy() for x in (advantages, deltas, decay)) if plain else (advantages, deltas, decay)
    if not len(adv):
        return advantages, advantages + values
    next_adv = delta[-1]
    adv[-1] = next_adv
    for t in range(len(adv) - 2, -1, -1):
        next_adv = delta[t] + k[t] * next_adv
        adv[t] = next_adv
    return advantages, advantages + values


@register_advantage("episode_grpo", layouts=("trajectory",))
def episode_grpo(rewards, dones, group_size: int, scale: str = "group", eps: float = 1e-6):
    """Embodied GRPO (SimpleVLA-RL, RLinf): each episode's return against the same episode of its group's envs.

    Envs ``[gG, (g+1)G)`` are group ``g``; they start each episode from one state and their episodes last the
    same number of steps (``rlnb.envs.groups.GroupedEpisodes``), so at each step a group's ``G`` envs are in
    episodes from the same start. An episode's return ``R`` (the sum of its rewards, undiscounted) gives each of
    its steps the advantage ``(R - mean_G R) / std_G R`` (``scale`` as :func:`grpo`'s). No value function.

    Args:
        rewards, dones: ``[T, N]``; ``N`` a multiple of ``group_size``, and the rollout ends its episodes.

    Returns:
        ``(advantages [T, N], returns [T, N])``: ``returns`` is each step's episode return ``R``.
    """
    check_choice("scale", scale, ("group", "batch", "none"))
    check_tensor("rewards", rewards, 2, "[T, N]")
    check_same_shape(["rewards", "dones"], [rewards, dones])
    T, N = rewards.shape
    if not isinstance(group_size, int) or group_size < 2 or N % group_size:
        raise ConfigError(
            f"algorithm.group_size: episode_grpo compares the episodes of groups of at least 2 envs, and "
            f"{group_size!r} does not divide the rollout's {N} envs", "algorithm.group_size",
        )  # fmt: skip
    ended = dones.bool()  # [T, N]
    if T and not ended[-1].all():
        raise ConfigError(
            "rollout.steps_per_rollout: episode_grpo needs whole episodes, and a rollout ended mid-episode; make it "
            "a multiple of the episodes' fixed length (env.kwargs.max_episode_steps)", "rollout.steps_per_rollout",
        )  # fmt: skip
    by_group = ended.view(T, N // group_size, group_size)  # [T, N/G, G]
    if not (by_group == by_group[..., :1]).all():
        raise ConfigError(
            "algorithm.advantage: episode_grpo found a group's envs ending episodes on different steps; their env "
            "must keep them aligned (rlnb.Env(..., group_size=G) does)", "algorithm.advantage",
        )  # fmt: skip
    r = rewards.float()
    to_go = torch.empty_like(r)  # [T, N] rewards from t to the end of t's episode
    running = torch.zeros(N, device=r.device)
    for t in range(T - 1, -1, -1):
        running = r[t] + running * ~ended[t]
        to_go[t] = running
    # [T, N] each step's whole-episode return, carried from the episode's first step
    episode = torch.empty_like(r)
    for t in range(T):
        episode[t] = to_go[t] if t == 0 else torch.where(ended[t - 1], to_go[t], episode[t - 1])
    g = episode.view(T, N // group_size, group_size)  # [T, N/G, G]
    # a group that scored alike is exactly 0: its mean's rounding over a std of 0 + eps would not be
    centred = torch.where((g == g[..., :1]).all(-1, keepdim=True), 0.0, g - g.mean(dim=-1, keepdim=True))
    if scale == "group":
        centred = centred / (g.std(dim=-1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (g.std() + eps)
    return centred.reshape(T, N), episode


def _grouped(rewards, group_size: int) -> torch.Tensor:
    check_tensor("rewards", rewards, 1, "[B]")
    if not isinstance(group_size, int) or group_size < 1:
        raise ConfigError(f"group_size: expected a positive int, got {group_size!r}", "group_size")
    if rewards.shape[0] % group_size:
        raise ConfigError(
            f"group_size: {group_size} does not divide the batch of {rewards.shape[0]} rewards; "
            "rewards must be laid out as consecutive groups of group_size samples per prompt",
            "group_size",
        )
    return rewards.float().view(-1, group_size)  # [B/G, G]


def _to_tokens(seq_values, response_mask):
    """Broadcast per-sequence values ``[B]`` over the response tokens ``[B, L]``."""
    if response_mask is None:
        return seq_values
    check_tensor("response_mask", response_mask, 2, "[B, L]")
    if response_mask.shape[0] != seq_values.shape[0]:
        raise ConfigError(
            f"response_mask: expected {seq_values.shape[0]} rows (one per reward), got {tuple(response_mask.shape)}",
            "response_mask",
        )
    return seq_values[:, None] * response_mask.float()  # [B, L]


@register_advantage("grpo", layouts=("sequence",))
def grpo(rewards, group_size: int, scale: str = "group", eps: float = 1e-6, response_mask=None):
    """GRPO (Shao et al. 2024): reward minus its group's mean, over a std.

    Args:
        rewards: ``[B]``, consecutive groups of ``group_size`` samples of one prompt.
        scale: ``"group"`` (std of the group), ``"batch"`` (std of the batch) or ``"none"``
            (Dr. GRPO, Liu et al. 2025: no division). Std uses Bessel's correction.
        response_mask: optional ``[B, L]``; advantages are then per token.

    Returns:
        ``(advantages, returns)``: ``[B]`` (or ``[B, L]``); returns are the rewards, broadcast.
    """
    check_choice("scale", scale, ("group", "batch", "none"))
    r = _grouped(rewards, group_size)  # [B/G, G]
    centred = r - r.mean(dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (r.std() + eps)
    adv = centred.reshape(-1)  # [B]
    return _to_tokens(adv, response_mask), _to_tokens(rewards.float(), response_mask)


@register_advantage("token_gae", layouts=("sequence",))
def token_gae(rewards, values, response_mask, gamma: float = 1.0, gae_lambda: float = 0.95):
    """PPO's GAE over a completion's tokens, with a value model (InstructGPT's PPO; veRL's, OpenRLHF's and TRL's
    PPO trainers): the reward comes at the completion's last token, each token is a step whose value the critic
    gives, and ``A_t = sum_k (gamma lambda)^k delta_{t+k}``, ``delta_t = r_t + gamma V_{t+1} - V_t``, over the
    response tokens in order (a multi-turn transcript's replies, off the mask, are skipped).

    Args:
        rewards: ``[B]``; values, response_mask: ``[B, L]``.

    Returns:
        ``(advantages [B, L], returns [B, L])``: 0 off the response; ``returns = advantages + values``.
    """
    check_same_shape(["values", "response_mask"], [values, response_mask])
    m = response_mask.float()
    b, length = m.shape
    last = (length - 1 - m.flip(1).argmax(1)).clamp(min=0)  # each row's last response token
    r = torch.zeros_like(m)
    r[torch.arange(b), last] = rewards.float() * (m.sum(1) > 0)
    v = values.float() * m
    adv = torch.zeros_like(m)
    gae, next_v = m.new_zeros(b), m.new_zeros(b)
    for t in range(length - 1, -1, -1):
        on = m[:, t] > 0
        g = r[:, t] + gamma * next_v - v[:, t] + gamma * gae_lambda * gae
        adv[:, t] = torch.where(on, g, torch.zeros_like(g))
        gae, next_v = torch.where(on, g, gae), torch.where(on, v[:, t], next_v)
    return adv, adv + v


@register_advantage("rloo", layouts=("sequence",))
def rloo(rewards, group_size: int, response_mask=None):
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024): baseline = mean of the other samples of the group.

    ``A_i = r_i - (sum_j r_j - r_i) / (G - 1)``.
    """
    if group_size < 2:
        raise ConfigError(
            f"group_size: rloo needs at least 2 samples per prompt, got {group_size}", "group_size"
        )
    r = _grouped(rewards, group_size)  # [B/G, G]
    baseline = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    adv = (r - baseline).reshape(-1)  # [B]
    return _to_tokens(adv, response_mask), _to_tokens(rewards.float(), response_mask)


def whiten(x, mask=None, eps: float = 1e-8):
    """(x - mean) / std over the whole batch (masked tokens only; veRL's masked whiten)."""
    if mask is None:
        return (x - x.mean()) / (x.std() + eps)
    m = mask.float()
    n = m.sum()
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / (n - 1).clamp(min=1)
    return (x - mean) * m / (var.sqrt() + eps)


def _token_returns(rewards, response_mask, kl, kl_coef: float, gamma: float):
    """Per-token returns: the sequence reward at the last response token, minus ``kl_coef * kl`` per token."""
    m = response_mask.float()  # [B, L]
    token_rewards = torch.zeros_like(m)
    if kl is not None:
        check_same_shape(["response_mask", "kl"], [response_mask, kl])
        token_rewards = -kl_coef * kl.float() * m
    last = (m.cumsum(dim=1) == m.sum(dim=1, keepdim=True)) & (m > 0)  # [B, L] one-hot on the last token
    token_rewards = token_rewards + last.float() * rewards.float()[:, None]
    returns = torch.zeros_like(m)
    running = torch.zeros(m.shape[0], device=m.device)
    for t in reversed(range(m.shape[1])):
        running = token_rewards[:, t] + gamma * running * m[:, t]
        returns[:, t] = running
    return returns * m


@register_advantage("reinforce_pp", layouts=("sequence",))
def reinforce_pp(
    rewards, response_mask=None, kl=None, kl_coef: float = 0.0, gamma: float = 1.0, eps: float = 1e-8
):
    """REINFORCE++ (Hu et al. 2025): discounted returns with a per-token KL penalty, whitened over the batch.

    Args:
        rewards: ``[B]`` sequence rewards.
        response_mask: ``[B, L]``; without it the advantage is per sequence: ``whiten(rewards)``.
        kl: optional ``[B, L]`` per-token KL to the reference policy, penalised by ``kl_coef``.
    """
    check_tensor("rewards", rewards, 1, "[B]")
    check_positive("gamma", gamma, allow_zero=True)
    if response_mask is None:
        return whiten(rewards.float(), eps=eps), rewards.float()
    _to_tokens(rewards, response_mask)  # shape checks
    returns = _token_returns(rewards, response_mask, kl, kl_coef, gamma)  # [B, L]
    return whiten(returns, response_mask, eps), returns


@register_advantage("reinforce_pp_baseline", layouts=("sequence",))
def reinforce_pp_baseline(
    rewards,
    group_size: int,
    response_mask=None,
    kl=None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-8,
):
    """REINFORCE++ with a group-mean baseline: rewards minus their group's mean, then :func:`reinforce_pp`."""
    r = _grouped(rewards, group_size)
    centred = (r - r.mean(dim=1, keepdim=True)).reshape(-1)  # [B]
    adv, _ = reinforce_pp(centred, response_mask, kl, kl_coef, gamma, eps)
    returns = _to_tokens(rewards.float(), response_mask)
    return adv, returns
