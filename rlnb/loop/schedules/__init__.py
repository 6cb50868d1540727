"""Schedules: when a family's phases run. Chosen once, from the recipe, by :func:`choose_schedule`:

- :class:`~rlnb.loop.schedules.sync.Sync`: one phase after another (``algorithm.max_staleness: 0``).
- :class:`~rlnb.loop.schedules.chained.Chained`: synchronous, where a whole step runs on one worker: its calls go
  as one chain, and inside ``run()`` the worker runs the next steps ahead while the driver logs.
- :class:`~rlnb.loop.schedules.ahead.Ahead`: whole batches ahead (``max_staleness >= 1``): the next batch is
  collected while the actor trains on this one (embodied PPO; an LM engine generating whole completions).
- :class:`~rlnb.loop.schedules.streaming.Streaming`: partial rollouts (``max_staleness >= 1``, an LM rollout
  generating a chunk of tokens at a time and taking new weights between chunks, AReaL's admission control);
  :class:`~rlnb.loop.schedules.streaming.ElasticStreaming` with rollout ranks that come and go (``cluster.elastic``).

A schedule is the only part of the loop that knows what runs ahead (``max_staleness``, work in flight, steps the
worker took ahead): the family's phases, the checkpoints and ``run()`` ask it.
"""

from __future__ import annotations

from rlnb.loop.schedules.ahead import Ahead
from rlnb.loop.schedules.base import Schedule
from rlnb.loop.schedules.chained import Chained
from rlnb.loop.schedules.streaming import ElasticStreaming, Streaming
from rlnb.loop.schedules.sync import Sync


def choose_schedule(recipe, family_name: str, placement, capabilities=None) -> type[Schedule]:
    """The schedule a run takes, chosen once: asynchronous mode (``algorithm.max_staleness >= 1``) streams an LM
    generating in chunks and runs whole batches ahead otherwise; a synchronous embodied run whose every role shares
    one slot is chained; anything else is synchronous. ``capabilities``: the composed components' (objects path);
    the recipe path reads the rollout backend."""
    if recipe.algorithm.asynchronous:
        if family_name == "grpo":
            whole = (
                capabilities.whole_completions
                if capabilities is not None
                else recipe.rollout.backend == "vllm"
            )
            if whole:
                return Ahead
            return ElasticStreaming if recipe.cluster.elastic else Streaming
        return Ahead
    slots = {tuple(v) for v in placement.slots.values()}
    if family_name == "ppo" and len(slots) == 1 and len(next(iter(slots))) == 1:
        return Chained
    return Sync


__all__ = ["Ahead", "Chained", "ElasticStreaming", "Schedule", "Streaming", "Sync", "choose_schedule"]
