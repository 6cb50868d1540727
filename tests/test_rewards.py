"""Rewards on workers: registered, weighted, from notebook cells, reading records' fields, reward models; completions logged."""

import json

import numpy as np
import pytest

import rlnb
from rlnb.loop import GRPOLoop
from tests.test_lm import GRPO_SMALL

SCORING_PATHS = [
    ["cluster.component_placement={'actor,rollout,reward': 0}"],
    ["cluster.component_placement={'actor,rollout': 0, reward: 1}"],
    ["cluster.component_placement={'rollout,reward': 0, actor: 1}", "algorithm.max_staleness=1"],
]


SCORING_PATH_IDS = ["scored-next-to-the-rollout", "scored-on-its-own-slot", "asynchronous"]


def test_math_reward_scores_on_a_worker_thread(cluster):
    """math-verify's signal-based timeouts raise off the main thread: every score used to be 0.0."""
    reward = rlnb.RewardWorker.launch(cluster, "1", fn="math")
    try:
        completions = ["so \\boxed{\\frac{1}{2}}", "#### 1,000", "it is \\boxed{2x+1}", "\\boxed{3}"]
        answers = ["0.5", "1000", "1+2x", "4"]
        assert reward.score(completions, answers).result() == [[1.0, 1.0, 1.0, 0.0]]
    finally:
        reward.shutdown()


def test_grpo_with_the_math_reward_on_a_boxed_jsonl(cluster, tmp_path):
    rows = [{"question": f"{a}+{b}=", "answer": f"\\boxed{{{a + b}}}"} for a in range(10) for b in range(10)]
    data = tmp_path / "boxed.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=2", "reward.name=math",
                 "data.task=file", f"data.path={data}", "rollout.max_new_tokens=10", "data.eval_size=20",
                 "actor.sft_steps=150"]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        accuracy = [r["eval/accuracy"] for r in loop.history if "eval/accuracy" in r]
        rewards = [r["reward/mean"] for r in loop.history if "reward/mean" in r]
    assert accuracy[0] > 0.2 and max(rewards) > 0.2, (accuracy, rewards, loop.last_samples)


def half_point(completion: str) -> float:
    """A reward of 0.5 whatever the completion (with weight 2.0: 1.0, which an accuracy of the weighted sum
    would count as right)."""
    return 0.5


def parity(level: int) -> float:
    """A reward read from the prompt record's own ``level`` field (nothing of the completion)."""
    return float(level)


@pytest.mark.parametrize("placement", SCORING_PATHS, ids=SCORING_PATH_IDS)
def test_several_weighted_rewards_are_summed_and_logged_apart(cluster, tmp_path, monkeypatch, placement):
    """``reward.name: [arithmetic, half_point]`` with ``reward.weights: [1, 2]`` (TRL's reward_funcs and
    reward_weights), on workers in each scoring path: each reward's mean is logged, the training reward is
    the weighted sum, and accuracy counts the first reward alone."""
    from rlnb.algorithms.rewards import REWARDS, register_reward

    monkeypatch.setattr(REWARDS, "_items", dict(REWARDS._items))  # registered for this test only
    register_reward("half_point")(half_point)
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=3", "actor.sft_steps=40",
                 "reward.name=[arithmetic,half_point]", "reward.weights=[1,2]", *placement]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        group = loop.sample_group(0)
        tried = loop.try_prompt("2+3=", "5")
    steps = [r for r in loop.history if "reward/mean" in r]
    assert len(steps) == 3
    for r in steps:
        assert r["reward/half_point/mean"] == 0.5
        assert r["reward/mean"] == pytest.approx(r["reward/arithmetic/mean"] + 2 * 0.5)
        assert r["reward/accuracy"] == pytest.approx(r["reward/arithmetic/mean"])  # 0/1 scores
    assert any(r["reward/accuracy"] > 0 for r in steps)  # the warm start answers some
    for row in [*group, *tried]:
        assert row["rewards"]["half_point"] == 0.5
        assert row["reward"] == pytest.approx(row["rewards"]["arithmetic"] + 1.0)
    evals = [r for r in loop.history if "eval/accuracy" in r]
    assert evals and all(r["eval/reward_mean"] == pytest.approx(r["eval/accuracy"] + 1.0) for r in evals)


