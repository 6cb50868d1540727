"""Seeded PPO runs on real clusters: learning thresholds per placement, determinism, exact resume."""

import copy
import json
import time

import gymnasium as gym
import numpy as np
import pytest
import torch

import rlnb
from rlnb.config import load_recipe
from rlnb.errors import ConfigError, PlacementError
from rlnb.loop import Loop, complete_checkpoints
from rlnb.metrics import read_metrics
from tests.conftest import assert_metrics_documented, collocated_loop, set_spaces, without_wall_clock

FAST = [
    "runner.stop_return=195",
    "runner.tensorboard=false",
]  # the recipe's lr schedule; stop at the threshold


def test_collocated_cartpole_learns(cluster, tmp_path):
    with Loop.from_recipe("ppo_cartpole", FAST, cluster=cluster, run_dir=tmp_path) as loop:
        assert loop.mode == "collocated"
        loop.run(progress=False)
        ret = loop.episode_stats()["episode_return_mean"]
        assert ret >= 195, f"mean return of the last 20 episodes {ret} after {loop.step} steps"
        ev = loop.evaluate(5)
        assert ev["eval/return_mean"] >= 150
    records = read_metrics(tmp_path)
    keys = set(records[0])
    for k in (
        "env/episode_return_mean",
        "env/episode_len_mean",
        "train/policy_loss",
        "train/value_loss",
        "train/approx_kl",
        "train/clip_frac",
        "rollout/steps_per_s",
        "time/rollout_s",
        "time/train_s",
        "time/step_s",
    ):
        assert k in keys, k
    assert records[-1]["eval/return_mean"] == ev["eval/return_mean"]
    assert_metrics_documented(tmp_path)  # every logged key is in the metrics glossary
    for r in records[1:-1]:  # the work, timed on the worker, fits inside the step; the rest is overhead
        work = ("time/env_s", "time/inference_s", "time/advantages_compute_s", "time/train_compute_s")
        assert all(r[k] > 0 for k in work) and sum(r[k] for k in work) < r["time/step_s"], r
        assert 0 < r["time/overhead_frac"] < 1
    assert (tmp_path / "recipe.yaml").exists()


def test_disaggregated_cartpole_learns(tmp_path):
    overrides = [*FAST, "cluster.component_placement={env: 0, rollout: 1, actor: 2}"]
    with (
        rlnb.Cluster(slots=3, gpus=False) as cluster,
        Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop,
    ):
        assert loop.mode == "disaggregated"
        assert set(loop.channels) == {"obs", "actions", "batches", "weights"}
        loop.run(progress=False)
        assert loop.episode_stats()["episode_return_mean"] >= 195


def test_collocated_data_parallel_actor_with_two_stages(cluster, tmp_path):
    overrides = [
        "runner.steps=3", "runner.tensorboard=false", "env.pipeline_stages=2",
        "cluster.component_placement={actor: 0-1, rollout: 0-1, env: 1}",
    ]  # fmt: skip
    with pytest.raises(
        PlacementError, match="1 env rank\\(s\\) cannot be shared evenly by 2 rollout rank\\(s\\)"
    ):
        Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path)
    overrides[-1] = "cluster.component_placement={'actor,rollout': 0-1, env: 0-1}"
    with Loop.from_recipe(
        "ppo_cartpole", [*overrides, "env.num_envs=4"], cluster=cluster, run_dir=tmp_path
    ) as loop:
        loop.run(progress=False)
        assert loop.step == 3
        # DDP keeps the two actor ranks' weights identical after training
        a0, a1 = (
            torch.cat([p.flatten() for p in sd.values()])
            for sd in loop.groups["actor"].policy_state().result()
        )
        assert torch.equal(a0, a1)


def test_hybrid_pipeline_through_channels(tmp_path):
    overrides = [
        "runner.steps=4", "runner.tensorboard=false", "env.pipeline_stages=2",
        "cluster.component_placement={'actor,rollout': 0, env: 1}",
    ]  # fmt: skip
    with (
        rlnb.Cluster(slots=2, gpus=False) as cluster,
        Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop,
    ):
        assert loop.mode == "hybrid" and set(loop.channels) == {"obs", "actions"}
        recs = loop.run(progress=False)
        assert [r["global_step"] for r in recs] == [256, 512, 768, 1024]
        sample = loop.sample(2)
        assert sample["obs"].shape == (2, 8, 4) and sample["rewards"].shape == (2, 8)


