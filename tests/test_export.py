"""Trained policies out of rlnb: written from runs on workers, loaded in processes with no cluster, acting as trained."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import rlnb
from rlnb.export import PolicyFileError, TrainedPolicy, load_policy
from rlnb.loop import Loop

RLNB = [sys.executable, "-m", "rlnb.cli"]


class DeterministicRollout(rlnb.PolicyRollout):
    """Says which actions its policy takes, deterministically, on given (already normalised) observations."""

    def act_deterministic(self, obs):
        return self.act(obs, deterministic=True)[0]


def test_an_exported_policy_acts_on_raw_observations_as_the_rollout_on_normalised_ones(cluster, tmp_path):
    env = rlnb.Env.launch(cluster, "0", make_env="Pendulum-v1", num_envs=4, normalize_obs=True)
    rollout = rlnb.launch(DeterministicRollout, cluster, "0", name="rollout")
    actor = rlnb.launch(rlnb.PPOActor, cluster, "0", name="actor")
    runner = {"tensorboard": False, "steps": 3}
    with Loop(
        env=env, rollout=rollout, actor=actor, steps_per_rollout=16, runner=runner, run_dir=tmp_path
    ) as loop:
        loop.run(progress=False)
        path = loop.export()
        loop.sync_weights()  # the rollout acts with the weights exported
        trained = env.obs_normalization().result()[0]
        # Pendulum's raw observations: cos, sin, angular velocity in [-8, 8]
        raw = np.random.default_rng(0).uniform([-1, -1, -8], [1, 1, 8], size=(64, 3)).astype(np.float32)
        expected = np.clip(rollout.act_deterministic(trained.normalize(raw)).result()[0].numpy(), -2.0, 2.0)
        evaluated = loop.evaluate(3)
        seed = loop.recipe.seed + 1_000_003
    assert path == tmp_path / "policy.pt" and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    policy = load_policy(tmp_path)  # (a run directory stands for its policy.pt)
    assert policy.step == 3 and policy.source == str(tmp_path) and "normalised observations" in repr(policy)
    np.testing.assert_array_equal(policy.predict(raw), expected)
    # one observation, one action (a batch of one may round otherwise in the last bit)
    np.testing.assert_allclose(policy.predict(raw[5]), expected[5], rtol=1e-5)
    # the same weights without the normalisation the file carries act otherwise
    bare = TrainedPolicy(policy.module, policy.observation_space, policy.action_space)
    assert not np.array_equal(bare.predict(raw), expected)
    with pytest.raises(
        ValueError, match=r"expected an observation of shape \(3,\) or a batch \[B, 3\], got shape"
    ):
        policy.predict(np.zeros(4))
    # its episodes in this process, on the env it was trained on, are the loop's evaluation (same seed)
    figures = {k.removeprefix("eval/"): v for k, v in evaluated.items() if not k.startswith("time/")}
    assert policy.evaluate(3, seed=seed) == figures
    assert policy.evaluate(3, seed=seed, kwargs={"max_episode_steps": 50})["len_mean"] == 50.0
    with pytest.raises(ValueError, match="episodes expected an integer >= 1, got 0"):
        policy.evaluate(0)
    with pytest.raises(
        ValueError, match=r"the env's observations \(4,\) and actions Discrete\(2\) are not the policy's"
    ):
        policy.evaluate(2, make_env="CartPole-v1")  # (was a shape error from inside the policy)


SCRIPT = """
import sys

import torch
import tiny_envs  # on this process's (and its workers') PYTHONPATH only

import rlnb
from rlnb.loop import Loop


class TinyPolicy(torch.nn.Module):  # defined in the script's __main__: no other process can import it
    def __init__(self, obs_space, act_space):
        super().__init__()
        self.net = torch.nn.Linear(4, 3)  # two logits and a value

    def forward(self, obs):
        out = self.net(obs)
        return torch.distributions.Categorical(logits=out[:, :2]), out[:, 2]


if __name__ == "__main__":
    with rlnb.Cluster(slots=1, gpus=False) as cluster:
        env = rlnb.Env.launch(cluster, "0", make_env=tiny_envs.Cart, num_envs=4)
        rollout = rlnb.PolicyRollout.launch(cluster, "0", policy=TinyPolicy)
        actor = rlnb.PPOActor.launch(cluster, "0", policy=TinyPolicy)
        runner = {"tensorboard": False, "steps": 1}
        with Loop(env=env, rollout=rollout, actor=actor, steps_per_rollout=8, runner=runner, run_dir=sys.argv[1]) as loop:
            loop.run(progress=False)
            print(loop.export())
            print(loop.groups["actor"].policy_module().result()[0].module.net.weight.tolist())
