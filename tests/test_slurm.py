"""rlnb on Slurm through dask-jobqueue, for real: a one-node Slurm (Debian's ``slurm-wlm`` and ``munge``, installed by
``make setup-system``) configured and started by this module's fixture, a ``SLURMCluster`` scaled to jobs and handed
to ``rlnb.Cluster``, PPO trained on slots that are Slurm jobs; one job cancelled mid-run (``scancel``) fails the
step with a typed error, and the run recovers from its last checkpoint on a job submitted in its place.

Needs root (the daemons run as root here); skipped with the reason elsewhere.
"""

import contextlib
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

CONF = """\
ClusterName=rlnb
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
NodeName={host} CPUs={cpus} RealMemory=8000 State=UNKNOWN
PartitionName=rlnb Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node Slurm of this module's own (its ports, state and logs in a temporary directory); ``SLURM_CONF``
    points at it while the module runs."""
    missing = [c for c in ("slurmctld", "slurmd", "munged", "sbatch", "scancel") if shutil.which(c) is None]
    if os.geteuid() != 0 or missing:
        pytest.skip(
            f"needs root and Slurm ({', '.join(missing) or 'not root'}): make setup-system installs slurm-wlm"
        )
    pytest.importorskip("dask_jobqueue", reason="dask-jobqueue is a dev dependency: make setup")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    conf.write_text(
        CONF.format(host=host, d=d, cpus=os.cpu_count(), ctld_port=_free_port(), d_port=_free_port())
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True, timeout=30)
    subprocess.run(["slurmctld", "-f", str(conf)], check=True, timeout=30, env=env)
    subprocess.run(["slurmd", "-f", str(conf)], check=True, timeout=30, env=env)
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = subprocess.run(
                ["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=env
            ).stdout
            if state.strip() == "idle":
                break
            time.sleep(0.5)
        else:
            pytest.fail(
                f"the Slurm node never became idle: {state!r}; {(d / 'slurmctld.log').read_text()[-2000:]}"
            )
        yield conf
    finally:
        subprocess.run(["scancel", "--user=root"], env=env, capture_output=True, timeout=30)
        for pid_file in ("slurmd.pid", "slurmctld.pid"):
            pid = (d / pid_file).read_text().strip() if (d / pid_file).exists() else ""
            if pid:
                subprocess.run(["kill", pid], capture_output=True)
        deadline = time.monotonic() + 30  # (slurmd ends once its last job's epilog is done)
        while subprocess.run(["pgrep", "-f", str(conf)], capture_output=True).returncode == 0:
            if time.monotonic() > deadline:
                subprocess.run(["pkill", "-9", "-f", str(conf)], capture_output=True)
                break
            time.sleep(0.2)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


def _jobs(slurm, tmp_path):
    from dask_jobqueue import SLURMCluster

    return SLURMCluster(
        cores=1, processes=1, memory="2GB", queue="rlnb", walltime="00:30:00", python=sys.executable,
        log_directory=str(tmp_path / "jobs"), scheduler_options={"host": "127.0.0.1"},
        job_script_prologue=[f"export SLURM_CONF={slurm}", f"export PYTHONPATH={Path(__file__).parent.parent}"],
        worker_extra_args=["--nthreads", "1"],
    )  # fmt: skip


def _squeue() -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %t"], capture_output=True, text=True, timeout=30).stdout
    return out.split("\n")[:-1]


def test_ppo_trains_on_slots_that_are_slurm_jobs_and_recovers_after_one_is_cancelled(slurm, tmp_path):
    jobs = _jobs(slurm, tmp_path)
    try:
        jobs.scale(jobs=2)
        with rlnb.Cluster(jobs, min_slots=2, timeout_s=180) as cluster:
            running = [line for line in _squeue() if line.endswith(" R")]
            assert len(running) == 2 and cluster.num_slots == 2, running  # each slot a running Slurm job
            overrides = ["cluster.component_placement={'env,rollout': 0, actor: 1}", "cluster.call_timeout_s=30",
                         "runner.steps=40", "runner.save_interval=5", "runner.tensorboard=false"]  # fmt: skip
            loop = Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path / "run")
            try:
                records = loop.run(progress=False)
                assert records[-1]["env/episode_return_mean"] > records[0]["env/episode_return_mean"] + 20, [
                    r.get("env/episode_return_mean") for r in records
                ]
                saved = loop.step
                # the actor's job cancelled: the next step fails typed, naming a component, within its deadline
                actor_worker = cluster.slots[1].address
                job_id = _job_of(jobs, actor_worker)
                subprocess.run(["scancel", job_id], check=True, timeout=30)
                t0 = time.monotonic()
                with pytest.raises(RemoteError) as failure:
                    loop.step_once()
                assert time.monotonic() - t0 < 30 + 30 and failure.value.component in (
                    "actor",
                    "env",
                    "rollout",
                )
                # a job in its place (the cluster object resubmits what its plan lacks), then the run goes on
                # from its last checkpoint
                deadline = time.monotonic() + 120
                while (
                    len(jobs.workers) >= 2 and time.monotonic() < deadline
                ):  # (Dask notices the lost worker)
                    time.sleep(1)
                jobs.scale(jobs=2)
                assert loop.recover(timeout_s=180) == saved
                loop.step_once()
                assert loop.step == saved + 1
            finally:
                loop.close()
    finally:
        jobs.close()


def _job_of(jobs, worker_address: str) -> str:
    """The Slurm job id of the dask-jobqueue job whose worker is at ``worker_address``."""
    info = jobs.scheduler_info["workers"].get(worker_address, {})
    name = info.get("name")
    job = jobs.workers.get(name)
    assert job is not None and job.job_id, (name, list(jobs.workers))
    return str(job.job_id)


def test_jobs_that_do_not_start_are_told_apart_from_a_cluster_never_scaled(slurm, tmp_path):
    """A SLURMCluster whose job cannot run (more memory than the node has) is refused after timeout_s pointing at
    its job queue and logs; one never scaled is told to scale."""
    from dask_jobqueue import SLURMCluster

    never = _jobs(slurm, tmp_path)
    try:
        with pytest.raises(rlnb.ClusterError, match=r"has 0 worker\(s\); waited 2 s for 1. Scale it first"):
            rlnb.Cluster(never, timeout_s=2)
    finally:
        never.close()
    too_big = SLURMCluster(cores=1, processes=1, memory="100GB", queue="rlnb", python=sys.executable,
                           scheduler_options={"host": "127.0.0.1"})  # fmt: skip
    try:
        too_big.scale(jobs=1)
        with pytest.raises(rlnb.ClusterError, match=r"It asked for 1 \(jobs submitted\): see why .*\(squeue"):
            rlnb.Cluster(too_big, timeout_s=5)
    finally:
        with contextlib.suppress(AssertionError):  # (Dask's close asserts on a job that sbatch refused)
            too_big.close()
