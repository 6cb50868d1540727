"""Loops: the phases of one RL step as public calls, and ``run()`` over them."""

from rlnb.loop.embodied import CheckpointError, Loop, TrainingDivergedError, complete_checkpoints

__all__ = ["CheckpointError", "Loop", "TrainingDivergedError", "complete_checkpoints"]
