"""Environment adapters: gymnasium vector envs (any registered id), MuJoCo, ManiSkill (GPU), torch-batched
envs on any device (``rlnb/TorchCartPole-v1``)."""

from rlnb.envs.gym_envs import RunningMeanStd, make_vector_env
from rlnb.envs.torch_envs import TorchCartPole

__all__ = ["RunningMeanStd", "TorchCartPole", "make_vector_env"]
