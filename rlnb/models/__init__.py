"""Policies (MLP/CNN actor-critics) and LM helpers (tiny LM factory, loading by path, token log-probs)."""

from rlnb.models.lm import (
    build_char_tokenizer,
    build_tiny_lm,
    build_tiny_reward_model,
    load_lm,
    load_reward_model,
    token_logprobs,
)
from rlnb.models.policies import ActorCritic, build_policy

__all__ = [
    "ActorCritic",
    "build_char_tokenizer",
    "build_policy",
    "build_tiny_lm",
    "build_tiny_reward_model",
    "load_lm",
    "load_reward_model",
    "token_logprobs",
]
