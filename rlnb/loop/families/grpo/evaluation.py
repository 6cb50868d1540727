"""The GRPO family's evaluation on held-out problems (greedy answers scored by the reward) and its views into a
batch: one prompt's group with its rewards and advantages, fresh completions of any prompt."""

from __future__ import annotations

import time

from rlnb.data.prompts import Problem, chat_prompts, is_conversation
from rlnb.loop.families.grpo.data import shard
from rlnb.loop.phase import count_or_default


def evaluate(family, size: int | None = None) -> dict:
    """Greedy answers to ``size`` held-out problems (default ``data.eval_size``) with the rollout's weights (the
    loop sends it the current ones first), scored by the reward: logs ``eval/accuracy``."""
    from rlnb.config.sections_lm import DataConfig

    s = family.session
    size = count_or_default(size, "size", s.recipe.data.eval_size, (DataConfig, "eval_size"))
    t0 = time.perf_counter()
    problems = family.task.held_out[:size]
    rollout = s.groups["rollout"]
    full = family.capabilities.takes_records
    texts = [
        t
        for part in rollout.call_each(
            "complete",
            [
                ([p.prompt for p in part], [p.answer for p in part], [p.fields for p in part])
                if full
                else ([p.prompt for p in part],)
                for part in shard(problems, rollout.world_size)
            ],
        ).result()
        for t in part
    ]
    scored = (
        s.groups["reward"]
        .on(0)
        .score_terms(
            texts, [p.answer for p in problems], [p.prompt for p in problems], [p.fields for p in problems]
        )
        .result()[0]
    )
    scores, first = scored["rewards"], next(iter(scored["terms"].values()))
    record = {
        "eval/accuracy": sum(1.0 for x in first if x >= 1.0) / len(first),
        "eval/reward_mean": sum(scores) / len(scores),
        "eval/size": len(scores),
        "time/eval_s": time.perf_counter() - t0,
    }
    s.logger.log(s.step, record)
    family.last_samples = [(p.prompt, t, p.answer) for p, t in zip(problems[:8], texts[:8])]
    return record


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
