"""Elastic rollout ranks (``cluster.elastic``): workers that leave and join a run between steps.

A step's batch is made of *shares*, one per rollout rank the run launched with; each share has a channel key of its
own (``b0``, ``b1``...), which the actor ranks take as they would without elasticity. A live rollout rank runs the
shares it owns (embodied: :meth:`rlnb.PolicyRollout.collect_into`, collect then put under the share's key; an LM's
partial rollouts: :class:`rlnb.loop.schedules.streaming.ElasticStreaming`). When a rank's worker is lost
mid-collection, the shares it owned move to the ranks left (fewest first) and are made again in the same step, so
the actor trains on as much data as ever and nothing that was made is taken twice. Between steps, a worker that
joined the cluster (an embedded worker's restart, ``scale()``, ``adapt()``) is given a rank of each group that
moves with the rollout (the env's, or the reward's), the actor's latest weights, and a share from the rank that
runs most. The actor's slots never change: losing one stays the typed error that ``loop.recover()`` answers.
"""

from __future__ import annotations

import logging

from rlnb.errors import RemoteError, WorkerLostError

log = logging.getLogger("rlnb")


class FixedRanks:
    """The rollout ranks a run launched with, kept for the whole run (no ``cluster.elastic``): it answers what
    :class:`ElasticRanks` answers, so a family and the data paths ask whichever was chosen at composition and never
    check which. Each rank's batch stays on it until handed over; a lost rank's worker is the typed error that
    ``loop.recover()`` answers."""

    def __init__(self, session, paths):
        self.session, self.paths = session, paths

    @property
    def shares(self) -> list[int]:
        return self.session.groups["rollout"].ranks

    def collect(self, version: int, steps: int, start) -> list:
        """A step's collection: ``start(steps)``, the family's own calls for its placement."""
        return start(steps)

    def settle(self, call) -> list:
        return call.result()

    def take(self, batches: list[dict] | None) -> None:
        self.paths.hand_batches(batches)

    def held_batches(self) -> list[dict]:
        return self.session.groups["rollout"].take_batch().result()

    def broken_shares(self) -> list[int]:
        return []  # (every share's batch follows its last on the same envs)

    def metrics(self) -> dict:
        return {}

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        """Nothing to restore."""