def test_reward_functions_from_a_notebook_cell_are_weighted_on_a_worker(cluster):
    def exact(completion, answer):
        return float(completion.strip() == answer)

    def short(completion):
        return -0.1 * len(completion)

    reward = rlnb.RewardWorker.launch(cluster, "1", fn=[exact, short], weights=[1.0, 0.5])
    try:
        scored = reward.score_terms(["4", "5 "], ["4", "4"]).result()[0]
        assert scored["terms"] == {"exact": [1.0, 0.0], "short": [pytest.approx(-0.1), pytest.approx(-0.2)]}
        assert scored["rewards"] == [pytest.approx(0.95), pytest.approx(-0.1)]
        assert reward.score(["4"], ["4"]).result() == [[pytest.approx(0.95)]]
    finally:
        reward.shutdown()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["reward.name=[arithmetic,fromat]"],
            r"reward.name\[1\]: unknown reward 'fromat'.*Did you mean 'format'",
        ),
        (["reward.name=[arithmetic,format]", "reward.weights=[1]"], r"reward.weights: expected a list of 2"),
        (["reward.name=[format,format]"], r"reward.name: each reward is logged under its name, and 'format'"),
        (["reward.name=[]"], r"reward.name: expected a reward or a non-empty list"),
        (
            ["reward.weights=[.nan]"],
            r"reward.weights\[0\]: expected a finite number \(the weight of 'arithmetic'\)",
        ),
    ],
)
def test_bad_reward_lists_are_refused_naming_the_key(overrides, message):
    from rlnb.config import load_recipe

    with pytest.raises(rlnb.ConfigError, match=message):
        load_recipe("grpo_arith", overrides)


def _group_or_none(loop, group: int) -> list[dict]:
    try:
        return loop.sample_group(group)
    except rlnb.RemoteError:  # past this actor rank's share of the batch
        return []


def _parity_records(path):
    rows = [
        {"question": f"{a}+{b}=", "answer": str(a + b), "level": (a + b) % 2}
        for a in range(10)
        for b in range(10)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return {r["question"]: r["level"] for r in rows}


@pytest.mark.parametrize("placement", SCORING_PATHS, ids=SCORING_PATH_IDS)
def test_rewards_read_the_prompt_records_other_fields(cluster, tmp_path, monkeypatch, placement):
    """A reward taking ``level`` gets each completion's record's ``level`` column (TRL passes a dataset's
    columns to its reward functions), on workers in every scoring path, in evaluation and in try_prompt."""
    from rlnb.algorithms.rewards import REWARDS, register_reward

    monkeypatch.setattr(REWARDS, "_items", dict(REWARDS._items))
    register_reward("parity")(parity)
    level = _parity_records(tmp_path / "data.jsonl")
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=2", "actor.sft_steps=5",
                 "data.task=file", f"data.path={tmp_path / 'data.jsonl'}", "reward.name=[arithmetic,parity]",
                 "data.eval_size=10", *placement]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        rows = [row for g in range(loop.recipe.data.prompts_per_step) for row in _group_or_none(loop, g)]
        tried = loop.try_prompt("2+3=", "5", level=1)
        held_out = [p.prompt for p in loop.task.held_out[:10]]
    assert {row["rewards"]["parity"] == level[row["prompt"]] for row in rows} == {True}
    assert {0.0, 1.0} <= {row["rewards"]["parity"] for row in rows}
    assert [row["rewards"]["parity"] for row in tried] == [1.0] * len(tried)
    evals = [r for r in loop.history if "eval/accuracy" in r]
    expected = sum(level[p] for p in held_out) / len(held_out)
    assert evals and all(r["eval/reward_mean"] == pytest.approx(r["eval/accuracy"] + expected) for r in evals)


def test_a_reward_needing_a_field_the_records_lack_is_refused_before_anything_runs(
    cluster, tmp_path, monkeypatch
):
    from rlnb.algorithms.rewards import REWARDS, register_reward
    from rlnb.config import load_recipe

    monkeypatch.setattr(REWARDS, "_items", dict(REWARDS._items))
    register_reward("parity")(parity)
    with pytest.raises(
        rlnb.ConfigError, match=r"reward 'parity' needs input\(s\) level .*these records have none"
    ):
        load_recipe("grpo_arith", ["reward.name=parity"])  # procedural arithmetic: no fields
    data = tmp_path / "data.jsonl"
    data.write_text(
        "\n".join(json.dumps({"question": f"{a}+1=", "answer": str(a + 1), "src": "x"}) for a in range(20))
    )
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "data.task=file", f"data.path={data}",
                 "reward.name=parity", "actor.sft_steps=0"]  # fmt: skip
    recipe = load_recipe("grpo_arith", overrides)  # the file's columns are not known yet: checked at build
    with pytest.raises(rlnb.ConfigError, match=r"needs input\(s\) level .*these records have src"):
        GRPOLoop(recipe, cluster=cluster, run_dir=tmp_path / "run")