def test_same_seed_same_metrics(cluster, tmp_path):
    runs = []
    for i in range(2):
        with Loop.from_recipe(
            "ppo_cartpole",
            ["runner.steps=3", "runner.tensorboard=false"],
            cluster=cluster,
            run_dir=tmp_path / str(i),
        ) as loop:
            runs.append([without_wall_clock(r) for r in loop.run(progress=False)])
    assert runs[0] == runs[1]
    with Loop.from_recipe(
        "ppo_cartpole",
        ["runner.steps=3", "seed=2", "runner.tensorboard=false"],
        cluster=cluster,
        run_dir=tmp_path / "s2",
    ) as loop:
        other = [without_wall_clock(r) for r in loop.run(progress=False)]
    assert other != runs[0]


@pytest.mark.parametrize("env_id", ["CartPole-v1", "rlnb/TorchCartPole-v1"])
def test_resume_reproduces_the_uninterrupted_run(cluster, tmp_path, env_id):
    """Also for a simulator that cannot be pickled (TorchCartPole, like ManiSkill's GPU simulator): its
    checkpoint goes through its own state_dict()."""
    base = ["runner.steps=4", "runner.save_interval=2", "runner.tensorboard=false", f"env.id={env_id}"]
    with Loop.from_recipe("ppo_cartpole", base, cluster=cluster, run_dir=tmp_path / "full") as loop:
        full = [without_wall_clock(r) for r in loop.run(progress=False)]
    assert [p.name for p in complete_checkpoints(tmp_path / "full")] == ["step_000002", "step_000004"]
    # a second run stops after its step-2 checkpoint, then resumes in a fresh Loop
    with Loop.from_recipe("ppo_cartpole", base, cluster=cluster, run_dir=tmp_path / "cut") as loop:
        loop.run(2, progress=False)
    with Loop.resume(tmp_path / "cut", cluster=cluster) as loop:
        assert loop.step == 2
        resumed = [without_wall_clock(r) for r in loop.run(progress=False)]
    assert resumed == full[2:]
    lines = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]


def test_bad_placement_fails_before_any_worker_starts():
    recipe = load_recipe(
        "ppo_cartpole", ["cluster.slots=2", "cluster.component_placement={'actor,rollout,env': 0-3}"]
    )
    with pytest.raises(
        PlacementError, match=r"component_placement.actor,rollout,env: slot 2 in '0-3' is beyond the cluster"
    ):
        Loop(recipe)  # no cluster was given: the placement is checked before one is started


def test_weights_by_broadcast_over_a_process_group(cluster, tmp_path):
    """rollout.weight_sync=broadcast: actor rank 0 sends the weights to the rollout ranks in one collective
    (gloo here, NCCL between GPUs): no weights channel, the rollout holds the actor's weights after each
    sync, and the policy learns."""
    overrides = [
        *FAST,
        "rollout.weight_sync=broadcast",
        "cluster.component_placement={'env,rollout': 0, actor: 1}",
    ]
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        assert loop.weight_sync == "broadcast" and "weights" not in loop.channels
        loop.run(steps=40, progress=False)
        loop.sync_weights()
        actor = loop.groups["actor"].on(0).policy_state().result()[0]
        rollout = loop.groups["rollout"].state_dict().result()[0]["policy"]
        assert actor.keys() == rollout.keys()
        assert all(torch.equal(actor[k], rollout[k]) for k in actor)
        assert loop.episode_stats()["episode_return_mean"] >= 100


def test_weight_sync_choices_are_checked_before_anything_starts(cluster, tmp_path):
    base = ["rollout.weight_sync=broadcast"]
    with pytest.raises(
        rlnb.ConfigError, match=r"rollout.weight_sync=broadcast is a collective .*max_staleness=1"
    ):
        Loop.from_recipe(
            "ppo_cartpole",
            [*base, "algorithm.max_staleness=1", "cluster.component_placement={'env,rollout': 0, actor: 1}"],
            cluster=cluster,
        )
    with pytest.raises(PlacementError, match=r"rollout slot\(s\) \[0\] share its worker") as e:
        Loop.from_recipe(
            "ppo_cartpole",
            [*base, "cluster.component_placement={'env,rollout': 0, actor: 0-1}"],
            cluster=cluster,
        )
    assert e.value.key == "rollout.weight_sync"
    # auto picks the channel on one node (CUDA IPC between GPUs, shared memory between CPU workers)
    overrides = ["runner.steps=1", "cluster.component_placement={'env,rollout': 0, actor: 1}"]
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        assert loop.weight_sync == "channel" and "weights" in loop.channels


