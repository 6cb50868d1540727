"""Loops: the phases of one RL step as public calls, and ``run()`` over them (a facade over a session, the data
paths, a family and a schedule: :mod:`rlnb.loop.base`)."""

from rlnb.loop.base import LoopBase
from rlnb.loop.checkpoint import CheckpointError, TrainingDivergedError, complete_checkpoints
from rlnb.loop.embodied import Loop
from rlnb.loop.families import Family
from rlnb.loop.grpo import GRPOLoop
from rlnb.loop.offpolicy import SACLoop
from rlnb.loop.runner import Callback, EvaluateEvery, SaveEvery
from rlnb.loop.steering import STEERABLE


def loop_class(recipe) -> type[LoopBase]:
    """The loop a recipe runs (its family): :class:`GRPOLoop` for ``grpo``, :class:`SACLoop` for ``sac``,
    :class:`Loop` for ``ppo``."""
    return {"grpo": GRPOLoop, "sac": SACLoop}.get(recipe.family, Loop)


__all__ = [
    "STEERABLE",
    "Callback",
    "CheckpointError",
    "EvaluateEvery",
    "Family",
    "GRPOLoop",
    "Loop",
    "LoopBase",
    "SACLoop",
    "SaveEvery",
    "TrainingDivergedError",
    "complete_checkpoints",
    "loop_class",
]