"""


def test_a_policy_class_from_a_scripts_main_is_exported_with_its_code_and_loads_in_another_process(tmp_path):
    """The policy class travels with the file; an env class importable only where it trained does not stop the
    file from loading elsewhere (only its evaluation on that env)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "tiny_envs.py").write_text(
        "from gymnasium.envs.classic_control import CartPoleEnv\n\n\nclass Cart(CartPoleEnv):\n    pass\n"
    )
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")],
        capture_output=True, text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(tmp_path / "pkg")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    path, weight = done.stdout.strip().splitlines()[-2:]
    load = (
        f"import rlnb; p = rlnb.load_policy({path!r}, trust=True); print(type(p.module.module).__name__); "
        "print(p.module.module.net.weight.tolist()); print(p.predict([0.0, 0.1, 0.0, -0.1])); "
        "print(p.evaluate(2, make_env='CartPole-v1')['len_mean'] > 0); p.evaluate(2)"
    )
    loaded = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=120)
    assert (
        loaded.returncode == 1
        and "ValueError: the env this policy was trained on cannot be rebuilt in this "
        "process (ModuleNotFoundError: No module named 'tiny_envs'); evaluate(make_env=...) names another"
        in loaded.stderr
    ), loaded.stderr[-3000:]
    name, loaded_weight, action, evaluated = loaded.stdout.strip().splitlines()
    assert name == "TinyPolicy" and loaded_weight == weight and action in ("0", "1") and evaluated == "True"
    # without trust=True, a pickled policy class is not unpickled
    untrusted = subprocess.run(
        [sys.executable, "-c", f"import rlnb; rlnb.load_policy({path!r})"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert untrusted.returncode == 1 and "holds a policy class of its author's own" in untrusted.stderr


def test_rlnb_eval_and_rlnb_export_work_from_a_runs_latest_checkpoint(tmp_path):
    run = tmp_path / "run"
    quiet = ["runner.tensorboard=false", "runner.eval_interval=0"]
    done = subprocess.run(
        [*RLNB, "run", "ppo_cartpole", "runner.steps=2", *quiet, "--run-dir", str(run), "--no-progress", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # the results on stdout, one JSON object with --json (the log and the progress on stderr)
    result = json.loads(done.stdout)
    assert result["outcome"] == "done" and result["step"] == 2 and result["eval/return_mean"] > 0, result
    assert result["metrics"] == str(run / "metrics.jsonl") and "step_000002" in result["checkpoint"], result
    evaluated = subprocess.run(
        [*RLNB, "eval", str(run), "--episodes", "3", "--json"], capture_output=True, text=True, timeout=300
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    scores = json.loads(evaluated.stdout)
    assert scores["step"] == 2 and scores["eval/return_mean"] > 0 and scores["run_dir"] == str(run), scores
    assert "rlnb: evaluating" in evaluated.stderr, evaluated.stderr  # (not silent while it waits)
    bad = subprocess.run(
        [*RLNB, "eval", str(run), "--episodes", "0"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "--episodes: expected an integer in [1, 1000000], got '0'" in bad.stderr, (
        bad.stderr
    )
    not_lm = subprocess.run([*RLNB, "eval", str(run), "--k", "4"], capture_output=True, text=True, timeout=60)
    assert (
        not_lm.returncode == 2 and "--k: 4 completions a problem (pass@k) evaluate an LM run" in not_lm.stderr
    ), not_lm.stderr
    # on several tasks in turn (a LIBERO suite's way), a success rate and a video each
    videos = tmp_path / "videos"
    tasks = subprocess.run(
        [*RLNB, "eval", str(run), "--episodes", "2", "--tasks", "CartPole-v1,CartPole-v0", "--videos", str(videos)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert tasks.returncode == 0, tasks.stderr[-3000:]
    for env_id, name in (("CartPole-v1", "CartPole-v1.mp4"), ("CartPole-v0", "CartPole-v0.mp4")):
        assert f"  {env_id}: return_mean=" in tasks.stdout and f"video: {videos / name}" in tasks.stdout
        assert (videos / name).stat().st_size > 1000
    suite = subprocess.run(
        [*RLNB, "eval", str(run), "--tasks", "libero:libero_spatal"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert suite.returncode == 2 and "--tasks: env.id: libero:libero_spatal" in suite.stderr, suite.stderr
    out = tmp_path / "exported" / "cartpole.pt"
    exported = subprocess.run(
        [*RLNB, "export", str(run), "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert f"at step 2 to {out} (no cluster started); load it with rlnb.load_policy(" in exported.stdout
    policy = load_policy(out)
    assert policy.step == 2 and policy.discrete and policy.predict(np.zeros((5, 4))).shape == (5,)
    missing = subprocess.run([*RLNB, "export", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "is not a run directory (no recipe.yaml)" in missing.stderr


def test_loading_what_is_not_a_policy_file_says_so(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"no policy file at .*policy\.pt \(write one with loop\.export"
    ):
        load_policy(tmp_path)
    (tmp_path / "text.pt").write_text("not a pickle")
    with pytest.raises(PolicyFileError, match="is not a policy file"):
        load_policy(tmp_path / "text.pt")
    (tmp_path / "grpo" / "model").mkdir(parents=True)
    (tmp_path / "grpo" / "model" / "config.json").write_text("{}")  # an LM run's export
    for given in (tmp_path / "grpo", tmp_path / "grpo" / "model"):
        with pytest.raises(
            PolicyFileError, match=r"is a Hugging Face model .*AutoModelForCausalLM.from_pretrained"
        ):
            load_policy(given)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "state.pt")
    with pytest.raises(PolicyFileError, match="expected format 'rlnb-policy/2', found None"):
        load_policy(tmp_path / "state.pt")


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_policy_file_runs_nothing_and_a_policy_file_holds_only_data(cluster, tmp_path):
    marker = tmp_path / "ran"
    torch.save({"format": "rlnb-policy/1", "module": _RunsCode(marker)}, tmp_path / "bad.pt")
    with pytest.raises(
        PolicyFileError, match=r"bad\.pt names posix\.system.*load_policy\(path, trust=True\)"
    ):
        load_policy(tmp_path / "bad.pt")
    assert not marker.exists()
    env = rlnb.Env.launch(cluster, "0", make_env="CartPole-v1", num_envs=4, normalize_obs=True)
    rollout, actor = rlnb.PolicyRollout.launch(cluster, "0"), rlnb.PPOActor.launch(cluster, "0")
    runner = {"tensorboard": False, "steps": 1}
    with Loop(
        env=env, rollout=rollout, actor=actor, steps_per_rollout=16, runner=runner, run_dir=tmp_path / "r"
    ) as loop:
        loop.run(progress=False)
        path = loop.export()
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) == [
        n for n in torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) if n.startswith("numpy")
    ]
    policy = load_policy(path)
    assert policy.evaluate(2)["len_mean"] > 0 and policy.obs_normalization is not None


def test_export_from_a_checkpoint_needs_no_cluster_and_equals_the_loops_export(cluster, tmp_path):
    """`rlnb export` used to start a whole cluster (9 s here) to write what the checkpoint already holds."""
    from rlnb.export import export_from_checkpoint

    overrides = ["runner.steps=2", "runner.tensorboard=false", "env.normalize_obs=true", "env.num_envs=4",
                 "rollout.steps_per_rollout=16"]  # fmt: skip
    with Loop.from_recipe("ppo_cartpole", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        loop.save()
        through_loop = load_policy(loop.export(tmp_path / "loop.pt"))
    from_checkpoint = load_policy(export_from_checkpoint(tmp_path / "run", tmp_path / "ckpt.pt"))
    obs = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    np.testing.assert_array_equal(from_checkpoint.predict(obs), through_loop.predict(obs))
    assert from_checkpoint.step == through_loop.step == 2
    np.testing.assert_array_equal(from_checkpoint.obs_normalization.mean, through_loop.obs_normalization.mean)
    assert from_checkpoint.evaluate(2, seed=5) == through_loop.evaluate(2, seed=5)


def test_pass_at_k_on_held_out_problems_in_the_loop_and_from_rlnb_eval_with_each_problems_answers(
    cluster, tmp_path
):
    """data.eval_samples / ``rlnb eval --k``: n sampled completions a held-out problem give pass@k (k = 1, 2, 4)
    and avg@4 (pass@1 is avg@n, pass@k grows with k), and each problem's completions, rewards and correct count in
    <run_dir>/eval/step-<step>.jsonl, which agree with the record; --k on an embodied run is refused."""
    from rlnb.loop import GRPOLoop

    run = tmp_path / "run"
    overrides = ["data.max_operand=9", "actor.sft_steps=60", "actor.tiny_lm.hidden_size=64", "runner.steps=1",
                 "runner.eval_interval=1", "data.eval_size=8", "data.eval_samples=4", "data.prompts_per_step=2",
                 "runner.tensorboard=false", "rollout.temperature=1.0", f"actor.model_path={tmp_path / 'model'}"]  # fmt: skip

    def check(record: dict, rows: list[dict], n: int = 4) -> None:
        assert len(rows) == record["eval/size"] == 8 and all(len(r["completions"]) == n for r in rows)
        assert all(r["correct"] == sum(x >= 1 for x in r["rewards"]) for r in rows)  # (arithmetic: 1 or 0)
        share = sum(r["correct"] for r in rows) / (n * len(rows))
        assert record[f"eval/avg_at/{n}"] == pytest.approx(share) == pytest.approx(record["eval/pass_at/1"])
        assert record["eval/pass_at/1"] <= record["eval/pass_at/2"] <= record["eval/pass_at/4"]
        assert record["eval/pass_at/4"] == pytest.approx(sum(r["correct"] > 0 for r in rows) / len(rows))
        assert "eval/accuracy" not in record

    def rows_of(path) -> list[dict]:
        return [json.loads(line) for line in Path(path).read_text().splitlines()]

    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=run) as loop:
        loop.run(progress=False)
        logged = [r for r in loop.history if "eval/pass_at/4" in r]
        assert [r["step"] for r in logged] == [0, 1], loop.history
        check(logged[-1], rows_of(run / "eval" / "step-0000001.jsonl"))
        assert (run / "eval" / "step-0000000.jsonl").stat().st_mode & 0o777 == 0o600
        greedy = loop.evaluate(size=8, samples=1)
        assert (
            "eval/accuracy" in greedy
            and len(rows_of(run / "eval" / "step-0000001.jsonl")[0]["completions"]) == 1
        )
        loop.save()
    evaluated = subprocess.run(
        [*RLNB, "eval", str(run), "--episodes", "8", "--k", "4", "--json"], capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    scores = json.loads(evaluated.stdout)
    assert scores["step"] == 1 and scores["results"] == str(run / "eval" / "step-0000001.jsonl"), scores
    check(scores, rows_of(scores["results"]))
    assert not [p for p in (run / "eval").iterdir() if p.name.startswith(".")]  # (written beside, renamed)
    bad = subprocess.run([*RLNB, "eval", str(run), "--k", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--k: expected an integer" in bad.stderr, bad.stderr


def test_an_lm_runs_export_and_eval_need_no_cluster_and_equal_the_loops(cluster, tmp_path):
    """`rlnb export` and `rlnb eval` of an LM run started a cluster (about 22 s each) for what the actor's
    checkpoint holds: the actor is built in the CLI's process instead, and writes the same model (LoRA merged),
    and its greedy held-out answers score as the loop's evaluation did."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlnb.export import lm_export_from_checkpoint
    from rlnb.loop import GRPOLoop

    run = tmp_path / "run"
    overrides = ["data.max_operand=9", "actor.sft_steps=150", "actor.tiny_lm.hidden_size=64",
                 "actor.tiny_lm.num_layers=1", "runner.steps=1", "runner.eval_interval=0", "data.eval_size=4",
                 "data.prompts_per_step=2", "runner.tensorboard=false", "actor.lora.rank=4",
                 f"actor.model_path={tmp_path / 'model'}"]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=run) as loop:
        loop.run(progress=False)
        loop.save()
        through_loop = loop.export(tmp_path / "loop")
        in_loop = loop.evaluate(size=16)
    before = {p.relative_to(run) for p in run.rglob("*")}
    evaluated = subprocess.run(
        [*RLNB, "eval", str(run), "--episodes", "16", "--json"], capture_output=True, text=True, timeout=300
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    scores = json.loads(evaluated.stdout)
    assert scores["step"] == 1 and scores["eval/size"] == 16, scores
    assert scores["eval/accuracy"] > 0 and (scores["eval/accuracy"], scores["eval/reward_mean"]) == (
        in_loop["eval/accuracy"],
        in_loop["eval/reward_mean"],
    )
    assert (
        "(no cluster started)"
        in subprocess.run(
            [*RLNB, "eval", str(run), "--episodes", "4"], capture_output=True, text=True, timeout=300
        ).stdout
    )
    started = subprocess.run(
        [*RLNB, "export", str(run), "--out", str(tmp_path / "cli")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert started.returncode == 0, started.stderr[-3000:]
    assert "at step 1 to" in started.stdout and "(no cluster started)" in started.stdout, started.stdout
    assert {p.relative_to(run) for p in run.rglob("*")} == before  # nothing written in the run directory
    here, step = lm_export_from_checkpoint(run, tmp_path / "here")
    assert step == 1
    for exported in (tmp_path / "cli", here):
        ours, theirs = (load_file(d / "model.safetensors") for d in (exported, through_loop))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
        assert not any("lora" in k for k in ours)  # merged
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "cli")
    assert model.config.hidden_size == 64


def test_an_evaluation_in_a_run_directory_it_may_not_write_keeps_its_figures(tmp_path, monkeypatch, caplog):
    """``rlnb eval`` of another user's run: the answers file cannot be written (as root here nothing is refused,
    so the write is made to fail as the kernel would); the evaluation goes on, said once in the log."""
    import rlnb.files
    from rlnb.loop.families.grpo.evaluation import write_results

    assert write_results(tmp_path, 3, [{"prompt": "1+1=", "correct": 1}]).name == "step-0000003.jsonl"

    def denied(path, text, sync=False):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(rlnb.files, "write_private", denied)
    assert write_results(tmp_path, 4, [{"prompt": "1+1="}]) is None
    assert "each problem's answers not written" in caplog.text
