"""Environment adapters: gymnasium vector envs (any registered id), MuJoCo, ManiSkill (GPU)."""

from rlnb.envs.gym_envs import RunningMeanStd, make_vector_env

__all__ = ["RunningMeanStd", "make_vector_env"]
