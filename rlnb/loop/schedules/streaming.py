"""Partial rollouts (asynchronous GRPO, ``algorithm.max_staleness`` N >= 1, an LM rollout generating a chunk of
tokens at a time): the rollout ranks generate the next batch while the actor trains, taking new weights between
chunks, mid-generation. Admission is AReaL's: by policy version ``v``, a rollout rank admits at most
``(N + v + 1) x`` its share of ``data.prompts_per_step`` problems, so a group started at ``v`` is trained at
``t <= v + N``. Each finished batch goes to the actor ranks through the batch channel."""

from __future__ import annotations

import time

from rlnb.errors import ConfigError
from rlnb.loop.checkpoint import MAX_STEP, ListOf, Num
from rlnb.loop.elastic import ElasticRanks, answers
from rlnb.loop.roles import ElasticStreamsGeneration, StreamsGeneration, check_role
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


class ElasticStreaming(Streaming):
    """Partial rollouts whose rollout ranks come and go (``cluster.elastic``, :mod:`rlnb.loop.elastic`): each share
    of a step's batch (one per rollout rank launched) has its own admissions, and the loop knows which problems
    each rank holds in its pool, not yet handed over. A lost rank's are admitted again where its shares go, and made
    into the shares' batches in the same step; a share that moves to a joining rank takes as many problems along;
    so every problem admitted is trained once. The reward ranks, next to the rollout's, come and go with them."""

    STATE = {
        **Streaming.STATE,
        "held?": ListOf(ListOf(Num(0, MAX_STEP))),
        "free?": ListOf(Num(0, MAX_STEP)),
        "cluster_reissued?": Num(0, MAX_STEP, optional=True),
        "cluster_joined?": Num(0, MAX_STEP, optional=True),
    }

    def __init__(self, session, paths, family, steer):
        super().__init__(session, paths, family, steer)
        check_role(session.groups["rollout"], "rollout", ElasticStreamsGeneration, "rlnb.components.HFRollout",
                   "of cluster.elastic")  # fmt: skip
        self.elastic = paths.ranks = ElasticRanks(session, paths, ("rollout", "reward"))
        self.elastic.on_drop.append(self._freed)

    def reset_state(self) -> None:
        super().reset_state()
        # the serials each live rollout rank holds in its pool (admitted, not yet handed over), and those a lost
        # rank held, to admit again
        self.held: dict[int, list[int]] = {r: [] for r in self.session.groups["rollout"].ranks}
        self.free: list[int] = []

    def _freed(self, ranks: list[int]) -> None:
        for r in ranks:
            self.free += self.held.pop(r, [])

    def rollout(self) -> dict:
        out = super().rollout()
        self.session.pending.update(self.elastic.metrics())
        return out

    def start_stream(self, train_version: int):
        """A worker that joined takes ranks and a share; the problems held follow the shares; each live rank is
        admitted its shares' new problems (see :meth:`Streaming.start_stream`) and starts making them."""
        s = self.session
        self.elastic.admit(s.step)
        readmit = self._rebalance()
        limit = self.admission_limit()
        work = {}
        for r, shares in self.elastic.assignment().items():
            new = sum(max(0, limit - self.admitted[k]) for k in shares)
            for k in shares:
                self.admitted[k] = max(self.admitted[k], limit)
            first = self.family.task.position
            fresh = list(zip(range(first, first + new), self.family.task.sample(new)))
            if shares:
                work[r] = (shares, self._problems(readmit.pop(r, [])) + fresh)
        return ElasticStream(self, train_version, work)

    def _rebalance(self) -> dict[int, list[int]]:
        """Each live rank to hold as many problems as its shares: a rank holding more gives up its youngest groups
        (``release``); they, and those of lost ranks, are admitted again by ranks holding fewer. Returns those
        serials by rank."""
        rollout = self.session.groups["rollout"]
        while True:
            shares = self.elastic.assignment()
            total = sum(len(self.held.setdefault(r, [])) for r in shares) + len(self.free)
            per_share, extra = divmod(total, len(self.elastic.shares))
            want = {r: per_share * len(ks) for r, ks in shares.items()}
            for r in sorted(want)[:extra]:
                want[r] += 1
            over = {r: len(self.held[r]) - want[r] for r in shares if len(self.held[r]) > want[r]}
            if not over:
                break
            ranks = sorted(over)
            got, lost = answers(rollout.on(ranks).call_each("release", [(over[r],) for r in ranks]))
            for r, serials in got.items():
                gone = set(serials)
                self.held[r] = [x for x in self.held[r] if x not in gone]
                self.free += serials
            if not lost:
                break
            self.elastic.drop_between_steps([r for r, _ in lost], lost[0][1])  # (and again, without them)
        readmit: dict[int, list[int]] = {}
        for r in sorted(want):
            n = max(0, want[r] - len(self.held[r]))
            readmit[r], self.free = self.free[:n], self.free[n:]
        return readmit

    def _problems(self, serials: list[int]) -> list[tuple]:
        return [(i, self.family.task.problem(i)) for i in serials]

    def issue(self, train_version: int, work: dict[int, tuple[list[int], list[tuple]]]):
        """``stream`` on each rank of ``work`` (its shares, and the problems it is admitted), their pools holding
        those from now on."""
        s = self.session
        puts = dict(self.paths.batch_keys()[0])
        ranks = sorted(work)
        for r in ranks:
            self.held.setdefault(r, []).extend(i for i, _ in work[r][1])
        calls = [
            self.family.stream_args(work[r][1], [(f"b{k}", puts[f"b{k}"]) for k in work[r][0]], f"w{r}",
                                    train_version, self.max_staleness)
            for r in ranks
        ]  # fmt: skip
        return s.groups["rollout"].on(ranks).call_each("stream", calls)

    def handed(self, rank: int, summary: dict) -> None:
        gone = set(summary["serials"])
        self.held[rank] = [x for x in self.held[rank] if x not in gone]

    def state(self) -> dict:
        # by position, as the ranks' own checkpoints: a resumed run's ranks are numbered afresh
        held = [self.held.get(r, []) for r in self.session.groups["rollout"].ranks]
        return {**super().state(), "held": held, "free": self.free, **self.elastic.state()}

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        ranks = self.session.groups["rollout"].ranks
        saved = state.get("held", [])
        # a rank the checkpoint kept no pool for starts empty; pools of ranks this run does not have are
        # admitted again
        self.held = {r: list(saved[i]) if i < len(saved) else [] for i, r in enumerate(ranks)}
        self.free = list(state.get("free", [])) + [x for pool in saved[len(ranks) :] for x in pool]
        self.elastic.load_state(state)


