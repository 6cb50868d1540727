"""The data paths between actor and rollout, chosen once from the placement: how weights reach the rollout ranks
(in-process when collocated, a channel, or a broadcast over a process group) and how batches reach the actor ranks
(in-process or a channel, split when there are more actor than rollout ranks)."""

from __future__ import annotations

from rlnb.errors import ConfigError, PlacementError
from rlnb.loop.elastic import FixedRanks
from rlnb.loop.roles import BroadcastsWeights, ReceivesWeights, check_role
from rlnb.runtime.channel import Channel
from rlnb.runtime.group import init_collective

WEIGHT_SYNC_GROUP = "rlnb-weight-sync"  # the process group of rollout.weight_sync=broadcast


def weight_sync_route(recipe, placement, slots, asynchronous: bool) -> str:
    """``channel`` or ``broadcast`` for rollout ranks apart from the actor (``rollout.weight_sync``), refusing a
    choice this placement or mode cannot serve."""
    choice = recipe.rollout.weight_sync
    if choice == "channel":
        return "channel"
    rollout = [slots[s] for s in placement["rollout"]]
    actor0 = slots[placement["actor"][0]]
    if choice == "auto":
        on_gpus = all(s.device.startswith("cuda") for s in [actor0, *rollout])
        elsewhere = all(s.node != actor0.node for s in rollout)
        sharded = recipe.actor.strategy == "fsdp2"  # (its weights are gathered by every actor rank)
        return "broadcast" if on_gpus and elsewhere and not asynchronous and not sharded else "channel"
    if asynchronous:
        raise ConfigError(
            f"rollout.weight_sync=broadcast is a collective both sides enter at once, which asynchronous mode "
            f"(algorithm.max_staleness={recipe.algorithm.max_staleness}) cannot do: the rollout takes weights "
            "between chunks while it generates. Use channel or auto",
            "rollout.weight_sync",
        )
    shared = sorted(s.rank for s in rollout if s.address == actor0.address)
    if shared:
        raise PlacementError(
            f"rollout.weight_sync=broadcast needs every rollout rank in another worker than actor rank 0 "
            f"(a process group has one rank per worker); rollout slot(s) {shared} share its worker. "
            "Use channel or auto, or place them apart",
            "rollout.weight_sync",
        )
    return "broadcast"


