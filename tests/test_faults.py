"""A killed worker, an unreachable scheduler: typed errors in bounded time, never a hang."""

import os
import signal
import socket
import time

import pytest

import rlnb
from rlnb.testing import Echo


def test_killed_worker_mid_call_and_after():
    with rlnb.Cluster(slots=2, gpus=False) as cluster:
        g = rlnb.Group.launch(Echo, cluster, "0-1")
        pid = g.on(1).pid().result(30)[0]
        assert pid == cluster.slots[1].pid
        ch = rlnb.Channel.create(cluster, "doomed", slot=1)
        ch.put("before", key="k")
        running = g.sleep(4)  # both ranks busy; rank 1's process is about to die
        time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        t0 = time.perf_counter()
        with pytest.raises(rlnb.WorkerLostError) as e:
            running.result(timeout=60)
        assert time.perf_counter() - t0 < 5
        err = e.value
        assert (err.component, err.rank, err.address, err.method) == (
            "echo",
            1,
            cluster.slots[1].address,
            "sleep",
        )
        assert "echo[rank 1] on tls://" in str(err)  # (the embedded cluster speaks TLS)

        # a later call on the dead rank also fails fast (the scheduler no longer lists the worker)
        t0 = time.perf_counter()
        with pytest.raises(rlnb.WorkerLostError, match=r"echo\[rank 1\]"):
            g.on(1).noop().result(timeout=60)
        assert time.perf_counter() - t0 < 10
        # the channel hosted by the dead worker: a typed error naming it, at once
        t0 = time.perf_counter()
        with pytest.raises(rlnb.WorkerLostError, match="channel 'doomed'"):
            ch.get(key="k", timeout=30)
        assert time.perf_counter() - t0 < 5
        # the surviving rank is fine
        assert g.on(0).add(1).result(30) == [1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_scheduler_is_a_clear_error_within_timeout():
    addr = f"tcp://127.0.0.1:{_free_port()}"
    t0 = time.perf_counter()
    with pytest.raises(
        rlnb.ClusterError, match=r"cannot reach the Dask scheduler at 'tcp://127.0.0.1:\d+' within 2 s"
    ):
        rlnb.Cluster(addr, timeout_s=2)
    assert time.perf_counter() - t0 < 15


def test_bad_cluster_arguments():
    with pytest.raises(rlnb.ClusterError, match="slots=...\\): expected a positive int, got 0"):
        rlnb.Cluster(slots=0)
    with pytest.raises(rlnb.ClusterError, match="gpus=...\\): expected 'auto', True or False, got 'yes'"):
        rlnb.Cluster(gpus="yes")
    with pytest.raises(rlnb.ClusterError, match="no GPU"):
        rlnb.Cluster(slots=1, gpus=True)


def test_a_gpu_machine_without_the_cuda_extra_is_told_so_not_given_cpu_workers(monkeypatch):
    """dask-cuda is the `cuda` extra: where NVML sees GPUs and it cannot be imported, the cluster says how to
    get it (or to ask for CPU workers) before starting anything."""
    import sys

    import rlnb.cluster.cluster as cluster_module

    monkeypatch.setattr(cluster_module, "_count_gpus", lambda: (2, "NVIDIA H200"))
    monkeypatch.setitem(sys.modules, "dask_cuda", None)  # (an import of it now fails)
    with pytest.raises(rlnb.ClusterError, match=r"has 2 GPU\(s\).*pip install 'rlnb\[cuda\]'.*gpus=False"):
        rlnb.Cluster()
