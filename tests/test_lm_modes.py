"""The LM loop's modes on workers: dynamic sampling, conversational records, multi-turn and tool calls, target_kl."""

import json
import math
import re

import pytest

import rlnb
from rlnb.loop import GRPOLoop
from rlnb.loop.families.grpo.data import turn_demonstrations
from tests.conftest import last_answer
from tests.test_lm import GRPO_SMALL
from tests.test_rewards import SCORING_PATH_IDS, SCORING_PATHS, _group_or_none


def test_lm_actor_honours_target_kl_and_anneal_lr_and_accepts_compile(cluster, tmp_path):
    # 60 SFT steps: ~1 answer in 8 right, so groups differ in reward and the update moves the policy (after
    # 10 steps, ~2 of 128 were: a step whose groups were all wrong moved it by weight decay alone, ~1e-12)
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=2", "actor.sft_steps=60",
                 "algorithm.update_epochs=3", "algorithm.target_kl=1e-12", "actor.anneal_lr=true"]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        trained = [r for r in loop.history if "train/epochs" in r]
    # epoch 1 starts at the sampling policy (approx_kl 0); after it the KL exceeds the target: 2 of 3 epochs
    assert [r["train/epochs"] for r in trained] == [2.0, 2.0]
    lr = loop.recipe.actor.lr
    assert [r["train/lr"] for r in trained] == pytest.approx([lr, lr / 2])  # annealed over runner.steps=2
    # actor.compile=true is served now (tests/test_compile.py compiles the LM actor's step on a worker)
    assert rlnb.config.load_recipe("grpo_arith", ["actor.compile=true"]).actor.compile is True


def odd_length_if_mixed(completion: str, mixed: int) -> float:
    """A learning signal only for records with ``mixed=1``: their groups' completions score 0 or 1 by length;
    a ``mixed=0`` record's group scores 0 throughout."""
    return float(mixed and len(completion) % 2)


@pytest.mark.parametrize(
    "placement", [*SCORING_PATHS[:2], []], ids=[*SCORING_PATH_IDS[:2], "two-rollout-ranks-data-parallel"]
)
def test_dynamic_sampling_fills_the_batch_with_groups_that_have_a_signal(
    cluster, tmp_path, monkeypatch, placement
):
    """``algorithm.dynamic_sampling`` (DAPO; veRL's filter_groups), on workers: half the records can give a
    learning signal; the trained batch holds only their groups, after more than one round of sampling."""
    from rlnb.algorithms.rewards import REWARDS, register_reward

    monkeypatch.setattr(REWARDS, "_items", dict(REWARDS._items))
    register_reward("odd_length_if_mixed")(odd_length_if_mixed)
    rows = [
        {"question": f"{a}+{b}=", "answer": str(a + b), "mixed": (a + b) % 2}
        for a in range(10)
        for b in range(10)
    ]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    mixed = {r["question"]: r["mixed"] for r in rows}
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=2", "actor.sft_steps=0",
                 "data.task=file", f"data.path={tmp_path / 'data.jsonl'}", "reward.name=odd_length_if_mixed",
                 "rollout.max_new_tokens=6", "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=6",
                 *placement]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        groups = [g for i in range(loop.recipe.data.prompts_per_step) if (g := _group_or_none(loop, i))]
    steps = [r for r in loop.history if "rollout/sampling_rounds" in r]
    assert len(steps) == 2 and all(r["rollout/sampling_rounds"] >= 2 for r in steps), steps
    assert all(r["rollout/informative_frac"] == 1.0 and r["rollout/signal_frac"] < 0.8 for r in steps), steps
    assert groups and all(mixed[g[0]["prompt"]] == 1 for g in groups)
    assert all(len({row["reward"] for row in g}) == 2 for g in groups)  # each with a signal


