"""Per-rank seeds: the one place that says how each component's random stream derives from the run's seed.

Every stream of rank ``r`` is seeded with ``seed + step * (r + offset)``, with its own step, so that ranks
and streams do not share a seed. Values are kept as they were when each component chose its own salt, so
seeded runs reproduce across versions.

Example:
    >>> rank_seed(1, 0, "env"), rank_seed(1, 1, "env")
    (1, 10001)
"""

from __future__ import annotations

# stream -> (step, offset): seed + step * (rank + offset)
STREAMS: dict[str, tuple[int, int]] = {
    "env": (10_000, 0),  # env i of a rank resets with rank_seed(...) + i
    "rollout": (7919, 1),  # the policy rollout's action sampling
    "actor": (104729, 1),  # minibatch shuffling (both actors)
    "lm_rollout": (1009, 0),  # LM generation: then one seed per call, from a counter
}


def rank_seed(seed: int, rank: int, stream: str) -> int:
    """The seed of ``stream`` (a key of :data:`STREAMS`) on ``rank`` for a run seeded with ``seed``."""
    step, offset = STREAMS[stream]
    return seed + step * (rank + offset)
