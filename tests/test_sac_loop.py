"""SAC's family under the composed loop (issue 56): it learns Pendulum on workers synchronously (and with the
collectors apart, running a batch ahead: notebooks/10_off_policy_sac.ipynb, whose checks the test command runs);
a killed run resumes exactly, its buffer included; the objects path, the CLI and the recipe checks."""

import re
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import rlnb
from rlnb.config import load_recipe
from rlnb.errors import ConfigError, PlacementError
from rlnb.loop import Callback, SACLoop, complete_checkpoints
from tests.conftest import assert_metrics_documented, kill_driver_inside_a_step, without_wall_clock

QUIET = ["runner.tensorboard=false", "runner.eval_interval=0"]
TOGETHER = "cluster.component_placement={'env,rollout,actor,buffer': 0}"
# small and quick: 16-wide networks, updates from the 128th transition on
SMALL = [
    *QUIET,
    "sac.hidden_sizes=[16,16]",
    "sac.learning_starts=128",
    "sac.batch_size=64",
    "rollout.steps_per_rollout=8",
]


def _learns(loop) -> tuple[float, float]:
    """Evaluation returns before training (an untrained policy's mean action) and after ``run()``."""
    before = loop.evaluate(4)["eval/return_mean"]
    loop.run(progress=False)
    return before, loop.evaluate(4)["eval/return_mean"]


