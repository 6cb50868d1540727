import contextlib
import glob
import multiprocessing.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# a torch thread per process (what the components' torch_threads default to, the driver too): two test processes
# side by side on 2 cores, each spinning a thread per core, slowed the suite ~15 % more under another program's load
os.environ.setdefault("OMP_NUM_THREADS", "1")
# this session's own temporary directory: whatever the tests start (workers, kernels, CLI runs) makes its
# temporary files there, so a check for leftovers looks at what this session made, not at other programs' /tmp
# (pytest's own tmp_path directories stay where they were: paths under them must stay short enough for the Unix
# sockets a test's processes make there)
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
SESSION_TMP = tempfile.mkdtemp(prefix="rlnbt-")
os.environ["TMPDIR"] = SESSION_TMP
tempfile.tempdir = None  # (gettempdir() reads TMPDIR again)
# removed at exit after multiprocessing's own temporary directory inside it (its finalizer has priority -100)
multiprocessing.util.Finalize(
    None, shutil.rmtree, args=(SESSION_TMP,), kwargs={"ignore_errors": True}, exitpriority=-101
)


# the fast subset (`make test-fast`, `pytest -m "not slow"`): everything but these modules and tests, which take
# ~10 s or more each (whole notebooks, a browser, training runs to a documented threshold, compiling)
SLOW_MODULES = {"test_browser", "test_notebooks", "test_headlines", "test_sweep", "test_hosts", "test_vllm"}
SLOW_TESTS = {
    "test_the_calculator_on_the_objects_path_trains_on_tool_transcripts_on_workers",
    "test_the_compiled_step_runs_on_the_worker_and_trains_as_eager_does",
    "test_the_lm_actor_compiles_its_step_on_the_worker_and_trains_as_eager_does",
    "test_command_line_cluster_check_runs_ppo_and_grpo",
    "test_bf16_grpo_learns_on_workers_and_logs_memory",
    "test_a_hub_id_is_never_replaced_by_a_random_model",
    "test_rlnb_eval_and_rlnb_export_work_from_a_runs_latest_checkpoint",
    "test_env_policy_advantage_and_reward_defined_in_main_train_on_workers",
    "test_async_grpo_generates_through_weight_updates_within_the_bound_and_learns",
    "test_killed_driver_resumes_with_identical_metrics",
    "test_grpo_with_a_retry_raises_the_final_answers_reward_on_workers",
    "test_a_policy_class_from_a_scripts_main_is_exported_with_its_code_and_loads_in_another_process",
    "test_grpo_through_the_cli_with_two_rewards_shows_rlnb_progress_only",
    "test_asynchronous_grpo_with_a_retry_raises_the_final_answers_reward_on_workers",
    "test_a_killed_async_grpo_run_resumes_without_training_a_problem_twice_or_skipping_one",
    "test_ppo_steps_a_maniskill_task_from_camera_images_and_state_on_the_workers",
    "test_ppo_learns_to_push_a_cube_on_maniskills_cpu_simulation_on_the_workers",
    "test_a_resumed_maniskill_run_continues_its_episodes_on_the_cpu_simulation",
    "test_the_libero_tests_run_in_the_environment_that_has_libero",
    "test_rlnb_run_vla_maniskill_warm_starts_on_the_scripted_expert_and_trains_from_the_command_line",
    "test_a_detached_run_outlives_its_kernel_and_is_attached_steered_listed_and_stopped_from_elsewhere",
    "test_a_worker_killed_mid_collection_has_its_share_collected_again_and_its_replacement_joins",
    "test_a_retired_worker_leaves_between_steps_and_a_worker_added_later_joins_on_a_new_slot",
}


# a notebook the browser tests open in JupyterLab, not one to run as a test (under --nbmake)
collect_ignore = ["browser"]

# the files that take longest as a whole go first: run side by side (make test: pytest-xdist, whole files to a
# process, the notebooks too), the suite's end then waits on no one of them alone
FIRST = (
    "test_vllm",
    "02_grpo_arithmetic",
    "test_browser",
    "test_lm_modes",
    "test_tools",
    "07_async_steering_mujoco",
    "test_precision",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(item.path).parent.name == "tests" and (
            item.path.stem in SLOW_MODULES or getattr(item, "originalname", None) in SLOW_TESTS
        ):
            item.add_marker(pytest.mark.slow)
    order = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: order.get(item.path.stem, len(FIRST)))  # (stable)


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


requires_gpu = pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU; this machine has none")