class ElasticStream:
    """A step's partial rollouts in flight on the live ranks, standing where a group call would (``result``,
    ``wait``, ``durations_s``): a rank lost meanwhile has its shares made again, in the same step, by the ranks
    left, from the problems it held. Its result is every call's summary."""

    def __init__(self, schedule: ElasticStreaming, train_version: int, work: dict):
        self.schedule, self.train_version = schedule, train_version
        self.calls = [schedule.issue(train_version, work)]
        self.summaries: list[dict] | None = None

    @property
    def durations_s(self) -> list:
        return [d for call in self.calls for d in call.durations_s]

    def result(self, timeout: float | None = None) -> list[dict]:
        if self.summaries is not None:
            return self.summaries
        sch, out, last = self.schedule, [], {}
        while True:
            got, lost = answers(self.calls[-1], timeout)
            for r, summary in got.items():
                sch.handed(r, summary)
                if r in last:  # (a rank that answered twice: its pool counted once, as it is now)
                    last[r]["pool"] = 0
                last[r] = summary
                out.append(summary)
            if not lost:
                break
            redo = sch.elastic.lose_shares([r for r, _ in lost], lost[0][1])
            # the lost ranks' problems, shared over the new owners by the shares each takes
            n_lost = sum(len(ks) for ks in redo.values())
            work, given = {}, 0
            for r in sorted(redo):
                n = len(sch.free) * len(redo[r]) // n_lost if r != max(redo) else len(sch.free) - given
                work[r] = (redo[r], sch._problems(sch.free[given : given + n]))
                given += n
            sch.free = []
            self.calls.append(sch.issue(self.train_version, work))
        self.summaries = out
        return out

    def wait(self, timeout: float | None = None) -> ElasticStream:
        self.result(timeout)
        return self

    def done(self) -> bool:
        return self.summaries is not None or self.calls[-1].done()
