"""Groups, channels and process groups on a real local Dask cluster (worker processes)."""

import asyncio
import gc
import glob
import os
import queue
import time

import pytest
import torch

import rlnb
from rlnb.runtime.rank import current_rank
from rlnb.testing import Collective, Echo, FailsToStart


@pytest.fixture(scope="module")
def echo(cluster):
    g = rlnb.Group.launch(Echo, cluster, "0-1", kwargs={"offset": 5})
    yield g
    g.shutdown()


def test_cluster_slots_and_views(cluster):
    assert cluster.num_slots == 2
    assert [s.rank for s in cluster.slots] == [0, 1]
    assert all(s.device == "cpu" for s in cluster.slots)
    assert len({s.address for s in cluster.slots}) == 2
    assert len({s.pid for s in cluster.slots}) == 2
    info = cluster.info()
    assert "slots=2" in info and cluster.slots[1].address in info
    view = cluster._repr_html_()  # what it shows: every slot's worker and device
    assert all(slot.address in view for slot in cluster.slots) and view.count("cpu") >= 2


def test_group_calls_every_rank_with_rank_info(cluster, echo):
    who = echo.whoami().result(timeout=30)
    assert [w["rank"] for w in who] == [0, 1]
    assert [w["init_rank"] for w in who] == [0, 1]
    assert all(w["world_size"] == 2 and w["env_world_size"] == "2" for w in who)
    assert [w["env_rank"] for w in who] == ["0", "1"]
    assert [w["local_rank"] for w in who] == [0, 1]  # both on this node
    assert [w["address"] for w in who] == [s.address for s in cluster.slots]
    assert who[0]["pid"] != who[1]["pid"]
    r = echo.add(1)
    assert r.result(timeout=30) == [6, 6]
    assert all(d is not None and d >= 0 for d in r.durations_s)
    assert echo.on(1).add(2).result(timeout=30) == [7]
    assert echo.on([1, 0]).echo("x").result(timeout=30) == ["x", "x"]
    assert echo.call_each("add", [(1,), {"x": 10}]).result(timeout=30) == [6, 15]
    assert "echo[0]" in cluster.placed_on(0)
    view = echo._repr_html_()  # each rank's slot and worker
    assert "Echo" in view and all(i.address in view for i in echo.infos)


def test_a_group_completes_and_documents_its_components_methods_and_refuses_shadowed_ones(cluster, echo):
    import inspect

    assert {"add", "echo", "whoami"} <= set(dir(echo))  # group.<TAB>
    assert echo.add.__doc__.startswith("Echo.add on every rank of 'echo'")  # group.add?
    assert "Returns what it is given" not in echo.add.__doc__ and str(inspect.signature(echo.add)) == "(x)"

    class Clash:
        def shutdown(self):
            return "the component's"

    with pytest.raises(
        rlnb.ComponentError, match=r"clash: Clash.shutdown: method\(s\) shutdown share a name"
    ):
        rlnb.Group.launch(Clash, cluster, "0")


def test_group_is_awaitable(echo):
    async def go():
        return await echo.add(3)

    assert asyncio.run(go()) == [8, 8]


def test_remote_exception_names_component_rank_address(cluster, echo):
    with pytest.raises(rlnb.RemoteError) as e:
        echo.on(1).fail("bad value").result(timeout=30)
    err = e.value
    assert (err.component, err.rank, err.address, err.method) == ("echo", 1, cluster.slots[1].address, "fail")
    assert err.cause_type == "ValueError"
    assert "in fail" in err.remote_traceback and "ValueError: bad value" in err.remote_traceback
    assert isinstance(err.__cause__, ValueError)
    assert f"echo[rank 1] on {cluster.slots[1].address}: fail() failed: ValueError: bad value" in str(err)
    # the group still works afterwards
    assert echo.add(0).result(timeout=30) == [5, 5]


def test_error_is_raised_without_waiting_for_slow_ranks(echo):
    slow = echo.on(0).sleep(3)
    t0 = time.perf_counter()
    with pytest.raises(rlnb.RemoteError):
        echo.on(1).fail().result(timeout=30)
    assert time.perf_counter() - t0 < 2.5
    slow.result(timeout=30)