def test_a_torch_batched_env_learns_with_observations_kept_as_device_tensors(cluster, tmp_path):
    """rlnb/TorchCartPole-v1 returns torch tensors (on its device: `cuda` in `make gpu-check`); the Env
    normalises them in torch and the rollout's batch holds them as they came, with no numpy round trip."""
    overrides = [*FAST, "env.id=rlnb/TorchCartPole-v1", "env.normalize_obs=true"]
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        loop.run(progress=False)
        assert loop.episode_stats()["episode_return_mean"] >= 195
        obs = loop.groups["rollout"].sample(2).result()[0]["obs"]
        assert isinstance(obs, torch.Tensor) and obs.dtype == torch.float32


def test_env_checkpoints_a_simulator_through_its_state_api_not_by_pickling():
    from rlnb.components import Env

    env = Env(make_env="rlnb/TorchCartPole-v1", num_envs=4, seed=3)
    env.reset()
    for _ in range(5):
        env.step(0, np.ones(4, dtype=np.int64))
    state = env.state_dict()
    state = copy.deepcopy(state)  # as a checkpoint holds it: nothing shared with `env`
    assert state["env_state"] is None and state["vector_state"] is not None
    after = [env.step(0, np.zeros(4, dtype=np.int64))["obs"] for _ in range(20)]
    twin = Env(make_env="rlnb/TorchCartPole-v1", num_envs=4, seed=99)
    twin.load_state_dict(state)
    again = [twin.step(0, np.zeros(4, dtype=np.int64))["obs"] for _ in range(20)]
    assert all(torch.equal(a, b) for a, b in zip(after, again))


def test_the_sample_after_advantages_shows_them_beside_rewards_and_dones(cluster, tmp_path):
    """What the quickstart notebook shows after `advantages()`: the actor's batch with advantages and
    returns (returns = advantages + values, GAE's value targets), read back from the actor's worker."""
    with Loop.from_recipe(
        "ppo_cartpole", ["runner.tensorboard=false"], cluster=cluster, run_dir=tmp_path
    ) as loop:
        loop.sync_weights()
        loop.rollout()
        before = loop.sample(5)
        assert "advantages" not in before and before["rewards"].shape == (5, 8)
        loop.advantages()
        after = loop.sample(5)
        assert after["advantages"].shape == after["rewards"].shape == after["dones"].shape == (5, 8)
        assert torch.allclose(after["returns"], after["advantages"] + after["values"], atol=1e-5)
        assert torch.equal(after["rewards"], before["rewards"])
        with pytest.raises(ConfigError, match="n: expected an integer >= 1, got -2"):
            loop.sample(-2)  # (was every time step but the last two)


def test_a_step_on_one_slot_is_one_chain_that_trains_as_the_phases_do(cluster, tmp_path):
    """On one collocated slot ``run()`` sends each step's four calls as one chain: the records are those of
    calling the phases one by one, and the phase times still add up to the step's."""
    overrides = ["runner.tensorboard=false", "runner.eval_interval=0"]
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path / "a") as loop:
        assert loop.schedule.one_round_trip(loop)
        chained = loop.run(3, progress=False)
        assert loop.steps_ahead == 2  # steps 2 and 3 ran on the worker ahead of the driver's request
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path / "b") as loop:
        for _ in range(3):
            loop.sync_weights(), loop.rollout(), loop.advantages(), loop.train()
        by_phase = loop.history
    for a, b in zip(chained, by_phase, strict=True):
        for key in ("train/loss", "train/approx_kl", "advantages/return_mean", "global_step"):
            assert a[key] == b[key], key
        phases = sum(a[f"time/{p}_s"] for p in ("sync", "rollout", "advantages", "train"))
        assert a["time/step_s"] == pytest.approx(phases) and 0 < a["time/overhead_frac"] < 1


class FailingSecondCollect(rlnb.PolicyRollout):
    def collect(self, *args, **kwargs):
        self.collected = getattr(self, "collected", 0) + 1
        if self.collected == 2:
            raise RuntimeError("the simulator crashed")
        return super().collect(*args, **kwargs)


class StepShowingActor(rlnb.PPOActor):
    def steps_taken(self) -> int:
        return self.step


