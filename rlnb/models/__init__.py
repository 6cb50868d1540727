"""Policies (MLP/CNN actor-critics, vision-language-action models) and LM helpers (tiny LM factory, loading by
path, token log-probs)."""

from rlnb.models.lm import (
    build_char_tokenizer,
    build_tiny_lm,
    build_tiny_reward_model,
    load_lm,
    load_reward_model,
    token_logprobs,
)
from rlnb.models.policies import ActorCritic, build_policy
from rlnb.models.vla import VLAPolicy, build_tiny_vla, load_vla

__all__ = [
    "ActorCritic",
    "VLAPolicy",
    "build_char_tokenizer",
    "build_policy",
    "build_tiny_lm",
    "build_tiny_reward_model",
    "build_tiny_vla",
    "load_lm",
    "load_reward_model",
    "load_vla",
    "token_logprobs",
]