@pytest.mark.parametrize(
    "recipe,overrides,message",
    [
        ("grpo_arith", ["algorithm.dynamic_sampling=true", "algorithm.max_staleness=1",
                        "cluster.component_placement={'rollout,reward': 0, actor: 1}"],
         r"algorithm.dynamic_sampling: .*with algorithm.max_staleness=1 \(asynchronous\)"),
        ("grpo_arith", ["algorithm.max_sampling_rounds=0"], r"algorithm.max_sampling_rounds: expected an integer in \[1, 10000\]"),
        ("ppo_cartpole", ["algorithm.dynamic_sampling=true"], r"algorithm.dynamic_sampling: it filters an LM's groups"),
    ],
)  # fmt: skip
def test_dynamic_sampling_misfits_are_refused_naming_the_key(recipe, overrides, message):
    from rlnb.config import load_recipe

    with pytest.raises(rlnb.ConfigError, match=message):
        load_recipe(recipe, overrides)


CONVERSATIONS = [
    {
        "prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": f"{a}+{b}="}],
        "answer": str(a + b),
    }
    for a in range(8)
    for b in range(8)
]


def test_conversational_records_train_through_the_chat_template_on_workers(cluster, tmp_path):
    """TRL's conversational records (``prompt``: a list of messages) in a data file: each conversation goes
    through the model's chat template, its own system turn included; without data.chat_template it is refused."""
    data = tmp_path / "conversations.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in CONVERSATIONS))
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=2", "actor.sft_steps=5",
                 "data.task=file", f"data.path={data}", "data.question_key=prompt"]  # fmt: skip
    with pytest.raises(rlnb.ConfigError, match=r"data.chat_template: 64 record\(s\) of .* are conversations"):
        GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "refused")
    with GRPOLoop.from_recipe(
        "grpo_arith", [*overrides, "data.chat_template=true"], cluster=cluster, run_dir=tmp_path / "run"
    ) as loop:
        loop.run(progress=False)
        row = loop.sample_group(0)[0]
        tried = loop.try_prompt([{"role": "user", "content": "2+3="}], "5")
    # the tiny template: <bos>, a system line, "Q: " user turns, the assistant's "A: " opened
    assert row["prompt_tokens"].startswith("<bos>Add.\nQ: ") and row["prompt_tokens"].endswith("=\nA: "), row
    assert len(tried) == loop.recipe.algorithm.group_size


def test_conversational_records_from_objects_use_the_rollouts_template(cluster, tmp_path):
    from rlnb.models import build_tiny_lm

    model = str(build_tiny_lm(tmp_path / "tiny", hidden_size=32, num_layers=1, num_heads=2))
    rollout = rlnb.HFRollout.launch(cluster, "0", model_path=model, max_new_tokens=2)
    actor = rlnb.LMActor.launch(cluster, "1", model_path=model, group_size=4)
    with GRPOLoop(
        rollout=rollout, actor=actor, reward="arithmetic", prompts=CONVERSATIONS, prompts_per_step=4,
        runner={"tensorboard": False}, run_dir=tmp_path / "run",
    ) as loop:  # fmt: skip
        assert all(
            p.prompt.startswith("<bos>Add.\nQ: ") and p.prompt.endswith("=\nA: ") for p in loop.task.train
        )
        record = loop.step_once()
    assert math.isfinite(record["train/loss"])


