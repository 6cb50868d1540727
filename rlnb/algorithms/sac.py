"""Soft Actor-Critic's losses (Haarnoja et al. 2018, "Soft Actor-Critic Algorithms and Applications": twin Q,
target networks, automatic entropy tuning), for continuous actions and for discrete ones (Christodoulou 2019), in
CleanRL's shape (``sac_continuous_action.py``, ``sac_atari.py``) with SB3's defaults.

Shapes: ``[M]`` a minibatch of transitions, ``[M, K]`` one value per discrete action. ``discount`` is ``gamma^n``
for each transition (``n`` the env steps its reward sums: 1, or fewer than ``n_step`` where its episode ended).
Every function returns ``(loss, metrics)``; the metrics are 0-dim tensors, detached.
"""

from __future__ import annotations

import math

import torch

from rlnb.algorithms._checks import check_same_shape


def soft_target(rewards, terminated, discount, next_q1, next_q2, next_logp, alpha):
    """The soft Bellman target ``y = r + (1 - terminated) gamma^n (min(Q1', Q2')(s', a') - alpha log pi(a'|s'))``,
    with ``a' ~ pi(.|s')`` (continuous: ``[M]`` each). A truncated episode's last transition bootstraps (only
    ``terminated`` stops it), as SB3 and CleanRL do with gymnasium's ``truncated``."""
    check_same_shape(["rewards", "terminated", "discount", "next_q1", "next_q2", "next_logp"],
                     [rewards, terminated, discount, next_q1, next_q2, next_logp])  # fmt: skip
    soft_v = torch.minimum(next_q1, next_q2) - alpha * next_logp  # [M]
    return (rewards + (1.0 - terminated.float()) * discount * soft_v).detach()


def discrete_soft_target(rewards, terminated, discount, next_q1, next_q2, next_probs, next_logp, alpha):
    """The discrete soft target: the next state's soft value is an expectation over its actions,
    ``V(s') = sum_a pi(a|s') (min(Q1', Q2')(s', a) - alpha log pi(a|s'))`` (``next_*``: ``[M, K]``)."""
    check_same_shape(
        ["next_q1", "next_q2", "next_probs", "next_logp"], [next_q1, next_q2, next_probs, next_logp]
    )
    check_same_shape(["rewards", "terminated", "discount"], [rewards, terminated, discount])
    soft_v = (next_probs * (torch.minimum(next_q1, next_q2) - alpha * next_logp)).sum(-1)  # [M]
    return (rewards + (1.0 - terminated.float()) * discount * soft_v).detach()


def q_loss(q1, q2, target):
    """Both Q-networks regressed on the one target: ``MSE(Q1, y) + MSE(Q2, y)`` (``[M]`` each; CleanRL's sum, SB3
    halves it)."""
    check_same_shape(["q1", "q2", "target"], [q1, q2, target])
    loss = torch.nn.functional.mse_loss(q1, target) + torch.nn.functional.mse_loss(q2, target)
    return loss, {"q_loss": loss.detach(), "q1_mean": q1.detach().mean(), "q2_mean": q2.detach().mean()}


def actor_loss(logp, q1_pi, q2_pi, alpha):
    """The policy's loss ``E[alpha log pi(a|s) - min(Q1, Q2)(s, a)]``, ``a ~ pi(.|s)`` reparameterised (``[M]``)."""
    check_same_shape(["logp", "q1_pi", "q2_pi"], [logp, q1_pi, q2_pi])
    loss = (alpha * logp - torch.minimum(q1_pi, q2_pi)).mean()
    return loss, {"actor_loss": loss.detach(), "entropy": -logp.detach().mean()}


def discrete_actor_loss(probs, logp, q1, q2, alpha):
    """The discrete policy's loss, an exact expectation over actions:
    ``E_s[sum_a pi(a|s) (alpha log pi(a|s) - min(Q1, Q2)(s, a))]`` (``[M, K]`` each; the Q-values detached)."""
    check_same_shape(["probs", "logp", "q1", "q2"], [probs, logp, q1, q2])
    q = torch.minimum(q1, q2).detach()
    loss = (probs * (alpha * logp - q)).sum(-1).mean()
    return loss, {"actor_loss": loss.detach(), "entropy": -(probs * logp).sum(-1).detach().mean()}


def alpha_loss(log_alpha, logp, target_entropy: float):
    """Automatic entropy tuning: ``-log_alpha E[log pi(a|s) + H_target]`` (SB3's form: its gradient raises
    ``alpha`` while the entropy is below the target). ``logp``: ``[M]``, or ``[M, K]`` with ``probs`` weighing it
    through :func:`discrete_alpha_loss`."""
    loss = -(log_alpha * (logp.detach() + target_entropy)).mean()
    return loss, {"alpha_loss": loss.detach(), "alpha": log_alpha.detach().exp()}


def discrete_alpha_loss(log_alpha, probs, logp, target_entropy: float):
    """Entropy tuning for discrete actions: the expectation over actions taken exactly (``[M, K]``)."""
    check_same_shape(["probs", "logp"], [probs, logp])
    loss = -(log_alpha * (probs.detach() * (logp.detach() + target_entropy)).sum(-1)).mean()
    return loss, {"alpha_loss": loss.detach(), "alpha": log_alpha.detach().exp()}


def target_entropy(action_space, scale: float = 0.89) -> float:
    """SB3's and CleanRL's targets: ``-dim(A)`` for a box; ``scale * log K`` for ``K`` discrete actions (CleanRL's
    ``target_entropy_scale`` 0.89 of the uniform policy's entropy)."""
    import gymnasium as gym

    if isinstance(action_space, gym.spaces.Discrete):
        return float(scale * math.log(int(action_space.n)))
    return -float(math.prod(action_space.shape))


@torch.no_grad()
def polyak_(target: torch.nn.Module, source: torch.nn.Module, tau: float) -> None:
    """``target <- tau source + (1 - tau) target``, in place, parameter by parameter (buffers copied)."""
    t_params, s_params = list(target.parameters()), list(source.parameters())
    torch._foreach_lerp_(t_params, s_params, tau)
    for tb, sb in zip(target.buffers(), source.buffers()):
        tb.copy_(sb)


__all__ = [
    "actor_loss", "alpha_loss", "discrete_actor_loss", "discrete_alpha_loss", "discrete_soft_target", "polyak_",
    "q_loss", "soft_target", "target_entropy",
]  # fmt: skip
