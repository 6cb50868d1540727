"""`dask scheduler` and `dask worker` started from the command line, on loopback with random ports."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import rlnb
from rlnb.testing import Echo

DASK = str(Path(sys.executable).with_name("dask"))


def _wait_for(pattern: str, path: Path, timeout_s: float = 60) -> str:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        m = re.search(pattern, path.read_text() if path.exists() else "")
        if m:
            return m.group(1)
        time.sleep(0.2)
    raise TimeoutError(f"{pattern!r} not seen in {path}: {path.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def cli_cluster(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("dask-cli")
    procs = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        log = tmp_path / "scheduler.log"
        procs.append(
            subprocess.Popen(
                [
                    DASK,
                    "scheduler",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--dashboard-address",
                    ":0",
                    "--no-show",
                ],
                stdout=log.open("w"),
                stderr=subprocess.STDOUT,
                env=env,
            )
        )
        address = _wait_for(r"Scheduler at:\s+(tcp://\S+)", log)
        for i, resources in enumerate(["train=1", "sim=1"]):
            wlog = tmp_path / f"worker{i}.log"
            procs.append(
                subprocess.Popen(
                    [
                        DASK,
                        "worker",
                        address,
                        "--nthreads",
                        "1",
                        "--nworkers",
                        "1",
                        "--no-dashboard",
                        "--host",
                        "127.0.0.1",
                        "--resources",
                        resources,
                        "--name",
                        f"w{i}",
                    ],
                    stdout=wlog.open("w"),
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            )
        yield address
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()


def test_remote_cluster_from_dask_command_line(cli_cluster):
    with rlnb.Cluster(cli_cluster, min_slots=2, timeout_s=60) as cluster:
        assert not cluster.embedded
        assert cluster.num_slots == 2
        assert cluster.node_groups == {"train": [0], "sim": [1]}
        placement = cluster.place(
            {"actor": {"node_group": "train"}, "env": {"node_group": "sim", "slots": 0}}
        )
        assert placement.slots == {"actor": (0,), "env": (1,)}
        actor = rlnb.Group.launch(Echo, cluster, placement["actor"], name="actor")
        env = rlnb.Group.launch(Echo, cluster, placement["env"], name="env")
        assert actor.whoami().result(30)[0]["address"] == cluster.slots[0].address
        ch = rlnb.Channel.create(cluster, "steps", maxsize=4)
        got = actor.consume(ch, 3, key="x")
        env.produce(ch, 3, 1024 * 1024, key="x").result(60)
        assert got.result(60) == [[0.0, 1.0, 2.0]]
        ch.put(torch.ones(2), key="nb")
        assert torch.equal(ch.get(key="nb", timeout=10), torch.ones(2))
        actor.shutdown()
        env.shutdown()


def test_remote_cluster_waits_for_workers_then_fails_clearly(cli_cluster):
    with pytest.raises(rlnb.ClusterError, match=r"has 2 worker\(s\); waited 3 s for 5"):
        rlnb.Cluster(cli_cluster, min_slots=5, timeout_s=3)