class ElasticRanks:
    """The shares of a step's batch and the live rollout ranks running them (see the module's docstring).

    Args:
        session: the run's session (its groups, the cluster, the channels).
        paths: its :class:`~rlnb.loop.paths.DataPaths` (the share keys are its batch keys), whose ``ranks`` the
            caller sets to this.
        groups: the groups whose ranks come and go together, one rank of each on a worker, ``rollout`` among
            them (embodied: ``env`` and ``rollout``; an LM: ``rollout`` and its collocated ``reward``).
        prepare: called with a joining rollout rank's number before it takes weights (binding the env's spaces).
    """

    def __init__(self, session, paths, groups: tuple[str, ...], prepare=None):
        self.session, self.paths, self.names, self.prepare = session, paths, groups, prepare
        rollout = session.groups["rollout"]
        self.shares = rollout.ranks  # one per rollout rank at launch, for the whole run
        self.owner = {k: k for k in self.shares}  # share -> the rollout rank that runs it
        for name in groups:
            group = session.groups[name]
            group.positional_state = True
            session.cluster.mark_elastic([f"{group.name}[{r}]" for r in group.ranks])
        self.on_drop: list = []  # called with the ranks dropped (a schedule tracking what they held)
        self.moved: set[int] = set()  # shares given to another rank since broken_shares() was last asked
        self.reissued = 0  # shares collected again after their rank was lost
        self.joined = 0  # ranks given to workers that joined
        self.admitting = True  # whether a worker that joins is given ranks (until one could not take them)

    # ------------------------------------------------------------------ a step's collection
    def collect(self, version: int, steps: int, start=None) -> list:
        """A step's collection: workers that joined take ranks first (nothing is in flight now), then every live
        rank runs its shares (``start``, the family's calls for fixed ranks, is not used)."""
        self.admit(version)
        return [self.start(steps)]

    def take(self, batches: list[dict] | None) -> None:
        """The step's batches to the actor: from the channel, where the ranks put them as they made them, or
        ``batches`` (a checkpoint's) put there from here."""
        if batches is None:
            self.paths.take_batches(self.paths.batch_keys()[1])
        else:
            self.paths.hand_batches(batches)

    def held_batches(self) -> list[dict]:
        """The ranks put their batches into the channel as they made them: read there (and put back, for the
        step that takes them), one per share."""
        return self.paths.peek_batches()

    def start(self, steps: int) -> ElasticCollection:
        """Start every live rank on the shares it owns (each put into the batch channel as it is made)."""
        running = {r: ks for r, ks in self.assignment().items() if ks}
        return ElasticCollection(self, steps, self._issue(steps, running))

    def assignment(self) -> dict[int, list[int]]:
        """Each live rollout rank's shares, in order (empty for one that stands by; a dropped rank's are in none)."""
        out: dict[int, list[int]] = {r: [] for r in self.session.groups["rollout"].ranks}
        for k in self.shares:
            if self.owner[k] in out:
                out[self.owner[k]].append(k)
        return out

    def _issue(self, steps: int, assignment: dict[int, list[int]]):
        s = self.session
        puts = dict(self.paths.batch_keys()[0])  # share key -> shards
        ranks = sorted(assignment)
        per_rank = [
            (
                steps,
                s.groups["env"].name,
                s.channels["batches"],
                [(f"b{k}", puts[f"b{k}"]) for k in assignment[r]],
            )
            for r in ranks
        ]
        return s.groups["rollout"].on(ranks).call_each("collect_into", per_rank), assignment

    def lose(self, ranks: list[int], steps: int, why: WorkerLostError):
        """Drop ``ranks`` (their workers are gone) and collect their shares again on the ranks left; the new
        calls and their assignment. Raises ``why`` where no rank is left."""
        return self._issue(steps, self.lose_shares(ranks, why))

    def lose_shares(self, ranks: list[int], why: WorkerLostError) -> dict[int, list[int]]:
        """Drop ``ranks`` mid-step: what they put of their shares is drained (each key holds one batch a step),
        and the shares go to the ranks left, which make them again; the new owners' lists of them. Raises ``why``
        where no rank is left."""
        lost, redo = self._drop(ranks, why)
        puts = dict(self.paths.batch_keys()[0])
        for k in lost:
            key, n = f"b{k}", puts[f"b{k}"]
            for part in [key] if n == 1 else [f"{key}.{j}" for j in range(n)]:
                _drain(self.session.channels["batches"], part)
        self.reissued += len(lost)
        log.warning(
            "rollout rank(s) %s lost (%s); their share(s) %s of this step's batch are made again by rank(s) %s, "
            "and the run goes on with %d rollout rank(s)",
            ranks, why.args[0] if why.args else why, lost, sorted(redo), self.session.groups["rollout"].world_size,
        )  # fmt: skip
        return redo

    def _drop(self, ranks: list[int], why: WorkerLostError) -> tuple[list[int], dict[int, list[int]]]:
        """Leave ``ranks`` out of the groups and give their shares to the ranks left (fewest first): the shares
        moved and the new owners' lists of them. Raises ``why`` where no rank is left."""
        groups = self.session.groups
        lost = [k for k in self.shares if self.owner[k] in ranks]
        for name in self.names:
            groups[name].drop(ranks)
        for hook in self.on_drop:
            hook(ranks)
        weights = self.session.channels.get("weights")
        for r in ranks:  # (weights published for a rank that went are never read)
            if weights is not None:
                _drain(weights, f"w{r}")
        if not groups["rollout"].ranks:
            raise why
        load = {r: len(ks) for r, ks in self.assignment().items()}
        live = list(load)
        redo: dict[int, list[int]] = {}
        self.moved.update(lost)
        for k in lost:
            r = min(live, key=lambda r: (load[r], r))
            self.owner[k] = r
            load[r] += 1
            redo.setdefault(r, []).append(k)
        return lost, redo

    def settle(self, call) -> list:
        """The values of a call on the elastic groups' ranks from those that answered; a rank lost meanwhile is
        dropped (its shares go to the others from the next step on). Other errors are raised."""
        got, lost = answers(call)
        if lost:
            self.drop_between_steps([r for r, _ in lost], lost[0][1])
        return list(got.values())

    def drop_between_steps(self, ranks: list[int], why: WorkerLostError) -> None:
        """Drop ``ranks``, lost while nothing of this step's batch was being made (their shares go to the others
        from the next step on)."""
        self._drop(ranks, why)
        log.warning("rollout rank(s) %s lost between steps; %d rollout rank(s) go on", ranks,
                    self.session.groups["rollout"].world_size)  # fmt: skip

    # ------------------------------------------------------------------ between steps
    def admit(self, version: int) -> list[int]:
        """Give each worker that joined since the last step an env and a rollout rank, the actor's weights (as
        ``version``) and, where a rank runs more than one share, one of them. Returns the new rollout ranks."""
        s = self.session
        rollout = s.groups["rollout"]
        if rollout.unrestored:  # a resumed run's ranks beyond those the checkpoint kept: the latest weights
            self._load_weights(rollout.unrestored, version)
            rollout.unrestored = []
        joined, _gone = s.cluster.update_slots()
        actor_slots = set(s.placement["actor"])
        new = []
        for slot in joined:
            if slot in actor_slots or s.cluster.placed_on(slot) or not self.admitting:
                continue
            try:
                r = self._start_ranks(slot, version)
            except RemoteError as e:
                # (a worker that cannot host them, or one group's rank started and another's did not: the
                # groups' numbers no longer match, so no worker joins this run again)
                self.admitting = False
                for group in (s.groups[name] for name in self.names):
                    group.drop([q for q in group.ranks if group.infos[q].slot == slot])
                log.warning("a worker joined on slot %d but could not take %s ranks (%s); the run goes on with the "
                            "ranks it has, and takes no more workers", slot, " and ".join(self.names), e)  # fmt: skip
                continue
            mine = max(self.assignment().values(), key=len)  # (the busiest rank's shares)
            if len(mine) > 1:
                self.owner[mine[-1]] = r
                self.moved.add(mine[-1])
            self.joined += 1
            new.append(r)
            log.info("a worker joined on slot %d: it runs %s rank %d", slot, " and ".join(self.names), r)
        return new

    def _start_ranks(self, slot: int, version: int) -> int:
        """A rank of each elastic group on ``slot``, prepared (``prepare``), with the actor's weights as
        ``version``; their number."""
        s = self.session
        groups = [s.groups[name] for name in self.names]
        numbers = {g.grow(slot) for g in groups}
        if len(numbers) != 1:  # (they are dropped and grown together, so their numbers match)
            raise AssertionError(f"ranks {sorted(numbers)} of {self.names} on slot {slot}")
        (r,) = numbers
        s.cluster.mark_elastic([f"{g.name}[{r}]" for g in groups])
        if self.prepare is not None:
            self.prepare(r)
        self._load_weights([r], version)
        return r

    def _load_weights(self, ranks: list[int], version: int) -> None:
        ch, rollout = self.session.channels["weights"], self.session.groups["rollout"]
        self.paths.publish_weights(ch, [f"w{r}" for r in ranks], version)
        rollout.on(ranks).call_each("load_from_channel", [(ch, f"w{r}") for r in ranks]).result()

    def broken_shares(self) -> list[int]:
        """The shares whose batch is not its last one's sequel on the same envs: moved to another rank since
        the last call, or run by a rank that runs several (one after another on its envs)."""
        runs = self.assignment()
        broken = self.moved | {k for ks in runs.values() if len(ks) > 1 for k in ks}
        self.moved = set()
        return sorted(broken)

    def metrics(self) -> dict:
        return {
            "cluster/ranks": self.session.groups["rollout"].world_size,
            "cluster/reissued": self.reissued,
            "cluster/joined": self.joined,
        }

    def state(self) -> dict:
        """Its counts, which go on from a resume (the checkpoint's ``cluster_reissued?``/``cluster_joined?``)."""
        return {"cluster_reissued": self.reissued, "cluster_joined": self.joined}

    def load_state(self, state: dict) -> None:
        self.reissued = state.get("cluster_reissued", 0)
        self.joined = state.get("cluster_joined", 0)


