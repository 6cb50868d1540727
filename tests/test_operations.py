"""Operations: the CLI, Ctrl-C, a killed driver resumed exactly, lost workers, NaN, corrupt and full disks."""

import asyncio
import json
import os
import random
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import distributed.nanny
import psutil
import pytest
import torch

import rlnb
from rlnb.cluster.cluster import listed_workers
from rlnb.loop import CheckpointError, Loop, TrainingDivergedError, complete_checkpoints
from rlnb.metrics import MetricLogger, read_metrics
from tests.conftest import group_members, kill_group, without_wall_clock


def numbers(records):
    return [without_wall_clock(r) for r in records]


RLNB = [sys.executable, "-m", "rlnb.cli"]
QUIET = ["runner.tensorboard=false"]


def _run(args, **kw):
    return subprocess.run([*RLNB, *args], capture_output=True, text=True, timeout=300, **kw)


def _wait_for_records(run_dir: Path, n: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if len(read_metrics(run_dir)) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run exited early: {proc.returncode}")
        time.sleep(0.05)
    raise TimeoutError(f"{run_dir} never reached {n} records")


# ---------------------------------------------------------------- CLI
def test_cli_usage_config_errors_and_print_config():
    r = _run(["--help"])
    assert r.returncode == 0 and "run" in r.stdout and "eval" in r.stdout and "recipes" in r.stdout
    assert _run(["run", "--help"]).returncode == 0
    r = _run(["frobnicate"])
    assert r.returncode == 2
    r = _run(["run", "ppo_cartpole", "env.num_envs=-1", "algorithm.advantag=gae"])
    assert r.returncode == 2
    assert "env.num_envs: expected an integer in [1, 65536] (envs of one env rank), got -1" in r.stderr
    assert "algorithm.advantag: unknown key" in r.stderr and "Did you mean 'advantage'?" in r.stderr
    r = _run(["run", "ppo_cartpole", "seed=5", "--print-config"])
    assert r.returncode == 0 and "seed: 5" in r.stdout and "id: CartPole-v1" in r.stdout
    r = _run(["recipes"])
    assert r.returncode == 0 and "ppo_cartpole" in r.stdout and "ppo_mujoco" in r.stdout


def _run_in_own_group(cmd: list[str], tmp_path: Path, timeout_s: float = 120) -> tuple[int, str, list[int]]:
    """Run ``cmd`` in a session of its own: its exit status, its stderr, and the processes of its group
    still running after it exited (killed, once listed). Its stdout goes to ``tmp_path / "out"``."""
    # (files: a pipe would wait for every process holding it)
    with open(tmp_path / "err", "w+") as stderr, open(tmp_path / "out", "w") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, start_new_session=True)
        proc.wait(timeout=timeout_s)
        stderr.seek(0)
        err = stderr.read()
    left = [p for p in group_members(proc.pid) if p != proc.pid]
    if left:
        kill_group(proc.pid)
    return proc.returncode, err, left


def test_cli_starts_workers_while_it_checks_the_recipe_and_stops_them_when_the_checks_fail(tmp_path):
    """``rlnb run`` starts the embedded workers' fork server before the recipe's checks import torch; a
    recipe failing those checks must not leave that server importing behind the exited driver."""
    returncode, err, left = _run_in_own_group(
        [*RLNB, "run", "ppo_cartpole", "algorithm.advantage=gea", *QUIET], tmp_path
    )
    assert returncode == 2 and "Did you mean 'gae'?" in err, err
    assert not left, f"processes left behind by a failed recipe check: {left}"


