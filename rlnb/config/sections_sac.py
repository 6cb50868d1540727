"""The recipe sections SAC's family reads (``family: sac``): the algorithm's own settings (``sac``) and the replay
buffer (``buffer``). SAC also reads ``algorithm.gamma`` (the discount), ``algorithm.max_staleness`` (collectors
running ahead of the learner), ``rollout.steps_per_rollout``, ``env`` and ``actor.torch_threads``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rlnb.config.checks import bounded, changed_keys

if TYPE_CHECKING:
    from rlnb.config.schema import Recipe

# the keys of the shared sections SAC's family reads (one source of truth: SAC's own settings are under sac.*)
SAC_READS_ALGORITHM = ("algorithm.gamma", "algorithm.max_staleness")
SAC_READS_ACTOR = ("actor.torch_threads", "actor.device")
SAC_READS_ROLLOUT = ("rollout.steps_per_rollout", "rollout.weight_sync")


SACKernel = Literal["autograd", "fused"]
"""How a SAC update computes its gradients (:attr:`SACConfig.kernel`)."""


@dataclass
class SACConfig:
    """Soft Actor-Critic (Haarnoja et al., 2018) with SB3's defaults, and SAC-Discrete for discrete actions.

    Twin Q-networks with Polyak-averaged targets, the entropy coefficient tuned towards a target entropy, a
    squashed Gaussian policy (discrete actions: a categorical one, Christodoulou 2019)."""

    variant: Literal["auto", "continuous", "discrete"] = "auto"
    """``continuous`` (a bounded box of actions) or ``discrete`` (SAC-Discrete); ``auto``: the env's action space
    says. A variant given that the env's actions do not fit is refused before launch."""
    lr: float = bounded(3e-4, 0, 1, low_open=True)
    """Adam's learning rate of the policy, the Q-networks and the entropy coefficient."""
    batch_size: int = bounded(256, 1, 1_000_000)
    """Transitions sampled from the buffer for each gradient update."""
    learning_starts: int = bounded(1000, 0, 1_000_000_000)
    """Env steps (over every env) of uniformly random actions before the policy acts and updates begin (SB3's
    ``learning_starts``); the buffer holds this many transitions when the first batch is drawn, so it must be at
    least ``sac.batch_size``."""
    utd_ratio: float = bounded(
        1.0, 0, 1000, "a thousand updates a transition is no off-policy run", low_open=True
    )
    """The update-to-data ratio: gradient updates per env step collected (SB3's ``gradient_steps /
    train_freq``; 1.0 is SB3's default). A training step makes ``utd_ratio x`` the transitions its collection
    added."""
    tau: float = bounded(0.005, 0, 1, low_open=True)
    """Polyak averaging of the target Q-networks at each update: ``target <- (1 - tau) target + tau Q``."""
    alpha: float | None = bounded(None, 0, 1000, low_open=True)
    """A fixed entropy coefficient; ``None`` tunes it (SB3's ``ent_coef="auto"``)."""
    target_entropy: float | None = bounded(None, -1e6, 1e6)
    """The entropy the tuning aims at; ``None``: ``-dim(A)`` (continuous), ``0.89 log K`` (discrete)."""
    hidden_sizes: list[int] = bounded(factory=lambda: [256, 256], low=1, high=65_536, length=(1, 16))
    """Hidden widths of the policy's and each Q-network's MLP."""
    policy_delay: int = bounded(1, 1, 1000)
    """Policy (and entropy coefficient) steps every this many Q steps (TD3's delay, CleanRL's
    ``policy_frequency``; 1 for SB3)."""
    target_every: int = bounded(1, 1, 1000)
    """Target updates every this many Q steps (SB3's ``target_update_interval``)."""
    kernel: SACKernel = "autograd"
    """How an update computes its gradients: ``autograd``, or ``fused`` (continuous actions only): the same update
    with its gradients written out, the twin Q-networks batched and Adam fused over flat parameters, about a third
    less CPU an update (``docs/benchmarks.md``). A checkpoint resumes with the kernel that wrote it."""

    def check(self, recipe: Recipe) -> list[str]:
        """The batch fits the warm-up; the rest is bounds (and the variant against the env, on the driver before
        launch: :meth:`rlnb.loop.families.sac.SAC.check_here`)."""
        errs: list[str] = []
        if recipe.family != "sac":
            return errs
        for section, read in ((recipe.algorithm, SAC_READS_ALGORITHM), (recipe.actor, SAC_READS_ACTOR),
                              (recipe.rollout, SAC_READS_ROLLOUT)):  # fmt: skip
            name = type(section).__name__.removesuffix("Config").lower()
            unread = [k for k in changed_keys(section, f"{name}.") if k not in read]
            if unread:
                errs.append(
                    f"{unread[0]}: family sac does not read it (of {name}, only {', '.join(read)}); SAC's own "
                    "settings are under sac.* (sac.lr, sac.batch_size...) and buffer.*"
                )
        ints = isinstance(self.batch_size, int) and isinstance(self.learning_starts, int)
        if ints and (misfit := batch_over_warm_up(self.batch_size, self.learning_starts)):
            errs.append(misfit)
        return errs


def batch_over_warm_up(batch_size: int, learning_starts: int) -> str | None:
    """The error of a batch larger than the buffer holds when updates begin, or ``None`` (the recipe's check and
    :class:`rlnb.components.SACActor`'s alike)."""
    if batch_size <= learning_starts:
        return None
    return (
        f"sac.batch_size: {batch_size} transitions a batch, more than the sac.learning_starts={learning_starts} the "
        f"buffer holds when updates begin; raise sac.learning_starts to {batch_size} or more, or lower the batch"
    )


@dataclass
class BufferConfig:
    """The replay buffer (:class:`rlnb.components.replay.ReplayBuffer`), placed with the learner."""

    capacity: int = bounded(1_000_000, 1, 2**40)
    """Transitions kept; the oldest are overwritten first. The buffer takes this many times a transition's bytes
    (two observations, the action, the reward, two flags and the discount; ``loop.buffer`` shows them), which must
    fit its slot's worker: a larger one is refused before launch."""
    n_step: int = bounded(1, 1, 1000)
    """Rewards summed over this many steps into one transition (1: plain one-step targets)."""
    in_checkpoint: bool = True
    """Save the buffer's transitions with each checkpoint, so a resumed run samples what the run would have
    (exact resume); ``false``: checkpoints leave them out (smaller), and a resumed run starts with an empty
    buffer, updating again once its collectors have added ``sac.learning_starts`` transitions (with the policy's
    actions)."""

    def check(self, recipe: Recipe) -> list[str]:
        return []


__all__ = ["BufferConfig", "SACConfig"]
