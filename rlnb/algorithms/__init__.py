"""Algorithm library: pure torch functions and registries; no cluster code.

Example:
    >>> import torch
    >>> from rlnb.algorithms import get_advantage
    >>> adv, ret = get_advantage("grpo")(rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2)
"""

from rlnb.algorithms.advantages import ADVANTAGES, get_advantage, register_advantage
from rlnb.algorithms.interactions import INTERACTIONS, get_interaction, register_interaction
from rlnb.algorithms.losses import (
    POLICY_LOSSES,
    aggregate,
    entropy_bonus,
    get_policy_loss,
    kl_penalty,
    masked_mean,
    register_policy_loss,
    value_loss,
)
from rlnb.algorithms.rewards import REWARDS, RewardModel, extract_answer, get_reward, register_reward

__all__ = [
    "ADVANTAGES",
    "INTERACTIONS",
    "POLICY_LOSSES",
    "REWARDS",
    "RewardModel",
    "aggregate",
    "entropy_bonus",
    "extract_answer",
    "get_advantage",
    "get_interaction",
    "get_policy_loss",
    "get_reward",
    "kl_penalty",
    "masked_mean",
    "register_advantage",
    "register_interaction",
    "register_policy_loss",
    "register_reward",
    "value_loss",
]
