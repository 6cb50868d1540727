"""rlnb on ``distributed.SSHCluster``: three hosts (the network namespaces of ``tests/test_hosts.py``), each running
Debian's ``sshd`` (installed by ``make setup-system``) with a key made by the test; Dask starts the scheduler on one
host and a worker on each of the others over SSH, and a disaggregated PPO run across the hosts learns.

Needs root (``ip netns``, ``sshd``); skipped with the reason elsewhere.
"""

import contextlib
import glob
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rlnb
from rlnb.loop import Loop
from tests.conftest import mapped_semaphores
from tests.test_hosts import NAMESPACES, PREFIX, _build_hosts, _teardown

SSHD_CONFIG = """\
ListenAddress {address}
Port 22
HostKey {d}/host_key
AuthorizedKeysFile {d}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile {d}/sshd-{ns}.pid
"""


@pytest.fixture
def ssh_hosts(tmp_path):
    """The three namespaces, an ``sshd`` listening in each, and the client key that logs in as root."""
    if shutil.which("sshd") is None and not os.path.exists("/usr/sbin/sshd"):
        pytest.skip("needs sshd (openssh-server): make setup-system installs it")
    pytest.importorskip("asyncssh", reason="SSHCluster's asyncssh is a dev dependency: make setup")
    _build_hosts()
    procs = []
    before = set(glob.glob("/dev/shm/sem.*"))
    try:
        key, host_key = tmp_path / "id_ed25519", tmp_path / "host_key"
        for path in (key, host_key):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True, timeout=30
            )
        (tmp_path / "authorized_keys").write_text(key.with_suffix(".pub").read_text())
        os.makedirs("/run/sshd", exist_ok=True)  # (sshd's privilege-separation directory)
        for ns, address in NAMESPACES.items():
            conf = tmp_path / f"sshd-{ns}.conf"
            conf.write_text(SSHD_CONFIG.format(address=address, d=tmp_path, ns=ns))
            log = open(tmp_path / f"sshd-{ns}.log", "w")  # noqa: SIM115 (closed below)
            cmd = ["ip", "netns", "exec", f"{PREFIX}-{ns}", "/usr/sbin/sshd", "-D", "-e", "-f", str(conf)]
            procs.append(
                (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log)
            )
        deadline = time.monotonic() + 30
        for ns in NAMESPACES:
            while not (tmp_path / f"sshd-{ns}.pid").exists():
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"sshd in {ns} did not start: {(tmp_path / f'sshd-{ns}.log').read_text()[-2000:]}"
                    )
                time.sleep(0.1)
        yield str(key)
    finally:
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, 15)
                p.wait(20)
            log.close()
        _end_namespace_processes()
        _teardown()
    held = mapped_semaphores(int(p.name) for p in Path("/proc").glob("[0-9]*"))
    left = {p for p in set(glob.glob("/dev/shm/sem.*")) - before - held if os.path.exists(p)}
    assert not left, f"named semaphores no process holds were left in /dev/shm: {sorted(left)}"


def _end_namespace_processes(grace_s: float = 15.0) -> None:
    """What SSH sessions started (Dask's processes) outlives sshd: asked to stop, then killed after ``grace_s``.
    (Killed at once, a worker's multiprocessing resource tracker died with it and left its named semaphores in
    /dev/shm; asked first, the processes exit and the tracker unlinks them.)"""

    def alive() -> list[int]:
        out = []
        for ns in NAMESPACES:
            pids = subprocess.run(["ip", "netns", "pids", f"{PREFIX}-{ns}"], capture_output=True, text=True,
                                  timeout=30).stdout  # fmt: skip
            out += [int(pid) for pid in pids.split()]
        return out

    for sig, wait_s in ((15, grace_s), (9, 10.0)):
        pids = alive()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = alive()


def test_a_disaggregated_run_learns_across_hosts_started_by_sshcluster(ssh_hosts, tmp_path):
    from distributed import SSHCluster

    hosts = [NAMESPACES["sched"], NAMESPACES["hosta"], NAMESPACES["hostb"]]  # the scheduler's first
    ssh = SSHCluster(
        hosts,
        connect_options={"known_hosts": None, "client_keys": [ssh_hosts], "username": "root"},
        worker_options={"nthreads": 1, "n_workers": 1},
        scheduler_options={
            "host": NAMESPACES["sched"],
            "dashboard_address": None,
        },  # (no default route there)
        remote_python=sys.executable,
    )
    try:
        with rlnb.Cluster(ssh, min_slots=2, timeout_s=120) as cluster:
            where = {s.address.split("//")[1].split(":")[0]: s.rank for s in cluster.slots}
            assert set(where) == {NAMESPACES["hosta"], NAMESPACES["hostb"]}, where  # a worker on each host
            env_slot, learner_slot = where[NAMESPACES["hosta"]], where[NAMESPACES["hostb"]]
            overrides = [f"cluster.component_placement={{env: {env_slot}, 'actor,rollout': {learner_slot}}}",
                         "runner.steps=40", "runner.tensorboard=false"]  # fmt: skip
            with Loop.from_recipe(
                "ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path / "run"
            ) as loop:
                assert loop.mode == "hybrid"  # the env on one host, rollout and actor on the other
                records = loop.run(progress=False)
        returns = [r["env/episode_return_mean"] for r in records]
        assert returns[-1] > returns[0] + 20, returns
    finally:
        ssh.close()