def test_a_multi_turn_run_answers_again_after_a_wrong_answer_and_trains_on_the_models_turns_on_workers(
    cluster, tmp_path, monkeypatch
):
    """``rollout.max_turns=3`` with ``arithmetic_retry`` on workers: a wrong answer is told `` no. `` and the
    model answers again, up to three times; a right one ends the transcript. The reward scores the whole
    transcript, the model's own turns are what the actor's recomputed log-probs match (the first epoch's ratio
    is 1: the replies are out of the mask), and evaluation runs the same turns greedily."""
    import re

    from rlnb.algorithms.rewards import REWARDS, register_reward

    monkeypatch.setattr(REWARDS, "_items", dict(REWARDS._items))
    register_reward("last_answer")(last_answer)
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=2", "actor.sft_steps=40",
                 "rollout.max_turns=3", "rollout.interaction=arithmetic_retry", "reward.name=last_answer",
                 "runner.eval_interval=2", "data.eval_size=8",
                 "cluster.component_placement={'actor,rollout,reward': 0}"]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        rows = [row for g in range(loop.recipe.data.prompts_per_step) for row in _group_or_none(loop, g)]
        history, evaluated = loop.history, loop.last_samples
    assert len(rows) == 16 * 8
    replies = [row["completion"].count(" no. ") for row in rows]
    assert max(replies) == 2 and 0 in replies and 1 in replies  # retried, up to max_turns - 1 times
    for row, n in zip(rows, replies):
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", row["prompt"]).groups())
        assert row["reward"] == last_answer(row["completion"], str(a + b))
        if n < 2:  # the transcript ended early: its last answer was right
            assert row["reward"] == 1.0
    trained = [r for r in history if "train/ratio_mean" in r]
    assert len(trained) == 2 and all(abs(r["train/ratio_mean"] - 1) < 1e-4 for r in trained)
    # the model's turns: one more than the replies; the step's mean over all 128 transcripts
    assert trained[-1]["rollout/turns_mean"] == pytest.approx(1 + sum(replies) / len(replies))
    assert all(abs(r["train/approx_kl"]) < 1e-6 for r in trained)
    assert {r["eval/size"] for r in history if "eval/size" in r} == {8}
    for (
        _,
        text,
        answer,
    ) in evaluated:  # greedy transcripts: told `` no. `` exactly when the first answer is wrong
        assert text.count(" no. ") <= 2 and (" no. " in text) == (
            last_answer(text.split(" no. ")[0], answer) < 1
        )


@pytest.mark.parametrize(
    "recipe, overrides, message",
    [
        ("grpo_arith", ["rollout.max_turns=0"], r"rollout.max_turns: expected an integer in \[1, 1000\]"),
        ("grpo_arith", ["rollout.max_turns=2"], "rollout.interaction: with rollout.max_turns=2 something must"),
        ("grpo_arith", ["rollout.interaction=arithmetic_retry"], "rollout.interaction: it answers between"),
        ("grpo_arith", ["rollout.max_turns=2", "rollout.interaction=arithmetic_retyr"],
         "rollout.interaction: unknown interaction 'arithmetic_retyr'.*Did you mean 'arithmetic_retry'"),
        ("ppo_cartpole", ["rollout.max_turns=2", "rollout.interaction=arithmetic_retry"],
         "rollout.max_turns: turns of an LM's conversation"),
    ],
)  # fmt: skip
def test_multi_turn_misfits_are_refused_naming_the_key(recipe, overrides, message):
    with pytest.raises(rlnb.ConfigError, match=message):
        rlnb.config.load_recipe(recipe, overrides)


def test_grpo_with_a_retry_raises_the_final_answers_reward_on_workers(cluster, tmp_path, monkeypatch):
    """Two turns (``arithmetic_retry``), rewarded on the transcript's last answer, over two data-parallel ranks:
    seeded, 80 steps take the reward's mean from 0.49 to 0.59 (first and last ten steps); threshold +0.05."""
    from rlnb.algorithms.rewards import REWARDS, register_reward

    monkeypatch.setattr(REWARDS, "_items", dict(REWARDS._items))
    register_reward("last_answer")(last_answer)
    overrides = [*GRPO_SMALL, f"actor.model_path={tmp_path / 'model'}", "runner.steps=80", "rollout.max_turns=2",
                 "rollout.interaction=arithmetic_retry", "reward.name=last_answer"]  # fmt: skip
    with GRPOLoop.from_recipe("grpo_arith", overrides, cluster=cluster, run_dir=tmp_path / "run") as loop:
        loop.run(progress=False)
        rewards = [r["reward/mean"] for r in loop.history if "reward/mean" in r]
        accuracy = loop.evaluate()["eval/accuracy"]
    assert len(rewards) == 80
    assert sum(rewards[-10:]) / 10 >= sum(rewards[:10]) / 10 + 0.05, rewards
    assert accuracy >= 0.5


def hinted(completion: str, turn: int, hint: str) -> str | None:
    """An interaction reading a field of each prompt record (as a notebook cell would define it)."""
    return f" {hint}{turn}:" if turn < 3 else None


