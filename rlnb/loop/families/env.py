"""What every family of a policy on environments shares (embodied PPO, SAC): env steps counted, the last
``EPISODE_WINDOW`` finished training episodes and their statistics, the stop at ``runner.stop_return``, and the
check that an asynchronous vector env's slots may start child processes."""

from __future__ import annotations

import math
from collections import deque

from rlnb.components.env import success_rate
from rlnb.loop.checkpoint import MAX_STEP, ListOf, Num
from rlnb.loop.families import Family

EPISODE_WINDOW = 20  # episode statistics over the last 20 finished training episodes, as SB3 reports them


class EnvFamily(Family):
    """A family whose rollout steps environments (see the module's docstring)."""

    STATE = {
        "global_step": Num(0, MAX_STEP),
        "episodes": ListOf(ListOf(max_len=3), max_len=EPISODE_WINDOW),
    }

    def check_cluster(self) -> None:
        if self.session.recipe.env.vector_mode == "async":
            self.session.cluster.check_children(
                self.session.placement["env"], "env.vector_mode=async (gymnasium AsyncVectorEnv)"
            )

    def reset_state(self) -> None:
        self.global_step = 0
        self.episodes: deque = deque(maxlen=EPISODE_WINDOW)

    def state(self) -> dict:
        return {"global_step": self.global_step, "episodes": list(self.episodes)}

    def load_state(self, state: dict) -> None:
        self.global_step = state["global_step"]
        self.episodes = deque((tuple(x) for x in state["episodes"]), maxlen=EPISODE_WINDOW)

    def episode_stats(self) -> dict:
        """Mean return and length of the last (up to) 20 finished training episodes, ``None`` before any (a few
        µs: the loop reads it several times a step)."""
        if not self.episodes:
            return {"episode_return_mean": None, "episode_len_mean": None, "episode_success_rate": None}
        n = len(self.episodes)
        return {
            "episode_return_mean": math.fsum(e[0] for e in self.episodes) / n,
            "episode_len_mean": math.fsum(e[1] for e in self.episodes) / n,
            "episode_success_rate": success_rate(self.episodes),
        }

    def solved(self) -> bool:
        target = self.session.recipe.runner.stop_return
        return (
            target is not None
            and len(self.episodes) >= EPISODE_WINDOW
            and self.episode_stats()["episode_return_mean"] >= target
        )

    def episode_record(self) -> dict:
        """The step record's env part: ``global_step``, the episodes' mean return and length (and success rate,
        where the env says), and the rollout's throughput."""
        stats = self.episode_stats()
        record = {
            "global_step": self.global_step,
            "env/episode_return_mean": stats["episode_return_mean"],
            "env/episode_len_mean": stats["episode_len_mean"],
            "rollout/steps_per_s": self.session.pending.get("rollout/steps_per_s"),
        }
        if stats["episode_success_rate"] is not None:  # an env that says whether its episodes succeeded
            record["env/success_rate"] = stats["episode_success_rate"]
        return record

    def summary(self) -> str:
        ret = self.episode_stats()["episode_return_mean"]
        return f"step {self.session.step}, {self.global_step} env steps; train return (last 20) " + (
            "n/a" if ret is None else f"{ret:.1f}"
        )