def test_timeout_is_typed(echo):
    with pytest.raises(rlnb.RemoteTimeoutError) as e:
        echo.sleep(2).result(timeout=0.3)
    assert e.value.component == "echo" and "no result within 0.3 s" in str(e.value)
    assert isinstance(e.value, TimeoutError)
    time.sleep(2)  # let the sleeps finish before the next test uses the ranks


def test_unknown_method_did_you_mean(echo):
    with pytest.raises(AttributeError, match="Echo has no method 'ech'. Did you mean 'echo'"):
        echo.ech(1)


def test_constructor_failure_is_typed(cluster):
    with pytest.raises(
        rlnb.RemoteError,
        match=r"failstostart\[rank 0\] .* __init__\(\) failed: RuntimeError: constructor exploded",
    ):
        rlnb.Group.launch(FailsToStart, cluster, "0")


def test_shutdown_then_relaunch_same_slots(cluster):
    g = rlnb.Group.launch(Echo, cluster, "all", name="tmp")
    assert g.add(1).result(30) == [1, 1]
    g.shutdown()
    assert "tmp[0]" not in cluster.placed_on(0)
    with pytest.raises(rlnb.RemoteError, match="shut down"):
        g.noop()
    g2 = rlnb.Group.launch(Echo, cluster, "all", name="tmp")
    assert g2.add(2).result(30) == [2, 2]
    g2.shutdown()


def test_placement_beyond_cluster(cluster):
    with pytest.raises(
        rlnb.PlacementError, match="slot 2 in '0-2' is beyond the cluster: valid slots are 0-1"
    ):
        rlnb.Group.launch(Echo, cluster, "0-2")


def test_gpu_on_cpu_cluster_is_an_error(cluster):
    with pytest.raises(
        rlnb.ClusterError, match="asks for device 'cuda' but every slot of this cluster is CPU-only"
    ):
        cluster.check_device("cuda", "actor")
    with pytest.raises(rlnb.ClusterError, match="nccl"):
        g = rlnb.Group.launch(Echo, cluster, "0", name="nc")
        try:
            g.init_process_group(backend="nccl")
        finally:
            g.shutdown()


# ---------------------------------------------------------------- channels
def test_channel_basics(cluster):
    ch = rlnb.Channel.create(cluster, "basics", maxsize=2)
    ch.put({"a": 1}, key="k")
    ch.put({"a": 2}, key="k")
    ch.put("other", key="j")
    assert ch.qsize("k") == 2 and ch.qsize(None) == 3
    assert sorted(ch.keys()) == ["j", "k"]
    with pytest.raises(rlnb.ChannelTimeoutError, match="queue stayed full \\(2 item\\(s\\), maxsize 2"):
        ch.put({"a": 3}, key="k", timeout=0.2)
    assert ch.get(key="k", timeout=5) == {"a": 1}
    ch.put({"a": 3}, key="k", timeout=5)
    assert ch.get_batch(2, key="k", timeout=5) == [{"a": 2}, {"a": 3}]
    assert ch.get_nowait(key="j") == "other"
    with pytest.raises(queue.Empty):
        ch.get_nowait(key="j")
    with pytest.raises(rlnb.ChannelTimeoutError, match="waited 0.2 s for 1 item"):
        ch.get(key="k", timeout=0.2)

    async def go():
        await ch.aput(torch.arange(3), key="x")
        return await ch.aget(key="x", timeout=5)

    assert torch.equal(asyncio.run(go()), torch.arange(3))
    assert "basics" in ch._repr_html_()


def test_reprs_render_local_state_without_asking_workers(cluster, echo, monkeypatch):
    ch = rlnb.Channel.create(cluster, "reprs", slot=0)
    pending = echo.on(0).sleep(0.5)

    def no_network(*args, **kwargs):
        raise AssertionError("a repr asked a worker")

    monkeypatch.setattr(rlnb.Channel, "_ask", no_network)
    monkeypatch.setattr(rlnb.GroupResult, "_read", no_network)
    assert "reprs" in ch._repr_html_() and "unbounded" in ch._repr_html_()
    assert "0/1 replies read" in repr(pending)
    monkeypatch.undo()
    pending.result(timeout=30)
    assert repr(pending).endswith("done>")
    ch.close()