def test_sac_learns_pendulum_on_a_worker_one_phase_after_another(cluster, tmp_path):
    """Everything on one slot, synchronous: 4,000 env steps, one update each (seen: -1252 -> -147), with the
    recipe's fused update (autograd's learns in tests/test_sac.py, the same update: a test there holds them equal)."""
    overrides = [*QUIET, TOGETHER, "algorithm.max_staleness=0", "runner.steps=50", "runner.stop_return=null"]
    with SACLoop.from_recipe("sac_pendulum", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        assert type(loop.schedule).__name__ == "Sync" and loop.weight_sync == "local"
        assert loop.recipe.sac.kernel == "fused"
        before, after = _learns(loop)
        assert after > before + 500, (before, after)
        last = next(
            r for r in reversed(loop.history) if "train/updates_total" in r
        )  # (the evaluation's after it)
        assert last["train/updates_total"] == 4000 - 1000  # one a transition, after the 1,000 of the warm-up
        assert last["buffer/size"] == 4000 and last["train/alpha"] < 1.0
        assert len(loop.buffer) == 4000
    assert_metrics_documented(tmp_path)


def test_a_killed_sac_run_resumes_exactly_its_buffer_included(cluster, tmp_path):
    """SIGKILL of the driver inside a step after the checkpoint at step 3: the resumed run logs what the uncut one
    logged, update for update (the buffer's transitions, its sampler and the collectors' RNGs were saved)."""
    base = [*SMALL, "runner.steps=9", "runner.save_interval=3"]
    with SACLoop.from_recipe("sac_pendulum", base, cluster=cluster, run_dir=tmp_path / "full") as loop:
        full = [without_wall_clock(r) for r in loop.run(progress=False)]
    assert full[-1]["train/updates"] > 0  # (the cut falls where the learner trains)
    cut = tmp_path / "cut"
    saved, step, phase = kill_driver_inside_a_step(
        cluster, "SACLoop", "sac_pendulum", base, cut, 3, timeout_s=180
    )
    assert saved == 3 and 4 <= step <= 6, (saved, step, phase)
    with SACLoop.resume(cut, cluster=cluster) as loop:
        assert loop.step == 3 and len(loop.buffer) == 3 * 32
        resumed = [without_wall_clock(r) for r in loop.run(progress=False)]
    assert resumed == full[3:]


class _StopAt(Callback):
    def on_step(self, loop, record):
        if loop.step == 3:
            loop.stop()  # as the dashboard's stop button, or the CLI on a signal


def test_a_sac_run_stopped_with_a_batch_in_flight_resumes_exactly(cluster, tmp_path):
    """Stopped between checkpoints, the collectors' next batch is in flight: the checkpoint keeps it (numpy
    transitions, read back without running code) and the resumed run trains on it as the uncut one did."""
    base = [*SMALL, "runner.steps=6"]
    with SACLoop.from_recipe("sac_pendulum", base, cluster=cluster, run_dir=tmp_path / "full") as loop:
        full = [without_wall_clock(r) for r in loop.run(progress=False)]
    with SACLoop.from_recipe("sac_pendulum", base, cluster=cluster, run_dir=tmp_path / "cut") as loop:
        loop.run(progress=False, callbacks=[_StopAt()])
        assert loop.step == 3 and loop.rollout_status()["in_flight"]
        assert (loop.save() / "in_flight.pt").is_file()
    with SACLoop.resume(tmp_path / "cut", cluster=cluster) as loop:
        assert loop.rollout_status()["in_flight"]
        resumed = [without_wall_clock(r) for r in loop.run(progress=False)]
    assert resumed == full[3:]


def test_a_buffer_left_out_of_checkpoints_is_refilled_after_a_resume(cluster, tmp_path):
    base = [*SMALL, TOGETHER, "algorithm.max_staleness=0", "runner.steps=6", "runner.save_interval=6",
            "buffer.in_checkpoint=false"]  # fmt: skip
    with SACLoop.from_recipe("sac_pendulum", base, cluster=cluster, run_dir=tmp_path) as loop:
        loop.run(progress=False)
        assert len(loop.buffer) == 6 * 32
    kept = {p.name: p.stat().st_size for p in complete_checkpoints(tmp_path)[-1].rglob("*buffer*")}
    assert kept and max(kept.values()) < 4096, kept  # no transitions in it
    with SACLoop.resume(tmp_path, cluster=cluster, overrides=["runner.steps=12"]) as loop:
        assert len(loop.buffer) == 0
        records = loop.run(progress=False)
    # refilled: no updates until the buffer holds sac.learning_starts=128 transitions again (4 steps of 32)
    assert [r["train/updates"] for r in records[:4]] == [0, 0, 0, 0] and records[4]["train/updates"] == 32


def test_a_sac_loop_from_objects_records_its_recipe_and_shows_its_buffer(cluster, tmp_path):
    from rlnb import Env, ReplayBuffer
    from rlnb.components import SACActor, SACCollector

    spaces = gym.make("Pendulum-v1")
    env = Env.launch(cluster, "0", make_env="Pendulum-v1", num_envs=2)
    rollout = SACCollector.launch(cluster, "0", hidden_sizes=(16, 16), random_steps=64)
    buffer = ReplayBuffer.launch(cluster, "1", obs_space=spaces.observation_space,
                                 action_space=spaces.action_space, capacity=1000, num_envs=2)  # fmt: skip
    actor = SACActor.launch(cluster, "1", hidden_sizes=(16, 16), batch_size=32, learning_starts=64)
    runner = {"steps": 4, "tensorboard": False}
    with SACLoop(env=env, rollout=rollout, buffer=buffer, actor=actor, steps_per_rollout=16, runner=runner,
                 max_staleness=1, run_dir=tmp_path) as loop:  # fmt: skip
        records = loop.run(progress=False)
        assert [r["buffer/size"] for r in records] == [32, 64, 96, 128]
        assert [r["train/updates"] for r in records] == [0, 0, 32, 32]
        assert loop.recipe.sac.batch_size == 32 and loop.recipe.buffer.capacity == 1000
        seen = loop.buffer.sample(5)
        assert seen["obs"].shape == (5, 3) and seen["actions"].shape == (5, 1)
        assert np.array_equal(loop.buffer.sample(5)["rewards"], seen["rewards"])  # (its own generator)
        assert "128 of 1,000 transitions" in repr(loop.buffer)
        # the export rebuilds the learner's networks from what the loop recorded of it (16-wide, not the default)
        assert rlnb.load_policy(loop.export()).module.config == {"hidden_sizes": [16, 16]}
    recorded = load_recipe(tmp_path / "recipe.yaml")
    assert recorded.family == "sac" and recorded.sac.learning_starts == 64


def test_discrete_sac_runs_cartpole_through_the_loop(cluster, tmp_path):
    overrides = [*SMALL, TOGETHER, "algorithm.max_staleness=0", "env.id=CartPole-v1", "sac.kernel=autograd", "runner.steps=6",
                 "runner.stop_return=null"]  # fmt: skip
    with SACLoop.from_recipe("sac_pendulum", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        records = loop.run(progress=False)
        assert records[-1]["train/updates"] > 0 and np.isfinite(records[-1]["train/q_loss"])
        shown = loop.evaluate(2)
        assert shown["eval/len_mean"] >= 8
        # the export plays the learner's policy in this process: the loop's evaluation on the same seeds, and the
        # collectors' greedy actions
        policy = rlnb.load_policy(loop.export())
        assert (
            policy.evaluate(episodes=2, seed=loop.recipe.seed + 1_000_003)["return_mean"]
            == shown["eval/return_mean"]
        )
        obs = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
        greedy = loop.groups["rollout"].on(0).actions(obs, deterministic=True).result()[0]
        assert (policy.predict(obs) == greedy).all() and "TrainedPolicy(SACPolicy, step 6" in repr(policy)


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (["sac.utd_ratio=0"], ConfigError, r"sac.utd_ratio: expected a number in \(0, 1000\].*got 0"),
        (["sac.utd_ratio=-1"], ConfigError, r"sac.utd_ratio: expected .*got -1"),
        (
            ["sac.batch_size=2048"],
            ConfigError,
            r"sac.batch_size: 2048 transitions a batch, more than the sac.learning_starts=1000",
        ),
        (
            ["sac.variant=discrete"],
            ConfigError,
            r"sac.variant: discrete SAC picks one of K actions, and this env's actions are Box",
        ),
        (
            ["sac.variant=continuous", "env.id=CartPole-v1"],
            ConfigError,
            r"sac.variant: continuous SAC .* Discrete\(2\)",
        ),
        (
            ["buffer.capacity=1000000000000"],
            PlacementError,
            r"buffer.capacity: 1,000,000,000,000 transitions of \d+ bytes take .* GiB, more than the .* GiB",
        ),
        (
            ["env.id=CartPole-v1"],
            ConfigError,
            r"sac.kernel: the fused update is written for continuous actions, and this env's are Discrete\(2\)",
        ),
        (["sac.kernel=jit"], ConfigError, r"sac.kernel"),
        (["actor.lr=0.01"], ConfigError, r"actor.lr: family sac does not read it .*sac.lr"),
        (["env.normalize_obs=true"], ConfigError, r"env.normalize_obs: the replay buffer keeps transitions"),
        (["env.id=rlnb/PixelReach-v0"], ConfigError, r"env.id: SAC's MLPs take flat vector observations"),
        (
            ["cluster.component_placement={'env,rollout,actor': 0, buffer: 1}"],
            PlacementError,
            r"buffer \[1\] and actor \[0\] must share their slots in family sac",
        ),
        (
            ["cluster.component_placement={'env,rollout': 0, 'actor,buffer': '0-1'}"],
            PlacementError,
            r"SAC's learner trains on one rank, got 2 actor slots",
        ),
    ],
)
def test_sac_recipes_that_cannot_run_are_refused_naming_the_key_before_launch(
    cluster, overrides, error, match
):
    with pytest.raises(error, match=match):
        SACLoop(load_recipe("sac_pendulum", [*QUIET, *overrides]), cluster=cluster)