def test_a_failure_inside_the_chain_stops_it_before_the_update(cluster, tmp_path):
    """A collection that fails ends the chain there: the actor does not train on the batch before it, and the
    error names the component and method as a separate call's would."""
    with collocated_loop(
        cluster,
        tmp_path,
        FailingSecondCollect,
        StepShowingActor,
        steps=3,
        steps_per_rollout=8,
        update_epochs=1,
    ) as loop:
        assert loop.schedule.one_round_trip(loop)
        with pytest.raises(rlnb.RemoteError, match="the simulator crashed") as e:
            loop.run(progress=False)
        assert (e.value.component, e.value.method) == ("rollout", "collect")
        assert loop.step == 1 and loop.groups["actor"].steps_taken().result() == [1]


def test_a_run_ahead_stops_where_the_driver_would_and_leaves_the_workers_in_step(
    cluster, tmp_path, monkeypatch
):
    """run() lets the worker start the next steps before the driver asks for them (runner.run_ahead), in
    blocks taken with one request each, and stops at the very step it stops at without: the worker checks
    runner.stop_return on each step's episodes before going on. An error between two steps (here a listener of
    the metrics) still takes the steps run ahead, so that the loop's step count and the actor's agree."""
    import rlnb.loop.schedules.chained as chained

    requests = []
    take = chained.take_run_ahead
    monkeypatch.setattr(chained, "take_run_ahead", lambda run, **kw: requests.append(run) or take(run, **kw))
    # blocks of about RUN_AHEAD_S of steps: 1 s, so that steps slowed past 50 ms by a loaded machine still come
    # several to a block (at 0.1 s they came one to a block there: 9 requests for 9 steps)
    monkeypatch.setattr(chained, "RUN_AHEAD_S", 1.0)
    ends = {}
    for run_ahead in (True, False):
        with collocated_loop(
            cluster, tmp_path / str(run_ahead), actor_cls=StepShowingActor, steps=40, steps_per_rollout=16,
            update_epochs=1,
        ) as loop:  # fmt: skip
            loop.recipe.runner.stop_return = 1.0  # reached once 20 episodes have ended
            loop.recipe.runner.run_ahead = run_ahead
            loop.run(progress=False)
            assert loop.groups["actor"].steps_taken().result() == [loop.step]
            ends[run_ahead] = (loop.step, loop.steps_ahead)
    assert ends[True][0] == ends[False][0] < 40 and ends[True][1] > 0 and ends[False][1] == 0
    # the steps run ahead came in blocks, fewer requests than steps
    assert 0 < len(requests) < ends[True][1] and max(len(r.chains) for r in requests) >= 2

    monkeypatch.setattr(chained, "RUN_AHEAD_S", 0.1)
    requests.clear()  # a driver slower than the worker (a listener taking 40 ms a step) paces the blocks
    with collocated_loop(cluster, tmp_path / "paced", steps=16, update_epochs=1) as loop:
        loop.logger.add_listener(lambda record: time.sleep(0.04))
        loop.run(progress=False)
    assert requests and max(len(r.chains) for r in requests) <= 3  # ~0.1 s of steps at its pace

    with collocated_loop(
        cluster, tmp_path / "error", actor_cls=StepShowingActor, steps=10, update_epochs=1
    ) as loop:

        def fail_at_step_3(record):
            if record["step"] == 3:
                raise RuntimeError("a listener failed")

        loop.logger.add_listener(fail_at_step_3)
        with pytest.raises(RuntimeError, match="a listener failed"):
            loop.run(progress=False)
        taken = loop.step  # step 4 at least: it ran ahead of step 3's end, with those of its block
        assert taken >= 4 and loop.groups["actor"].steps_taken().result() == [taken]
        assert [r["step"] for r in loop.history] == list(range(1, taken + 1)) and not loop.schedule.taken


class HeadResettingActor(StepShowingActor):
    def reset_critic_head(self) -> None:  # a user's reset of the value head: a new layer, assigned
        self.policy.critic_head = torch.nn.Linear(self.policy.critic_head.in_features, 1)
        torch.nn.init.constant_(self.policy.critic_head.weight, 0.5)

    def critic_weight(self) -> torch.Tensor:
        return self.policy.critic_head.weight.detach().clone()


class CriticShowingRollout(rlnb.PolicyRollout):
    def critic_weight(self) -> torch.Tensor:
        return self.policy.critic_head.weight.detach().clone()


