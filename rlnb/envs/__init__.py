"""Environment adapters: gymnasium vector envs (any registered id), MuJoCo, ManiSkill (GPU), torch-batched
envs on any device (``rlnb/TorchCartPole-v1``)."""

from rlnb.envs.gym_envs import RunningMeanStd, make_vector_env
from rlnb.envs.torch_envs import TorchCartPole
from rlnb.testing import NaNRewardCartPole  # noqa: F401  (registers rlnb-test/NaNReward-v0)

__all__ = ["RunningMeanStd", "TorchCartPole", "make_vector_env"]
