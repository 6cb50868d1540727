"""The private Dask internals rlnb relies on (all in ``rlnb/_dask.py``): if a Dask release moves one,
this fails first, naming it."""

import inspect

import rlnb
from rlnb import _dask
from rlnb.testing import Echo


def test_the_private_dask_names_rlnb_uses_still_exist():
    from distributed.actor import Actor
    from distributed.worker import _run_actor

    assert list(inspect.signature(_run_actor).parameters) == [
        "func", "args", "kwargs", "execution_state", "key", "active_threads", "active_threads_lock",
    ], "distributed.worker._run_actor changed its parameters"  # fmt: skip
    assert isinstance(inspect.getattr_static(Actor, "_worker_rpc"), property), "Actor._worker_rpc is gone"
    source = inspect.getsource(Actor.__init__) + inspect.getsource(Actor._try_bind_worker_client)
    for name in ("self._client", "self._future", "self._worker"):
        assert name in source, f"Actor no longer keeps {name}"
    import distributed.utils
    from distributed.threadpoolexecutor import ThreadPoolExecutor
    from distributed.worker import _worker_cvar

    assert callable(distributed.utils.set_thread_state), "distributed.utils.set_thread_state is gone"
    assert hasattr(_worker_cvar, "set"), "distributed.worker._worker_cvar is no longer a context variable"
    pool = ThreadPoolExecutor(1, thread_name_prefix="probe")
    assert pool._threads == set() and pool._thread_name_prefix == "probe", "ThreadPoolExecutor's fields moved"
    pool.shutdown()
    assert isinstance(distributed.utils._forkserver_preload_set, bool), (
        "utils._forkserver_preload_set is gone"
    )
    assert "_forkserver_preload_set" in inspect.getsource(distributed.utils.get_mp_context)


def _worker_internals(dask_worker) -> dict:
    from rlnb.runtime.actor_thread import ActorThread

    return {
        "actor executor": isinstance(dask_worker.executors.get("actor"), ActorThread),
        "execution_state": isinstance(dask_worker.execution_state, dict),
        "active_threads": isinstance(dask_worker.active_threads, dict),
        "active_threads_lock": hasattr(dask_worker.active_threads_lock, "acquire"),
        "actor_execute handler": "actor_execute" in dask_worker.handlers,
    }


def test_the_wrappers_work_against_a_real_worker(cluster):
    group = rlnb.Group.launch(Echo, cluster, "0", name="internals")  # (rlnb's worker plugin is set up by now)
    try:
        for address, found in cluster.client.run(_worker_internals).items():
            assert all(found.values()), f"{address}: missing {[k for k, ok in found.items() if not ok]}"
        # direct calls run on the ActorThread that replaced Dask's actor executor, Dask-route calls
        # through actor_execute on that same thread
        assert group.thread().result(20) == [group._dask_route.send([(0, "call", ("thread", (), {}))], 20)[0]
                                             .future.result(20)[1]]  # fmt: skip
        host = group._dask_route.hosts[0]
        assert _dask.actor_client(host) is cluster.client and _dask.actor_worker(host) is None
    finally:
        group.shutdown()


def _preloaded(dask_worker=None) -> bool:
    """Whether this worker forked from rlnb's server: torch and rlnb imported there, and frozen out of the
    garbage collector's scans (``rlnb._preload``), with the collector running."""
    import gc
    import sys

    return (
        "torch" in sys.modules
        and "rlnb.components" in sys.modules
        and gc.get_freeze_count() > 0
        and gc.isenabled()
    )


def test_embedded_workers_start_with_torch_preloaded_unless_told_to_spawn(monkeypatch):
    import rlnb

    with rlnb.Cluster(slots=1, gpus=False) as cluster:  # forked from the preloaded server: nothing to import
        assert all(cluster.client.run(_preloaded).values())
    monkeypatch.setenv("RLNB_WORKER_START", "spawn")
    with rlnb.Cluster(slots=1, gpus=False) as cluster:  # Dask's default: each worker imports for itself
        assert not any(cluster.client.run(_preloaded).values())
    monkeypatch.delenv("RLNB_WORKER_START")
    with rlnb.Cluster(slots=1, gpus=False) as cluster:
        assert all(cluster.client.run(_preloaded).values())


def _profile_interval_ms(dask_worker) -> float:
    return dask_worker.periodic_callbacks["profile"].callback_time


def _tick_interval_ms(dask_worker) -> float:
    return dask_worker.periodic_callbacks["tick"].callback_time


def test_embedded_workers_sample_their_profile_every_100_ms_unless_the_dask_config_says_otherwise(cluster):
    """Dask's profiler walks the running call's stack twice a sample, holding the GIL: every 10 ms (Dask's
    default) it took ~1 % of a worker's time. A value set in the dask config is kept."""
    import dask

    import rlnb

    assert set(cluster.client.run(_profile_interval_ms).values()) == {100.0}
    with (
        dask.config.set({"distributed.worker.profile.interval": "20ms"}),
        rlnb.Cluster(slots=1, gpus=False) as own,
    ):
        assert set(own.client.run(_profile_interval_ms).values()) == {20.0}
        assert set(own.client.run(_tick_interval_ms).values()) == {200.0}  # (the other setting stays ours)
    assert (
        dask.config.get("distributed.worker.profile.interval") == "10ms"
    )  # the driver's config is as it was


def test_embedded_workers_check_their_event_loop_every_200_ms_unless_the_dask_config_says_otherwise(cluster):
    """Dask's event-loop health check woke each worker's event loop thread every 20 ms, taking the GIL from
    the component's thread 50 times a second. A value set in the dask config is kept."""
    import dask

    import rlnb

    assert set(cluster.client.run(_tick_interval_ms).values()) == {200.0}
    with (
        dask.config.set({"distributed.admin.tick.interval": "50ms"}),
        rlnb.Cluster(slots=1, gpus=False) as own,
    ):
        assert set(own.client.run(_tick_interval_ms).values()) == {50.0}
        assert set(own.client.run(_profile_interval_ms).values()) == {100.0}
    assert dask.config.get("distributed.admin.tick.interval") == "20ms"
