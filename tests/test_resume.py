"""Resume and evaluation between steps: exact, with TensorBoard and wandb continuing the same run."""

import pytest

import rlnb
from rlnb.loop import GRPOLoop, Loop
from tests.conftest import assert_resume_is_exact
from tests.test_lm import GRPO_SMALL


def test_resume_purges_tensorboard_and_tolerates_a_torn_metrics_line(cluster, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = ["runner.steps=4", "runner.save_interval=2", "runner.stop_return=100000", "env.num_envs=4",
                 "rollout.steps_per_rollout=16"]  # fmt: skip
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        loop.run(3, progress=False)  # checkpoint at 2, then step 3 is logged and lost
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "env/episode_ret')  # a killed driver's torn last line
    with Loop.resume(tmp_path, cluster=cluster) as loop:
        assert loop.step == 2
        loop.run(progress=False)
    steps = []
    for events in sorted((tmp_path / "tensorboard").glob("events.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if "train/policy_loss" in acc.Tags()["scalars"]:
            steps.append([e.step for e in acc.Scalars("train/policy_loss")])
    records = [r for r in rlnb.metrics.read_metrics(tmp_path) if "train/policy_loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # TensorBoard's x is the dashboard's, env steps (16 steps x 4 envs a training step)
    x = [r["global_step"] for r in records]
    assert x == [64, 128, 192, 256]
    assert steps[0][:2] == x[:2] and steps[-1] == x[2:]
    acc = EventAccumulator(str(tmp_path / "tensorboard"))  # the directory, as TensorBoard reads it
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/policy_loss")] == x  # no overlapping points
    # the recipe as the run's hyperparameters (TensorBoard's HParams tab), written once
    hparams = acc.PluginTagToContent("hparams")
    assert (
        b"actor.lr" in hparams["_hparams_/session_start_info"]
        and b"env.num_envs" in hparams["_hparams_/session_start_info"]
    )

    def hparams_in(events) -> bool:
        try:
            return "_hparams_/session_start_info" in EventAccumulator(
                str(events)
            ).Reload().PluginTagToContent("hparams")
        except KeyError:  # (no summary of the HParams plugin in that file)
            return False

    assert sum(map(hparams_in, (tmp_path / "tensorboard").glob("events.*"))) == 1


def test_mujoco_resume_is_exact(cluster, tmp_path):
    """Pickling rebuilt MuJoCo envs from their constructor arguments: physics state and RNG were lost."""
    base = ["runner.steps=4", "runner.save_interval=2", "runner.tensorboard=false", "runner.eval_interval=0",
            "runner.stop_return=100000", "rollout.steps_per_rollout=24", "env.num_envs=4",
            "algorithm.update_epochs=2", "algorithm.num_minibatches=2"]  # fmt: skip
    assert_resume_is_exact("ppo_mujoco", base, cluster, tmp_path)


@pytest.mark.parametrize("recipe", ["ppo_mujoco", "grpo_arith"])
def test_evaluating_between_steps_does_not_change_training(cluster, tmp_path, recipe):
    """A deterministic evaluation used to draw from the rollout's sampling generator (continuous
    actions) or shift its seeds (greedy LM decoding), so evaluating in a notebook changed the run."""
    from tests.conftest import without_wall_clock

    small = {
        "ppo_mujoco": ["env.num_envs=4", "rollout.steps_per_rollout=16", "algorithm.update_epochs=1"],
        "grpo_arith": [*GRPO_SMALL, "actor.sft_steps=10", "data.eval_size=8", "data.prompts_per_step=4"],
    }[recipe]
    overrides = [*small, "runner.tensorboard=false", "runner.eval_interval=0", "runner.stop_return=100000",
                 "cluster.component_placement={'actor,rollout,env,reward': 0}"]  # fmt: skip
    runs = []
    for evaluate in (False, True):
        run_dir = tmp_path / str(evaluate)
        loop_cls = GRPOLoop if recipe == "grpo_arith" else Loop
        extra = [f"actor.model_path={tmp_path / 'model'}"] if recipe == "grpo_arith" else []
        place = [
            o.replace(",reward", "") if recipe == "ppo_mujoco" else o.replace(",env", "") for o in overrides
        ]
        with loop_cls.from_recipe(recipe, [*place, *extra], cluster=cluster, run_dir=run_dir) as loop:
            if recipe == "grpo_arith":
                loop.sft()
            records = [loop.step_once()]
            if evaluate:
                loop.evaluate(2) if recipe == "ppo_mujoco" else loop.evaluate()
            records.append(loop.step_once())
        runs.append([without_wall_clock(r) for r in records])
    assert runs[0] == runs[1]


def test_resume_continues_the_same_wandb_run(cluster, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # no account, no network: runs are written locally
    monkeypatch.setenv("WANDB_SILENT", "true")
    overrides = ["runner.steps=3", "runner.save_interval=2", "runner.tensorboard=false", "runner.stop_return=100000",
                 "runner.wandb_project=rlnb-test", "env.num_envs=4", "rollout.steps_per_rollout=16"]  # fmt: skip
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path) as loop:
        loop.run(2, progress=False)
    run_id = (tmp_path / "wandb_run_id").read_text()
    with Loop.resume(tmp_path, cluster=cluster) as loop:
        loop.run(progress=False)
    # one offline folder per process, named by the second it started (wandb adds "-1" when two share one),
    # each holding the same run's records: one run, resumed
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    records = [sorted(f.name for f in run.glob("run-*.wandb")) for run in runs]
    assert len(runs) == 2 and records == [[f"run-{run_id}.wandb"]] * 2, (run_id, runs, records)


def test_a_resume_in_the_same_second_is_read_last_by_tensorboard(tmp_path):
    """TensorBoard reads a run's event files in name order, and names made in one second by one process end in a
    counter that sorts as text ("...10" before "...9"): a resumed logger's file, whose purge drops the lost
    steps, must sort after the files before it, or TensorBoard shows the lost steps again."""
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import event_file_writer

    from rlnb.metrics import MetricLogger

    counter = event_file_writer._global_uid
    while counter._value < 9:  # the first logger's file ends in .9, the resumed one's in .10 and .11
        counter.get()
    time.sleep(1.01 - time.time() % 1)  # all in one second (the files are made within a few ms)
    first = MetricLogger(tmp_path, tensorboard=True)
    for step in (1, 2, 3):
        first.log(step, {"train/loss": float(step)})
    first.close()
    again = MetricLogger(tmp_path, tensorboard=True)  # a resume from the checkpoint at step 2
    again.truncate_after(2)
    for step in (3, 4):
        again.log(step, {"train/loss": 10.0 + step})
    again.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 13.0),
        (4, 14.0),
    ]