def test_grpo_raises_a_learned_reward_models_score_on_workers(cluster, tmp_path):
    """``reward.model_path``: a sequence-classification reward model (TRL's model in ``reward_funcs``), loaded
    on the workers, scores prompt + completion in batches; GRPO raises its score, and a completion's reward on
    the worker is the model's score of it here."""
    from rlnb.algorithms import RewardModel
    from rlnb.models import build_tiny_reward_model

    rm = build_tiny_reward_model(tmp_path / "rm", seed=0)
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=30", "actor.sft_steps=40",
                 "data.eval_size=20", "reward.name=[]", f"reward.model_path={rm}", "reward.model_batch_size=5",
                 "rollout.max_new_tokens=6"]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        rows = loop.sample_group(0)
    rewards = [r["reward/mean"] for r in loop.history if "reward/mean" in r]
    assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.04, rewards
    here = RewardModel(rm).score_batch([r["completion"] for r in rows], [r["prompt"] for r in rows])
    assert [r["reward"] for r in rows] == pytest.approx(here, abs=1e-5)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["reward.model_path=/no/such/rm"], r"reward.model_path: '/no/such/rm' has no config.json"),
        (["reward.model_path={rm}", "reward.weights=[1]"], r"reward.weights: expected a list of 2 number\(s\), one "
         r"per reward in \['arithmetic', 'reward_model'\]"),
        (["reward.model_path={rm}", "reward.model_batch_size=0"], r"reward.model_batch_size: expected an integer in \[1, 1000000\]"),
    ],
)  # fmt: skip
def test_bad_reward_model_settings_are_refused_naming_the_key(tmp_path, overrides, message):
    from rlnb.config import load_recipe
    from rlnb.models import build_tiny_reward_model

    rm = build_tiny_reward_model(tmp_path / "rm")
    with pytest.raises(rlnb.ConfigError, match=message):
        load_recipe("grpo_arith", [o.format(rm=rm) for o in overrides])


def test_a_batched_reward_that_raises_scores_zero_on_a_worker(cluster, tmp_path):
    """A reward scored a batch at a time (``score_batch``) that raises on the worker (here, a reward model
    whose directory is gone) scores the batch 0.0, logged once, as a reward scored one by one does."""
    from rlnb.algorithms import RewardModel

    reward = rlnb.RewardWorker.launch(cluster, "1", fn=["arithmetic", RewardModel(tmp_path / "gone")])
    try:
        scored = reward.score_terms(["4", "5"], ["4", "4"]).result()[0]
    finally:
        reward.shutdown()
    assert scored == {"rewards": [1.0, 0.0], "terms": {"arithmetic": [1.0, 0.0], "reward_model": [0.0, 0.0]}}


@pytest.mark.parametrize("placement", SCORING_PATHS, ids=SCORING_PATH_IDS)
def test_truncated_completions_are_marked_for_the_actor_on_workers(cluster, tmp_path, placement):
    """Completions cut at ``rollout.max_new_tokens`` reach the actor marked (``truncated``, what
    ``algorithm.mask_truncated_completions`` leaves out of the loss), through every hand-off, and their share
    is logged as ``rollout/truncated_frac``."""
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=2", "actor.sft_steps=5",
                 "rollout.max_new_tokens=2", "algorithm.mask_truncated_completions=true", *placement]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        rows = [row for g in range(loop.recipe.data.prompts_per_step) for row in _group_or_none(loop, g)]
        shares = [r["rollout/truncated_frac"] for r in loop.history if "rollout/truncated_frac" in r]
    assert len(shares) == 2 and 0 < shares[-1] <= 1
    assert {row["truncated"] for row in rows} <= {True, False} and any(row["truncated"] for row in rows)
    if "actor,rollout,reward" in placement[0]:  # one rank holds the whole batch
        assert sum(row["truncated"] for row in rows) / len(rows) == pytest.approx(shares[-1])


def test_completions_are_logged_every_interval_and_resume_drops_later_ones(cluster, tmp_path):
    """``runner.completions_interval`` (TRL's log_completions): the group actor rank 0 trained on, written on
    the driver every N steps to completions.jsonl; a resume from an earlier checkpoint drops the rows of the
    steps it recomputes, as it drops their metrics."""
    from rlnb.metrics import read_table

    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=4", "actor.sft_steps=5",
                 "runner.completions_interval=2", "runner.save_interval=2"]  # fmt: skip
    run_dir = tmp_path / "run"
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=run_dir) as loop:
        loop.run(progress=False)
        group_size = loop.recipe.algorithm.group_size
    rows = read_table(run_dir)
    assert [r["step"] for r in rows] == [2] * group_size + [4] * group_size
    assert {"prompt", "completion", "reward", "advantage"} <= set(rows[0])
    assert len({r["prompt"] for r in rows if r["step"] == 2}) == 1  # one prompt's group
    import shutil

    shutil.rmtree(run_dir / "checkpoints" / "step_000004")  # as if the run died after step 4's rows
    with GRPOLoop.resume(run_dir) as loop:
        assert loop.step == 2
        assert [r["step"] for r in read_table(run_dir)] == [2] * group_size
        loop.run(progress=False)
    assert [r["step"] for r in read_table(run_dir)] == [2] * group_size + [4] * group_size


def test_completions_interval_is_refused_for_an_env_recipe():
    from rlnb.config import load_recipe

    with pytest.raises(rlnb.ConfigError, match=r"runner.completions_interval: 2 logs an LM's completions"):
        load_recipe("ppo_cartpole", ["runner.completions_interval=2"])
