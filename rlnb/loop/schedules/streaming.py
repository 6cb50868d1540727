"""Partial rollouts (asynchronous GRPO, ``algorithm.max_staleness`` N >= 1, an LM rollout generating a chunk of
tokens at a time): the rollout ranks generate the next batch while the actor trains, taking new weights between
chunks, mid-generation. Admission is AReaL's: by policy version ``v``, a rollout rank admits at most
``(N + v + 1) x`` its share of ``data.prompts_per_step`` problems, so a group started at ``v`` is trained at
``t <= v + N``. Each finished batch goes to the actor ranks through the batch channel."""

from __future__ import annotations

import time

from rlnb.errors import ConfigError
from rlnb.loop.checkpoint import MAX_STEP, ListOf, Num
from rlnb.loop.roles import StreamsGeneration, check_role
from rlnb.loop.schedules.ahead import Ahead, Settled


class Streaming(Ahead):
    """Partial rollouts (see the module's docstring)."""

    STATE = {
        **Ahead.STATE,
        "admitted?": ListOf(Num(0, MAX_STEP)),
        "trained_problems?": ListOf(ListOf(Num(0, MAX_STEP))),
    }

    @classmethod
    def check(cls, recipe, placement) -> None:
        """The rollout apart from the actor (it generates while the actor trains), the reward next to the rollout
        (each finished group is scored where it is made)."""
        super().check(recipe, placement)
        if tuple(placement["reward"]) != tuple(placement["rollout"]):
            raise ConfigError(
                f"algorithm.max_staleness={recipe.algorithm.max_staleness} scores each group where it is generated: "
                f"place the reward on the rollout's slots {list(placement['rollout'])} (it is on "
                f"{list(placement['reward'])}), e.g. component_placement={{'rollout,reward': 0, actor: 1}}",
                "algorithm.max_staleness",
            )

    def __init__(self, session, paths, family, steer):
        super().__init__(session, paths, family, steer)
        n = self.max_staleness
        check_role(session.groups["rollout"], "rollout", StreamsGeneration, "rlnb.components.HFRollout",
                   f"of asynchronous generation (algorithm.max_staleness={n})")  # fmt: skip

    def reset_state(self) -> None:
        super().reset_state()
        self.admitted = [0] * len(self.session.placement["rollout"])  # groups admitted per rollout rank, ever
        self.trained_problems: list[list[int]] = []  # per step: the serials of the problems it trained on

    def sync_weights(self) -> dict:
        """Actor -> rollout weights, published without waiting: the rollout ranks take them at their next chunk
        boundary, mid-generation."""
        self.steer.apply()
        s = self.session
        with s.timed("sync", version=s.step) as phase:
            if self.in_flight is not None and self.rollout_version != s.step:
                self.publish()
            phase.metrics.update(self.paths.take_sync_stats())
        return phase.metrics

    def publish(self) -> None:
        s = self.session
        self.paths.publish_weights(
            s.channels["weights"], [f"w{r}" for r in s.groups["rollout"].ranks], s.step
        )
        self.rollout_version = s.step

    def settle(self) -> None:
        """Let the generation in flight finish: it ends once its batch is done and the actor's newest version
        reached the rollout ranks, so that version is published first."""
        if self.in_flight is not None and self.rollout_version != self.session.step:
            self.publish()
        super().settle()

    def rollout(self) -> dict:
        s = self.session
        with s.timed("rollout") as phase:
            if self.in_flight is None:  # an empty pipeline (first step, after a checkpoint or evaluation)
                if self.rollout_version != s.step:
                    self.sync_rollout()
                self.in_flight = [self.start_stream(s.step)]
            elif self.rollout_version != s.step:
                self.publish()  # sync_weights() was skipped: the ranks wait for this version
            t_wait = time.perf_counter()
            summaries = self.in_flight[0].result()
            wait_s = time.perf_counter() - t_wait
            self.in_flight = None
            self.paths.take_batches(self.paths.batch_keys()[1])
            if not self.drains_at(s.step + 1):
                self.in_flight = [self.start_stream(s.step + 1)]
            staleness = [x for summary in summaries for x in summary["staleness"]]
            self.trained_problems.append(sorted(x for summary in summaries for x in summary["serials"]))
            generate_s = max(x["generate_s"] for x in summaries)
            extra = {
                "staleness_mean": sum(staleness) / len(staleness),
                "staleness_max": max(staleness),
                "interrupted_frac": sum(x["interrupted"] for x in summaries)
                / sum(x["sequences"] for x in summaries),
                "weight_swaps": sum(x["swaps"] for x in summaries),
                "pool_groups": sum(x["pool"] for x in summaries),
                "wait_s": wait_s,
                "overlap_frac": max(0.0, 1.0 - wait_s / generate_s) if generate_s > 0 else 0.0,
                "in_flight": int(self.in_flight is not None),
            }
            self.family.rollout_metrics(phase, summaries, extra)
            # (a weight sync this phase ran: its bytes logged with it, under sync/)
            phase.metrics.update(self.paths.take_sync_stats("sync/"))
        return phase.metrics

    def start_stream(self, train_version: int):
        """Admit problems to each rollout rank (AReaL's admission control) and start generating the batch trained at
        ``train_version``."""
        limit = self.admission_limit()
        new = [max(0, limit - got) for got in self.admitted]
        calls = self.family.stream_calls(new, train_version, self.max_staleness)
        self.admitted = [got + n for got, n in zip(self.admitted, new)]
        return self.session.groups["rollout"].call_each("stream", calls)

    def admission_limit(self) -> int:
        """By version ``v`` (the newest sent is the step) a rollout rank admits at most ``(N + v + 1) x`` its share
        of ``data.prompts_per_step`` problems."""
        per_rank = self.session.recipe.data.prompts_per_step // len(self.admitted)
        return (self.max_staleness + self.session.step + 1) * per_rank

    # ------------------------------------------------------------------ in flight, and checkpoints
    def held_batches(self) -> list[dict]:
        """Streaming generation puts each finished batch into the batch channel itself: read back from there (and
        put again: a checkpoint leaves the pipeline as it was)."""
        return self.paths.peek_batches()

    def restore_in_flight(self, saved: dict) -> None:
        ch = self.session.channels["batches"]
        for k, batch in zip(self.paths.put_keys(), saved["batches"]):
            ch.put(batch, key=k)
        self.in_flight = [Settled(v) for v in saved["values"]]

    def state(self) -> dict:
        # what the rollout ranks hold in their pools is in their own checkpoints
        return {**super().state(), "admitted": self.admitted, "trained_problems": self.trained_problems}

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        if "admitted" in state:
            if len(state["admitted"]) != len(self.admitted):
                raise ConfigError(
                    f"loop.json: admitted counts {len(state['admitted'])} rollout rank(s); this run has "
                    f"{len(self.admitted)}", "component_placement"
                )  # fmt: skip
            self.admitted = list(state["admitted"])
            self.trained_problems = [list(x) for x in state["trained_problems"]]

    def status(self) -> dict:
        """What is in flight and how stale, and how many groups each rollout rank has admitted against the limit."""
        out = super().status()
        out.pop("next_batch_staleness")
        return {**out, "admitted": list(self.admitted), "admission_limit": self.admission_limit()}