class DataPaths:
    """Weights and batches between a session's actor and rollout ranks (chosen in :meth:`open`).

    Attributes:
        batch_local: actor and rollout share their slots: batches and weights move in-process.
        weight_sync: ``local``, ``channel`` or ``broadcast``.
    """

    def __init__(self, session):
        self.session = session
        self.batch_local = False
        self.weight_sync = "local"
        # a LoRA actor sends a channel's rollout ranks its adapters alone once they hold the base (the LM family
        # says so: actor.lora.sync, a rollout that merges them)
        self.adapter_sync = False
        self._unlogged: dict = {}
        # the rollout ranks' FixedRanks or, in an elastic run, ElasticRanks (rlnb.loop.elastic): batch keys by its
        # shares, not by the rollout ranks live now; a rank lost while weights load is dropped, not an error
        self.ranks = FixedRanks(session, self)

    def open(self, asynchronous: bool) -> None:
        """Channels (and the weight-sync process group) for whatever is not collocated between actor and rollout."""
        s = self.session
        p, groups = s.placement, s.groups
        self.batch_local = p["rollout"] == p["actor"]  # batches and weights move in-process
        if self.batch_local:
            self.weight_sync = "local"
            return
        self.weight_sync = weight_sync_route(s.recipe, p, s.cluster.slots, asynchronous)
        timeout = groups["actor"].call_timeout_s
        # (no byte bound on the loop's own channels: its protocol bounds them, one batch or one set of weights in
        # flight per rank, and a model's weights may be bigger than any default bound)
        s.channels["batches"] = Channel.create(
            s.cluster, "batches", slot=p["actor"][0], timeout_s=timeout, max_bytes=0
        )
        if self.weight_sync == "broadcast":
            actor, rollout = groups["actor"], groups["rollout"]
            why = "rollout.weight_sync=broadcast"
            check_role(actor, "actor", BroadcastsWeights, "component", f"of {why}")
            check_role(rollout, "rollout", ReceivesWeights, "component", f"of {why}")
            init_collective([actor.on(0), rollout], name=WEIGHT_SYNC_GROUP, timeout_s=timeout)
        else:
            s.channels["weights"] = Channel.create(
                s.cluster, "weights", slot=p["rollout"][0], timeout_s=timeout, max_bytes=0
            )

    def sync(self, version: int) -> dict:
        """Actor -> rollout weights, stamped ``version``, waiting for them to load. Returns the phase's metrics
        (with adapters-only sync, ``bytes`` sent and whether they were the ``adapters_only``)."""
        actor, rollout = self.session.groups["actor"], self.session.groups["rollout"]
        if self.batch_local:
            rollout.call_each(
                "load_from_local_actor", [(actor.name, r, version) for r in rollout.ranks]
            ).result()
        elif self.weight_sync == "broadcast":  # one collective: both sides enter it at once
            receiving = rollout.receive_weights(version, WEIGHT_SYNC_GROUP)
            actor.on(0).broadcast_weights(version, WEIGHT_SYNC_GROUP).result()
            receiving.result()
        else:
            ch = self.session.channels["weights"]
            keys = [f"w{r}" for r in rollout.ranks]
            # publish first (unbounded channel: never blocks), then load: a rollout rank sharing actor rank 0's
            # worker would otherwise hold its actor thread waiting for weights not yet sent
            self.publish_weights(ch, keys, version)
            loading = rollout.call_each("load_from_channel", [(ch, k) for k in keys])
            self.ranks.settle(loading)
            return dict(self._unlogged)
        return {}

    def take_sync_stats(self, prefix: str = "") -> dict:
        """The stats of the last sync not logged yet (``{}``: none since), keyed ``prefix + name``: a schedule that
        syncs inside another phase (run-ahead admission) logs them there under ``sync/``."""
        out, self._unlogged = self._unlogged, {}
        return {prefix + k: v for k, v in out.items()}

    def sync_stats(self) -> dict:
        """What the last adapters-only sync sent (``{}`` where weights go whole)."""
        if not self.adapter_sync:
            return {}
        last = self.session.groups["actor"].on(0).sync_stats().result()[0]
        return {"bytes": last["bytes"], "adapters_only": float(last["kind"] == "adapters")}

    def hand_batches(self, batches: list[dict] | None = None) -> list[dict]:
        """Rollout rank ``k``'s batch goes to actor rank ``k % actor ranks`` (in-process when collocated); with
        more actor than rollout ranks, it is split over several. Returns each actor rank's intake. ``batches``:
        one per rollout rank, from a checkpoint (work that was in flight), put from here instead."""
        rollout, actor = self.session.groups["rollout"], self.session.groups["actor"]
        if self.batch_local:
            return actor.call_each("take_local_batches", [(rollout.name, [a]) for a in actor.ranks]).result()
        ch = self.session.channels["batches"]
        puts, takes = self.batch_keys()
        if batches is not None:
            for (key, shards), batch in zip(puts, batches):
                parts = [batch] if shards == 1 else rollout.cls.split_batch(batch, shards)
                for j, part in enumerate(parts):
                    ch.put(part, key=key if shards == 1 else f"{key}.{j}")
            return self.take_batches(takes)
        sent = rollout.call_each("put_batch", [(ch, key, shards) for key, shards in puts])
        # puts never block (the channel is unbounded), so a rank sharing a worker with one of the other group's
        # ranks cannot hold that worker's actor thread while waiting for it
        sent.result()
        return self.take_batches(takes)

    def batch_keys(self) -> tuple[list[tuple[str, int]], list[list[str]]]:
        """The channel hand-off: per rollout rank ``(key, shards)`` it puts under, and per actor rank the keys it
        takes. With more actor than rollout ranks each batch is split (RLinf's hybrid)."""
        actor = self.session.groups["actor"]
        sources = self.ranks.shares
        n_act, n_roll = actor.world_size, len(sources)
        if n_act > n_roll:
            m = n_act // n_roll
            return [(f"b{k}", m) for k in sources], [[f"b{a // m}.{a % m}"] for a in actor.ranks]
        takes = [[f"b{k}" for k in sources if k % n_act == a] for a in actor.ranks]
        return [(f"b{k}", 1) for k in sources], takes

    def put_keys(self) -> list[str]:
        """Every channel key the rollout ranks put batches under, in rank order (``key.j`` for split ones)."""
        puts, _ = self.batch_keys()
        return [k for key, n in puts for k in ([key] if n == 1 else [f"{key}.{j}" for j in range(n)])]

    def peek_batches(self) -> list[dict]:
        """The batches waiting in the batch channel, one per put key, read and put back (a checkpoint of work in
        flight whose ranks put their batches themselves leaves the pipeline as it was)."""
        ch, keys = self.session.channels["batches"], self.put_keys()
        held = [ch.get(key=k) for k in keys]
        for k, batch in zip(keys, held):
            ch.put(batch, key=k)
        return held

    def take_batches(self, takes: list[list[str]]) -> list[dict]:
        ch, actor = self.session.channels["batches"], self.session.groups["actor"]
        return actor.call_each("take_channel_batches", [(ch, k) for k in takes]).result()

    def actor_gathers(self) -> bool:
        """Whether every actor rank takes part in gathering the whole model (``actor.strategy: fsdp2``)."""
        return self.session.recipe.actor.strategy == "fsdp2" and self.session.groups["actor"].world_size > 1

    def publish_weights(self, channel, keys: list[str], version: int) -> None:
        """Actor rank 0 puts its weights under ``keys``; a sharded actor's ranks gather them together first."""
        actor = self.session.groups["actor"]
        if self.actor_gathers():
            calls = [(channel, keys if r == 0 else [], version) for r in actor.ranks]
            actor.call_each("publish_weights", calls).result()
        elif self.adapter_sync:
            actor.on(0).publish_weights(channel, keys, version, True).result()
        else:
            actor.on(0).publish_weights(channel, keys, version).result()
        self._unlogged = self.sync_stats()

    def export_actor(self, path: str) -> str:
        """The actor's model in Hugging Face format at ``path`` (by rank 0; a sharded actor's ranks gather it)."""
        actor = self.session.groups["actor"]
        return (actor if self.actor_gathers() else actor.on(0)).export_hf(path).result()[0]