def test_channel_worker_to_worker_big_tensors_use_shared_memory(cluster, echo):
    ch = rlnb.Channel.create(cluster, "bulk", maxsize=2, slot=0)
    numel = 4 * 1024 * 1024  # 16 MiB of float32
    consumer = echo.on(1).consume(ch, 5, key="t")
    producer = echo.on(0).produce(ch, 5, numel, key="t")
    assert producer.result(timeout=60) == [5]
    assert consumer.result(timeout=60) == [[0.0, 1.0, 2.0, 3.0, 4.0]]  # FIFO order, values intact
    stats = ch.stats()
    assert stats == {
        "items": 5,
        "shm_tensors": 5,
        "shm_bytes": 5 * numel * 4,
        "cuda_ipc_tensors": 0,
        "cuda_ipc_bytes": 0,
    }
    # the producer reuses its segments: with maxsize=2, at most 3 in flight, so at most 3 files
    producer_pid = echo.on(0).pid().result(30)[0]
    assert 1 <= len(glob.glob(f"/dev/shm/rlnb-ch-{producer_pid}-*")) <= 3


def _put_stats_and_pool():
    """On a worker: its channel puts so far and its pooled segments (all, and those taken now)."""
    from rlnb.runtime import shm

    gc.collect()
    taken = sum(int(seg[3][0]) for seg in shm._POOL.segments)
    return {**shm.PUT_STATS, "segments": len(shm._POOL.segments), "taken": taken}


def _an_unsent_buffer_goes_back_to_the_pool():
    from rlnb.runtime import shm

    before = _put_stats_and_pool()
    buffer = shm.shared_empty((1024, 1024))
    view = buffer[1:]  # a view keeps the segment, as the tensor does
    del buffer
    held = _put_stats_and_pool()
    del view
    return before["taken"], held["taken"], _put_stats_and_pool()["taken"]


def test_a_tensor_built_in_shared_memory_is_put_without_a_copy(cluster, echo):
    ch = rlnb.Channel.create(cluster, "zero_copy", maxsize=2, slot=0)
    producer = [echo.infos[0].address]
    before = cluster.client.run(_put_stats_and_pool, workers=producer)[producer[0]]
    numel = 4 * 1024 * 1024  # 16 MiB of float32
    consumer = echo.on(1).consume(ch, 6, key="z")
    assert echo.on(0).produce(ch, 6, numel, key="z", shared=True).result(60) == [6]
    assert consumer.result(60) == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]  # each item whole, in order
    after = cluster.client.run(_put_stats_and_pool, workers=producer)[producer[0]]
    assert after["zero_copy_bytes"] - before["zero_copy_bytes"] == 6 * numel * 4
    assert after["copied_bytes"] == before["copied_bytes"]  # nothing was copied into shared memory
    # the reader handed every segment back: reused (maxsize 2: at most 3 in flight), none held now
    assert after["segments"] - before["segments"] <= 3 and after["taken"] == 0
    # built but never put: back to the pool once the tensor and its views are freed
    free, held, freed = cluster.client.run(_an_unsent_buffer_goes_back_to_the_pool, workers=producer)[
        producer[0]
    ]
    assert (held, freed) == (free + 1, free)
    ch.close()


def test_channel_close_releases_unconsumed_shared_memory(cluster):
    import os

    from rlnb.runtime.shm import _POOL

    def taken():
        return [seg for seg in _POOL.segments if int(seg[2][0]) == 1]

    gc.collect()  # earlier tests' received tensors hand their segments back
    ch = rlnb.Channel.create(cluster, "leftover")
    ch.put(torch.zeros(1024 * 1024), key="a")  # from this (the notebook's) process: its pool
    mine = glob.glob(f"/dev/shm/rlnb-ch-{os.getpid()}-*")
    assert len(taken()) == 1  # occupied
    segment = taken()[0]
    assert ch.close() == 1
    assert taken() == [] and int(segment[2][0]) == 0  # released for reuse, not leaked
    ch2 = rlnb.Channel.create(cluster, "again")
    big = torch.randn(1024, 1024)
    ch2.put(big)
    assert glob.glob(f"/dev/shm/rlnb-ch-{os.getpid()}-*") == mine  # a segment reused, no new file
    assert torch.equal(ch2.get(timeout=10), big)