class ElasticCollection:
    """A step's collection in flight on the live ranks, standing where a group call would (``wait``,
    ``result``, ``durations_s``): its result is one summary per share, in share order, with a lost rank's
    shares collected again by the ranks left."""

    def __init__(self, elastic: ElasticRanks, steps: int, issued):
        self.elastic, self.steps = elastic, steps
        self.calls = [issued]
        self.summaries: list[dict] | None = None

    @property
    def durations_s(self) -> list:
        return [d for call, _ in self.calls for d in call.durations_s]

    def result(self, timeout: float | None = None) -> list[dict]:
        if self.summaries is not None:
            return self.summaries
        by_share: dict[int, dict] = {}
        call, assignment = self.calls[-1]
        while True:
            got, lost = answers(call, timeout)
            for rank, summaries in got.items():
                by_share.update(zip(assignment[rank], summaries))
            if not lost:
                break
            call, assignment = self.elastic.lose([r for r, _ in lost], self.steps, lost[0][1])
            self.calls.append((call, assignment))
        self.summaries = [by_share[k] for k in self.elastic.shares]
        return self.summaries

    def wait(self, timeout: float | None = None) -> ElasticCollection:
        self.result(timeout)
        return self

    def done(self) -> bool:
        return self.summaries is not None or self.calls[-1][0].done()


def answers(call, timeout: float | None = None) -> tuple[dict, list]:
    """A call's values by rank from the ranks that answered, and ``(rank, error)`` for those whose worker was lost;
    any other error is raised."""
    got, lost = {}, []
    for rank, outcome in zip(call.ranks, call.outcomes(timeout)):
        if isinstance(outcome, WorkerLostError):
            lost.append((rank, outcome))
        elif isinstance(outcome, Exception):
            raise outcome
        else:
            got[rank] = outcome
    return got, lost


def _drain(channel, key: str) -> None:
    while channel.qsize(key):
        channel.get_nowait(key)
