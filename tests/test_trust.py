"""Trust (issue 40): a run directory from someone else cannot run code when it is resumed or evaluated; run
directories have one writer; a run says what it resumes."""

import contextlib
import os
import pickle
import stat

import gymnasium as gym
import numpy as np
import pytest
import torch

import rlnb
from rlnb.envs.state import capture_state, restore_state
from rlnb.files import UnsafeFileError, torch_load_safe
from rlnb.loop import CheckpointError, Loop, complete_checkpoints

QUIET = [
    "runner.tensorboard=false",
    "runner.stop_return=100000",
    "env.num_envs=4",
    "rollout.steps_per_rollout=16",
]


class _RunsCode:
    """What a hostile checkpoint holds: unpickling it calls ``os.system``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_file_naming_code_is_refused_before_any_of_it_runs(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"policy": _RunsCode(marker)}, tmp_path / "x.pt")
    with pytest.raises(UnsafeFileError, match=r"x\.pt names posix\.system"):
        torch_load_safe(tmp_path / "x.pt")
    assert not marker.exists()
    torch.save({"a": np.arange(3), "b": np.float32(2.0), "c": [torch.ones(2), ("x", 1)]}, tmp_path / "ok.pt")
    loaded = torch_load_safe(tmp_path / "ok.pt")
    assert loaded["a"].tolist() == [0, 1, 2] and loaded["b"] == 2.0 and loaded["c"][1] == ("x", 1)


@pytest.mark.parametrize("component", ["actor", "env"])
def test_resuming_a_hostile_checkpoint_is_an_error_and_runs_nothing(cluster, tmp_path, component):
    with Loop.from_recipe(
        "ppo_cartpole", ["runner.steps=1", *QUIET], cluster=cluster, run_dir=tmp_path
    ) as loop:
        loop.run(progress=False)
        path = loop.save()
    marker = tmp_path / "ran"
    with open(path / f"{component}_rank0.pt", "wb") as f:  # a plain pickle too: torch.load reads both
        pickle.dump({"policy": _RunsCode(marker)}, f)
    with pytest.raises(CheckpointError, match=rf"{component}_rank0\.pt.*(posix\.system|rlnb loads only)"):
        Loop.resume(tmp_path, cluster=cluster)
    assert not marker.exists()


class _Opaque:
    pass


class _OpaqueStateRollout(rlnb.PolicyRollout):
    def state_dict(self):
        return {**super().state_dict(), "extra": _Opaque()}


def test_a_component_state_that_could_not_load_safely_is_refused_when_saved(cluster, tmp_path):
    env = rlnb.Env.launch(cluster, "0", make_env="CartPole-v1", num_envs=4)
    rollout = _OpaqueStateRollout.launch(cluster, "0")
    actor = rlnb.PPOActor.launch(cluster, "0")
    runner = {"steps": 1, "tensorboard": False}
    with Loop(
        env=env, rollout=rollout, actor=actor, steps_per_rollout=16, runner=runner, run_dir=tmp_path
    ) as loop:
        loop.run(progress=False)
        with pytest.raises(CheckpointError, match=r"_OpaqueStateRollout.state_dict\(\) holds .*_Opaque"):
            loop.save()
    assert not complete_checkpoints(tmp_path)


class NotebookEnv(gym.Env):
    """An env class as a notebook cell defines it: its state in plain attributes and a nested object."""

    observation_space = gym.spaces.Box(-10, 10, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    class Counter:
        def __init__(self):
            self.n, self.history = 0, []

    def __init__(self):
        self.pos = np.zeros(2, np.float32)
        self.counter = self.Counter()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = self.np_random.normal(size=2).astype(np.float32)
        return self.pos, {}

    def step(self, action):
        self.pos = self.pos + self.np_random.normal(size=2).astype(np.float32) * (1 + action)
        self.counter.n += 1
        self.counter.history.append(float(self.pos[0]))
        return self.pos, float(-abs(self.pos[0])), bool(abs(self.pos[0]) > 5), self.counter.n % 7 == 0, {}


def test_env_state_is_plain_data_and_restores_exactly():
    from rlnb.envs.gym_envs import make_vector_env

    a, b = make_vector_env(NotebookEnv, 3), make_vector_env(NotebookEnv, 3)
    a.reset(seed=5)
    for _ in range(4):
        a.step(np.array([0, 1, 1]))
    state = capture_state(a)
    restore_state(b, state)
    for _ in range(10):
        act = np.array([1, 0, 1])
        (oa, ra, ta, *_), (ob, rb, tb, *_) = a.step(act), b.step(act)
        assert np.array_equal(oa, ob) and np.array_equal(ra, rb) and np.array_equal(ta, tb)
    assert b.envs[0].counter.history == a.envs[0].counter.history
    path = "/dev/shm/rlnb-test-env-state.pt" if os.path.isdir("/dev/shm") else "env-state.pt"
    try:
        torch.save(state, path)
        restore_state(make_vector_env(NotebookEnv, 3), torch_load_safe(path))  # loads with weights_only
    finally:
        os.unlink(path)


def test_checkpoints_are_private_to_their_user(cluster, tmp_path):
    run_dir = tmp_path / "run"
    with Loop.from_recipe(
        "ppo_cartpole", ["runner.steps=1", *QUIET], cluster=cluster, run_dir=run_dir
    ) as loop:
        loop.run(progress=False)
        path = loop.save()
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    for f in [*path.iterdir(), run_dir / "metrics.jsonl", run_dir / "recipe.yaml"]:
        assert stat.S_IMODE(f.stat().st_mode) & 0o077 == 0, f


def test_a_run_directory_has_one_writer_and_is_never_silently_mixed(cluster, tmp_path, caplog):
    from rlnb.errors import ConfigError
    from rlnb.metrics import read_metrics

    one = ["runner.steps=2", *QUIET]
    with Loop.from_recipe("ppo_cartpole", one, cluster=cluster, run_dir=tmp_path) as loop:
        with pytest.raises(
            ConfigError,
            match=rf"runner.run_dir: {tmp_path} is in use by another loop of this process \(pid {os.getpid()}.*close",
        ):
            Loop.from_recipe("ppo_cartpole", one, cluster=cluster, run_dir=tmp_path)
        loop.run(progress=False)
    with pytest.raises(
        ConfigError, match=r"holds a run \(0 checkpoint\(s\), metrics\); continue it with runner.resume"
    ):
        Loop.from_recipe("ppo_cartpole", one, cluster=cluster, run_dir=tmp_path)
    # resume=auto with no checkpoint (ppo_cartpole saves none): says so, and logs no step twice
    with Loop.from_recipe(
        "ppo_cartpole", [*one, "runner.resume=auto"], cluster=cluster, run_dir=tmp_path
    ) as loop:
        assert loop.resumed_from is None
        loop.run(progress=False)
    assert "nothing to resume" in caplog.text
    assert [r["step"] for r in read_metrics(tmp_path) if "train/policy_loss" in r] == [1, 2]
    with Loop.from_recipe(
        "ppo_cartpole", [*one, "runner.overwrite=true"], cluster=cluster, run_dir=tmp_path
    ) as loop:
        loop.run(1, progress=False)
    assert [r["step"] for r in read_metrics(tmp_path) if "train/policy_loss" in r] == [1]


@pytest.mark.parametrize("kind", ["file", "read-only", "under-a-file"])
def test_a_run_directory_that_cannot_be_written_is_refused_before_anything_starts(tmp_path, kind):
    from rlnb.errors import ConfigError

    if kind == "file":
        target = tmp_path / "f"
        target.write_text("x")
        expected = "expected a directory"
    elif kind == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        (tmp_path / "ro").mkdir(mode=0o500)
        target = tmp_path / "ro" / "run"
        expected = "cannot create"
    if kind == "under-a-file":
        (tmp_path / "g").write_text("x")
        target = tmp_path / "g" / "run"
        expected = "cannot create .*Not a directory"
    with pytest.raises(ConfigError, match=f"runner.run_dir: .*{expected}"):
        Loop.from_recipe(
            "ppo_cartpole", ["cluster.address=tcp://127.0.0.1:9"], run_dir=target
        )  # no cluster needed


def _connections_and_threads(dask_worker) -> tuple:
    import threading

    from rlnb.runtime import direct

    return direct._SERVERS[dask_worker.address].connections, threading.active_count()


def _worker_connections_and_threads(cluster):
    address = cluster.slots[0].address
    return cluster.client.run(_connections_and_threads, workers=[address])[address]


def test_closed_channels_leave_no_connection_or_thread_on_their_worker(cluster):
    """Channel.close() used to keep two connections and two threads on its worker: the 129th channel on a
    worker then failed with a WorkerLostError on a live worker."""
    import time

    warm = rlnb.Channel.create(cluster, "warm")  # (the first channel starts a pool of threads of Dask's own)
    warm.put(1)
    warm.get()
    warm.close()
    time.sleep(0.5)
    conns0, threads0 = _worker_connections_and_threads(cluster)
    for i in range(300):
        ch = rlnb.Channel.create(cluster, f"c{i}")
        ch.put(torch.ones(4), key="k")  # unbounded: through the ordered sender's connection
        assert ch.get(key="k", timeout=30).sum() == 4  # through the pooled connection
        ch.close()
    deadline = time.time() + 10
    while time.time() < deadline:
        conns, threads = _worker_connections_and_threads(cluster)
        if conns <= conns0 and threads <= threads0 + 2:
            break
        time.sleep(0.2)
    assert conns <= conns0 and threads <= threads0 + 2, (conns0, conns, threads0, threads)
    with pytest.raises(rlnb.errors.ChannelClosedError):
        ch.put(1)


def test_rlnb_eval_and_export_leave_the_run_directory_as_it_was(tmp_path):
    """`rlnb eval` used to append a step record to metrics.jsonl (on a live run: truncate it), and both added
    TensorBoard event files."""
    import subprocess
    import sys

    run = tmp_path / "run"
    cli = [sys.executable, "-m", "rlnb.cli"]
    done = subprocess.run([*cli, "run", "ppo_cartpole", "runner.steps=2", "runner.eval_interval=0", "--run-dir",
                           str(run), "--no-progress"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    def snapshot():
        return {
            p.relative_to(run): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in run.rglob("*")
            if p.is_file()
        }

    before = snapshot()
    evaluated = subprocess.run(
        [*cli, "eval", str(run), "--episodes", "2"], capture_output=True, text=True, timeout=300
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert snapshot() == before
    exported = subprocess.run([*cli, "export", str(run)], capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, exported.stderr[-3000:]
    after = snapshot()
    assert set(after) - set(before) == {type(next(iter(before)))("policy.pt")}
    assert {k: v for k, v in after.items() if k.name != "policy.pt"} == before


OTHER_USER = """
import sys
from distributed import Client
from distributed.security import Security

