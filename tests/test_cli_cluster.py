"""`dask scheduler` and `dask worker` started from the command line, on loopback with random ports."""

import os

import pytest
import torch

import rlnb
from rlnb.cluster import DaskProcesses
from rlnb.testing import Echo


@pytest.fixture(scope="module")
def cli_cluster():
    """The notebook's helper: `dask scheduler` and two `dask worker`s, node groups train and sim."""
    with DaskProcesses({"w0": {"train": 1}, "w1": {"sim": 1}}) as procs:
        yield procs.address


def test_remote_cluster_from_dask_command_line(cli_cluster):
    with rlnb.Cluster(cli_cluster, min_slots=2, timeout_s=60) as cluster:
        assert not cluster.embedded
        assert cluster.num_slots == 2
        assert cluster.node_groups == {"train": [0], "sim": [1]}
        placement = cluster.place(
            {"actor": {"node_group": "train"}, "env": {"node_group": "sim", "slots": 0}}
        )
        assert placement.slots == {"actor": (0,), "env": (1,)}
        # by the workers' host name (one host here: both slots)
        (host,) = cluster.nodes
        assert cluster.place({"actor": {"host": host, "slots": 1}}).slots == {"actor": (1,)}
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


def test_dask_processes_stop_and_clean_up_and_say_why_a_scheduler_did_not_start(tmp_path):
    procs = DaskProcesses(1)
    procs.start()
    log_dir, pids = procs.log_dir, [p.pid for p in procs.processes]
    assert procs.address.startswith("tcp://127.0.0.1:") and "scheduler" in procs.logs()
    procs.close()
    assert not log_dir.exists()
    for pid in pids:  # reaped: no process left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    broken = DaskProcesses(1, host="203.0.113.1", timeout_s=30)  # an address of no interface here
    try:
        with pytest.raises(rlnb.ClusterError, match="`dask scheduler` did not start"):
            broken.start()
        assert broken.processes == [] and not broken.log_dir.exists()
    finally:
        broken.close()  # nothing left running even if start() unexpectedly worked


LM_WORKERS = """
import sys
from rlnb.cli import _prestart_embedded_workers

def loaded(dask_worker=None):
    import sys
    return sorted(m for m in ("rlnb._preload_lm", "transformers", "torch._dynamo") if m in sys.modules)

if __name__ == "__main__":
    import rlnb
    assert _prestart_embedded_workers(lm=sys.argv[1] == "lm")
    with rlnb.Cluster(slots=1, gpus=False) as cluster:
        print(list(cluster.client.run(loaded).values())[0])
"""


@pytest.mark.parametrize("kind", ["lm", "embodied"])
def test_rlnb_run_preloads_transformers_for_an_lm_recipes_workers_only(tmp_path, kind):
    """``rlnb run`` of an LM recipe starts the workers' fork server with transformers and ``torch._dynamo``
    imported (each worker would import them, ~1.5 s); an embodied recipe's workers need neither."""
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    script.write_text(LM_WORKERS)
    done = subprocess.run([sys.executable, str(script), kind], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = ["rlnb._preload_lm", "torch._dynamo", "transformers"] if kind == "lm" else []
    assert done.stdout.strip().splitlines()[-1] == str(expected)