def test_a_weight_sync_carries_a_layer_the_actor_replaced(cluster, tmp_path):
    """The collocated weight sync copies tensor to tensor with the pairs it found once; a layer of the actor's
    policy replaced since (a user resetting the value head) is found again, not left behind."""
    with collocated_loop(
        cluster, tmp_path, CriticShowingRollout, HeadResettingActor, steps=2, update_epochs=1
    ) as loop:  # fmt: skip
        loop.run(1, progress=False)  # (the pairs are found)
        actor, rollout = loop.groups["actor"], loop.groups["rollout"]
        actor.reset_critic_head().result()
        loop.sync_weights()
        synced = rollout.critic_weight().result()[0]
        assert torch.equal(synced, actor.critic_weight().result()[0]) and torch.all(synced == 0.5)


class ReusedBufferVectorEnv(gym.vector.VectorEnv):
    """A batched simulator that writes each step's observations into one array it returns every time (as
    simulators that avoid allocations do): ``obs[i] = (steps taken, i)``; an episode ends every 5 steps."""

    def __init__(self, num_envs: int = 4):
        set_spaces(self, num_envs)
        self.obs = np.zeros((num_envs, 2), np.float32)
        self.obs[:, 1] = np.arange(num_envs)

    def reset(self, *, seed=None, options=None):
        self.obs[:, 0] = 0
        return self.obs, {}

    def step(self, actions):
        self.obs[:, 0] += 1
        terminated = np.full(self.num_envs, self.obs[0, 0] % 5 == 0)
        return self.obs, np.ones(self.num_envs), terminated, np.zeros(self.num_envs, bool), {}


def test_a_collection_records_each_step_of_a_simulator_that_reuses_its_arrays(cluster, tmp_path):
    """On the rollout's worker, each step's observations are copied as they are recorded: the batch shows the
    simulator's state at every step, not its last state at every step."""
    env = rlnb.Env.launch(cluster, "0", make_env=ReusedBufferVectorEnv, num_envs=4)
    rollout = rlnb.PolicyRollout.launch(cluster, "0")
    actor = rlnb.PPOActor.launch(cluster, "0")
    runner = {"tensorboard": False}
    with Loop(
        env=env, rollout=rollout, actor=actor, steps_per_rollout=6, runner=runner, run_dir=tmp_path
    ) as loop:
        loop.sync_weights()
        loop.rollout()
        obs = loop.sample(6)["obs"]  # [T, N, 2]
    assert obs[:, :, 0].tolist() == [[t] * 4 for t in range(6)]
    assert obs[:, :, 1].tolist() == [[0, 1, 2, 3]] * 6


class NumpyOutputsRollout(rlnb.PolicyRollout):
    """A subclass whose ``act`` returns its log-probs and values as numpy arrays."""

    def act(self, obs, deterministic: bool = False):
        actions, logprobs, values = super().act(obs, deterministic)
        return actions, logprobs.numpy(), values.numpy()


def test_a_rollout_whose_act_returns_numpy_log_probs_and_values_trains_on_its_worker(cluster, tmp_path):
    with collocated_loop(
        cluster, tmp_path, NumpyOutputsRollout, steps=2, steps_per_rollout=8, update_epochs=1
    ) as loop:
        records = loop.run(progress=False)
        batch = loop.sample(8)
    assert len(records) == 2 and all(np.isfinite(r["train/loss"]) for r in records)
    assert batch["logprobs"].dtype == batch["values"].dtype == torch.float32 and batch["values"].shape == (
        8,
        4,
    )


def test_the_progress_bar_redraws_at_its_own_pace_not_twice_a_step(cluster, tmp_path, capsys):
    """tqdm draws at most every 0.1 s; setting the postfix must not force a redraw at every step (each costs
    the driver ~0.1 ms between two steps)."""
    with collocated_loop(cluster, tmp_path, steps=40, steps_per_rollout=8, update_epochs=1) as loop:
        start = time.perf_counter()
        loop.run(progress=True)
        took_s = time.perf_counter() - start
    drawn = capsys.readouterr().err.count("\r")
    # at most one a tenth of a second (a few more at the start and end), and fewer than the 40 steps whatever the
    # machine's pace (26 in 40 steps on a loaded machine; twice a step before)
    assert 0 < drawn <= min(39, took_s / 0.1 + 5), (drawn, took_s)


