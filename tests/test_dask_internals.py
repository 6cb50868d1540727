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

    assert isinstance(distributed.utils._forkserver_preload_set, bool), (
        "utils._forkserver_preload_set is gone"
    )
    assert "_forkserver_preload_set" in inspect.getsource(distributed.utils.get_mp_context)


def _worker_internals(dask_worker) -> dict:
    return {
        "actor executor": "actor" in dask_worker.executors,
        "execution_state": isinstance(dask_worker.execution_state, dict),
        "active_threads": isinstance(dask_worker.active_threads, dict),
        "active_threads_lock": hasattr(dask_worker.active_threads_lock, "acquire"),
        "actor_execute handler": "actor_execute" in dask_worker.handlers,
    }


def test_the_wrappers_work_against_a_real_worker(cluster):
    for address, found in cluster.client.run(_worker_internals).items():
        assert all(found.values()), f"{address}: missing {[k for k, ok in found.items() if not ok]}"
    group = rlnb.Group.launch(Echo, cluster, "0", name="internals")
    try:
        # direct calls run through run_on_actor_thread, Dask-route calls through actor_execute
        assert group.thread().result(20) == [group._dask_route.send([(0, "call", ("thread", (), {}))], 20)[0]
                                             .future.result(20)[1]]  # fmt: skip
        host = group._dask_route.hosts[0]
        assert _dask.actor_client(host) is cluster.client and _dask.actor_worker(host) is None
    finally:
        group.shutdown()


def _preloaded(dask_worker=None) -> bool:
    import sys

    return "torch._dynamo" in sys.modules and "rlnb.components" in sys.modules


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
