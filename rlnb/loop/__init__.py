"""Loops: the phases of one RL step as public calls, and ``run()`` over them."""

from rlnb.loop.base import CheckpointError, LoopBase, TrainingDivergedError, complete_checkpoints
from rlnb.loop.embodied import Loop
from rlnb.loop.grpo import GRPOLoop


def loop_class(recipe) -> type[LoopBase]:
    """The loop a recipe runs: :class:`GRPOLoop` for LM rollouts (``hf``/``vllm``), else :class:`Loop`."""
    return GRPOLoop if recipe.rollout.backend in ("hf", "vllm") else Loop


__all__ = [
    "CheckpointError",
    "GRPOLoop",
    "Loop",
    "LoopBase",
    "TrainingDivergedError",
    "complete_checkpoints",
    "loop_class",
]
