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

from dataclasses import dataclass

from rlnb.algorithms.advantages import ADVANTAGES
from rlnb.algorithms.losses import POLICY_LOSSES
from rlnb.algorithms.registry import Entry, check_serves
from rlnb.algorithms.rewards import REWARDS


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
    # rewards, values, dones [T, N]; last_values [N]
    advantage_inputs=frozenset({"rewards", "values", "dones", "last_values", "gamma", "gae_lambda"}),
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
    advantage_inputs=frozenset({"rewards", "response_mask", "group_size", "scale", "kl", "kl_coef", "gamma"}),
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
            "behave_weight_cap",
        }
    ),
    reward_inputs=frozenset({"completion", "answer", "prompt"}),
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


def check_reward(reward) -> Entry:
    """The reward entry (a name or a function) if the LM loop can call it, else a :class:`rlnb.ConfigError`."""
    return check_serves(REWARDS, reward, LM.reward_inputs, LM.layout, "reward.name", LM.name)