def test_stopping_the_fork_server_leaves_no_child_process_running():
    """What ``rlnb run`` does when a recipe fails its checks after the fork server started: stopping it
    must also stop the resource tracker it started, not leave it to exit after the driver (on a loaded
    machine the CLI test above then found it still running)."""
    code = (
        "import os\n"
        "from rlnb._dask import prestart_fork_server, stop_fork_server\n"
        "assert prestart_fork_server()\n"
        "stop_fork_server()\n"
        "def parent(pid):\n"
        "    try:\n"
        "        return int(open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[1])\n"
        "    except OSError:\n"
        "        return None\n"
        "print([p for p in os.listdir('/proc') if p.isdigit() and parent(p) == os.getpid()])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])


WARM_UP_CHILD = """
import os, sys, time
from multiprocessing import forkserver
import rlnb
t = time.perf_counter()
assert rlnb.warm_up()
returned_s = time.perf_counter() - t
server = forkserver._forkserver._forkserver_pid
if __name__ == "__main__":
    with rlnb.Cluster(slots=1, gpus=False) as cluster:
        def preloaded(dask_worker=None):
            import sys
            return "torch" in sys.modules and "rlnb.components" in sys.modules
        ok = all(cluster.client.run(preloaded).values())
        same = forkserver._forkserver._forkserver_pid == server
    print("RESULT", returned_s, ok, same, server)
"""


def test_warm_up_returns_at_once_and_the_first_cluster_forks_from_its_server():
    """``rlnb.warm_up()`` in a notebook's import cell: it starts the workers' fork server (importing
    torch in the background) and returns; the first cluster's workers then fork from that very
    server, preloaded; and it ends with the process, leaving nothing behind."""
    r = subprocess.run([sys.executable, "-c", WARM_UP_CHILD], capture_output=True, text=True, timeout=180)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, r.stderr[-3000:]
    returned_s, preloaded, same_server, server = line.split()[1:]
    assert float(returned_s) < 1.0, f"warm_up took {returned_s} s: it waited for the imports"
    assert preloaded == "True" and same_server == "True"
    deadline = time.monotonic() + 10
    while Path(f"/proc/{server}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{server}").exists(), "the fork server outlived its process"
    r = subprocess.run(
        [sys.executable, "-c", "import rlnb; print(rlnb.warm_up())"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "RLNB_WORKER_START": "spawn"},
    )  # fmt: skip
    assert r.stdout.strip() == "False", r.stderr[-2000:]


BYTECODE_CHILD = """
import importlib.util, os, struct, sys
import torch, transformers, distributed, gymnasium, rlnb.loop, rlnb.components  # what drivers and workers load
stale = []
for name, mod in list(sys.modules.items()):
    src = getattr(mod, "__file__", None) or ""
    if not src.endswith(".py") or not os.path.exists(src) or "site-packages" not in src:
        continue  # (rlnb's own files, edited between runs, are compiled by make setup but not checked)
    try:
        with open(importlib.util.cache_from_source(src), "rb") as f:
            header = f.read(16)
        st = os.stat(src)  # (a timestamp .pyc: flags, then the source's mtime and size)
        ok = struct.unpack("<4xIII", header) == (0, int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF)
    except OSError:
        ok = False
    if not ok:
        stale.append(name)
print(len(stale), sum(1 for m in sys.modules.values() if "site-packages" in (getattr(m, "__file__", None) or "")))
print(" ".join(sorted(stale)[:20]))
"""


def test_drivers_and_workers_load_the_environments_packages_and_rlnb_from_compiled_bytecode():
    """With PYTHONDONTWRITEBYTECODE set (these machines set it) nothing imported is cached, so unless set-up compiled
    the environment every process compiled torch, transformers and Dask from source on each start: ``import torch``
    took 3 s of CPU instead of 1.5, and the suite's files that start processes twice their CPU."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run(
        [sys.executable, "-c", BYTECODE_CHILD], capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0, r.stderr[-2000:]
    counts, names = [*r.stdout.splitlines(), ""][:2]
    stale, total = map(int, counts.split())
    assert total > 1000, r.stdout
    assert stale == 0, (
        f"{stale} of {total} modules have no current bytecode (make setup compiles it): {names}"
    )


def test_importing_rlnb_does_not_import_torch_and_a_first_cluster_imports_it_beside_the_workers():
    code = (
        "import sys, threading, rlnb\n"
        "assert 'torch' not in sys.modules, 'import rlnb imported torch'\n"
        "if __name__ == '__main__':\n"
        "    with rlnb.Cluster(slots=1, gpus=False):\n"
        "        assert 'torch' in sys.modules and 'rlnb.loop' in sys.modules\n"
        "        assert not [t for t in threading.enumerate() if t.name == 'rlnb-driver-imports']\n"
        "    print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    # and quietly: torch imported beside Dask's imports showed a FutureWarning of torch's own code
    assert "Warning" not in r.stderr, r.stderr[-2000:]


def test_a_script_starting_a_cluster_at_import_time_fails_at_once_instead_of_hanging(tmp_path):
    """Workers start by fork server (or spawn), which imports the driver's script again: without a
    ``__main__`` guard each would start a cluster of its own, and Dask hangs (dask/distributed#5726)."""
    script = tmp_path / "train.py"
    script.write_text(
        "from rlnb.loop import Loop\n"
        "\n"
        "def main():\n"
        "    return Loop.from_recipe('ppo_cartpole', ['runner.steps=1'], run_dir=None)\n"
        "\n"
        "loop = main()\n"
    )
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(script)], stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)  # the script, its fork server and its workers
        proc.communicate()
        pytest.fail("a script starting a cluster at import time hung")
    assert proc.returncode == 1, stderr[-2000:]
    assert f"rlnb.errors.ClusterError: {script}:6 starts an embedded Cluster at import time" in stderr
    assert 'if __name__ == "__main__":' in stderr and time.monotonic() - t0 < 30


