"""Three real hosts on this machine: network namespaces joined by veth pairs and a bridge.

``dask scheduler`` runs in one namespace, a ``dask worker`` in each of two others, each with its own IP
address and network stack, so nothing can take a shortcut through loopback or shared memory. A PPO run is
disaggregated across them (the env on one host, rollout and actor on the other), learns, then one host's
link is cut: the next step fails with a typed error within the call timeout, and once the link is back
the loop recovers from its last checkpoint.

Needs root (``ip netns``); skipped with the reason elsewhere.
"""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rlnb
from rlnb.errors import RemoteError
from rlnb.loop import Loop

ROOT = Path(__file__).resolve().parents[1]
PREFIX = f"rlnb{os.getpid() % 10000}"  # unique per test process: parallel runs do not collide
# The subnet too: two bridges holding one subnet (this file's and test_ssh's, side by side under xdist) make the
# host's route to it ambiguous, and a run's connections were reset mid-step when the other test's bridge came.
SUBNET = f"10.{64 + os.getpid() % 128}.0"
NAMESPACES = {"sched": f"{SUBNET}.1", "hosta": f"{SUBNET}.2", "hostb": f"{SUBNET}.3"}
BRIDGE, DRIVER_IP = f"{PREFIX}br", f"{SUBNET}.254"
DASK = str(Path(sys.executable).with_name("dask"))