address = sys.argv[1]
for how, kw in (("no credentials", {}), ("credentials of its own", {"security": Security.temporary()}),
                ("plain tcp", {"address": address.replace("tls://", "tcp://")})):
    try:
        Client(kw.pop("address", address), timeout=5, **kw).close()
        print(how, "CONNECTED")
    except Exception as e:
        print(how, "refused", type(e).__name__)
"""


def test_the_embedded_cluster_is_closed_to_other_users_and_open_to_its_own(cluster, tmp_path):
    """Its scheduler had no authentication: a process of another uid connected over loopback and ran code in
    the workers as the run's user. Now it speaks TLS with credentials only its driver holds."""
    import subprocess
    import sys

    assert cluster.address.startswith("tls://")
    # another process without the driver's credentials, as another user's would be (of any uid: the scheduler
    # asks for the certificate, not the user)
    done = subprocess.run([sys.executable, "-c", OTHER_USER, cluster.address], capture_output=True, text=True,
                          timeout=120, cwd="/")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 3 and all(" refused " in line for line in lines), lines
    # this user's own other process, given the credentials the driver saved (0600 files in a 0700 directory)
    creds = cluster.save_credentials(tmp_path / "creds")
    assert stat.S_IMODE(creds.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in creds.iterdir())
    own = "import sys, rlnb\nif __name__ == '__main__':\n    with rlnb.Cluster(sys.argv[1], security=sys.argv[2]) as c:\n" \
          "        print(len(c.slots))\n"  # fmt: skip
    script = tmp_path / "own.py"
    script.write_text(own)
    mine = subprocess.run([sys.executable, str(script), cluster.address, str(creds)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert mine.returncode == 0 and mine.stdout.strip() == str(len(cluster.slots)), mine.stderr[-2000:]
    # direct calls stay on: loopback and Unix sockets, authenticated by tokens that travel over the TLS
    from rlnb.testing import Echo

    group = rlnb.Group.launch(Echo, cluster, "0", name="tls-direct")
    assert group.transport == "direct" and group.add(2).result(30) == [2]
    group.shutdown()


def test_one_driver_can_neither_call_nor_steer_another_drivers_components(cluster, tmp_path):
    """A second driver on the same scheduler read the first driver's actor and set its learning rate: direct
    calls had one token per worker, handed to every driver that launched something there. Now each driver
    session has its own: the second driver's connection, even naming the first's host keys, finds no host of the
    first's (a rank or a channel), and both drivers' own calls go on."""
    from rlnb.runtime.direct import dumps
    from rlnb.runtime.link import DirectLink
    from rlnb.testing import Echo

    first = rlnb.Group.launch(Echo, cluster, "0", name="first-driver", kwargs={"offset": 1})
    queue = rlnb.Channel.create(cluster, "first-driver-queue", slot=0)
    queue.put(7)
    with rlnb.Cluster(cluster.address, security=cluster.save_credentials(tmp_path / "creds")) as other:
        second = rlnb.Group.launch(Echo, other, "0", name="second-driver")
        mine, theirs = second._route.links[0], first._route.links[0]
        assert mine.address == theirs.address and mine.token != theirs.token  # one worker, two credentials
        for key, op, args in ((theirs.key, "call", ("echo", ("steered",), {})),
                              (queue._direct[3], "get", ("default", 1, 5.0, "elsewhere"))):  # fmt: skip
            forged = DirectLink(*theirs.address, mine.token, key, rank=op == "call")
            status, value, _ = forged.send(op, dumps(args), 30).read()
            forged.close()
            assert status == "lost" and "shut down" in str(value), (op, status, value)
        assert second.add(1).result(30) == [1]
        second.shutdown()  # the second driver's last host on that worker: a late call of its own is still its own
        late = DirectLink(*mine.address, mine.token, mine.key, rank=True)
        status, value, _ = late.send("call", dumps(("add", (1,), {})), 30).read()
        late.close()
        assert status == "lost" and "shut down" in str(value), (status, value)  # not refused as a stranger's
    assert first.add(1).result(30) == [2]  # its component untouched
    assert queue.get(timeout=30) == 7  # and its channel's item still there
    queue.close()
    first.shutdown()


def _sessions_kept(limit=None, dask_worker=None):
    """On a worker: (set ``KEPT_SESSIONS`` to ``limit``, if given, and) the sessions whose tokens its call server
    keeps, and those of its live hosts."""
    from rlnb.runtime import direct

    if limit is not None:
        direct.KEPT_SESSIONS = limit
    server = direct._SERVERS[dask_worker.address]
    return sorted(server._tokens), sorted({h.session for h in list(server.hosts.values())})


def test_the_tokens_of_departed_drivers_are_bounded(cluster, tmp_path):
    """A worker keeps a departed driver session's token (a late request is answered, not refused) until it keeps
    ``KEPT_SESSIONS``; then a new session's first host drops those with no host left."""
    from rlnb.testing import Echo

    address = cluster.slots[0].address
    creds = cluster.save_credentials(tmp_path / "creds")
    try:
        for _ in range(2):  # two drivers come and go
            with rlnb.Cluster(cluster.address, security=creds) as other:
                rlnb.Group.launch(Echo, other, "0", name="passing").shutdown()
        kept, live = cluster.client.run(_sessions_kept, workers=[address])[address]
        assert len(kept) >= 2 + len(live), (kept, live)  # theirs kept, though no host of theirs is left
        cluster.client.run(_sessions_kept, 1, workers=[address])
        with rlnb.Cluster(cluster.address, security=creds) as other:
            group = rlnb.Group.launch(Echo, other, "0", name="newcomer")
            kept, live = cluster.client.run(_sessions_kept, workers=[address])[address]
            assert kept == live and other.session in kept, (kept, live)
            group.shutdown()
    finally:
        cluster.client.run(_sessions_kept, 1024, workers=[address])


def test_direct_calls_over_tls_only_where_the_workers_listen_on_loopback():
    from rlnb.runtime.plugin import _loopback_tls

    assert _loopback_tls("tls://127.0.0.1:4000") and _loopback_tls("tls://[::1]:4000")
    assert not _loopback_tls("tls://10.1.2.3:4000") and not _loopback_tls("tcp://127.0.0.1:4000")


def test_without_cryptography_the_embedded_cluster_says_it_runs_plain_tcp(monkeypatch, caplog):
    from distributed.security import Security

    def missing():
        raise ImportError("No module named 'cryptography'")

    monkeypatch.setattr(Security, "temporary", staticmethod(missing))
    with rlnb.Cluster(slots=1, gpus=False) as cluster:
        assert cluster.address.startswith("tcp://")
    assert "runs plain TCP" in caplog.text and "Install the cryptography package" in caplog.text
    with rlnb.Cluster(slots=1, gpus=False, security=False) as cluster:  # asked for
        assert cluster.address.startswith("tcp://")


def test_a_channel_holds_at_most_max_bytes_of_tensors(cluster):
    """A channel with the default maxsize had no memory bound: 1.4 GiB of /dev/shm grew without blocking."""
    from rlnb.runtime.channel import DEFAULT_MAX_BYTES

    ch = rlnb.Channel.create(cluster, "bounded", maxsize=4, max_bytes=1 << 20, timeout_s=30)
    try:
        assert rlnb.Channel.create.__defaults__[-1] == DEFAULT_MAX_BYTES == 1 << 30  # bounded by default
        ch.put(torch.ones(150_000))  # 600 KB (in shared memory)
        with pytest.raises(rlnb.errors.ChannelTimeoutError, match="max_bytes 1048576"):
            ch.put(torch.ones(150_000), timeout=1.0)  # 1.2 MB would be queued: waits, then times out
        assert ch.get(timeout=10).sum() == 150_000
        ch.put(torch.ones(150_000), timeout=5)  # room again
        ch.put(np.ones(1000), key="other", timeout=5)  # small: fits beside it
        assert ch.get(timeout=10).numel() == 150_000 and ch.get(key="other", timeout=10).size == 1000
        ch.put(torch.ones(400_000), timeout=5)  # bigger than the bound, into an empty channel: goes in
        assert ch.get(timeout=10).numel() == 400_000
        with pytest.raises(ValueError, match="max_bytes: expected an int >= 0"):
            rlnb.Channel.create(cluster, "bad", max_bytes=-1)
    finally:
        ch.close()


def test_a_put_that_never_found_room_is_reported_at_the_next_operation(cluster):
    """Puts to a channel without a count bound do not wait for their answer; one that timed out waiting for
    room under max_bytes is an error at that handle's next operation, never a silently dropped item."""
    ch = rlnb.Channel.create(cluster, "bytes-only", max_bytes=1 << 20, timeout_s=30)
    try:
        ch.put(torch.ones(150_000))
        ch.put(torch.ones(150_000), timeout=1.0)  # returns at once; held on the worker, then times out
        with pytest.raises(rlnb.errors.ChannelTimeoutError, match="an earlier put waited past its timeout"):
            ch.qsize()
        assert ch.qsize() == 1 and ch.get(timeout=10).numel() == 150_000
    finally:
        ch.close()


def test_the_shared_memory_pool_gives_memory_back_after_a_channel_is_drained(cluster, monkeypatch):
    """514 MiB of /dev/shm used to stay in a producer's pool after its channel was drained."""
    import time

    from rlnb.runtime import shm

    monkeypatch.setattr(shm, "TRIM_IDLE_S", 0.5)
    monkeypatch.setattr(shm, "POOL_KEEP_BYTES", 8 << 20)
    # timers armed by earlier tests wait the default 10 s: start afresh with this test's figures
    with shm._POOL._lock:
        if shm._POOL._timer is not None:
            shm._POOL._timer.cancel()
            shm._POOL._timer = None
    if shm._READ_TIMER[0] is not None:
        shm._READ_TIMER[0].cancel()
        shm._READ_TIMER[0] = None

    def mine() -> int:  # bytes of this process's segments in /dev/shm
        prefix, d, total = f"{shm.SHM_PREFIX}{os.getpid()}-", shm._shm_dir(), 0
        for name in os.listdir(d):
            if name.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):  # (removed by the trim meanwhile)
                    total += os.path.getsize(os.path.join(d, name))
        return total

    ch = rlnb.Channel.create(cluster, "drained", max_bytes=0)
    try:
        for _ in range(12):  # 12 x 16 MiB queued at once: the pool grows to hold them
            ch.put(torch.ones(4 << 20))
        assert mine() >= 12 * (16 << 20)
        for got in ch.get_batch(12, timeout=60):
            assert got[0] == 1.0
        del got
        import gc

        gc.collect()  # (the tensors read are freed: their segments are free again)
        deadline = time.time() + 10
        while mine() > (8 << 20) + (32 << 20) and time.time() < deadline:
            time.sleep(0.2)
        assert mine() <= (8 << 20) + (32 << 20), mine()  # what the pool keeps (segments are powers of two)
        time.sleep(1.5)
        assert not [p for p in shm._READ_MAPS if not os.path.exists(p)]  # the reader let go of removed ones
        ch.put(torch.ones(4 << 20))  # and the pool works on
        assert ch.get(timeout=30)[0] == 1.0
    finally:
        ch.close()


def test_a_run_in_another_process_holds_its_directory(tmp_path):
    """The lock is the kernel's: another process's run into the directory is refused naming it, and once that
    process is gone (killed: it left its lock file) the directory is free again."""
    import signal
    import subprocess
    import sys
    import time

    from rlnb.errors import ConfigError
    from rlnb.loop.run_dir import RunDirLock

    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom pathlib import Path\nfrom rlnb.loop.run_dir import RunDirLock\n"
        "RunDirLock(Path(sys.argv[1])); print('locked', flush=True); time.sleep(60)")
        , str(tmp_path)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(
            ConfigError, match=rf"in use by another run \(pid {holder.pid} on .* since .*wait for it"
        ):
            RunDirLock(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    time.sleep(0.1)
    assert (tmp_path / ".lock").exists()  # left by the killed holder, unlocked
    lock = RunDirLock(tmp_path)
    lock.release()
    assert not (tmp_path / ".lock").exists()


def test_an_env_state_of_the_older_pickled_format_is_refused_saying_why():
    env = rlnb.Env(make_env="CartPole-v1", num_envs=2)
    try:
        old = {**env.state_dict(), "envs": b"\x80\x05N."}
        del old["env_state"]
        with pytest.raises(ValueError, match="written by an older rlnb, which pickled the envs"):
            env.load_state_dict(old)
    finally:
        env.close()
