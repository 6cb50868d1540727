"""Policy losses: ``get_policy_loss(name)(**kwargs) -> (loss, metrics)``, plus value loss, entropy and KL.

Token tensors are ``[B, L]`` (LM) or ``[T, N]`` / ``[M]`` (embodied minibatches); ``mask`` has the same
shape (1 = counts) and defaults to all ones. ``metrics`` map names to scalars: 0-dim tensors (no host sync,
so a compiled train step has no graph break) or floats; the actor turns them into floats after the step.
"""

from __future__ import annotations

import torch

from rlnb.algorithms._checks import check_choice, check_positive, check_same_shape
from rlnb.algorithms.registry import Registry
from rlnb.errors import ConfigError

POLICY_LOSSES = Registry("policy loss", key="algorithm.policy_loss")
register_policy_loss = POLICY_LOSSES.register
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")


def get_policy_loss(name: str):
    """The policy loss registered as ``name`` (case-insensitive)."""
    return POLICY_LOSSES.get(name, key="algorithm.policy_loss")


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return x.mean()
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor | None, agg: str = "token-mean", max_len: int | None = None
):
    """Reduce per-token losses ``[B, L]`` to a scalar.

    - ``token-mean``: mean over all unmasked tokens of the batch (DAPO).
    - ``seq-mean-token-mean``: mean per sequence, then over sequences (GRPO paper).
    - ``seq-mean-token-sum``: sum per sequence, then mean over sequences.
    - ``seq-mean-token-sum-norm``: sum per sequence / ``max_len`` (a constant, default ``L``), then mean
      over sequences (Dr. GRPO: no length bias).
    """
    check_choice("agg", agg, AGGREGATIONS)
    m = torch.ones_like(loss) if mask is None else mask.to(loss.dtype)
    if agg == "token-mean":
        return (loss * m).sum() / m.sum().clamp(min=1)
    seq_sum = (loss * m).reshape(loss.shape[0], -1).sum(dim=1)  # [B]
    if agg == "seq-mean-token-mean":
        seq_len = m.reshape(loss.shape[0], -1).sum(dim=1).clamp(min=1)
        return (seq_sum / seq_len).mean()
    if agg == "seq-mean-token-sum":
        return seq_sum.mean()
    max_len = max_len if max_len is not None else m.reshape(loss.shape[0], -1).shape[1]
    return (seq_sum / max_len).mean()


def _clip_bounds(clip_coef: float, clip_coef_high: float | None):
    check_positive("clip_coef", clip_coef)
    high = clip_coef if clip_coef_high is None else clip_coef_high
    check_positive("clip_coef_high", high)
    return 1.0 - clip_coef, 1.0 + high


def _clipped_objective(ratio, advantages, lo, hi, dual_clip):
    """Per-token PPO-clip loss, with the optional dual clip for negative advantages (Ye et al. 2020)."""
    pg_unclipped = -advantages * ratio  # [B, L]
    pg_clipped = -advantages * ratio.clamp(lo, hi)
    loss = torch.maximum(pg_unclipped, pg_clipped)
    clipped = pg_clipped > pg_unclipped
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ConfigError(f"dual_clip: expected a constant > 1, got {dual_clip}", "dual_clip")
        capped = torch.minimum(loss, -advantages * dual_clip)
        clipped = clipped | ((advantages < 0) & (capped < loss))
        loss = torch.where(advantages < 0, capped, loss)
    return loss, clipped


@register_policy_loss("ppo", zero_at_zero_advantage=True)
def ppo(
    logprobs,
    old_logprobs,
    advantages,
    mask=None,
    clip_coef: float = 0.2,
    clip_coef_high: float | None = None,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    max_len: int | None = None,
):
    """PPO clipped surrogate (Schulman et al. 2017), with clip-higher (DAPO) and dual clip.

    Args:
        logprobs: ``[B, L]`` log-probs under the current policy (with grad).
        old_logprobs: ``[B, L]`` log-probs of the policy that sampled (no grad).
        advantages: ``[B, L]`` (broadcast per-sequence advantages over tokens first).
        mask: ``[B, L]`` 1 for tokens that count.
        clip_coef: epsilon; ratio clipped to ``[1 - clip_coef, 1 + clip_coef_high]``.
        clip_coef_high: upper epsilon (defaults to ``clip_coef``).
        dual_clip: constant c > 1 bounding the loss for negative advantages.
        agg: see :func:`aggregate`.

    Returns:
        ``(loss, {"clip_frac", "approx_kl", "ratio_mean"})``.
    """
    check_same_shape(
        ["logprobs", "old_logprobs", "advantages", "mask"], [logprobs, old_logprobs, advantages, mask]
    )
    lo, hi = _clip_bounds(clip_coef, clip_coef_high)
    log_ratio = logprobs - old_logprobs.detach()
    ratio = log_ratio.exp()
    loss_tok, clipped = _clipped_objective(ratio, advantages.detach(), lo, hi, dual_clip)
    loss = aggregate(loss_tok, mask, agg, max_len)
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean(clipped.float(), mask),
            "approx_kl": masked_mean((ratio - 1) - log_ratio, mask),  # k3 estimator (Schulman 2020)
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, metrics


