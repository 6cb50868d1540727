"""What every family of a policy on environments shares (embodied PPO, SAC): env steps counted, the last
``EPISODE_WINDOW`` finished training episodes and their statistics, the stop at ``runner.stop_return``, the
check that an asynchronous vector env's slots may start child processes, and env and rollout ranks that come and
go (``cluster.elastic``, :mod:`rlnb.loop.elastic`)."""

from __future__ import annotations

import math
from collections import deque

from rlnb.components.env import success_rate
from rlnb.loop.checkpoint import MAX_STEP, ListOf, Num
from rlnb.loop.elastic import ElasticRanks, FixedRanks
from rlnb.loop.families import Family
from rlnb.loop.roles import ElasticRolloutRole, check_role

EPISODE_WINDOW = 20  # episode statistics over the last 20 finished training episodes, as SB3 reports them


class EnvFamily(Family):
    """A family whose rollout steps environments (see the module's docstring)."""

    STATE = {
        "global_step": Num(0, MAX_STEP),
        "episodes": ListOf(ListOf(max_len=3), max_len=EPISODE_WINDOW),
        "cluster_reissued?": Num(0, MAX_STEP, optional=True),
        "cluster_joined?": Num(0, MAX_STEP, optional=True),
    }

    def check_cluster(self) -> None:
        if self.session.recipe.env.vector_mode == "async":
            self.session.cluster.check_children(
                self.session.placement["env"], "env.vector_mode=async (gymnasium AsyncVectorEnv)"
            )

    def reset_state(self) -> None:
        self.global_step = 0
        self.episodes: deque = deque(maxlen=EPISODE_WINDOW)

    @property
    def ranks(self) -> FixedRanks | ElasticRanks:
        """The env and rollout ranks, fixed or coming and going (:meth:`compose_ranks`): the data paths' own."""
        return self.paths.ranks

    def compose_ranks(self, builtin: str) -> None:
        """The env and rollout ranks, chosen once: fixed, or with ``cluster.elastic`` ranks that come and go (a
        joining rollout rank binds the env's spaces, then :meth:`prepare_joining`). ``builtin``: the rollout class
        an elastic run's rollout must be or subclass."""
        s = self.session
        if not s.recipe.cluster.elastic:  # (the paths' FixedRanks stand)
            return
        rollout = s.groups["rollout"]
        check_role(rollout, "rollout", ElasticRolloutRole, builtin, "of cluster.elastic")

        def prepare(r: int) -> None:
            rollout.on(r).bind_spaces(*self.spaces).result()
            self.prepare_joining(r)

        self.paths.ranks = ElasticRanks(s, self.paths, ("env", "rollout"), prepare)

    def prepare_joining(self, rank: int) -> None:
        """An elastic run's joining rollout rank, its spaces bound, before it takes weights (nothing here)."""

    def state(self) -> dict:
        return {"global_step": self.global_step, "episodes": list(self.episodes), **self.ranks.state()}

    def load_state(self, state: dict) -> None:
        self.global_step = state["global_step"]
        self.episodes = deque((tuple(x) for x in state["episodes"]), maxlen=EPISODE_WINDOW)
        self.ranks.load_state(state)

    def start_collection(self) -> list:
        """Start a step's collection (the pending calls): the ranks' own (:meth:`start_ranks` for fixed ranks)."""
        s = self.session
        return self.ranks.collect(s.step, s.recipe.rollout.steps_per_rollout, self.start_ranks)

    def start_ranks(self, steps: int) -> list:
        """Fixed ranks' collection of ``steps`` env steps for the family's placement: the pending calls."""
        raise NotImplementedError

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
