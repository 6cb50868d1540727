"""Runtime hardening: drivers sharing a scheduler stay apart, the direct-call server survives transient
accept errors, checkpoints order, sync, clean up and fall back."""

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import rlnb
from rlnb.loop import CheckpointError, Loop, complete_checkpoints
from rlnb.testing import Echo

ROOT = Path(__file__).resolve().parents[1]
QUIET = [
    "runner.tensorboard=false",
    "runner.stop_return=100000",
    "env.num_envs=4",
    "rollout.steps_per_rollout=16",
]

DRIVER = """
import pathlib, sys, time
import rlnb
from rlnb.runtime import current_rank, local_peer
from rlnb.testing import Echo

address, offset, role, sync = sys.argv[1], int(sys.argv[2]), sys.argv[3], pathlib.Path(sys.argv[4])

def wait(name):
    deadline = time.time() + 120
    while not (sync / name).exists():
        if time.time() > deadline:
            raise SystemExit(f"{role}: timed out waiting for {name}")
        time.sleep(0.05)

def check(group, channel):
    assert group.add(0).result(30) == [offset, offset], (role, group.add(0).result(30))
    peers = group.apply(lambda: local_peer("echo", current_rank().rank).offset).result(30)
    assert peers == [offset, offset], (role, "collocated peer lookup saw", peers)
    channel.put(offset, key="k")
    assert channel.get(key="k", timeout=30) == offset, role

with rlnb.Cluster(address) as cluster:
    group = rlnb.Group.launch(Echo, cluster, "0-1", kwargs={"offset": offset}, name="echo")
    channel = rlnb.Channel.create(cluster, "shared-name")
    check(group, channel)
    if role == "a":
        (sync / "a_ready").touch(); wait("b_ready")
        check(group, channel)  # b launched the same names meanwhile
        group.shutdown(); channel.close()
        (sync / "a_done").touch()
    else:
        (sync / "b_ready").touch(); wait("a_done")
        check(group, channel)  # a shut its own down: b's still run
print(role, "ok")
"""


def test_two_drivers_on_one_scheduler_see_only_their_own_components(tmp_path):
    from distributed import LocalCluster

    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER))
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as scheduler:
        run = [sys.executable, str(script), scheduler.scheduler_address]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's rlnb, whatever is installed
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": env}
        a = subprocess.Popen([*run, "1", "a", str(tmp_path)], **pipes)
        deadline = time.time() + 120
        while not (tmp_path / "a_ready").exists() and a.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        b = subprocess.Popen([*run, "100", "b", str(tmp_path)], **pipes)
        outs = [p.communicate(timeout=240) for p in (a, b)]
    assert (a.returncode, b.returncode) == (0, 0), [err[-2500:] for _, err in outs]
    assert outs[0][0].strip() == "a ok" and outs[1][0].strip() == "b ok"


def _squeeze_fds(hold_s: float) -> int:
    """On a worker: for ``hold_s`` seconds allow only a few more open files than are open now."""
    import resource
    import threading

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 2, hard))

    def restore():
        time.sleep(hold_s)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    threading.Thread(target=restore, daemon=True).start()
    return soft


def test_direct_call_server_keeps_accepting_after_running_out_of_file_descriptors(tmp_path):
    with rlnb.Cluster(slots=1, gpus=False) as cluster:
        group = rlnb.Group.launch(Echo, cluster, "0")
        assert group.transport == "direct"
        address = group._links[0].address
        cluster.client.run(_squeeze_fds, 1.5)
        held = []
        for _ in range(8):  # the worker accepts two of these, then accept() fails with EMFILE
            held.append(socket.create_connection(address, timeout=5))
        time.sleep(0.5)
        for s in held:
            s.close()
        time.sleep(1.5)  # the limit is back
        fresh = rlnb.Group.launch(Echo, cluster, "0", name="fresh")
        assert fresh.transport == "direct"
        assert fresh.add(1).result(20) == [1]  # a new connection is served (it used to wait out the timeout)


def test_checkpoints_order_by_step_number_and_stale_partials_are_removed(cluster, tmp_path):
    root = tmp_path / "checkpoints"
    for step in (999_999, 1_000_000):
        (root / f"step_{step:06d}").mkdir(parents=True)
        (root / f"step_{step:06d}" / "COMPLETE").write_text("ok\n")
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_999999", "step_1000000"]
    for p in list(root.iterdir()):
        for f in p.iterdir():
            f.unlink()
        p.rmdir()
    (root / ".tmp-step_000001-dead00").mkdir()  # a save killed half-way
    with Loop.from_recipe(
        "ppo_cartpole", ["runner.steps=1", *QUIET], cluster=cluster, run_dir=tmp_path
    ) as loop:
        loop.run(progress=False)
        loop.save()
    assert sorted(p.name for p in root.iterdir()) == ["step_000001"]


def test_an_unreadable_latest_checkpoint_is_an_error_unless_a_fallback_is_asked_for(
    cluster, tmp_path, caplog
):
    overrides = ["runner.steps=4", "runner.save_interval=2", *QUIET]
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        loop.run(progress=False)
    latest = complete_checkpoints(tmp_path)[-1]
    (latest / "actor_rank0.pt").write_bytes(b"torn")
    with pytest.raises(CheckpointError, match=r"step_000004.*Earlier complete checkpoints: step_000002"):
        Loop.resume(tmp_path, cluster=cluster)
    with Loop.resume(tmp_path, cluster=cluster, overrides=["runner.resume_fallback=true"]) as loop:
        assert loop.step == 2
    assert "falling back to the previous complete checkpoint" in caplog.text


def test_a_failed_resume_leaves_no_cluster_running(tmp_path):
    overrides = ["runner.steps=1", *QUIET, "cluster.slots=1"]
    with Loop.from_recipe("ppo_cartpole", overrides, run_dir=tmp_path) as loop:
        loop.run(progress=False)
        path = loop.save()
    (path / "actor_rank0.pt").write_bytes(b"torn")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(CheckpointError):
        Loop.resume(tmp_path)  # starts its own embedded cluster, then cannot load the only checkpoint
    time.sleep(1.0)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()]
    assert not [p for p in left if p.status() != psutil.STATUS_ZOMBIE], left
