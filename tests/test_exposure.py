"""What a cluster exposes and to whom: listening sockets, TLS, existing Dask objects, and process
groups that another driver cannot take over."""

import ipaddress
import os

import psutil
import pytest

import rlnb
from rlnb.errors import ClusterError, RemoteError
from rlnb.testing import Collective, Echo

QUIET = [
    "runner.tensorboard=false",
    "runner.stop_return=100000",
    "env.num_envs=4",
    "rollout.steps_per_rollout=16",
]


def _listening(pid: int) -> list[tuple[str, int]]:
    return [
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]


def test_nothing_an_embedded_cluster_starts_listens_beyond_loopback():
    with rlnb.Cluster(slots=2, gpus=False) as cluster:
        group = rlnb.Group.launch(Collective, cluster, "0-1", name="listen")
        group.init_process_group()  # rank 0 runs the process group's TCPStore
        assert group.all_reduce().result(30) == [[3.0, 30.0], [3.0, 30.0]]
        channel = rlnb.Channel.create(cluster, "listen")
        channel.put(1)
        dashboard_port = int(cluster.dashboard_link.split(":")[-1].split("/")[0])
        exposed = {}
        for pid in [*cluster.client.run(os.getpid).values()]:
            exposed[pid] = [a for a in _listening(pid) if not ipaddress.ip_address(a[0]).is_loopback]
        exposed["dashboard"] = [a for a in _listening(os.getpid()) if a[1] == dashboard_port]
        assert exposed["dashboard"] and all(
            ipaddress.ip_address(ip).is_loopback for ip, _ in exposed.pop("dashboard")
        )
        assert not any(exposed.values()), f"listening beyond loopback: {exposed}"
        group.shutdown()


def test_a_second_driver_cannot_take_over_the_default_process_group(cluster):
    other = rlnb.Cluster(cluster.address)  # another driver (notebook, `rlnb run`) on the same scheduler
    try:
        mine = rlnb.Group.launch(Collective, cluster, "0-1", name="pg")
        theirs = rlnb.Group.launch(Collective, other, "0-1", name="pg")
        mine.init_process_group()
        with pytest.raises(RemoteError, match=r"default process group belongs to pg\[\d\] of another driver"):
            theirs.init_process_group()
        theirs.shutdown()  # and shutting theirs down leaves mine alone
        assert mine.all_reduce().result(30) == [[3.0, 30.0], [3.0, 30.0]]
        mine.shutdown()
        again = rlnb.Group.launch(Collective, other, "0-1", name="pg")  # free once its owner shut down
        again.init_process_group()
        assert again.all_reduce().result(30) == [[3.0, 30.0], [3.0, 30.0]]
        again.shutdown()
    finally:
        other.close()


def test_cluster_takes_an_existing_dask_cluster_object_or_client():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as local:
        with rlnb.Cluster(local) as cluster:
            assert cluster.num_slots == 1 and not cluster.embedded
            assert rlnb.Group.launch(Echo, cluster, "0").add(1).result(20) == [1]
        with Client(local) as client:
            with rlnb.Cluster(client) as cluster:
                assert cluster.client is client
                assert rlnb.Group.launch(Echo, cluster, "0").add(2).result(20) == [2]
            assert client.status == "running"  # the caller's client: rlnb does not close it
        assert local.status.name == "running"
    with pytest.raises(ClusterError, match=r"Cluster\(address\).*scheduler address.*Client.*got int"):
        rlnb.Cluster(8786)


def test_a_tls_cluster_runs_ppo_end_to_end(tmp_path):
    pytest.importorskip("cryptography", reason="Security.temporary() needs the cryptography package")
    from distributed import LocalCluster
    from distributed.security import Security

    security = Security.temporary()
    with LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        protocol="tls://",
        security=security,
        dashboard_address=None,
    ) as local:
        assert local.scheduler_address.startswith("tls://")
        with pytest.raises(ClusterError, match="security="):  # plain tcp cannot talk to it
            rlnb.Cluster(local.scheduler_address, timeout_s=3)
        with rlnb.Cluster(local.scheduler_address, security=security) as cluster:
            group = rlnb.Group.launch(Echo, cluster, "0-1", name="tls")
            # workers on loopback: direct calls (nothing else can read loopback traffic; their tokens came over
            # TLS). Workers on a network interface keep Dask's tls:// rpc, as the direct port is not encrypted
            assert group.transport == "direct"
            assert group.add(3).result(30) == [3, 3]
            loop = rlnb.Loop.from_recipe(
                "ppo_cartpole", [*QUIET, "runner.steps=3"], cluster=cluster, run_dir=tmp_path / "run"
            )
            try:
                records = [loop.step_once() for _ in range(3)]
                assert loop.step == 3 and len(records) == 3
            finally:
                loop.close()
