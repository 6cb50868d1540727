"""Environment adapters: gymnasium vector envs (any registered id), MuJoCo, ManiSkill (GPU)."""

from rlnb.envs.gym_envs import RunningMeanStd, make_vector_env
from rlnb.testing import NaNRewardCartPole  # noqa: F401  (registers rlnb-test/NaNReward-v0)

__all__ = ["RunningMeanStd", "make_vector_env"]