def _ip(*args, ns: str | None = None):
    cmd = ["ip", *args] if ns is None else ["ip", "netns", "exec", f"{PREFIX}-{ns}", "ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


def _teardown() -> None:
    for ns in NAMESPACES:
        # (the link first: a namespace the kernel has not freed yet would keep its veth pair in ours)
        subprocess.run(["ip", "link", "del", _veth(ns)], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", f"{PREFIX}-{ns}"], capture_output=True, timeout=30)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, timeout=30)


def _veth(ns: str) -> str:
    return f"{PREFIX}{ns[-1]}"  # the bridge-side end of ns's link (short: interface names are <= 15)


def _build_hosts() -> None:
    """The namespaces of :data:`NAMESPACES` on one bridge, or the test skipped with the reason."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to build network namespaces")
    taken = subprocess.run(
        ["ip", "route", "show", f"{SUBNET}.0/24"], capture_output=True, text=True, timeout=30
    )
    assert not taken.stdout.strip(), f"{SUBNET}.0/24 is routed here already (a stale bridge?): {taken.stdout}"
    try:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{DRIVER_IP}/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for ns, address in NAMESPACES.items():
            _ip("netns", "add", f"{PREFIX}-{ns}")
            _ip("link", "add", _veth(ns), "type", "veth", "peer", "name", "eth0", "netns", f"{PREFIX}-{ns}")
            _ip("addr", "add", f"{address}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            _ip("link", "set", _veth(ns), "master", BRIDGE)
            _ip("link", "set", _veth(ns), "up")
    except (subprocess.CalledProcessError, OSError) as e:
        _teardown()
        pytest.skip(f"network namespaces are not permitted here: {getattr(e, 'stderr', '') or e}")


@pytest.fixture
def three_hosts(tmp_path):
    _build_hosts()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}
    scheduler = f"tcp://{NAMESPACES['sched']}:8786"

    def start(ns: str, *args):
        log = open(tmp_path / f"{ns}.log", "w")  # noqa: SIM115 (closed below)
        cmd = ["ip", "netns", "exec", f"{PREFIX}-{ns}", DASK, *args]
        return subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        ), log

    procs = [start("sched", "scheduler", "--host", NAMESPACES["sched"], "--port", "8786", "--no-dashboard")]
    for ns in ("hosta", "hostb"):
        procs.append(
            start(
                ns,
                "worker",
                scheduler,
                "--host",
                NAMESPACES[ns],
                "--name",
                ns,
                "--nthreads",
                "1",
                "--no-dashboard",
            )
        )
    try:
        yield scheduler
    finally:
        for p, _ in procs:
            if p.poll() is None:
                os.killpg(p.pid, 15)
        for p, log in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait(10)
            log.close()
        _teardown()


def test_ppo_across_three_hosts_fails_typed_when_a_link_is_cut_and_recovers_when_it_returns(
    three_hosts, tmp_path
):
    with rlnb.Cluster(three_hosts, min_slots=2, timeout_s=60) as cluster:
        where = {s.address.split("//")[1].split(":")[0]: s.rank for s in cluster.slots}
        env_slot, learner_slot = where[NAMESPACES["hosta"]], where[NAMESPACES["hostb"]]
        overrides = [
            f"cluster.component_placement={{env: {env_slot}, 'actor,rollout': {learner_slot}}}",
            "cluster.call_timeout_s=15",
            "runner.stop_return=150",
            "runner.steps=120",
            "runner.save_interval=5",
            "runner.tensorboard=false",
        ]
        loop = Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path / "run")
        try:
            assert loop.mode == "hybrid"  # env on one host; rollout and actor together on the other
            loop.run(progress=False)
            assert loop.episode_stats()["episode_return_mean"] >= 150, f"after {loop.step} steps"
            loop.save()
            saved = loop.step

            _ip("link", "set", _veth("hostb"), "down")  # the learner's host drops off the network
            t0 = time.monotonic()
            with pytest.raises(RemoteError) as failure:
                loop.step_once()
            waited = time.monotonic() - t0
            assert waited < 15 + 20, f"the step took {waited:.0f} s to fail"
            assert failure.value.component in ("actor", "rollout", "env"), failure.value
            assert NAMESPACES["hostb"] in str(failure.value) or NAMESPACES["hosta"] in str(failure.value)

            _ip("link", "set", _veth("hostb"), "up")
            assert loop.recover(timeout_s=120) == saved  # from the last checkpoint, on the same hosts
            loop.step_once()
            assert loop.step == saved + 1
        finally:
            loop.close()


@pytest.fixture
def hosts():
    _build_hosts()
    try:
        yield
    finally:
        _teardown()


def _on(ns: str, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(["ip", "netns", "exec", f"{PREFIX}-{ns}", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env)  # fmt: skip


ATTACH = """
import json, sys, time
import rlnb
run = rlnb.attach(sys.argv[1])
run.pause()
time.sleep(1.0)  # (the step under way ends, then it holds)
held = run.status()
time.sleep(1.0)
still = run.status()
run.unpause()
run.stop()
print(json.dumps({"held": held, "still": still, "outcome": run.wait(120)}))
"""


def test_a_run_served_on_the_network_is_attached_steered_and_stopped_from_another_host(hosts, tmp_path):
    """``runner.control=network``: a detached ``rlnb run`` on one host, reached from another through the run
    directory they share (a shared file system here) over TLS with the run's certificate: paused (it holds),
    resumed, stopped with a checkpoint. Served on loopback (the default), the other host cannot reach it."""
    rlnb_cli = [sys.executable, "-m", "rlnb.cli"]
    for control, run_dir in (("network", tmp_path / "net"), ("loopback", tmp_path / "local")):
        started = _on("hosta", *rlnb_cli, "run", "ppo_cartpole", "runner.steps=100000", "runner.stop_return=1e9",
                      "runner.tensorboard=false", f"runner.control={control}", "--run-dir", str(run_dir),
                      "--detach")  # fmt: skip
        assert started.returncode == 0, started.stderr[-3000:]
        try:
            found = json.loads((run_dir / "control.json").read_text())
            if control == "network":  # the token in clear, not TLS: closed unanswered
                with socket.create_connection((NAMESPACES["hosta"], found["port"]), timeout=10) as plain:
                    plain.sendall((json.dumps({"token": found["token"], "op": "stop"}) + "\n").encode())
                    with contextlib.suppress(ConnectionResetError):
                        assert plain.recv(4096) == b""
            attached = _on("hostb", sys.executable, "-c", ATTACH, str(run_dir))
        finally:
            _on("hosta", *rlnb_cli, "stop", str(run_dir))  # (already stopped: says so)
        if control == "loopback":
            assert "cert" not in found and attached.returncode != 0, attached.stdout
            assert "does not answer" in attached.stderr, attached.stderr[-2000:]
            continue
        assert found["addresses"] == [NAMESPACES["hosta"]] and "BEGIN CERTIFICATE" in found["cert"], found
        assert attached.returncode == 0, attached.stderr[-3000:]
        said = json.loads(attached.stdout.splitlines()[-1])
        assert said["held"]["paused"] and said["still"]["step"] == said["held"]["step"], said
        assert said["outcome"] == "stopped", said
