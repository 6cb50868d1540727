"""Training-inference mismatch correction: importance weights from the rollout engine's token log-probs to the
trainer's, for the policy loss (``algorithm.mismatch_correction``).

An engine samples with its own kernels and precision (vLLM in bf16, a float32 actor), so the tokens come from
``pi_engine`` while the loss's ratio is taken to ``pi_trainer``: each token's (or sequence's) loss is weighted by
``w = pi_trainer / pi_engine`` with its gradient stopped, truncated (TIS: ``min(w, cap)``; Yao et al. 2025, "Your
Efficient RL Framework Secretly Brings You Off-Policy RL Training") or masked (MIS: ``w`` outside
``[floor, cap]`` weighs 0; IcePop, veRL's rollout rejection sampling). Sequence level takes ``w`` of the whole
completion, the product of its tokens' (a sum of log-ratios).

Example:
    >>> import torch
    >>> w, m = mismatch_weights(torch.zeros(1, 2), torch.tensor([[0.0, -1.0]]), None, "tis", "token", cap=2.0)
    >>> [round(x, 3) for x in w[0].tolist()], round(float(m["is_clipped_frac"]), 2)
    ([1.0, 2.0], 0.5)
"""

from __future__ import annotations

import torch

from rlnb.algorithms._checks import check_choice, check_same_shape
from rlnb.algorithms.losses import masked_mean

MODES = ("tis", "mis")
LEVELS = ("token", "sequence")


def mismatch_weights(
    trainer_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    mask: torch.Tensor | None,
    mode: str,
    level: str = "token",
    cap: float = 2.0,
    floor: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """The weights ``[B, L]`` (no gradient) that multiply each token's policy loss, and their metrics.

    Args:
        trainer_logprobs: ``[B, L]`` the trainer's log-probs of the sampled tokens (the policy the loss's ratio is
            taken to, before this update).
        engine_logprobs: ``[B, L]`` the rollout engine's log-probs of the same tokens, as it sampled them.
        mask: ``[B, L]`` 1 on the completion's tokens.
        mode: ``tis`` (truncate at ``cap``) or ``mis`` (0 outside ``[floor, cap]``).
        level: ``token`` (each token's own ratio) or ``sequence`` (the completion's, on all its tokens).
        cap: TIS's truncation, MIS's upper bound (> 1).
        floor: MIS's lower bound (``1 / cap`` where ``None``).

    Returns:
        ``(weights, {"is_ratio_mean", "is_clipped_frac", "is_masked_frac", "is_kl"})``: the ratios' mean before
        truncating, the share of tokens whose weight was truncated (TIS) or masked (MIS), and the k3 estimate of
        KL(engine || trainer) a token.
    """
    check_same_shape(
        ["trainer_logprobs", "engine_logprobs", "mask"], [trainer_logprobs, engine_logprobs, mask]
    )
    check_choice("mode", mode, MODES)
    check_choice("level", level, LEVELS)
    m = torch.ones_like(trainer_logprobs) if mask is None else mask.to(trainer_logprobs.dtype)
    log_ratio = ((trainer_logprobs - engine_logprobs).detach() * m).float()  # [B, L], 0 off the completion
    if level == "sequence":  # the completion's ratio, on each of its tokens
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    ratio = log_ratio.clamp(max=20.0).exp()  # (e^20: a ratio past any cap; no overflow to inf)
    low = 1.0 / cap if floor is None else floor
    if mode == "tis":
        weights = ratio.clamp(max=cap)
        cut = ratio > cap
    else:
        cut = (ratio > cap) | (ratio < low)
        weights = torch.where(cut, torch.zeros_like(ratio), ratio)
    token_ratio = (trainer_logprobs - engine_logprobs).detach().float().exp()
    metrics = {
        "is_ratio_mean": masked_mean(ratio, mask),
        "is_clipped_frac" if mode == "tis" else "is_masked_frac": masked_mean(cut.float(), mask),
        "is_kl": masked_mean((token_ratio - 1) - (trainer_logprobs - engine_logprobs).detach().float(), mask),
    }
    return weights * m, metrics


__all__ = ["LEVELS", "MODES", "mismatch_weights"]