def test_channel_from_notebook_gets_values(cluster):
    ch = rlnb.Channel.create(cluster, "nb")
    big = torch.randn(512, 1024)
    ch.put({"obs": big, "step": 3})
    got = ch.get(timeout=10)
    assert got["step"] == 3 and torch.equal(got["obs"], big)


# ---------------------------------------------------------------- process groups
def test_all_reduce_within_group_and_broadcast_across_groups(cluster):
    actor = rlnb.Group.launch(Collective, cluster, "0-1", name="actor")
    assert actor.init_process_group() == "gloo"
    # rank r contributes [r+1, 10(r+1)] -> [1+2, 10+20]
    assert actor.all_reduce().result(60) == [[3.0, 30.0], [3.0, 30.0]]

    rollout = rlnb.Group.launch(Collective, cluster, "1", name="rollout")
    assert rlnb.init_collective([actor.on(0), rollout], name="weights") == "gloo"
    actor.on(0).set_weights(2.5).result(30)
    send = actor.on(0).broadcast_weights(0)
    recv = rollout.broadcast_weights(0)
    expected = {"weight": [[2.5] * 3] * 2, "bias": [2.5, 2.5]}
    assert send.result(60) == [expected]
    assert recv.result(60) == [expected]
    actor.shutdown()
    rollout.shutdown()


def test_collective_over_one_worker_is_refused(cluster):
    a = rlnb.Group.launch(Collective, cluster, "0", name="a")
    b = rlnb.Group.launch(Collective, cluster, "0", name="b")
    with pytest.raises(rlnb.PlacementError, match=r"a\[0\] and b\[0\] share worker"):
        rlnb.init_collective([a, b])
    a.shutdown()
    b.shutdown()