def test_a_guarded_script_edited_while_it_runs_is_not_taken_for_an_unguarded_one(tmp_path):
    """The check reads the script from disk: edited since it started (a benchmark's file saved while it
    runs), its line numbers are not the running code's, and a guarded call was refused."""
    script = tmp_path / "bench.py"
    script.write_text(
        "import pathlib\n"
        "from rlnb.cluster.script_guard import check_script_guard\n"
        "if __name__ == '__main__':\n"
        "    path = pathlib.Path(__file__)\n"
        "    path.write_text('\\n' * 3 + path.read_text())  # line 6 is now the `if` line\n"
        "    check_script_guard()\n"
        "    print('checked')\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "checked\n", proc.stderr[-2000:]


def test_which_lines_of_a_script_run_when_it_is_imported():
    from rlnb.cluster.script_guard import runs_at_import

    source = (
        "import rlnb\n"  # 1
        "c = rlnb.Cluster()\n"  # 2
        "if __name__ == '__main__':\n"  # 3
        "    c = rlnb.Cluster()\n"  # 4
        "    for i in range(2):\n"  # 5
        "        main(i)\n"  # 6
        "else:\n"  # 7
        "    c = rlnb.Cluster()\n"  # 8
        "if '__main__' == __name__ and True:\n"  # 9: not the guard's plain form
        "    main()\n"  # 10
        "with ctx():\n"  # 11
        '    if "__main__" == __name__:\n'  # 12
        "        main()\n"  # 13
        "    main()\n"  # 14
    )
    ran = {line: runs_at_import(source, line) for line in (2, 4, 6, 8, 10, 13, 14)}
    assert ran == {2: True, 4: False, 6: False, 8: True, 10: True, 13: False, 14: True}


def test_cli_unreachable_scheduler_exits_1():
    r = _run(["info", "--address", "tcp://127.0.0.1:9", "--timeout-s", "2"])
    assert r.returncode == 1 and "cannot reach the Dask scheduler at 'tcp://127.0.0.1:9'" in r.stderr


@pytest.mark.parametrize(
    "sig,code,to_group",
    [(signal.SIGINT, 130, False), (signal.SIGTERM, 143, False), (signal.SIGHUP, 129, False),
     (signal.SIGTERM, 143, True), (signal.SIGHUP, 129, True)],
)  # fmt: skip
def test_ctrl_c_sigterm_and_sighup_stop_at_a_step_boundary_after_a_checkpoint(tmp_path, sig, code, to_group):
    """SIGTERM (docker stop, Slurm and Kubernetes preemption) and SIGHUP (a closed terminal) used to kill
    the run at once, with no checkpoint. Sent to the whole process group (``systemctl stop``, a closed
    terminal, ``kill -- -PGID``), they reached the embedded workers too, which died: WorkerLostError, exit 1,
    nothing saved. The workers leave them to the driver now."""
    proc = subprocess.Popen(
        [*RLNB, "run", "ppo_cartpole", "runner.steps=300", "runner.stop_return=100000", *QUIET,
         "--run-dir", str(tmp_path), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for_records(tmp_path, 3, proc)
        if to_group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            kill_group(proc.pid)
    assert proc.returncode == code, err
    assert "stopping at the end of this step" in err
    steps = [r["step"] for r in read_metrics(tmp_path) if "train/policy_loss" in r]
    ckpts = complete_checkpoints(tmp_path)
    assert ckpts and ckpts[-1].name == f"step_{steps[-1]:06d}"  # the last completed step is saved


def test_the_metrics_file_kept_open_holds_every_record_as_logged_and_follows_a_truncation(tmp_path):
    """The logger keeps metrics.jsonl open between records: each is in the file once logged, a resume's
    truncation replaces the file and the next record goes into the new one, and close() closes it."""
    logger = MetricLogger(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        logger.log(step, {"train/loss": float(step)})
        assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, step + 1))
    logger.truncate_after(1)
    logger.log(2, {"train/loss": 20.0})
    assert [(r["step"], r["train/loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 20.0)]
    file = logger._file
    logger.close()
    assert file.closed and logger._file is None
    logger.log(3, {"train/loss": 3.0})  # after close(): the file opens again, for appending
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    logger.close()


def test_a_runs_control_file_is_replaced_whole_so_a_reader_never_sees_it_half_written(tmp_path):
    """rlnb stop read control.json while its driver rewrote it at the run's end (an empty file: a JSON error, seen
    in CI under load): the driver now writes a new file and renames it over the old."""
    import types

    from rlnb.loop.control import ControlServer, read_control

    loop = types.SimpleNamespace(
        recipe=types.SimpleNamespace(name="x", runner=types.SimpleNamespace(control="loopback"))
    )
    server = ControlServer(loop, tmp_path)
    served = (tmp_path / "control.json").stat()
    assert "port" in read_control(tmp_path) and served.st_mode & 0o777 == 0o600
    server.close("done")
    ended = (tmp_path / "control.json").stat()
    assert ended.st_ino != served.st_ino and read_control(tmp_path)["outcome"] == "done"
    assert ended.st_mode & 0o777 == 0o600 and sorted(p.name for p in tmp_path.iterdir()) == ["control.json"]


def test_a_runs_outcome_is_on_file_before_its_driver_stops_answering(tmp_path):
    """`rlnb stop` said "ended (unknown)" in CI: it found the driver gone and read control.json before the driver
    had written the outcome there. The outcome is now written first, then the port closed."""
    import types

    from rlnb.loop.control import ControlServer, read_control

    loop = types.SimpleNamespace(
        recipe=types.SimpleNamespace(name="x", runner=types.SimpleNamespace(control="loopback"))
    )
    server = ControlServer(loop, tmp_path)
    seen = []

    class Watched:  # the server's socket, noting what control.json says when it is shut
        def __init__(self, sock):
            self.sock = sock

        def shutdown(self, how):
            seen.append(read_control(tmp_path).get("outcome"))
            self.sock.shutdown(how)

        def __getattr__(self, name):
            return getattr(self.sock, name)

    server.sock = Watched(server.sock)
    server.close("stopped")
    assert seen == ["stopped"] and read_control(tmp_path)["outcome"] == "stopped"


def test_a_follower_of_the_metrics_file_reads_each_whole_record_once_and_starts_over_after_a_truncation(
    tmp_path,
):
    """What `rlnb attach` and an attached dashboard read each poll: only the records new since the last poll, a
    line being written held back until it is whole, and a file a resume rewrote (shorter) read from its start."""
    from rlnb.metrics import MetricsTail

    tail, path = MetricsTail(tmp_path), tmp_path / "metrics.jsonl"
    assert tail.new() == []  # (no file yet)
    logger = MetricLogger(tmp_path, tensorboard=False)
    for step in (1, 2):
        logger.log(step, {"train/loss": float(step)})
    assert [r["step"] for r in tail.new()] == [1, 2] and tail.new() == []
    with open(path, "a") as f:  # a record half written by the driver
        f.write('{"step": 3, "train/lo')
    assert tail.new() == []
    with open(path, "a") as f:
        f.write('ss": 3.0}\n')
    assert [r["step"] for r in tail.new()] == [3]
    logger.truncate_after(1)  # (a resume: the file replaced by its records up to step 1)
    logger.log(2, {"train/loss": 20.0})
    logger.log(3, {"train/loss": 30.0})  # (longer than what was read: the replacement is seen all the same)
    assert [(r["step"], r["train/loss"]) for r in tail.new()] == [(1, 1.0), (2, 20.0), (3, 30.0)]
    logger.close()


def test_a_background_run_logging_while_the_metrics_file_is_closed_loses_no_record(tmp_path):
    """A background run logs from its own thread; close() (or a resume's truncation) may close the file
    between two of its records, never in the middle of one."""
    logger = MetricLogger(tmp_path, tensorboard=False)
    errors = []

    def log_many():
        try:
            for step in range(1, 3001):
                logger.log(step, {"train/loss": 0.0})
        except Exception as e:  # a write on a file closed under it
            errors.append(e)

    writer = threading.Thread(target=log_many)
    writer.start()
    while writer.is_alive():
        logger._close_file()
    writer.join()
    logger.close()
    assert errors == [] and [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 3001))


def test_killed_driver_resumes_with_identical_metrics(tmp_path):
    args = ["ppo_cartpole", "runner.steps=8", "runner.save_interval=2", "runner.stop_return=100000", *QUIET]
    full = tmp_path / "full"
    r = _run(["run", *args, "--run-dir", str(full), "--no-progress"])
    assert r.returncode == 0, r.stderr
    reference = numbers([x for x in read_metrics(full) if "train/policy_loss" in x])
    assert len(reference) == 8

    cut = tmp_path / "cut"
    kill_at = random.randint(3, 7)  # any step: the design makes every point safe
    # (a killed driver cannot remove its temporary files, multiprocessing's among them: they go in tmp_path)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    multiprocessing_files = set(Path(tempfile.gettempdir()).glob("pymp-*"))
    proc = subprocess.Popen(
        [*RLNB, "run", *args, "--run-dir", str(cut), "--no-progress"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env,
    )  # fmt: skip
    try:
        _wait_for_records(cut, kill_at, proc)
    finally:
        kill_group(proc.pid)  # driver and its workers, mid-step
        proc.wait(timeout=30)
    assert set(Path(tempfile.gettempdir()).glob("pymp-*")) <= multiprocessing_files
    r = _run(["run", *args, "runner.resume=auto", "--run-dir", str(cut), "--no-progress"])
    assert r.returncode == 0, r.stderr
    resumed = numbers([x for x in read_metrics(cut) if "train/policy_loss" in x])
    assert resumed == reference, f"killed at record {kill_at}"


# ---------------------------------------------------------------- lost workers
@pytest.fixture
def own_cluster():
    with rlnb.Cluster(slots=2, gpus=False) as c:
        yield c


def _kill_when(loop: Loop, records: int, slot: int) -> threading.Thread:
    def killer():
        while len(loop.history) < records:
            time.sleep(0.01)
        os.kill(loop.cluster.slots[slot].pid, signal.SIGKILL)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    return t


def test_lost_worker_raises_then_recover_continues(own_cluster, tmp_path):
    overrides = ["runner.steps=6", "runner.save_interval=2", "runner.stop_return=100000", *QUIET,
                 "cluster.component_placement={'actor,rollout,env': 1}"]  # fmt: skip
    loop = Loop.from_recipe("ppo_cartpole", overrides, cluster=own_cluster, run_dir=tmp_path)
    try:
        address = own_cluster.slots[1].address
        _kill_when(loop, 3, slot=1)
        t0 = time.perf_counter()
        with pytest.raises(rlnb.WorkerLostError) as e:
            loop.run(progress=False)
        assert time.perf_counter() - t0 < 60
        assert e.value.address == address and e.value.component in ("env", "rollout", "actor")
        step = loop.recover()
        assert step == 2 and loop.step == 2  # the step-2 checkpoint
        assert own_cluster.slots[1].address != address  # the Nanny restarted the worker
        loop.run(progress=False)
        assert loop.step == 6
        assert [r["step"] for r in read_metrics(tmp_path) if "train/policy_loss" in r] == [1, 2, 3, 4, 5, 6]
    finally:
        loop.close()


def test_loop_built_from_objects_recovers_by_relaunching_its_components(own_cluster, tmp_path):
    from rlnb.components import Env, PolicyRollout, PPOActor

    env = Env.launch(own_cluster, "1", make_env="CartPole-v1", num_envs=4, name="my-env")
    rollout = PolicyRollout.launch(own_cluster, "1", name="my-rollout")
    actor = PPOActor.launch(own_cluster, "0", name="my-actor", lr=1e-3, num_minibatches=2)
    runner = {"steps": 5, "save_interval": 2, "max_restarts": 1, "tensorboard": False}
    with Loop(
        env=env, rollout=rollout, actor=actor, steps_per_rollout=16, runner=runner, run_dir=tmp_path
    ) as loop:
        address = own_cluster.slots[1].address
        _kill_when(loop, 3, slot=1)
        loop.run(progress=False)
        assert loop.step == 5 and own_cluster.slots[1].address != address  # a restart happened
        assert loop.groups["env"].name == "my-env" and loop.groups["env"].infos[0].address != address
        assert (tmp_path / "checkpoints" / "step_000004" / "my-actor_rank0.pt").exists()


def test_a_refresh_right_after_a_worker_dies_waits_for_its_restart(own_cluster, monkeypatch):
    # A loaded scheduler lists a killed worker for a moment: a refresh that only counted workers saw two, then
    # renumbered the slots from a list of one (a recover's placement then said "slot 1 is beyond the cluster").
    scheduler = own_cluster._local.scheduler
    remove_worker = scheduler.remove_worker

    async def slow_remove_worker(*args, **kwargs):
        await asyncio.sleep(1.0)  # the scheduler's pace under load, from CI
        return await remove_worker(*args, **kwargs)

    monkeypatch.setattr(scheduler, "remove_worker", slow_remove_worker)
    # the Nanny reads a started worker's message late, as under load: the second kill lands before it has, so
    # it unregisters the worker before (CI: the restart was refused "name taken" and the slot never came back)
    monkeypatch.setattr(distributed.nanny.WorkerProcess, "_init_msg_interval", 2.0)
    for _ in range(2):
        dead = own_cluster.slots[1].address
        process = psutil.Process(own_cluster.slots[1].pid)
        process.kill()
        process.wait(30)  # as a loop that saw the loss: the process is gone
        slots = own_cluster.refresh(60)
        assert len(slots) == 2 and dead not in {s.address for s in slots}
        assert sorted(own_cluster.client.run(os.getpid)) == sorted(s.address for s in slots)


def test_a_refresh_starts_a_worker_whose_nanny_gave_up(own_cluster):
    # (as after a restart the scheduler refused)
    own_cluster._local.sync(own_cluster._local.workers[1].close)
    slots = own_cluster.refresh(60)
    assert len(slots) == 2 and len(own_cluster.client.run(os.getpid)) == 2


def test_max_restarts_recovers_automatically(own_cluster, tmp_path):
    overrides = ["runner.steps=6", "runner.save_interval=1", "runner.max_restarts=1", "runner.stop_return=100000",
                 *QUIET, "cluster.component_placement={'actor,rollout,env': 0}"]  # fmt: skip
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=own_cluster, run_dir=tmp_path) as loop:
        pid = own_cluster.slots[0].pid
        _kill_when(loop, 2, slot=0)
        loop.run(progress=False)
        assert loop.step == 6
        assert loop.restarts == 1 and own_cluster.slots[0].pid != pid  # a restart happened, on a new worker


# ---------------------------------------------------------------- bad data and disks
def test_nan_loss_stops_clearly_and_keeps_last_good_checkpoint(cluster, tmp_path):
    overrides = ["env.id=rlnb.testing:rlnb-test/NaNReward-v0", "env.kwargs={nan_after: 100}", "runner.save_interval=1",
                 "runner.steps=10", *QUIET]  # fmt: skip
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        with pytest.raises(TrainingDivergedError) as e:
            loop.run(progress=False)
        ckpts = complete_checkpoints(tmp_path)
        assert e.value.step == len(ckpts) + 1  # nothing saved at or after the bad step
        assert e.value.last_checkpoint == str(ckpts[-1])
        assert "training diverged at step" in str(e.value) and "non-finite loss" in str(e.value)


def test_corrupt_checkpoint_names_the_file(cluster, tmp_path):
    with Loop.from_recipe(
        "ppo_cartpole", ["runner.steps=1", *QUIET], cluster=cluster, run_dir=tmp_path
    ) as loop:
        loop.run(progress=False)
        path = loop.save()
    (path / "actor_rank0.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"actor\[rank 0\] failed to load actor_rank0.pt"):
        Loop.resume(tmp_path, cluster=cluster)


def _limit_file_size(nbytes: int):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-large write then fails with EFBIG, like ENOSPC
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def test_full_disk_leaves_no_partial_checkpoint(own_cluster, tmp_path):
    with Loop.from_recipe(
        "ppo_cartpole", ["runner.steps=2", *QUIET], cluster=own_cluster, run_dir=tmp_path
    ) as loop:
        loop.run(1, progress=False)
        first = loop.save()
        loop.run(1, progress=False)
        own_cluster.client.run(_limit_file_size, 1000)  # every worker: files over 1 kB cannot be written
        with pytest.raises(CheckpointError, match="could not write checkpoint .*step_000002"):
            loop.save()
        assert complete_checkpoints(tmp_path) == [first]
        assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
        state = torch.load(first / "actor_rank0.pt", weights_only=False)
        assert state["step"] == 1
    assert json.loads((first / "loop.json").read_text())["step"] == 1


ENTRY_CHILD = """
import atexit, pathlib, sys
class AtTeardown:
    def __del__(self):
        (out / "teardown").write_text("ran")
if __name__ == "__main__":  # (the workers import this module as __mp_main__: its effects are the driver's)
    out = pathlib.Path(sys.argv[1])
    keep = AtTeardown()
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    from rlnb.cli import entry
    sys.argv = ["rlnb", "run", "ppo_cartpole", "runner.steps=1", "runner.tensorboard=false", "--no-progress",
                "--run-dir", str(out / "run")]
    entry()
"""


def test_the_command_ends_without_the_interpreters_teardown_once_the_run_is_closed(tmp_path):
    """``rlnb``'s entry point skips freeing torch's and Dask's modules one by one (0.5-1.5 s) after the run
    is closed, but still runs the exit handlers, flushes its output and leaves no process behind."""
    script = tmp_path / "child.py"
    script.write_text(ENTRY_CHILD)
    returncode, err, left = _run_in_own_group([sys.executable, str(script), str(tmp_path)], tmp_path, 300)
    assert returncode == 0, err[-3000:]
    said = (tmp_path / "out").read_text()
    assert "checkpoint" in said.splitlines()[-1], (said, err[-3000:])  # the result's line, flushed
    records = read_metrics(tmp_path / "run")  # the step and the final evaluation, written out
    assert [r["step"] for r in records] == [1, 1] and "eval/return_mean" in records[1], records
    assert (tmp_path / "atexit").exists()  # exit handlers ran...
    assert not (tmp_path / "teardown").exists()  # ...the interpreter's teardown did not
    assert not left, f"processes left behind: {left}"


HEARTBEAT_CHILD = """
import sys
import rlnb

def slow_heartbeat(dask_worker=None):
    # on the worker: its next heartbeat opens a new connection to the scheduler that takes seconds (as a TLS
    # handshake under load), so the close finds it connecting
    import asyncio
    import distributed.core as core

    connect = core.connect

    async def slow(*args, **kwargs):
        await asyncio.sleep(30)
        return await connect(*args, **kwargs)

    core.connect = slow
    dask_worker.rpc.available.clear()  # (no idle connection to reuse)
    dask_worker.loop.add_callback(dask_worker.heartbeat)

if __name__ == "__main__":
    with rlnb.Cluster(slots=1, gpus=False) as cluster:
        from rlnb.testing import Echo
        group = rlnb.Group.launch(Echo, cluster, "0", name="echo")  # (rlnb's worker plugin is set up)
        cluster.client.run(slow_heartbeat)
    print("closed", file=sys.stderr)
"""


def test_a_heartbeat_still_connecting_when_the_cluster_closes_prints_no_traceback(tmp_path):
    """Under load a worker's heartbeat was still connecting (a TLS handshake) when the close ended its connection
    pool, and Dask's traceback for it was printed after a successful ``rlnb run``'s last line (on CI)."""
    script = tmp_path / "heartbeat.py"
    script.write_text(HEARTBEAT_CHILD)
    returncode, err, _ = _run_in_own_group([sys.executable, str(script)], tmp_path, 120)
    assert returncode == 0, err[-3000:]
    assert "Failed to communicate" not in err and err.splitlines()[-1] == "closed", err[-3000:]


STUCK_CHILD = """
import sys, threading, time
from rlnb.cli import _exit_now
threading.Thread(target=time.sleep, args=(3600,), name="stuck-hook").start()  # not a daemon: exit waits for it
t0 = time.monotonic()
try:
    _exit_now(3, join_s=1.0)
finally:
    print(f"not reached {time.monotonic() - t0}", file=sys.stderr)
"""


def test_the_command_exits_within_its_deadline_when_a_thread_does_not_end(tmp_path):
    """A non-daemon thread left running (a user's hook that never returns) would hold Python's own exit
    forever; the command's exit waits for it within a deadline, says which thread it left, and ends with
    the run's status."""
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_CHILD)
    t0 = time.monotonic()
    returncode, err, left = _run_in_own_group([sys.executable, str(script)], tmp_path, 60)
    assert returncode == 3 and time.monotonic() - t0 < 30, err
    assert "exiting with thread(s) ['stuck-hook'] still running 1 s after the run closed" in err, err
    assert "not reached" not in err and not left


def test_a_tensorboard_that_cannot_be_imported_is_said_once_not_silently_skipped(
    tmp_path, monkeypatch, caplog
):
    import sys

    import rlnb.metrics as metrics
    from rlnb.metrics import MetricLogger

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # (an import of it now fails)
    monkeypatch.setattr(metrics, "_TENSORBOARD_MISSING_SAID", False)
    with caplog.at_level("WARNING", logger="rlnb"):
        for name in ("a", "b"):
            logger = MetricLogger(tmp_path / name, tensorboard=True)
            logger.log(1, {"x": 1.0})
            logger.close()
    said = [r.getMessage() for r in caplog.records if "TensorBoard cannot be imported" in r.getMessage()]
    assert len(said) == 1 and "runner.tensorboard=false" in said[0], said
    assert not (tmp_path / "a" / "tensorboard").exists() and (tmp_path / "a" / "metrics.jsonl").exists()


def test_a_recipes_start_deadline_bounds_how_long_its_components_take_to_start(cluster, tmp_path):
    """``cluster.start_timeout_s`` reaches every component's launch (a vLLM engine's start on a loaded machine
    took past the 120 s it was fixed at): a deadline no rank can meet is said naming it, the ranks given back."""
    before = len(listed_workers(cluster.client))
    overrides = ["cluster.start_timeout_s=0.001", "runner.tensorboard=false"]
    with pytest.raises(rlnb.errors.RemoteTimeoutError, match=r"did not start within 0.001 s"):
        Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path / "run")
    with Loop.from_recipe(
        "ppo_cartpole", ["runner.tensorboard=false"], cluster=cluster, run_dir=tmp_path / "ok"
    ) as loop:
        loop.step_once()  # the cluster is as it was
    assert len(listed_workers(cluster.client)) == before


class _StartsAChildThenHangs:
    """A component whose start begins a child process (as a vLLM engine does) and then takes longer than its
    rank's start deadline."""

    def __init__(self, pid_file: str):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        Path(pid_file).write_text(str(child.pid))
        time.sleep(600)


def test_processes_a_worker_started_end_when_the_cluster_closes_after_a_start_given_up_on(tmp_path):
    """A vLLM rank whose start passed its deadline left the engine's processes (and their shared memory) running
    after the run: what the workers started ends with the embedded cluster."""
    import psutil

    from rlnb.runtime.group import Group

    pid_file = tmp_path / "child.pid"
    with rlnb.Cluster(slots=1, gpus=False) as c:
        with pytest.raises(rlnb.errors.RemoteTimeoutError, match="did not start within"):
            Group.launch(_StartsAChildThenHangs, c, "0", args=(str(pid_file),), start_timeout_s=5)
        deadline = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        child = psutil.Process(int(pid_file.read_text()))
    try:
        child.wait(timeout=10)
    except psutil.TimeoutExpired:
        child.kill()
        pytest.fail("the child process a worker started outlived the cluster")


KERNEL = """
import os, signal, sys
from rlnb.loop import Loop

if __name__ == "__main__":
    overrides = ["runner.steps=1000000", "runner.stop_return=100000", "runner.eval_interval=0", "runner.tensorboard=false",
                 "runner.save_interval=0", "env.num_envs=2", "rollout.steps_per_rollout=8", "algorithm.update_epochs=1",
                 "algorithm.num_minibatches=1"]
    loop = Loop.from_recipe("ppo_cartpole", overrides, run_dir=sys.argv[1])
    loop.run(3, progress=False)
    run = loop.detach()
    print("DETACHED", run.status()["step"], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the kernel dies: the run goes on without it
"""


def test_a_detached_run_outlives_its_kernel_and_is_attached_steered_listed_and_stopped_from_elsewhere(
    tmp_path,
):
    """``loop.detach()`` hands a notebook's run to a driver of its own (``rlnb run --detach`` resuming it from a
    checkpoint); the kernel killed, another process attaches (``rlnb.attach``), pauses it, changes its lr,
    resumes it; ``rlnb ps`` lists it, ``rlnb stop`` ends it with a checkpoint; its metrics hold every step once."""
    run_dir = tmp_path / "runs" / "detached"
    kernel = tmp_path / "kernel.py"
    kernel.write_text(KERNEL)
    k = subprocess.run(
        [sys.executable, str(kernel), str(run_dir)], capture_output=True, text=True, timeout=300
    )
    assert k.returncode == -signal.SIGKILL and "DETACHED" in k.stdout, k.stderr[-3000:]
    run = rlnb.attach("detached", root=tmp_path / "runs")  # (by its name, as rlnb ps lists it)
    assert run.run_dir == run_dir
    try:
        run.pause()
        assert run.status()["paused"]
        deadline = time.monotonic() + 60
        # held once the step under way and the steps its worker ran ahead (up to 16) are taken: on CI the first
        # block after the resume was still being taken 0.5 s after the pause
        while not run.status()["held"] and time.monotonic() < deadline:
            time.sleep(0.1)
        held = run.status()["step"]
        time.sleep(1.0)
        assert run.status()["step"] == held > 3, "a paused run went on"
        # its batch, as loop.sample() shows it in the driver's notebook, taken between steps
        batch = run.sample(2)
        assert batch["obs"].shape[:1] == (2,) and batch["obs"].shape[-1] == 4, {
            k: getattr(v, "shape", v) for k, v in batch.items()
        }
        assert batch["actions"].shape[0] == 2 and batch["logprobs"].dtype.kind == "f"
        # a second detached driver for the same directory is refused, and leaves the live one reachable (while it is paused)
        again = subprocess.run([*RLNB, "run", "ppo_cartpole", "--run-dir", str(run_dir), "--detach"],
                               capture_output=True, text=True, timeout=300)  # fmt: skip
        assert again.returncode == 2 and "is a live run's" in again.stderr and run.live(), again.stderr[
            -2000:
        ]
        run.set_hyperparameters(lr=1e-4)
        with pytest.raises(rlnb.RlnbError, match="lr"):
            run.set_hyperparameters(lr=-1.0)  # checked by its driver, said here
        run.unpause()
        deadline = time.monotonic() + 60
        while run.status()["step"] < held + 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        # only its owner steers it: the port's token is in a file of the owner's alone, and a wrong one is refused
        control = run_dir / "control.json"
        assert control.stat().st_mode & 0o077 == 0 and run_dir.stat().st_mode & 0o077 == 0
        with socket.create_connection(
            ("127.0.0.1", json.loads(control.read_text())["port"]), timeout=30
        ) as conn:
            conn.sendall(b'{"token": "guessed", "op": "stop"}\n')
            assert b"refused" in conn.recv(4096)
        assert not run.status()["stopping"]
        listed = subprocess.run(
            [*RLNB, "ps", str(tmp_path / "runs")], capture_output=True, text=True, timeout=120
        )
        assert str(run_dir) in listed.stdout and "ppo_cartpole" in listed.stdout, (
            listed.stdout + listed.stderr
        )
        # its dashboard in this process: curves from its metrics, controls that steer it through its driver
        dash = run.dashboard(poll_s=0.2)
        dash.pause_button.value = True
        deadline = time.monotonic() + 60
        while not run.status()["paused"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert run.status()["paused"]
        dash.pause_button.value = False
        # `rlnb attach` follows it in a terminal, a line a step, until it ends
        follower = subprocess.Popen([*RLNB, "attach", str(run_dir)], stdout=subprocess.PIPE, text=True)
        # (attached before the run goes on: a command starting on a loaded machine could find it ended)
        assert select.select([follower.stdout], [], [], 120)[0], "rlnb attach said nothing within 120 s"
        attached = follower.stdout.readline()
        deadline = time.monotonic() + 60
        while run.status()["step"] < held + 6 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stopped = subprocess.run([*RLNB, "stop", str(run_dir)], capture_output=True, text=True, timeout=300)
    assert stopped.returncode == 0 and "ended (stopped)" in stopped.stdout, stopped.stdout + stopped.stderr
    followed = attached + follower.communicate(timeout=120)[0]
    assert "rlnb: attached to AttachedRun(" in followed and "the run ended (stopped)" in followed, followed
    assert re.search(r"^step \d+: ", followed, flags=re.M), followed
    assert not run.live() and run.outcome() == "stopped"
    deadline = time.monotonic() + 30
    while dash.model.outcome is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (
        dash.model.outcome == "stopped" and "return / reward" in dash.plots.panels and dash.model.step > held
    )
    with pytest.raises(rlnb.loop.control.RunNotLiveError, match="the run ended"):
        rlnb.attach(run_dir)
    trained = [r["step"] for r in read_metrics(run_dir) if "train/policy_loss" in r]
    assert trained == list(range(1, len(trained) + 1)) and len(trained) > held  # every step once, none lost
    lrs = [r["steer/lr"] for r in read_metrics(run_dir) if "steer/lr" in r]
    assert lrs and lrs[-1] == 1e-4
    assert complete_checkpoints(run_dir)[-1].name == f"step_{trained[-1]:06d}"  # stopped with a checkpoint
    assert (run_dir / "driver.log").exists()