def test_the_ppo_family_refuses_sac_sections():
    with pytest.raises(ConfigError, match=r"buffer.capacity: the buffer section is read by family sac only"):
        load_recipe("ppo_cartpole", ["buffer.capacity=10"])


def test_rlnb_run_sac_mujoco_from_the_cli(tmp_path):
    """The MuJoCo recipe, made short, from the command line (HalfCheetah's 17 observations, 6 actions)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlnb.cli", "run", "sac_mujoco", "runner.steps=4", "runner.eval_interval=2",
           "runner.save_interval=4", "runner.eval_episodes=1", "sac.learning_starts=256", "sac.hidden_sizes=[32,32]", "runner.tensorboard=false",
           f"runner.run_dir={run_dir}"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 4, 400 env steps" in out.stdout + out.stderr, out.stdout[-2000:]
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step_000004"]
    assert_metrics_documented(run_dir)
    cli = [sys.executable, "-m", "rlnb.cli"]
    out = subprocess.run([*cli, "eval", str(run_dir)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "at step 4: eval/return_mean=" in out.stdout, (
        out.stdout + out.stderr[-2000:]
    )
    shown = float(re.search(r"eval/return_mean=(-?[0-9.]+)", out.stdout)[1])
    out = subprocess.run([*cli, "export", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert (
        out.returncode == 0 and f"at step 4 to {run_dir / 'policy.pt'} (no cluster started)" in out.stdout
    ), out.stdout + out.stderr[-2000:]
    # the file plays the checkpoint's policy: its evaluation on the loop's seeds is the one rlnb eval printed
    policy = rlnb.load_policy(run_dir / "policy.pt")
    seed = load_recipe(run_dir / "recipe.yaml").seed + 1_000_003
    assert policy.evaluate(episodes=1, seed=seed)["return_mean"] == pytest.approx(shown, abs=0.01)
    assert policy.predict(np.zeros(17, np.float32)).shape == (6,)
    steps = policy.inspect_episode(max_steps=5)
    assert len(steps) == 5 and np.isfinite(steps["value"]).all() and np.isfinite(steps["logprob"]).all()
