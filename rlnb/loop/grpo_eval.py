"""The GRPO loop's evaluation on held-out problems (greedy answers scored by the reward) and its views into a
batch: one prompt's group with its rewards and advantages, fresh completions of any prompt."""

from __future__ import annotations

import time

from rlnb.data.prompts import Problem, chat_prompts, is_conversation
from rlnb.loop.base import count_or_default
from rlnb.loop.grpo_data import shard, takes_records


class GRPOEvaluation:
    """A mixin of :class:`rlnb.loop.grpo.GRPOLoop`."""

    def evaluate(self, size: int | None = None) -> dict:
        """Greedy answers to held-out problems, scored by the reward: logs ``eval/accuracy``.

        In asynchronous mode it first lets the generation in flight finish (its batch is kept for the
        next :meth:`rollout`); the groups still in the pools go on with the current weights after it. ``size``:
        how many held-out problems (default ``data.eval_size``)."""
        size = count_or_default(size, "size", self.recipe.data.eval_size)
        t0 = time.perf_counter()
        self._settle_in_flight()
        self._sync_rollout()  # evaluate the current weights
        problems = self.task.held_out[:size]
        rollout = self.groups["rollout"]
        full = takes_records(rollout)
        texts = [
            t
            for part in rollout.call_each(
                "complete",
                [
                    ([p.prompt for p in s], [p.answer for p in s], [p.fields for p in s])
                    if full
                    else ([p.prompt for p in s],)
                    for s in shard(problems, rollout.world_size)
                ],
            ).result()
            for t in part
        ]
        scored = (
            self.groups["reward"]
            .on(0)
            .score_terms(
                texts,
                [p.answer for p in problems],
                [p.prompt for p in problems],
                [p.fields for p in problems],
            )
            .result()[0]
        )
        scores, first = scored["rewards"], next(iter(scored["terms"].values()))
        record = {
            "eval/accuracy": sum(1.0 for s in first if s >= 1.0) / len(first),
            "eval/reward_mean": sum(scores) / len(scores),
            "eval/size": len(scores),
            "time/eval_s": time.perf_counter() - t0,
        }
        self.logger.log(self.step, record)
        self.last_samples = [(p.prompt, t, p.answer) for p, t in zip(problems[:8], texts[:8])]
        return record

    def try_prompt(self, prompt: str, answer: str, **fields) -> list[dict]:
        """``group_size`` completions of ``prompt`` sampled with the rollout's current weights, scored by the
        reward and normalised by the advantage as a training batch would be; nothing in the run changes.
        Call it before and after training to see what GRPO did to one prompt. With ``data.chat_template``, the
        prompt is a question, given as the training prompts are (a user turn of the chat template). ``fields``:
        the record's other fields a reward reads (``tests=[...]``)."""
        import torch

        from rlnb.algorithms import ADVANTAGES

        algorithm = self.recipe.algorithm
        size = algorithm.group_size
        if self._chat is not None:
            prompt = chat_prompts([Problem(prompt, answer)], self._chat, self.recipe.data.system_prompt)[
                0
            ].prompt
        elif is_conversation(prompt):  # objects path: through the rollout's tokenizer
            prompt = self._template([prompt])[0]
        rollout = self.groups["rollout"]
        args = (prompt, size, answer, fields) if takes_records(rollout) else (prompt, size)
        texts = rollout.on(0).sample_completions(*args).result()[0]
        scored = (
            self.groups["reward"].on(0).score_terms(texts, [answer] * size, [prompt] * size, [fields] * size)
        ).result()[0]
        rewards, terms = scored["rewards"], scored["terms"]
        offered = {"rewards": torch.tensor(rewards, dtype=torch.float32), "group_size": size}
        offered.update(scale=algorithm.scale, gamma=algorithm.gamma, kl_coef=0.0)
        advantages = ADVANTAGES.entry(algorithm.advantage)(**offered)
        advantages = advantages[0] if isinstance(advantages, tuple) else advantages
        rows = [
            {"completion": t, "reward": r, "advantage": float(a)}
            for t, r, a in zip(texts, rewards, advantages)
        ]
        if len(terms) > 1:  # several rewards: each one's score
            for i, row in enumerate(rows):
                row["rewards"] = {name: scores[i] for name, scores in terms.items()}
        return rows

    def sample_group(self, group: int = 0) -> list[dict]:
        """One prompt's group of completions in the batch actor rank 0 trains on: prompt, completion,
        reward, sampling log-prob and, after :meth:`advantages`, the normalised advantage of each."""
        return self.groups["actor"].on(0).sample_group(group).result()[0]
