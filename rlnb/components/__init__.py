"""Components: plain classes usable in-process, placed on a cluster with ``Cls.launch(cluster, slots, ...)``
(or ``rlnb.launch(MyClass, cluster, slots, ...)`` for a class of your own)."""

from rlnb.components.actor import PPOActor
from rlnb.components.env import Env
from rlnb.components.launch import launch
from rlnb.components.lm import HFRollout, LMActor, RewardWorker, VLLMRollout
from rlnb.components.replay import ReplayBuffer
from rlnb.components.rollout import PolicyRollout
from rlnb.components.sac import SACActor, SACCollector, SACLearner

__all__ = [
    "Env",
    "HFRollout",
    "LMActor",
    "PPOActor",
    "PolicyRollout",
    "ReplayBuffer",
    "RewardWorker",
    "SACActor",
    "SACCollector",
    "SACLearner",
    "VLLMRollout",
    "launch",
]
