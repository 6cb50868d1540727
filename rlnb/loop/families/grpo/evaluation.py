"""The GRPO family's evaluation on held-out problems (greedy answers scored by the reward) and its views into a
batch: one prompt's group with its rewards and advantages, fresh completions of any prompt."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from rlnb.algorithms.estimators import ks_up_to, pass_at_k
from rlnb.data.prompts import Problem, chat_prompts, is_conversation
from rlnb.errors import ComponentError
from rlnb.loop.families.grpo.data import shard
from rlnb.loop.phase import count_or_default

log = logging.getLogger("rlnb")


def evaluate(family, size: int | None = None, samples: int | None = None) -> dict:
    """Greedy answers to ``size`` held-out problems (default ``data.eval_size``) with the rollout's weights (the
    loop sends it the current ones first), scored by the reward: logs ``eval/accuracy``; or ``samples`` (default
    ``data.eval_samples``) > 1 completions a problem, sampled: pass@k and avg@n (:func:`eval_record`). Each
    problem's completions and scores go to ``<run_dir>/eval/step-<step>.jsonl``."""
    from rlnb.config.sections_lm import DataConfig

    s = family.session
    size = count_or_default(size, "size", s.recipe.data.eval_size, (DataConfig, "eval_size"))
    samples = count_or_default(samples, "samples", s.recipe.data.eval_samples, (DataConfig, "eval_samples"))
    rollout = s.groups["rollout"]
    check_samples(family, samples)
    t0 = time.perf_counter()
    problems = family.task.held_out[:size]
    full, more = family.capabilities.takes_records, (samples,) if samples > 1 else ()

    def args(part: list) -> tuple:
        prompts = [p.prompt for p in part]
        if full:
            return (prompts, [p.answer for p in part], [p.fields for p in part], *more)
        return (prompts, None, None, *more) if more else (prompts,)

    texts = [
        t
        for part in rollout.call_each(
            "complete", [args(part) for part in shard(problems, rollout.world_size)]
        ).result()
        for t in part
    ]
    each = [p for p in problems for _ in range(samples)]  # (a problem's samples side by side)
    scored = (
        s.groups["reward"]
        .on(0)
        .score_terms(texts, [p.answer for p in each], [p.prompt for p in each], [p.fields for p in each])
        .result()[0]
    )
    record, rows = eval_record(scored, problems, texts, samples, t0)
    write_results(s.run_dir, s.step, rows)  # (read-only too: rlnb eval's answers, a file of their own)
    s.logger.log(s.step, record)
    family.last_samples = [
        (p.prompt, t, p.answer) for p, t in zip(each[: 8 * samples : samples], texts[::samples])
    ]
    return record


def check_samples(family, samples: int) -> None:
    """Refuse ``samples`` > 1 completions a problem where the rollout's ``complete`` gives the greedy one only."""
    if samples > 1 and not family.capabilities.samples_completions:
        rollout = family.session.groups["rollout"]
        raise ComponentError(
            f"data.eval_samples: {samples} completions a problem need a rollout whose complete() samples n of them "
            "(rlnb.loop.roles.SamplesCompletions, as the built-in rollouts); this one gives the greedy one only",
            rollout.name, rollout.cls.__name__, "complete",
        )  # fmt: skip