def test_an_interaction_function_reads_each_records_fields_on_the_objects_path(cluster, tmp_path):
    """``HFRollout.launch(..., max_turns=3, interaction=fn)``: a plain function travels to the worker and is
    given each completion's own record's field and its turn; the loop evaluates with the same turns."""
    from rlnb.models import build_tiny_lm

    model = str(build_tiny_lm(tmp_path / "tiny", hidden_size=32, num_layers=1, num_heads=2))
    records = [
        {"question": f"{a}+{b}=", "answer": str(a + b), "hint": "xy"[a % 2]}
        for a in range(6)
        for b in range(3)
    ]
    rollout = rlnb.HFRollout.launch(
        cluster, "0", model_path=model, max_new_tokens=2, max_turns=3, interaction=hinted
    )
    actor = rlnb.LMActor.launch(cluster, "1", model_path=model, group_size=4)
    with GRPOLoop(
        rollout=rollout, actor=actor, reward="arithmetic", prompts=records, prompts_per_step=4,
        runner={"tensorboard": False}, run_dir=tmp_path / "run",
    ) as loop:  # fmt: skip
        record = loop.step_once()
        rows = loop.sample_group(0) + loop.sample_group(1)
        loop.evaluate(4)
        evaluated = loop.last_samples
        tried = loop.try_prompt("3+1=", "4", hint="z")  # as training samples it: the same turns
    assert math.isfinite(record["train/loss"]) and abs(record["train/ratio_mean"] - 1) < 1e-4
    for row in rows:
        hint = "xy"[int(row["prompt"].split("+")[0]) % 2]
        assert f" {hint}1:" in row["completion"] and f" {hint}2:" in row["completion"], row
    assert all(f" {'xy'[int(p.split('+')[0]) % 2]}2:" in text for p, text, _ in evaluated)
    assert len(tried) == 4 and all(" z1:" in r["completion"] and " z2:" in r["completion"] for r in tried)


def final_answer(completion: str, answer: str) -> float:
    """A tool-use reward: 1.0 if what the transcript says after the tool's last result is the answer."""
    return 1.0 if completion.rsplit(";", 1)[-1].strip() == answer else 0.0


def test_the_calculator_on_the_objects_path_trains_on_tool_transcripts_on_workers(cluster, tmp_path):
    """Agentic RL with a tool, built from objects: two-digit products the tiny model cannot compute, a
    ``calculator`` interaction named on the rollout ranks, a reward function from this file, and a warm start
    (``actor.sft`` with an imperfect teacher's rows) that calls the tool wrong (``calc(a+b)``) 65 % of the time and
    copies its result after. Held-out greedy accuracy after the warm start: 0.0, the model calling the wrong
    expression through the tool; then GRPO steps train on the transcripts on two data-parallel ranks. (That GRPO
    learns the right call is the recipe's test below and notebook 02's: the same run twice more was 4 minutes of
    the suite under load.)"""
    import random

    from rlnb.models import build_tiny_lm

    problems = [(a, b) for a in range(10, 40) for b in range(10, 40)]
    random.Random(0).shuffle(problems)
    records = [{"question": f"{a}*{b}=", "answer": str(a * b)} for a, b in problems[:800]]
    model = str(build_tiny_lm(tmp_path / "tiny", hidden_size=64, num_layers=2, num_heads=4, seed=0))
    rollout = rlnb.HFRollout.launch(
        cluster, "0-1", model_path=model, max_new_tokens=12, max_turns=2, interaction="calculator"
    )
    actor = rlnb.LMActor.launch(cluster, "0-1", model_path=model, group_size=8, lr=2e-4)
    with GRPOLoop(
        rollout=rollout, actor=actor, reward=final_answer, prompts=records, prompts_per_step=16, eval_size=100,
        runner={"tensorboard": False, "eval_interval": 0}, run_dir=tmp_path / "run",
    ) as loop:  # fmt: skip
        train = [tuple(map(int, p.prompt[:-1].split("*"))) for p in loop.task.train]
        # the warm start: the call (right or wrong), then the answer after the tool's result
        calls = [f"{a}*{b}=" for a, b in train]
        copies = [f"{a}*{b}=calc({a}*{b})<eos> = {a * b};" for a, b in train]
        right = [f"calc({a}*{b})" for a, b in train] + [str(a * b) for a, b in train]
        wrong = [f"calc({a}+{b})" for a, b in train] + [str(a * b) for a, b in train]
        actor.sft(calls + copies, right, 300, 32, 3e-3, wrong, 0.65).result()
        before = loop.evaluate()["eval/accuracy"]
        shown = loop.last_samples
        records_ = loop.run(3, progress=False)
    wrong_calls = sum("+" in text for _, text, _ in shown)
    assert before <= 0.2 and wrong_calls >= 6, (before, wrong_calls)  # it calls calc(a+b)
    calls = [(m, text) for _, text, _ in shown if (m := re.match(r"calc\((\d+)([+*])(\d+)\)", text))]
    assert len(calls) >= 6, shown
    for m, text in calls:  # each through the tool: the call, then the calculator's reply after it
        a, op, b = int(m[1]), m[2], int(m[3])
        assert text.startswith(f"{m[0]} = {a + b if op == '+' else a * b};"), text
    assert len(records_) == 3 and all(math.isfinite(r["train/loss"]) for r in records_), records_
    assert all(r["rollout/turns_mean"] > 1 for r in records_), records_  # the tool's turn in every batch


