"""The LM RL loop: SFT warm start, then GRPO with an HF (or vLLM) rollout, a reward component and an actor (the facade
of :mod:`rlnb.loop.base` with the GRPO family, :mod:`rlnb.loop.families.grpo`).

Example (one phase per notebook cell):
    >>> loop = GRPOLoop.from_recipe("grpo_arith")   # doctest: +SKIP
    >>> loop.sft(); loop.evaluate()                    # doctest: +SKIP
    >>> loop.sync_weights(); loop.rollout(); loop.advantages(); loop.train()   # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

from rlnb.components.lm import RewardWorker
from rlnb.config.schema import Recipe
from rlnb.config.sections_lm import DataConfig, RolloutConfig
from rlnb.data.prompts import common_fields, problems_from_records
from rlnb.errors import ComponentError, ConfigError
from rlnb.loop.base import LoopBase
from rlnb.loop.families.grpo import GRPO, evaluation, warm_start
from rlnb.loop.schedules.streaming import Streaming
from rlnb.loop.session import objects_recipe
from rlnb.runtime.group import Group


class GRPOLoop(LoopBase):
    """GRPO for language models, phase by phase: ``sft()``, then ``sync_weights()`` -> ``rollout()`` (generate +
    reward) -> ``advantages()`` -> ``train()``; ``evaluate()`` reports held-out accuracy.

    Build it from a recipe (``GRPOLoop.from_recipe("grpo_arith")``) or from components you launched::

        rollout = HFRollout.launch(cluster, "0", model_path="models/tiny", max_new_tokens=8)
        actor = LMActor.launch(cluster, "1", model_path="models/tiny", group_size=8, advantage="grpo")
        loop = GRPOLoop(rollout=rollout, actor=actor, reward=my_reward, prompts=records)

    Args:
        recipe, cluster, run_dir, read_only: the recipe path, as :class:`rlnb.loop.Loop`.
        rollout, actor: launched groups (the objects path); the loop owns them from then on.
        reward: a launched reward group, or a function / registered reward name, or a list of them (summed, each
            logged apart as ``reward/<name>/mean``; accuracy counts the first), then placed on the rollout's slots
            and scored next to it.
        reward_weights: with a list of rewards, one weight each (default 1.0 each), as ``reward.weights``.
        prompts: prompt/answer records (dicts with ``prompt`` or ``question`` and ``answer``), or a
            ``datasets.Dataset`` of them; ``held_out_frac`` of them are held out for ``evaluate()``.
        prompts_per_step, eval_size, held_out_frac: as ``data.*`` in a recipe.
        chunk_tokens: as ``rollout.chunk_tokens`` (asynchronous mode: the actor's ``max_staleness``).
        runner, name, seed: as for :class:`rlnb.loop.Loop`.
    """

    FAMILY = GRPO

    def __init__(self, recipe: Recipe | None = None, cluster=None, run_dir=None, *, rollout=None, actor=None,
                 reward=None, reward_weights=None, prompts=None, prompts_per_step: int = 16, eval_size: int = 200,
                 held_out_frac: float = 0.2, chunk_tokens: int = 8, runner=None, name: str = "custom", seed: int = 1,
                 read_only: bool = False):  # fmt: skip
        if recipe is not None:
            if any(c is not None for c in (rollout, actor, reward, prompts)):
                raise ConfigError(
                    "GRPOLoop: pass either a recipe or rollout=, actor=, reward=, prompts=", "recipe"
                )
            super().__init__(recipe, cluster, run_dir, read_only=read_only)
            return
        if rollout is None or actor is None or reward is None or prompts is None:
            raise ConfigError(
                "GRPOLoop: pass a recipe (GRPOLoop.from_recipe('grpo_arith')) or rollout=, actor=, reward= and prompts=",
                "recipe",
            )
        if isinstance(reward, Group) and reward_weights is not None:
            raise ConfigError(
                "reward_weights: a launched reward group weighs its rewards itself "
                "(RewardWorker.launch(..., fn=[...], weights=[...])); pass the functions or names instead",
                "reward_weights",
            )
        if not isinstance(reward, Group):  # functions or registered names: score next to the rollout
            if not isinstance(rollout, Group):
                raise ComponentError(
                    "expected a launched group", "rollout", type(rollout).__name__, "rollout"
                )
            slots = tuple(i.slot for i in rollout.infos)
            prompts = problems_from_records(prompts)  # (their fields are what a reward may read)
            reward = RewardWorker.launch(
                rollout.cluster, slots, fn=reward, weights=reward_weights, fields=common_fields(prompts)
            )
        data = DataConfig(prompts_per_step=prompts_per_step, eval_size=eval_size, held_out_frac=held_out_frac)
        rollout_config = RolloutConfig(backend="hf", chunk_tokens=chunk_tokens)
        recipe = objects_recipe(name, seed, runner, family="grpo", data=data, rollout=rollout_config)
        try:
            super().__init__(recipe, None, run_dir, components={"rollout": rollout, "actor": actor, "reward": reward},
                             family_args={"prompts": prompts})  # fmt: skip
        except BaseException:
            reward.shutdown()  # launched here for this loop (a no-op if the loop's close() freed it)
            raise

    # ------------------------------------------------------------------ the GRPO family's own
    @property
    def task(self):
        """The problems: ``train`` and ``held_out`` lists, and the sampling ``position``."""
        return self.family.task

    @property
    def sft_done(self) -> bool:
        return self.family.sft_done

    @property
    def model_path(self) -> str | None:
        return self.family.model_path

    @property
    def reward_local(self) -> bool:
        """Whether the reward ranks sit with the rollout's (each group scored where it is made)."""
        return self.family.reward_local

    @property
    def last_samples(self) -> list[tuple]:
        """The last evaluation's first problems: ``(prompt, completion, answer)``."""
        return self.family.last_samples

    @property
    def trained_problems(self) -> list[list[int]]:
        """Asynchronous mode: per step, the serials of the problems it trained on."""
        return self.schedule.trained_problems if isinstance(self.schedule, Streaming) else []

    def sft(self, steps: int | None = None, progress: bool = True) -> dict:
        """Supervised warm start on the training answers (``actor.sft_steps``); exports ``<run_dir>/sft_model``.
        ``progress``: a progress bar with the latest loss (``run()`` shows it where it shows its own)."""
        return warm_start.sft(self.family, steps, progress)

    def evaluate(self, size: int | None = None, samples: int | None = None) -> dict:
        """Greedy answers to held-out problems, scored by the reward: logs ``eval/accuracy``; or ``samples`` > 1
        completions a problem sampled at the rollout's temperature: ``eval/pass_at/k`` (k = 1, 2, 4, ... and
        ``samples``, the unbiased estimator) and ``eval/avg_at/<samples>``. Each problem's completions and rewards go
        to ``<run_dir>/eval/step-<step>.jsonl``.

        In asynchronous mode it first lets the generation in flight finish (its batch is kept for the next
        :meth:`rollout`); the groups still in the pools go on with the current weights after it. ``size``: how many
        held-out problems (default ``data.eval_size``); ``samples``: default ``data.eval_samples``."""
        self.schedule.before_evaluate()
        return self.family.evaluate(size, samples)

    def try_prompt(self, prompt: str, answer: str, **fields) -> list[dict]:
        """``group_size`` completions of ``prompt`` sampled with the rollout's current weights, scored by the reward
        and normalised by the advantage as a training batch would be; nothing in the run changes. Call it before and
        after training to see what GRPO did to one prompt. With ``data.chat_template``, the prompt is a question,
        given as the training prompts are (a user turn of the chat template). ``fields``: the record's other fields
        a reward reads (``tests=[...]``)."""
        return evaluation.try_prompt(self.family, prompt, answer, **fields)

    def inspect(self, prompt: str, top_k: int = 5, max_new_tokens: int | None = None):
        """The rollout's greedy completion of ``prompt`` token by token, with the rollout's current weights: each
        token, its log-probability, the entropy (nats) of the distribution it was drawn from and the ``top_k``
        likeliest tokens with their probabilities, as a ``pandas.DataFrame`` (a row a token). With
        ``data.chat_template``, the prompt is a question, as :meth:`try_prompt` takes it. Nothing in the run
        changes.

        Example:
            >>> loop.inspect("7+6=", top_k=3)                                         # doctest: +SKIP
        """
        return evaluation.inspect(self.family, prompt, top_k, max_new_tokens)

    def plan(self, slot_memory_bytes: int | None = None):
        """What each slot of this run holds, estimated from the model's config (:mod:`rlnb.loop.families.grpo.plan`): the bytes of the
        actor's weights, gradients and AdamW state, the KL reference, a micro-batch's activations, the rollout's
        weights and KV cache, against each worker's memory limit (or ``slot_memory_bytes``). A
        :class:`rlnb.loop.families.grpo.plan.Plan` (a table in a notebook); ``plan.check()`` refuses one that does not fit.

        Example:
            >>> loop.plan()                                                           # doctest: +SKIP
        """
        from rlnb.loop.families.grpo.plan import plan_recipe

        slots = self.cluster.slots if self.cluster is not None else None
        return plan_recipe(self.recipe, slots, slot_memory_bytes)

    def sample(self, n: int = 4) -> list[dict]:
        """A look at the batch, as :meth:`rlnb.Loop.sample` gives an embodied loop's: here its first group of
        completions whole (:meth:`sample_group`; ``n``, an embodied loop's time steps, is not read)."""
        return self.sample_group(0)

    def sample_group(self, group: int = 0) -> list[dict]:
        """One prompt's group of completions in the batch actor rank 0 trains on: prompt, completion, reward,
        sampling log-prob and, after :meth:`advantages`, the normalised advantage of each."""
        return evaluation.sample_group(self.family, group)

    def export(self, path=None) -> Path:
        """Write the trained model and its tokenizer in Hugging Face format (``save_pretrained``) to the directory
        ``path`` (default ``<run_dir>/model``), atomically, for ``transformers``' ``from_pretrained`` or vLLM. Actor
        rank 0 writes it, on its worker's filesystem (as checkpoints are written). Returns the path.

        Example:
            >>> path = loop.export()                                                  # doctest: +SKIP
            >>> model = transformers.AutoModelForCausalLM.from_pretrained(path)       # doctest: +SKIP
        """
        return self.family.export(path)
