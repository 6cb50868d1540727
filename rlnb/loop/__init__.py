"""Loops: the phases of one RL step as public calls, and ``run()`` over them."""

from rlnb.loop.base import LoopBase
from rlnb.loop.checkpoint import CheckpointError, TrainingDivergedError, complete_checkpoints
from rlnb.loop.embodied import Loop
from rlnb.loop.grpo import GRPOLoop
from rlnb.loop.runner import Callback, EvaluateEvery, SaveEvery
from rlnb.loop.steering import STEERABLE


def loop_class(recipe) -> type[LoopBase]:
    """The loop a recipe runs (its ``loop:``): :class:`GRPOLoop` for ``grpo``, :class:`Loop` for ``embodied``."""
    return GRPOLoop if recipe.loop == "grpo" else Loop


__all__ = [
    "STEERABLE",
    "Callback",
    "CheckpointError",
    "EvaluateEvery",
    "GRPOLoop",
    "Loop",
    "LoopBase",
    "SaveEvery",
    "TrainingDivergedError",
    "complete_checkpoints",
    "loop_class",
]