def eval_record(scored: dict, problems: list, texts: list[str], samples: int, t0: float) -> tuple[dict, list]:
    """The evaluation's record from the reward's ``score_terms`` of ``samples`` completions a problem (begun at
    ``t0``), and its rows, one a problem. A completion is correct where the first reward scored it >= 1. One
    sample (greedy): ``eval/accuracy``; more: ``eval/pass_at/k`` (the unbiased estimator, averaged over problems)
    for k = 1, 2, 4, ... and ``n``, and ``eval/avg_at/n``; both: the mean reward, how many problems, seconds."""
    scores, first = scored["rewards"], next(iter(scored["terms"].values()))
    n = samples
    correct = [sum(1 for x in first[i * n : (i + 1) * n] if x >= 1.0) for i in range(len(problems))]
    record: dict = {}
    if n == 1:
        record["eval/accuracy"] = sum(correct) / len(correct)
    else:
        for k in ks_up_to(n):
            record[f"eval/pass_at/{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(correct)
        record[f"eval/avg_at/{n}"] = sum(correct) / (n * len(correct))
    record.update({"eval/reward_mean": sum(scores) / len(scores), "eval/size": len(problems),
                   "time/eval_s": time.perf_counter() - t0})  # fmt: skip
    rows = [
        {
            "prompt": p.prompt,
            "answer": p.answer,
            "completions": texts[i * n : (i + 1) * n],
            "rewards": scores[i * n : (i + 1) * n],
            "correct": correct[i],
        }
        for i, p in enumerate(problems)
    ]
    return record, rows


def write_results(run_dir, step: int, rows: list[dict]) -> Path | None:
    """``rows`` (one a problem) as JSON lines in ``<run_dir>/eval/step-<step>.jsonl``, ``0600``, written beside and
    renamed over (a reader never sees half a file); the folder made ``0700``, never through a link out of the run.
    A run directory this process may not write to (``rlnb eval`` of another user's run) gets none: ``None``, said
    once in the log; the evaluation's figures stand."""
    from rlnb.files import check_inside, write_private

    folder = Path(run_dir) / "eval"
    final = folder / f"step-{step:07d}.jsonl"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        check_inside(folder, run_dir)
        tmp = folder / f".{final.name}.tmp"
        write_private(tmp, "".join(json.dumps(row, default=str) + "\n" for row in rows))
        os.replace(tmp, final)
    except PermissionError as e:
        log.warning("evaluation: each problem's answers not written (%s)", e)
        return None
    return final


def evaluate_checkpoint(run_dir, size: int | None = None, samples: int | None = None) -> dict | None:
    """:func:`evaluate` of an LM run's latest checkpoint in this process, without a cluster (``rlnb eval``): the
    actor's weights (:func:`rlnb.export.lm_actor_from_checkpoint`) in the built-in ``transformers`` rollout, the
    recipe's held-out problems and rewards, ``samples`` completions a problem (as :func:`evaluate`). Returns the
    record with its ``step`` and the ``results`` file, or ``None`` where a cluster is needed (weights in DCP
    shards; ``rollout.backend: vllm``, whose engine decodes otherwise)."""
    from rlnb.algorithms.rewards import recipe_rewards
    from rlnb.components.lm import HFRollout, RewardWorker
    from rlnb.config.sections_lm import DataConfig
    from rlnb.data.prompts import common_fields
    from rlnb.export import lm_actor_from_checkpoint
    from rlnb.loop.families.grpo.data import recipe_interaction, recipe_task

    t0 = time.perf_counter()
    found = lm_actor_from_checkpoint(run_dir)
    if found is None:
        return None
    actor, r, step = found
    if r.rollout.backend != "hf":
        return None
    size = count_or_default(size, "size", r.data.eval_size, (DataConfig, "eval_size"))
    samples = count_or_default(samples, "samples", r.data.eval_samples, (DataConfig, "eval_samples"))
    model_path = actor.cfg.model_path
    task, _chat = recipe_task(r, model_path)
    problems, ro = task.held_out[:size], r.rollout
    fields = common_fields(task.train, task.held_out)
    extra = (
        {"max_turns": ro.max_turns, "interaction": recipe_interaction(r, model_path, fields)}
        if ro.max_turns > 1
        else {}
    )
    rollout = HFRollout(
        model_path, max_new_tokens=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
        seed=r.seed, device="cpu", torch_threads=r.actor.torch_threads, drop_finished=ro.drop_finished,
        dtype=r.actor.dtype if ro.dtype == "auto" else ro.dtype, static_cache=ro.static_cache, **extra,
    )  # fmt: skip
    rollout.load_weights(actor.policy_state(), 1)
    texts = rollout.complete(
        [p.prompt for p in problems], [p.answer for p in problems], [p.fields for p in problems], samples
    )
    reward = RewardWorker(
        weights=r.reward.weights, fields=fields, sandbox=r.reward.sandbox,
        fn=recipe_rewards(r.reward.name, r.reward.model_path, r.reward.model_batch_size),
    )  # fmt: skip
    each = [p for p in problems for _ in range(samples)]
    scored = reward.score_terms(
        texts, [p.answer for p in each], [p.prompt for p in each], [p.fields for p in each]
    )
    record, rows = eval_record(scored, problems, texts, samples, t0)
    written = write_results(run_dir, step, rows)
    return {"step": step, **record, "results": str(written) if written else None}


def inspect(family, prompt: str, top_k: int, max_new_tokens: int | None):
    """:meth:`rlnb.GRPOLoop.inspect`: rollout rank 0's token-by-token view of ``prompt``'s greedy completion."""
    import pandas as pd

    from rlnb.errors import ComponentError

    s = family.session
    rollout = s.groups["rollout"]
    if not family.capabilities.inspects_tokens:
        raise ComponentError(
            "shows no completion token by token (loop.inspect): its class has no inspect(prompt, top_k, "
            "max_new_tokens); the built-in transformers rollout (rollout.backend=hf) has",
            rollout.name, rollout.cls.__name__, "inspect",
        )  # fmt: skip
    if family.chat is not None:
        prompt = chat_prompts([Problem(prompt, "")], family.chat, s.recipe.data.system_prompt)[0].prompt
    rows = s.bind_checked([rollout.on(0).inspect(prompt, top_k, max_new_tokens)])[0][0]
    return pd.DataFrame(rows)


def try_prompt(family, prompt: str, answer: str, **fields) -> list[dict]:
    """``group_size`` completions of ``prompt`` sampled with the rollout's current weights, scored by the reward and
    normalised by the advantage as a training batch would be (see :meth:`rlnb.GRPOLoop.try_prompt`)."""
    import torch

    from rlnb.algorithms import ADVANTAGES

    s = family.session
    algorithm = s.recipe.algorithm
    size = algorithm.group_size
    if family.chat is not None:
        prompt = chat_prompts([Problem(prompt, answer)], family.chat, s.recipe.data.system_prompt)[0].prompt
    elif is_conversation(prompt):  # objects path: through the rollout's tokenizer
        prompt = family.template([prompt])[0]
    rollout = s.groups["rollout"]
    args = (prompt, size, answer, fields) if family.capabilities.takes_records else (prompt, size)
    texts = rollout.on(0).sample_completions(*args).result()[0]
    scored = (
        s.groups["reward"]
        .on(0)
        .score_terms(texts, [answer] * size, [prompt] * size, [fields] * size)
        .result()[0]
    )
    rewards, terms = scored["rewards"], scored["terms"]
    offered = {"rewards": torch.tensor(rewards, dtype=torch.float32), "group_size": size}
    offered.update(scale=algorithm.scale, gamma=algorithm.gamma, kl_coef=0.0)
    advantages = ADVANTAGES.entry(algorithm.advantage)(**offered)
    advantages = advantages[0] if isinstance(advantages, tuple) else advantages
    rows = [
        {"completion": t, "reward": r, "advantage": float(a)} for t, r, a in zip(texts, rewards, advantages)
    ]
    if len(terms) > 1:  # several rewards: each one's score
        for i, row in enumerate(rows):
            row["rewards"] = {name: scores[i] for name, scores in terms.items()}
    return rows


def sample_group(family, group: int = 0) -> list[dict]:
    """One prompt's group of completions in the batch actor rank 0 trains on: prompt, completion, reward, sampling
    log-prob and, after the advantages phase, the normalised advantage of each."""
    return family.session.groups["actor"].on(0).sample_group(group).result()[0]
