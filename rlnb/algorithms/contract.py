"""What each loop offers the algorithm registries: one input contract for every loop.

An advantage, policy loss or reward is called with the offered inputs it accepts (see
:class:`rlnb.algorithms.registry.Entry`). A choice whose needs a loop cannot meet is refused at
recipe validation and when the loop is built, before any worker starts.

Example:
    >>> from rlnb.algorithms.contract import EMBODIED, check_algorithm
    >>> advantage, loss = check_algorithm(EMBODIED, "gae", "ppo")
    >>> sorted(advantage.needs)
    ['dones', 'last_values', 'rewards', 'values']
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlnb.algorithms.advantages import ADVANTAGES
from rlnb.algorithms.losses import POLICY_LOSSES
from rlnb.algorithms.registry import Entry, check_serves
from rlnb.algorithms.rewards import REWARDS
from rlnb.errors import ConfigError


@dataclass(frozen=True)
class LoopContract:
    """The inputs a loop's actor offers each kind of algorithm function, and its batch layout."""

    name: str
    layout: str
    advantage_inputs: frozenset[str]
    loss_inputs: frozenset[str]
    reward_inputs: frozenset[str] = frozenset()


EMBODIED = LoopContract(
    name="embodied PPO",
    layout="trajectory",
    # rewards, values, dones [T, N]; last_values [N]; group_size: envs [gG, (g+1)G) start each episode alike
    advantage_inputs=frozenset(
        {"rewards", "values", "dones", "last_values", "gamma", "gae_lambda", "group_size", "scale"}
    ),
    # one minibatch, every tensor [M]; prox_logprobs: the policy at the start of this update
    loss_inputs=frozenset(
        {
            "logprobs",
            "old_logprobs",
            "prox_logprobs",
            "advantages",
            "values",
            "old_values",
            "returns",
            "entropy",
            "clip_coef",
            "clip_coef_high",
            "dual_clip",
            "vf_coef",
            "ent_coef",
            "clip_vloss",
            "norm_adv",
            "behave_weight_cap",
        }
    ),
)

LM = LoopContract(
    name="LM (GRPO)",
    layout="sequence",
    # rewards [B]; response_mask, kl [B, L] (kl only with algorithm.kl_coef > 0)
    # values: a value model's, where the advantage asks for them (the actor then holds a critic)
    advantage_inputs=frozenset(
        {"rewards", "response_mask", "group_size", "scale", "kl", "kl_coef", "gamma", "values", "gae_lambda"}
    ),
    # one micro-batch, every tensor [m, L]
    loss_inputs=frozenset(
        {
            "logprobs",
            "old_logprobs",
            "prox_logprobs",
            "advantages",
            "mask",
            "clip_coef",
            "clip_coef_high",
            "dual_clip",
            "agg",
            "max_len",
            "behave_weight_cap",
        }
    ),
    reward_inputs=frozenset({"completion", "answer", "prompt", "sandbox"}),
)


def check_algorithm(contract: LoopContract, advantage, policy_loss) -> tuple[Entry, Entry]:
    """The advantage and policy-loss entries (names or functions) if ``contract``'s loop can serve them,
    else a :class:`rlnb.ConfigError` naming the key, the value, what is missing and the compatible choices."""
    adv = check_serves(
        ADVANTAGES,
        advantage,
        contract.advantage_inputs,
        contract.layout,
        "algorithm.advantage",
        contract.name,
    )
    loss = check_serves(
        POLICY_LOSSES,
        policy_loss,
        contract.loss_inputs,
        contract.layout,
        "algorithm.policy_loss",
        contract.name,
    )
    return adv, loss


def check_reward(reward, fields=()) -> Entry:
    """The reward entry (a name or a function) if the LM loop can call it, else a :class:`rlnb.ConfigError`.

    ``fields``: the prompt records' fields a reward may also read by name (:func:`rlnb.data.prompts.common_fields`),
    or ``None`` where they are not known yet (a recipe's data file before it is read): any input is then taken
    for one, and the loop checks again once it has the records."""
    if fields is None:
        fields = REWARDS.entry(reward).needs
    try:
        return check_serves(
            REWARDS, reward, LM.reward_inputs | set(fields), LM.layout, "reward.name", LM.name
        )
    except ConfigError as e:
        has = f"these records have {', '.join(fields)}" if fields else "these records have none"
        raise ConfigError(
            f"{e}. A reward may also read any field every prompt record has ({has})", e.key
        ) from None


def check_rewards(rewards, weights=None, fields=()) -> tuple[list[Entry], list[float]]:
    """Several rewards summed with weights, as TRL's ``reward_funcs`` and ``reward_weights``: the entries of
    ``rewards`` (a name, a function, or a list of them) and one weight each (default 1.0 each), or a
    :class:`rlnb.ConfigError` naming ``reward.name`` or ``reward.weights``. ``fields``: as for :func:`check_reward`.

    Example:
        >>> entries, weights = check_rewards(["arithmetic", "format"], [1.0, 0.2])
        >>> [e.name for e in entries], weights
        (['arithmetic', 'format'], [1.0, 0.2])
    """
    items = list(rewards) if isinstance(rewards, (list, tuple)) else [rewards]
    if not items:
        raise ConfigError(
            "reward.name: expected a reward or a non-empty list of rewards, got []", "reward.name"
        )
    entries = [check_reward(r, fields) for r in items]
    names = [e.name for e in entries]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(
            f"reward.name: each reward is logged under its name, and {', '.join(map(repr, repeated))} comes "
            f"more than once in {names}; give each function a name of its own (a def, not a lambda)",
            "reward.name",
        )
    if weights is None:
        return entries, [1.0] * len(entries)
    if not isinstance(weights, (list, tuple)) or len(weights) != len(entries):
        raise ConfigError(
            f"reward.weights: expected a list of {len(entries)} number(s), one per reward in {names}, "
            f"got {weights!r}",
            "reward.weights",
        )
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ConfigError(
                f"reward.weights[{i}]: expected a finite number (the weight of {names[i]!r}), got {w!r}",
                "reward.weights",
            )
    return entries, [float(w) for w in weights]
