"""Advertised options exercised where they really run: on Dask workers, through the loop or the CLI."""

import json

import rlnb
from rlnb.loop import GRPOLoop
from tests.test_lm import GRPO_SMALL


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
