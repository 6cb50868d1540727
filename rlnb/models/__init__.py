"""Policies: MLP and CNN actor-critics with categorical or Gaussian heads."""

from rlnb.models.policies import ActorCritic, build_policy

__all__ = ["ActorCritic", "build_policy"]