@register_policy_loss("decoupled_ppo", zero_at_zero_advantage=True)
def decoupled_ppo(
    logprobs,
    old_logprobs,
    prox_logprobs,
    advantages,
    mask=None,
    clip_coef: float = 0.2,
    clip_coef_high: float | None = None,
    dual_clip: float | None = None,
    behave_weight_cap: float | None = None,
    behave_mode: str = "mask",
    agg: str = "token-mean",
    max_len: int | None = None,
):
    """Decoupled PPO for off-policy batches (AReaL, Fu et al. 2025).

    The trust region is taken around a proximal policy (``prox_logprobs``, usually the policy just
    before this update); the behaviour policy that generated the data (``old_logprobs``) enters only
    through the importance weight ``w = pi_prox / pi_behave``. Tokens with ``w > behave_weight_cap``
    are dropped (``behave_mode="mask"``) or capped (``"clamp"``).
    """
    check_same_shape(
        ["logprobs", "old_logprobs", "prox_logprobs", "advantages", "mask"],
        [logprobs, old_logprobs, prox_logprobs, advantages, mask],
    )
    check_choice("behave_mode", behave_mode, ("mask", "clamp"))
    lo, hi = _clip_bounds(clip_coef, clip_coef_high)
    log_ratio = logprobs - prox_logprobs.detach()
    ratio = log_ratio.exp()
    loss_tok, clipped = _clipped_objective(ratio, advantages.detach(), lo, hi, dual_clip)
    behave_w = (prox_logprobs - old_logprobs).detach().exp()  # [B, L]
    keep = torch.ones_like(behave_w, dtype=torch.bool) if mask is None else mask.bool()
    if behave_weight_cap is not None:
        if behave_mode == "mask":
            keep = keep & (behave_w <= behave_weight_cap)
        else:
            behave_w = behave_w.clamp(max=behave_weight_cap)
    behave_w = torch.where(keep, behave_w, torch.zeros_like(behave_w))
    loss = aggregate(loss_tok * behave_w, mask, agg, max_len)
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean(clipped.float(), mask),
            "approx_kl": masked_mean((ratio - 1) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "behave_weight_mean": masked_mean(behave_w, mask),
            "behave_masked_frac": 1.0 - masked_mean(keep.float(), mask),
        }
    return loss, metrics


@register_policy_loss("gspo", zero_at_zero_advantage=True, layouts=("sequence",))
def gspo(
    logprobs,
    old_logprobs,
    advantages,
    mask=None,
    clip_coef: float = 3e-4,
    clip_coef_high: float | None = 4e-4,
    agg: str = "seq-mean-token-mean",
    max_len: int | None = None,
):
    """GSPO, Group Sequence Policy Optimization (Zheng et al. 2025): PPO's clip on the sequence's ratio
    ``s_i = exp(mean_t (log pi - log pi_old))`` (the per-token ratios' geometric mean) instead of each token's,
    in its token form ``s_i,t = sg(s_i) * pi_t / sg(pi_t)``: the same value, and the gradient of the sequence
    form where advantages are one a sequence. The paper clips at ``[1 - 3e-4, 1 + 4e-4]``.

    Args: as :func:`ppo`'s (``mask`` marks each sequence's tokens; ``agg`` the paper's per-sequence mean).

    Returns:
        ``(loss, {"clip_frac", "approx_kl", "ratio_mean"})``; ``clip_frac`` the share of sequences clipped.
    """
    check_same_shape(
        ["logprobs", "old_logprobs", "advantages", "mask"], [logprobs, old_logprobs, advantages, mask]
    )
    lo, hi = _clip_bounds(clip_coef, clip_coef_high)
    m = torch.ones_like(logprobs) if mask is None else mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs.detach()  # [B, L]
    seq_log_ratio = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)  # [B]
    # (clamped as veRL does: a sequence's ratio of e^10 is an error in the data, not a step to take)
    log_s = (logprobs - logprobs.detach() + seq_log_ratio.detach()[:, None]).clamp(max=10.0)
    ratio = log_s.exp()  # [B, L], each row's value its sequence's ratio
    loss_tok, clipped = _clipped_objective(ratio, advantages.detach(), lo, hi, None)
    loss = aggregate(loss_tok, mask, agg, max_len)
    with torch.no_grad():
        seq = m.sum(-1) > 0
        metrics = {
            "clip_frac": masked_mean(clipped.float(), mask),
            "approx_kl": masked_mean((log_ratio.exp() - 1) - log_ratio, mask),
            "ratio_mean": seq_log_ratio.exp()[seq].mean() if seq.any() else seq_log_ratio.new_ones(()),
        }
    return loss, metrics


