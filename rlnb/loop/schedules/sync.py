"""The synchronous schedule (``algorithm.max_staleness: 0``): each step's phases one after another, weights to the
rollout ranks at the start of every step."""

from __future__ import annotations

from rlnb.loop.schedules.base import Schedule


class Sync(Schedule):
    """One phase after another (everything :class:`~rlnb.loop.schedules.Schedule` does)."""