def test_a_run_past_runner_steps_extends_the_learning_rate_decay_instead_of_training_at_zero(
    cluster, tmp_path, caplog
):
    overrides = ["runner.steps=3", "runner.tensorboard=false", "runner.stop_return=100000"]
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        lrs = [r["train/lr"] for r in loop.run(6, progress=False)]  # 6 steps of a 3-step recipe
        assert loop.recipe.runner.steps == 6 and load_recipe(tmp_path / "recipe.yaml").runner.steps == 6
        assert lrs == pytest.approx([1e-3 * (1 - k / 6) for k in range(6)])  # (was 0 from the 4th step on)
        with caplog.at_level("WARNING", logger="rlnb"):
            loop.step_once()  # a 7th step, past the run's end, phase by phase: the rate is 0, and it says so
            loop.step_once()
        assert [r["train/lr"] for r in loop.history[-2:]] == [0.0, 0.0]
        for bad in (-1, 2.5, "3"):  # (2.5 ran 3 steps and made runner.steps a float)
            with pytest.raises(ConfigError, match=rf"steps: expected an integer >= 0, got {bad!r}"):
                loop.run(bad)
        assert loop.run(0) == [] and loop.step == 8
    said = [r.getMessage() for r in caplog.records if "trained with learning rate 0" in r.getMessage()]
    assert said == [
        "step 7 trained with learning rate 0: actor.anneal_lr decays it to 0 at runner.steps=6, and this step is "
        "past it; loop.run(n) extends runner.steps (and the decay) to the steps it runs, or set "
        "actor.anneal_lr: false"
    ]


def test_a_solved_run_says_so_in_its_summary_and_its_progress_bar(cluster, tmp_path, capsys):
    """The CLI's bar ended at "32%" on a solved run whose summary never said "solved"."""
    overrides = [
        "runner.stop_return=15",
        "runner.steps=50",
        "runner.tensorboard=false",
        "runner.save_interval=0",
    ]
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        loop.run(progress=True)
        assert loop.run_outcome == "solved" and loop.step < 50
        summary = loop.summary()
    bar = capsys.readouterr().err.rstrip().splitlines()[-1]
    assert f"{loop.step}/50" in bar and bar.endswith("solved]"), bar
    assert summary.startswith(f"solved at step {loop.step} of 50 (runner.stop_return 15 reached); step"), (
        summary
    )


def test_a_captured_batch_is_replayed_under_other_settings_and_the_run_goes_on_as_it_would_have(
    cluster, tmp_path
):
    """``loop.capture()`` gives the batch the actor holds as plain data; ``loop.replay(batch, **overrides)`` re-runs
    the update on it on the worker as the run would and under other settings, without rolling out again, and
    reports both; the run then trains exactly as it would have without the replay."""
    overrides = ["runner.steps=3", "runner.tensorboard=false", "runner.eval_interval=0", "env.num_envs=4",
                 "rollout.steps_per_rollout=32", "algorithm.update_epochs=2", "algorithm.num_minibatches=2"]  # fmt: skip
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(1, progress=False)
        loop.sync_weights()
        loop.rollout()
        batch = loop.capture()
        assert (
            batch["obs"].shape == (32, 4, 4)
            and batch["last_values"].shape == (4,)
            and "advantages" not in batch
        )
        fused_before = loop.groups["actor"].on(0).fused_stats().result(60)[0]
        same = loop.replay(batch)
        tighter = loop.replay(batch, clip_coef=0.02, lr=3e-3)
        assert loop.groups["actor"].on(0).fused_stats().result(60)[0] == fused_before  # (its counters too)
        for bad, key in (({"clip_coef": -1.0}, "algorithm.clip_coef"), ({"clip_cof": 0.1}, "clip_cof"),
                         ({"hidden_sizes": [8]}, "hidden_sizes")):  # fmt: skip
            with pytest.raises(ConfigError) as e:
                loop.replay(batch, **bad)
            assert e.value.key == key, e.value
        loop.advantages()
        trained = loop.train()
    assert same["difference"]["policy_loss"] == 0 and same["difference"]["param_change_norm"] == 0
    as_run = tighter["as_run"]
    # the update the run then made is the one replayed "as run": the replays left nothing behind
    assert trained["policy_loss"] == as_run["policy_loss"] and trained["approx_kl"] == as_run["approx_kl"]
    assert tighter["replayed"]["clip_frac"] > as_run["clip_frac"]  # a tighter clip clips more
    assert tighter["replayed"]["param_change_norm"] != as_run["param_change_norm"]
    assert set(tighter["difference"]) >= {"policy_loss", "approx_kl", "clip_frac", "param_change_norm", "lr"}