def test_the_calculator_recipes_warm_start_rows_are_each_problems_conversation_turn_by_turn(
    cluster, tmp_path
):
    """``grpo_calculator``: the warm start's rows are each problem's conversation turn by turn, the calculator
    replying between them as in training (``data.sft_turns``); the imperfect teacher's call is ``calc(a+b)`` on
    65 % of the first turns and the second turn copies the right result. (That GRPO then learns the right call,
    held-out accuracy from at most 0.2 after the warm start to at least 0.8, is notebook 02's check: it runs
    this recipe as shipped.)"""
    overrides = [
        f"actor.model_path={tmp_path / 'model'}",
        "runner.tensorboard=false",
        "runner.eval_interval=0",
    ]
    with GRPOLoop.from_recipe(
        "grpo_calculator", overrides, cluster=cluster, run_dir=tmp_path / "run"
    ) as loop:
        contexts, targets, wrong_contexts, wrong_targets = turn_demonstrations(loop.task, loop.recipe)
        n = len(loop.task.train)
    assert len(contexts) == len(wrong_contexts) == 2 * n
    (first, call), (after, answer) = zip(contexts[:2], targets[:2])
    a, b = map(int, first[:-1].split("*"))
    assert call == f"calc({a}*{b})" and answer == str(a * b)
    assert after == [first, call, f" = {a * b};"]  # the calculator's own reply, as in training
    assert wrong_targets[0] == f"calc({a}+{b})" and (wrong_contexts[1], wrong_targets[1]) == (after, answer)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.sft_turns=['calc({expresion})', '{answer}']"],
         r"data.sft_turns: 'calc\({expresion}\)' names {expresion}; .*Did you mean 'expression'"),
        (["data.sft_noise_turns=['calc({a}+{b})']"],
         r"data.sft_noise_turns: expected a list of 2 format strings or nulls"),
        (["data.sft_noise_turns=null"], r"data.sft_noise: 0.65 of a multi-turn warm start's demonstrations"),
        (["rollout.max_turns=1", "rollout.interaction=null"], r"data.sft_turns: 2 turns, and the rollout takes"),
        (["data.min_operand=40"], r"data.min_operand: expected an integer from 0 to data.max_operand \(39\), got 40"),
        (["data.sft_turns=null"], r"data.sft_noise_turns: the imperfect teacher's turns need data.sft_turns"),
    ],
)  # fmt: skip
def test_the_calculator_recipes_warm_start_settings_are_checked_naming_the_key(overrides, message):
    with pytest.raises(rlnb.ConfigError, match=message):
        rlnb.config.load_recipe("grpo_calculator", overrides)