def set_spaces(vector_env, num_envs: int) -> None:
    """Give a test's own ``gymnasium.vector.VectorEnv`` its spaces: ``num_envs`` observations of 2 floats,
    actions ``Discrete(2)``."""
    import gymnasium as gym
    import numpy as np

    vector_env.num_envs = num_envs
    vector_env.single_observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
    vector_env.single_action_space = gym.spaces.Discrete(2)
    vector_env.observation_space = gym.vector.utils.batch_space(vector_env.single_observation_space, num_envs)
    vector_env.action_space = gym.vector.utils.batch_space(vector_env.single_action_space, num_envs)


WALL_CLOCK = ("wall_time", "rollout/steps_per_s", "rollout/tokens_per_s", "rollout/overlap_frac")


def without_wall_clock(record: dict) -> dict:
    """A metric record without wall-clock quantities (they differ run to run; everything else must not)."""
    return {k: v for k, v in record.items() if not k.startswith("time/") and k not in WALL_CLOCK}


def assert_resume_is_exact(
    recipe: str, overrides: list[str], cluster, tmp_path, cut_at: int = 2, tolerance: float = 0.0
) -> None:
    """A run of ``recipe`` cut after ``cut_at`` steps and resumed logs what the uncut run logged after them,
    wall-clock figures aside (``overrides`` must save a checkpoint at ``cut_at``): the same keys, each value
    the same (or within ``tolerance``, absolute and relative, for a simulator whose state API leaves solver
    caches out)."""
    from rlnb.loop import Loop

    with Loop.from_recipe(recipe, overrides, cluster=cluster, run_dir=tmp_path / "full") as loop:
        full = [without_wall_clock(r) for r in loop.run(progress=False)]
    with Loop.from_recipe(recipe, overrides, cluster=cluster, run_dir=tmp_path / "cut") as loop:
        loop.run(cut_at, progress=False)
    with Loop.resume(tmp_path / "cut", cluster=cluster) as loop:
        resumed = [without_wall_clock(r) for r in loop.run(progress=False)]
    if not tolerance:
        assert resumed == full[cut_at:]
        return
    assert [sorted(r) for r in resumed] == [sorted(r) for r in full[cut_at:]], (resumed, full[cut_at:])
    for got, want in zip(resumed, full[cut_at:]):
        for k, v in want.items():
            same = got[k] == v or (isinstance(v, float) and abs(got[k] - v) <= tolerance * (1 + abs(v)))
            assert same, (k, got[k], v)


@pytest.fixture(scope="session")
def cluster():
    """One embedded 2-slot CPU cluster shared by the runtime tests that do not break it."""
    import rlnb

    c = rlnb.Cluster(slots=2, gpus=False)
    yield c
    c.close()


KILLED_DRIVER = """
import os, signal, sys
import rlnb
from rlnb.loop import {loop}

address, credentials, run_dir, kill_at, overrides = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:]
with rlnb.Cluster(address, security=credentials) as cluster:
    with {loop}.from_recipe("{recipe}", overrides, cluster=cluster, run_dir=run_dir) as loop:
        calls = [0]

        def wrap(name):
            phase = getattr(loop, name)

            def counted(*args, **kwargs):
                calls[0] += 1
                if calls[0] == kill_at:  # the driver dies here, inside a step, work in flight
                    os.kill(os.getpid(), signal.SIGKILL)
                return phase(*args, **kwargs)

            setattr(loop, name, counted)

        for name in ("sync_weights", "rollout", "advantages", "train"):
            wrap(name)
        loop.run(progress=False)
"""
PHASES_PER_STEP = 4  # sync_weights, rollout, advantages, train


def kill_driver_inside_a_step(
    cluster,
    loop: str,
    recipe: str,
    overrides,
    run_dir: Path,
    save_interval: int,
    seed: int = 0,
    timeout_s=180,
) -> tuple[int, int, str]:
    """Run ``recipe`` with ``loop`` in a driver process on ``cluster`` and SIGKILL it inside a step chosen
    by ``seed``: just before the rollout, advantages or train phase of one of the steps after the first
    checkpoint (``save_interval``) and up to the second. Returns ``(step of the last complete checkpoint,
    the step killed in, the phase it was about to run)``; the checkpoint is always ``save_interval``'s."""
    import random

    from rlnb.loop import complete_checkpoints

    rng = random.Random(seed)
    step = rng.randrange(save_interval + 1, 2 * save_interval + 1)
    offset = rng.randrange(2, PHASES_PER_STEP + 1)  # rollout, advantages or train: inside the step
    kill_at = PHASES_PER_STEP * (step - 1) + offset
    script = run_dir.parent / f"{run_dir.name}-driver.py"
    script.write_text(KILLED_DRIVER.format(loop=loop, recipe=recipe))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    credentials = cluster.save_credentials(run_dir.parent / f"{run_dir.name}-credentials")  # (its TLS)
    driver = subprocess.Popen(
        [
            sys.executable,
            str(script),
            cluster.address,
            str(credentials),
            str(run_dir),
            str(kill_at),
            *overrides,
        ],
        env=env,
    )
    try:
        code = driver.wait(timeout_s)
    except subprocess.TimeoutExpired:
        driver.kill()
        raise
    assert code == -signal.SIGKILL, f"the driver was not killed at phase {kill_at} (exit code {code})"
    phase = ("sync_weights", "rollout", "advantages", "train")[offset - 1]
    return int(complete_checkpoints(run_dir)[-1].name.split("_")[1]), step, phase