class Tally(Echo):
    """Counts its calls, and fails when told to."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = []

    def record(self, x):
        self.calls.append((x, current_rank().component))  # run in its own rank's context
        return len(self.calls)

    def fail(self, message: str):
        raise ValueError(message)

    def seen(self) -> list:
        return self.calls

    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return time.perf_counter()


def test_a_chain_runs_its_calls_in_order_in_one_request_and_stops_at_the_first_failure(cluster):
    from rlnb.runtime.chain import chain

    first = rlnb.Group.launch(Tally, cluster, "0", name="first")
    second = rlnb.Group.launch(Tally, cluster, "0", name="second")
    elsewhere = rlnb.Group.launch(Tally, cluster, "1", name="elsewhere")
    try:
        done = chain([(first, "record", ("a",)), (second, "record", ("b",)), (first, "record", ("c",))])
        assert [c.result() for c in done] == [1, 1, 2]
        assert all(c.duration_s >= 0 for c in done)
        assert first.seen().result() == [[("a", "first"), ("c", "first")]]
        assert second.seen().result() == [[("b", "second")]]

        done = chain([(second, "record", ("d",)), (first, "fail", ("no",)), (second, "record", ("e",))])
        assert len(done) == 2 and done[0].result() == 2  # the call after the failure did not run
        with pytest.raises(rlnb.RemoteError, match="ValueError: no") as e:
            done[1].result()
        assert (e.value.component, e.value.rank, e.value.method) == ("first", 0, "fail")
        assert second.seen().result() == [[("b", "second"), ("d", "second")]]

        with pytest.raises(ValueError, match="not in the worker of first"):
            chain([(first, "record", ("x",)), (elsewhere, "record", ("y",))])
        both = rlnb.Group.launch(Tally, cluster, "0-1", name="both")
        with pytest.raises(ValueError, match="narrow it to one"):
            chain([(both, "record", ("x",))])
        assert [c.result() for c in chain([(both.on(1), "record", ("z",))])] == [1]
        both.shutdown()
    finally:
        for g in (first, second, elsewhere):
            g.shutdown()


def _below(values: list, limit: int) -> bool:
    """A chain's `then` rule (module level: it travels by reference): go on while the first call's value is
    below ``limit``."""
    return values[0] < limit


def test_a_chain_run_ahead_starts_once_its_reply_is_sent_and_is_taken_later(cluster):
    """``then``: the worker answers the chain, then runs the next one at once, without a request; take_ahead
    returns its replies (and how long the worker waited before it). A rule on the worker, a failure, or
    nothing to take each stop it, with a clear error where there is nothing."""
    from rlnb.runtime.chain import RunAhead, chain, take_ahead

    first = rlnb.Group.launch(Tally, cluster, "0", name="first")
    second = rlnb.Group.launch(Tally, cluster, "0", name="second")
    try:
        ahead = [(first, "record", ("ahead",)), (second, "nap", (1.0,))]
        t0 = time.perf_counter()
        done = chain([(first, "record", ("a",))], then=RunAhead(ahead))
        assert time.perf_counter() - t0 < 0.5  # the reply did not wait for the chain run ahead (1 s)
        assert done.ahead and done.idle_s is None and done[0].result() == 1
        later = take_ahead(ahead, then=RunAhead(ahead, _below, (3,)))  # waits for it, runs it again
        assert later[0].result() == 2 and later[1].result() > t0 + 1.0
        assert later.ahead and 0 <= later.idle_s < 0.5
        last = take_ahead(ahead, then=RunAhead(ahead, _below, (3,)))
        assert last[0].result() == 3 and not last.ahead  # the rule said stop: 3 is not below 3
        assert first.seen().result() == [[("a", "first"), ("ahead", "first"), ("ahead", "first")]]
        with pytest.raises(rlnb.RemoteError, match="ran no chain ahead"):
            take_ahead(ahead)

        failing = chain([(first, "fail", ("no",))], then=RunAhead(ahead))
        assert not failing.ahead  # nothing runs after a failure
        with pytest.raises(rlnb.RemoteError, match="ValueError: no"):
            failing[0].result()
        assert len(first.seen().result()[0]) == 3
    finally:
        for g in (first, second):
            g.shutdown()


def _seen_below(values: list, seen: list, limit: int) -> bool:
    """A `then` rule that keeps state in its arguments: the values it was shown, until ``limit`` of them."""
    seen.append(values[0])
    return len(seen) < limit


def test_a_block_of_chains_runs_ahead_with_no_request_between_them(cluster):
    """RunAhead(more=...): the worker runs the chains one after another without waiting for the driver, as
    long as every call succeeded and the rule holds after each (its arguments, one tuple on the worker, keep
    what it saw); take_run_ahead returns a ChainResult per chain that ran, with one request; take_ahead, which
    expects one chain, refuses a block, naming take_run_ahead."""
    from rlnb.runtime.chain import RunAhead, chain, take_ahead, take_run_ahead

    tally = rlnb.Group.launch(Tally, cluster, "0", name="tally")
    try:
        nap = [(tally, "nap", (0.2,))]
        run = RunAhead(nap, more=[nap, nap])
        t0 = time.perf_counter()
        assert chain(nap, then=run).ahead and time.perf_counter() - t0 < 0.5
        block = take_run_ahead(run)
        assert len(block) == 3 and not block[-1].ahead and time.perf_counter() - t0 > 0.75
        assert all(0 <= done.idle_s < 0.1 for done in block)  # each started as the one before ended
        assert [done.duration_s > 0.19 for done in block] == [True] * 3

        record = [(tally, "record", ("ahead",))]
        run = RunAhead(record, _seen_below, ([], 3), more=[record] * 4)
        assert chain([(tally, "record", ("a",))], then=run).ahead  # the rule saw 1
        assert [done[0].result() for done in take_run_ahead(run)] == [2, 3]  # it saw 2, then 3: stop

        run = RunAhead(record, more=[[(tally, "fail", ("no",))], record])
        chain(record, then=run)
        first, failed = take_run_ahead(run)  # the chain after the failure did not run
        assert first[0].result() == 5 and not failed.ahead
        with pytest.raises(rlnb.RemoteError, match="ValueError: no"):
            failed[0].result()
        assert len(tally.seen().result()[0]) == 5

        chain(record, then=RunAhead(record, more=[record]))
        with pytest.raises(ValueError, match="ran 2 chains ahead.*take_run_ahead"):
            take_ahead(record)
    finally:
        tally.shutdown()


def test_a_chain_run_ahead_needs_direct_calls(cluster, monkeypatch):
    from rlnb.runtime.chain import RunAhead, chain

    monkeypatch.setenv("RLNB_DIRECT_CALLS", "0")
    tally = rlnb.Group.launch(Tally, cluster, "0", name="tally")
    try:
        assert tally.transport == "dask"
        with pytest.raises(ValueError, match="`then` needs direct calls; tally is reached through dask"):
            chain([(tally, "record", ("a",))], then=RunAhead([(tally, "record", ("b",))]))
        assert tally.seen().result() == [[]]  # refused before anything was sent
    finally:
        tally.shutdown()


def test_calls_on_other_components_are_answered_between_chains_run_ahead(cluster):
    """While a driver keeps a worker running chains ahead (each taken as the next runs), a call on another
    component of that worker waits for the chain under way, not for the run to end."""
    import threading

    from rlnb.runtime.chain import RunAhead, chain, take_ahead

    busy = rlnb.Group.launch(Tally, cluster, "0", name="busy")
    other = rlnb.Group.launch(Tally, cluster, "0", name="other")
    try:
        ahead = [(busy, "nap", (0.25,))]
        done = chain(ahead, then=RunAhead(ahead))
        taken = []

        def keep_taking():  # 8 chains of 0.25 s, each started by the worker as soon as the one before ended
            reply = done
            while reply.ahead:
                reply = take_ahead(ahead, then=RunAhead(ahead, _below_count, (len(taken) + 1, 8)))
                taken.append(reply[0].result())

        runner = threading.Thread(target=keep_taking)
        runner.start()
        time.sleep(0.4)
        t0 = time.perf_counter()
        assert other.record("between").result(30) == [1]
        waited = time.perf_counter() - t0
        runner.join(30)
        assert len(taken) == 8 and waited < 0.6, (waited, len(taken))  # one chain at most, not the 1.6 s left
    finally:
        for g in (busy, other):
            g.shutdown()


def _below_count(values: list, taken: int, limit: int) -> bool:
    return taken < limit


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_the_driver_waits_for_a_chain_that_runs_ahead_as_a_batch_thread(cluster):
    """Waiting for the reply of a chain whose worker then goes on computing, the driver's thread is a batch
    thread (its wake-up does not preempt that worker), and a normal thread again once the reply is in; a plain
    chain's wait is left alone."""
    import threading

    from rlnb.runtime.chain import RunAhead, chain, take_ahead

    napper = rlnb.Group.launch(Tally, cluster, "0", name="napper")
    tid, phase, seen, done = threading.get_native_id(), [None], {}, threading.Event()

    def watch():  # the policy of the test's thread, sampled while it waits in each phase
        while not done.is_set():
            if phase[0] is not None:
                seen.setdefault(phase[0], set()).add(os.sched_getscheduler(tid))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        nap = [(napper, "nap", (0.3,))]
        phase[0] = "chain run ahead"
        first = chain(nap, then=RunAhead(nap))
        phase[0] = None
        assert first.ahead and os.sched_getscheduler(0) == os.SCHED_OTHER
        take_ahead(nap)
        phase[0] = "plain chain"
        chain(nap)
        phase[0] = None
        assert seen == {"chain run ahead": {os.SCHED_BATCH}, "plain chain": {os.SCHED_OTHER}}
    finally:
        done.set()
        watcher.join(5)
        napper.shutdown()