@register_policy_loss("cispo", zero_at_zero_advantage=True, layouts=("sequence",))
def cispo(
    logprobs,
    old_logprobs,
    advantages,
    mask=None,
    clip_coef: float = 1.0,
    clip_coef_high: float | None = 0.28,
    agg: str = "token-mean",
    max_len: int | None = None,
):
    """CISPO, clipped importance-sampling-weight policy optimization (MiniMax-M1, 2025): REINFORCE on every
    token, weighted by its importance ratio clipped to ``[1 - clip_coef, 1 + clip_coef_high]`` with the gradient
    stopped, ``-sg(clip(r_t)) * A_t * log pi_t``. Unlike PPO's clip no token leaves the gradient, so rare tokens
    keep theirs. MiniMax set no lower bound (``clip_coef: 1``: the ratio is never below 0) and tuned the upper.

    Returns:
        ``(loss, {"clip_frac", "approx_kl", "ratio_mean"})``; ``clip_frac`` the share of tokens whose weight was
        clipped.
    """
    check_same_shape(
        ["logprobs", "old_logprobs", "advantages", "mask"], [logprobs, old_logprobs, advantages, mask]
    )
    lo, hi = _clip_bounds(clip_coef, clip_coef_high)
    log_ratio = logprobs - old_logprobs.detach()
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(lo, hi)
    loss = aggregate(-advantages.detach() * weight * logprobs, mask, agg, max_len)
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((weight != ratio).float(), mask),
            "approx_kl": masked_mean((ratio - 1) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, metrics


def value_loss(values, old_values, returns, mask=None, clip_coef: float | None = None):
    """0.5 * squared error of the value head, optionally clipped around the old values (PPO2 style)."""
    check_same_shape(["values", "old_values", "returns", "mask"], [values, old_values, returns, mask])
    unclipped = (values - returns) ** 2
    if clip_coef is None:
        return 0.5 * masked_mean(unclipped, mask)
    clipped_values = old_values + (values - old_values).clamp(-clip_coef, clip_coef)
    return 0.5 * masked_mean(torch.maximum(unclipped, (clipped_values - returns) ** 2), mask)


def entropy_bonus(entropy, mask=None):
    """Mean entropy over counted tokens (subtract ``ent_coef`` times this from the loss)."""
    return masked_mean(entropy, mask)


@register_policy_loss("ppo_clip_value_entropy", aliases=("actor_critic", "ppo_actor_critic"))
def ppo_clip_value_entropy(
    logprobs,
    old_logprobs,
    advantages,
    values,
    old_values,
    returns,
    entropy,
    clip_coef: float = 0.2,
    vf_coef: float = 0.5,
    ent_coef: float = 0.0,
    clip_vloss: bool = True,
    norm_adv: bool = True,
):
    """PPO on embodied tasks, written as CleanRL's ``ppo.py`` writes it, top to bottom.

    Shapes: every tensor is one minibatch, ``[M]`` (``M = T * N / num_minibatches`` samples).
    ``logprobs``, ``values`` and ``entropy`` come from the current policy (with grad); ``old_logprobs``,
    ``old_values``, ``advantages`` and ``returns`` from the rollout and GAE (no grad).

    Returns:
        ``(loss, {"policy_loss", "value_loss", "entropy", "approx_kl", "clip_frac", "ratio_mean"})``.
    """
    check_positive("clip_coef", clip_coef)
    logratio = logprobs - old_logprobs.detach()  # [M]
    ratio = logratio.exp()  # pi_new / pi_old
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()  # k3 estimator (Schulman 2020)
        clip_frac = ((ratio - 1.0).abs() > clip_coef).float().mean()

    mb_advantages = advantages.detach()
    if norm_adv and mb_advantages.numel() > 1:
        mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)

    # policy loss: the pessimistic (max) of the unclipped and the clipped surrogate
    pg_loss1 = -mb_advantages * ratio
    pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
    pg_loss = torch.max(pg_loss1, pg_loss2).mean()

    # value loss, optionally clipped around the rollout's values
    if clip_vloss:
        v_loss_unclipped = (values - returns) ** 2
        v_clipped = old_values + torch.clamp(values - old_values, -clip_coef, clip_coef)
        v_loss_clipped = (v_clipped - returns) ** 2
        v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
    else:
        v_loss = 0.5 * ((values - returns) ** 2).mean()

    entropy_loss = entropy.mean()
    loss = pg_loss - ent_coef * entropy_loss + vf_coef * v_loss
    metrics = {
        "policy_loss": pg_loss.detach(),
        "value_loss": v_loss.detach(),
        "entropy": entropy_loss.detach(),
        "approx_kl": approx_kl,
        "clip_frac": clip_frac,
        "ratio_mean": ratio.detach().mean(),
    }
    return loss, metrics


def kl_penalty(logprobs, ref_logprobs, kind: str = "k3"):
    """Per-token KL(pi || pi_ref) estimators from samples of pi (Schulman, "Approximating KL divergence").

    With ``log_r = ref_logprobs - logprobs``: ``k1 = -log_r`` (unbiased, high variance),
    ``k2 = log_r**2 / 2`` (low variance, biased), ``k3 = exp(log_r) - 1 - log_r`` (unbiased, >= 0).
    """
    check_choice("kind", kind, KL_KINDS)
    check_same_shape(["logprobs", "ref_logprobs"], [logprobs, ref_logprobs])
    log_r = ref_logprobs - logprobs
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    return log_r.exp() - 1 - log_r
