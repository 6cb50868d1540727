"""Elastic env and rollout ranks (``cluster.elastic``): workers that leave and join a run between steps.

A step's batch is made of *shares*, one per rollout rank the run launched with; each share has a channel key of its
own (``b0``, ``b1``...), which the actor ranks take as they would without elasticity. A live rollout rank runs the
shares it owns (:meth:`rlnb.PolicyRollout.collect_into`: collect, then put under the share's key). When a rank's
worker is lost mid-collection, the shares it owned move to the ranks left (fewest first) and are collected again
in the same step, so the actor trains on as many env steps as ever and nothing that was made is taken twice.
Between steps, a worker that joined the cluster (an embedded worker's restart, ``scale()``, ``adapt()``) is given
an env rank and a rollout rank, the actor's latest weights, and a share from the rank that runs most. The actor's
slots never change: losing one stays the typed error that ``loop.recover()`` answers.
"""

from __future__ import annotations

import logging

from rlnb.errors import RemoteError, WorkerLostError

log = logging.getLogger("rlnb")


class ElasticRanks:
    """The shares of a step's batch and the live env and rollout ranks running them (see the module's docstring).

    Args:
        session: the run's session (its groups ``env``, ``rollout`` and ``actor``, the cluster, the channels).
        paths: its :class:`~rlnb.loop.paths.DataPaths` (the share keys are its batch keys).
        spaces: the env's spaces, which a joining rollout rank binds.
    """

    def __init__(self, session, paths, spaces: tuple):
        self.session, self.paths, self.spaces = session, paths, spaces
        rollout = session.groups["rollout"]
        self.shares = rollout.ranks  # one per rollout rank at launch, for the whole run
        self.owner = {k: k for k in self.shares}  # share -> the rollout rank that runs it
        paths.elastic = self
        for name in ("env", "rollout"):
            group = session.groups[name]
            group.positional_state = True
            session.cluster.mark_elastic([f"{group.name}[{r}]" for r in group.ranks])
        self.reissued = 0  # shares collected again after their rank was lost
        self.joined = 0  # ranks given to workers that joined
        self.admitting = True  # whether a worker that joins is given ranks (until one could not take them)

    # ------------------------------------------------------------------ a step's collection
    def start(self, steps: int) -> ElasticCollection:
        """Start every live rank on the shares it owns (each put into the batch channel as it is made)."""
        running = {r: ks for r, ks in self._assignment().items() if ks}
        return ElasticCollection(self, steps, self._issue(steps, running))

    def _assignment(self) -> dict[int, list[int]]:
        """Each live rollout rank's shares (empty for one that stands by; a dropped rank's are in none)."""
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
        lost, redo = self._drop(ranks, why)
        for k in lost:  # what a lost rank put before it went is dropped: each key holds one batch a step
            _drain(self.session.channels["batches"], f"b{k}")
        self.reissued += len(lost)
        log.warning(
            "env/rollout rank(s) %s lost (%s); their share(s) %s of this step's batch are collected again by "
            "rank(s) %s, and the run goes on with %d rollout rank(s)",
            ranks, why.args[0] if why.args else why, lost, sorted(redo), self.session.groups["rollout"].world_size,
        )  # fmt: skip
        return self._issue(steps, redo)

    def _drop(self, ranks: list[int], why: WorkerLostError) -> tuple[list[int], dict[int, list[int]]]:
        """Leave ``ranks`` out of the env and rollout groups and give their shares to the ranks left (fewest
        first): the shares moved and the new owners' lists of them. Raises ``why`` where no rank is left."""
        groups = self.session.groups
        lost = [k for k in self.shares if self.owner[k] in ranks]
        for name in ("env", "rollout"):
            groups[name].drop(ranks)
        weights = self.session.channels.get("weights")
        for r in ranks:  # (weights published for a rank that went are never read)
            if weights is not None:
                _drain(weights, f"w{r}")
        if not groups["rollout"].ranks:
            raise why
        load = {r: len(ks) for r, ks in self._assignment().items()}
        live = list(load)
        redo: dict[int, list[int]] = {}
        for k in lost:
            r = min(live, key=lambda r: (load[r], r))
            self.owner[k] = r
            load[r] += 1
            redo.setdefault(r, []).append(k)
        return lost, redo

    def settle(self, call) -> list:
        """The values of a call on the env or rollout ranks from those that answered; a rank lost meanwhile is
        dropped (its shares go to the others from the next step on). Other errors are raised."""
        got, lost = answers(call)
        values = list(got.values())
        if lost:
            self._drop([r for r, _ in lost], lost[0][1])
            log.warning("env/rollout rank(s) %s lost between steps; %d rollout rank(s) go on",
                        [r for r, _ in lost], self.session.groups["rollout"].world_size)  # fmt: skip
        return values

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
            env, rollout = s.groups["env"], s.groups["rollout"]
            try:
                r = self._start_ranks(slot, version)
            except RemoteError as e:
                # (a worker that cannot host them, or the env rank started and the rollout's did not: the two
                # groups' numbers no longer match, so no worker joins this run again)
                self.admitting = False
                for group in (env, rollout):
                    group.drop([q for q in group.ranks if group.infos[q].slot == slot])
                log.warning("a worker joined on slot %d but could not take env and rollout ranks (%s); the run goes "
                            "on with the ranks it has, and takes no more workers", slot, e)  # fmt: skip
                continue
            mine = max(self._assignment().values(), key=len)  # (the busiest rank's shares)
            if len(mine) > 1:
                self.owner[mine[-1]] = r
            self.joined += 1
            new.append(r)
            log.info("a worker joined on slot %d: it runs env and rollout rank %d", slot, r)
        return new

    def _start_ranks(self, slot: int, version: int) -> int:
        """An env and a rollout rank on ``slot``, bound to the env's spaces, with the actor's weights as
        ``version``; the rollout rank's number."""
        s = self.session
        env, rollout = s.groups["env"], s.groups["rollout"]
        e = env.grow(slot)
        r = rollout.grow(slot)
        if e != r:  # (they are dropped and grown together, so their numbers match)
            raise AssertionError(f"env rank {e} and rollout rank {r} on slot {slot}")
        s.cluster.mark_elastic([f"{env.name}[{e}]", f"{rollout.name}[{r}]"])
        rollout.on(r).bind_spaces(*self.spaces).result()
        self._load_weights([r], version)
        return r

    def _load_weights(self, ranks: list[int], version: int) -> None:
        ch, rollout = self.session.channels["weights"], self.session.groups["rollout"]
        self.paths.publish_weights(ch, [f"w{r}" for r in ranks], version)
        rollout.on(ranks).call_each("load_from_channel", [(ch, f"w{r}") for r in ranks]).result()

    def metrics(self) -> dict:
        return {
            "cluster/ranks": self.session.groups["rollout"].world_size,
            "cluster/reissued": self.reissued,
            "cluster/joined": self.joined,
        }


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