RUNS = Path(__file__).resolve().parents[1] / "runs"
RUNS_BEFORE = set(RUNS.glob("*")) if RUNS.is_dir() else set()  # (a user's runs there stay)


def mapped_semaphores(pids) -> set[str]:
    """The named semaphores (``/dev/shm/sem.*``) the processes ``pids`` have open (mapped), matched by inode: the
    process that creates one maps glibc's temporary file, linked to the name afterwards, so its maps line names
    the temporary file, deleted."""
    inodes = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                # (address, perms, offset, device, inode, path)
                inodes.update(int(line.split()[4]) for line in f if "/dev/shm/" in line)
        except OSError:  # it ended meanwhile
            continue
    found = set()
    for path in glob.glob("/dev/shm/sem.*"):
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino in inodes:
                found.add(path)
    return found


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (zombies left out)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def kill_group(pgid: int) -> None:
    """SIGKILL the process group ``pgid`` (a driver the test started in a session of its own, its fork server,
    workers and resource tracker), then unlink the named semaphores its processes held and no process holds now:
    its resource tracker, killed with it, cannot. Nothing another program made is touched."""
    held = mapped_semaphores(group_members(pgid))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    others = mapped_semaphores(int(p.name) for p in Path("/proc").glob("[0-9]*"))
    for path in held - others:
        with contextlib.suppress(OSError):
            os.unlink(path)


def pytest_sessionfinish(session, exitstatus):
    """Remove shared-memory segments of processes the tests SIGKILLed (drivers, workers): a killed process
    cannot unlink its own, and workers sweep them only when the next one starts. (Named semaphores of a killed
    group go with it: :func:`kill_group`.)"""
    from rlnb.runtime.shm import sweep_dead_segments

    sweep_dead_segments()
    _remove_default_run_dirs()


def _remove_default_run_dirs() -> None:
    """The run directories that loops built here without a ``run_dir`` wrote under the checkout's ``runs/``
    (``<name>-<YYYYmmdd-HHMMSS>-<4 hex>``, made during this session): the suite leaves the checkout as it
    found it (``runs/models``, the built models the tests share, stays)."""
    import re

    for path in set(RUNS.glob("*-*-*-*")) - RUNS_BEFORE if RUNS.is_dir() else ():
        if path.is_dir() and re.fullmatch(r".+-\d{8}-\d{6}-[0-9a-f]{4}", path.name):
            shutil.rmtree(path, ignore_errors=True)


def last_answer(completion: str, answer: str) -> float:
    """A multi-turn arithmetic reward: 1.0 if the transcript's last answer (after its last `` no. ``) is right."""
    from rlnb.algorithms.rewards import arithmetic_reward

    return arithmetic_reward(completion.rsplit(" no. ", 1)[-1], answer)


def collocated_loop(
    cluster, run_dir, rollout_cls=None, actor_cls=None, steps=2, steps_per_rollout=16, **actor
):
    """A PPO loop built from objects on slot 0: CartPole (4 envs), a rollout and an actor of the given classes
    (the built-ins by default; ``actor`` are the actor's settings), ``steps`` steps, no TensorBoard."""
    import rlnb
    from rlnb.loop import Loop

    env = rlnb.Env.launch(cluster, "0", make_env="CartPole-v1", num_envs=4)
    rollout = rlnb.launch(rollout_cls or rlnb.PolicyRollout, cluster, "0", name="rollout")
    actor = rlnb.launch(actor_cls or rlnb.PPOActor, cluster, "0", name="actor", **actor)
    runner = {"tensorboard": False, "steps": steps}
    return Loop(
        env=env,
        rollout=rollout,
        actor=actor,
        steps_per_rollout=steps_per_rollout,
        runner=runner,
        run_dir=run_dir,
    )


def assert_metrics_documented(run_dir) -> None:
    """Every key a run logged is explained in the metrics glossary (rlnb.metrics.GLOSSARY)."""
    import json

    from rlnb.metrics import undocumented

    keys = set()
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        keys |= set(json.loads(line))
    assert keys and not undocumented(keys), f"metrics missing from the glossary: {undocumented(keys)}"
