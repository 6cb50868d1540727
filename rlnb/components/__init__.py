"""Components: plain classes usable in-process, placed on a cluster with ``rlnb.Group.launch``."""

from rlnb.components.actor import PPOActor
from rlnb.components.env import Env
from rlnb.components.rollout import PolicyRollout

__all__ = ["Env", "PPOActor", "PolicyRollout"]
