"""What every LM rollout does, whatever its engine: sample ``n`` completions per prompt into a batch (the layout
of :mod:`rlnb.components.lm.layout`), score it, keep it for the actor, and the modes built on that: multi-turn
(:mod:`.multi_turn`) and dynamic sampling (:mod:`.dynamic_sampling`). An engine subclass implements
``_generate`` (one turn: ``(batch, texts)``), ``load_weights`` and, where it has memory to give back while a
collocated actor trains, ``offload``/``onload``."""

from __future__ import annotations

import time

import torch

from rlnb.algorithms.interactions import SafeInteraction, check_interaction
from rlnb.components.launch import launcher
from rlnb.components.lm.dynamic_sampling import DynamicSampling
from rlnb.components.lm.multi_turn import MultiTurn
from rlnb.components.rollout import RolloutBase, resolve_device
from rlnb.config.checks import check_field
from rlnb.config.sections_lm import RolloutConfig
from rlnb.data.prompts import template_prompts
from rlnb.errors import ComponentError, ConfigError
from rlnb.runtime.rank import RankInfo, current_rank, local_peer
from rlnb.seeding import rank_seed


class LMRollout(MultiTurn, DynamicSampling, RolloutBase):
    """The engine-independent half of an LM rollout (:class:`rlnb.components.HFRollout`,
    :class:`rlnb.components.VLLMRollout`).

    Args:
        max_new_tokens, temperature, top_p, top_k: sampling parameters (``top_k=0``: all tokens), applied
            as ``transformers``' ``generate`` applies them: temperature, then top-k, then top-p.
        seed: rank ``r`` seeds each call from ``rlnb.seeding.rank_seed(seed, r, "lm_rollout")`` and a call
            counter (reproducible, and different on every rank).
        device: ``auto`` (the rank's slot), ``cpu`` or ``cuda``.
        max_turns, interaction: multi-turn rollouts (:class:`.multi_turn.MultiTurn`).
    """

    launch = launcher("rollout")
    # asynchronous mode: whether stream() generates chunks of tokens (HFRollout's own decoding), taking weights
    # between chunks; an engine that generates whole completions (vLLM) runs the next batch ahead instead,
    # taking weights between batches
    CHUNKED_GENERATION = False
    # complete() and sample_completions() take each prompt's answer and record fields after the prompts (a
    # multi-turn interaction reads them); a rollout class of one's own without this is given the prompts only
    TAKES_RECORDS = True
    SAMPLES_COMPLETIONS = True
    MERGES_ADAPTERS = True

    @classmethod
    def prepare_launch(cls, kwargs: dict) -> dict:
        """On the driver, before launch: refuse a ``max_turns`` below 1, more turns with nothing to answer between
        them, and an interaction the loop cannot call; resolve a registered one (it travels by value)."""
        kwargs = dict(kwargs)
        turns, interaction = kwargs.get("max_turns", 1), kwargs.get("interaction")
        check_field(RolloutConfig, "max_turns", turns)
        if interaction is not None:
            kwargs["interaction"] = check_interaction(interaction, None)
        elif turns > 1:
            raise ConfigError(
                f"interaction: with max_turns={turns} something must answer between the model's turns: a "
                "registered interaction's name or a function (completion, turn, answer, ...) -> str | None",
                "interaction",
            )
        return kwargs

    def __init__(
        self, max_new_tokens: int = 8, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
        device: str = "auto", max_turns: int = 1, interaction=None, rank_info: RankInfo | None = None,
    ):  # fmt: skip
        rank_info = rank_info or current_rank()
        self.rank = rank_info.rank if rank_info else 0
        self.device = resolve_device(device, rank_info)
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = (
            max_new_tokens,
            temperature,
            top_p,
            top_k,
        )
        self.max_turns = max_turns
        self.interaction = SafeInteraction(interaction) if interaction is not None else None
        self.seed, self.calls = rank_seed(seed, self.rank, "lm_rollout"), 0
        self.version = 0
        self.batch: dict | None = None
        self.offloaded = False
        self._lora_base: tuple[dict, int] | None = (
            None  # a LoRA actor's adapted layers' base, and its version
        )
        self.kept_groups, self.aside_groups = [], []  # dynamic sampling's rounds this step

    def _generate(self, prompts: list, n: int, greedy: bool) -> tuple[dict, list[str]]:
        """One turn: ``n`` completions of each prompt (text, or token ids of a transcript so far) as a batch's
        ``input_ids``, ``attention_mask``, ``response_mask`` and ``logprobs``, and the completions' texts."""
        raise NotImplementedError

    def load_weights(self, state_dict: dict, version: int) -> int:
        raise NotImplementedError

    def load_some_weights(self, state_dict: dict, version: int) -> int:
        """Some of the model's tensors (the adapted layers' merged weights), the rest kept; then ``version``."""
        raise NotImplementedError

    def load_message(self, msg: dict) -> int:
        """A weight-sync message: whole weights (with a LoRA actor's, the adapted layers' base kept beside them),
        or a LoRA actor's adapters alone, merged here into the base kept (``actor.lora.sync: adapters``)."""
        if "adapters" not in msg:
            lora = msg.get("lora")
            self._lora_base = (lora["base"], lora["base_version"]) if lora else None
            return self.load_weights(msg["state"], msg["version"])
        from rlnb.components.lm.lora import merge_adapters

        self._check_base(msg["base_version"])
        return self.load_some_weights(merge_adapters(self._lora_base[0], msg["adapters"]), msg["version"])

    def _check_base(self, base_version: int) -> None:
        """Adapters sent alone must be for the base this rank holds."""
        kept = self._lora_base
        if kept is None or kept[1] != base_version:
            raise ComponentError(
                f"the actor sent LoRA adapters for base version {base_version}, and this rank holds "
                f"{'no base' if kept is None else f'base version {kept[1]}'} (a rollout rank started anew after the "
                "actor sent it the base: restart the run, or set actor.lora.sync=merged)",
                "rollout", type(self).__name__, "load_message",
            )  # fmt: skip

    def offload(self) -> bool:
        """Give back the device memory a collocated actor needs while it trains; returns whether it is given
        back (an engine that holds none to give keeps it)."""
        return self.offloaded

    def onload(self) -> bool:
        """Take the memory :meth:`offload` gave back again; returns whether the model is on its device."""
        return not self.offloaded

    def generation_stats(self) -> dict:
        """How this rank generated (an engine adds its own): multi-turn transcripts that ended because their next
        turn would not fit in the model's positions (``turns_cut``)."""
        return {"turns_cut": self.turns_cut}

    def generate(
        self,
        prompts: list[str],
        answers: list[str],
        n: int,
        reward: str | None = None,
        fields: list[dict] | None = None,
    ) -> dict:
        """Sample ``n`` completions per prompt and keep the batch; score in-process if ``reward`` is collocated.
        ``fields``: each prompt record's other fields, for the reward.

        Returns a summary with the completion texts (to score elsewhere) unless scored here.
        """
        started = time.perf_counter()
        batch, texts = self._generate_turns(prompts, n, False, answers, fields)
        generate_s = time.perf_counter() - started
        batch["group_index"] = torch.arange(len(prompts)).repeat_interleave(n)
        batch["answers"] = [a for a in answers for _ in range(n)]
        batch["prompts"] = [p for p in prompts for _ in range(n)]
        batch["fields"] = [f for f in fields or [{}] * len(prompts) for _ in range(n)]
        batch["texts"] = texts
        batch["version"] = self.version
        batch["truncated"] = self._truncated(batch)
        self.batch = batch
        lengths = batch["response_mask"].sum(-1).float()
        summary = {
            "version": self.version,  # the policy version that generated it
            "generate_s": generate_s,
            "sequences": len(texts),
            "tokens": int(lengths.sum()),
            "response_len_mean": float(lengths.mean()),
            "truncated_frac": float(batch["truncated"].float().mean()),
        }
        if "turns" in batch:  # multi-turn: the model's turns per transcript
            summary["turns_mean"] = float(batch["turns"].float().mean())
        if reward is not None:
            scored = local_peer(reward, self.rank).score_terms(
                texts, batch["answers"], batch["prompts"], batch["fields"]
            )
            summary.update(self.set_rewards(scored["rewards"], scored["terms"]))
        else:
            for key in ("texts", "answers", "prompts", "fields"):
                summary[key] = batch[key]
        return summary

    def _truncated(self, batch: dict) -> torch.Tensor:
        """``[B]`` bool: the completions that reached ``max_new_tokens`` without ending (their last token is
        not EOS). Responses sit right after their prompts, right-padded, so a row's last response position is
        its last token."""
        mask = batch["response_mask"].bool()
        last = mask.shape[1] - 1 - mask.flip(1).int().argmax(1)
        last_token = batch["input_ids"].gather(1, last[:, None]).squeeze(1)
        return (mask.sum(1) >= self.max_new_tokens) & (last_token != self.tok.eos_token_id)

    @staticmethod
    def split_batch(batch: dict, shards: int) -> list[dict]:
        """Split along the sequence axis (dim 0 of tensors, and the per-sequence lists); the loop makes
        each part whole groups of ``group_size`` completions, so group advantages stay exact."""
        n = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))
        size = n // shards
        return [
            {
                k: (v[j * size : (j + 1) * size] if isinstance(v, (torch.Tensor, list)) else v)
                for k, v in batch.items()
            }
            for j in range(shards)
        ]

    def set_rewards(self, rewards: list[float], terms: dict[str, list[float]] | None = None) -> dict:
        """The batch's ``rewards [B]`` and, from :meth:`RewardWorker.score_terms`, each reward's scores apart
        (``reward_terms [B, K]`` named by ``reward_names``, with several). Returns the mean reward, the
        accuracy (the share the first reward scored >= 1) and each reward's mean (``reward_terms``)."""
        r = torch.tensor(rewards, dtype=torch.float32)
        self.batch["rewards"] = r
        first = torch.tensor(next(iter(terms.values())), dtype=torch.float32) if terms else r
        summary = {"reward_mean": float(r.mean()), "accuracy": float((first >= 1.0).float().mean())}
        if terms and len(terms) > 1:
            self.batch["reward_terms"] = torch.tensor(list(zip(*terms.values())), dtype=torch.float32)
            self.batch["reward_names"] = tuple(terms)
            summary["reward_terms"] = {n: sum(v) / len(v) for n, v in terms.items()}
        return summary

    def template_prompts(self, prompts: list, system_prompt: str | None = None) -> list[str]:
        """``prompts`` (questions, or conversations: lists of ``{"role", "content"}`` messages) through this
        model's chat template, the assistant's turn opened (:func:`rlnb.data.prompts.template_prompts`)."""
        return template_prompts(prompts, self.tok, system_prompt)

    def complete(
        self,
        prompts: list[str],
        answers: list[str] | None = None,
        fields: list[dict] | None = None,
        n: int = 1,
    ) -> list[str]:
        """Greedy completions (evaluation, samples in notebooks), or with ``n > 1`` that many sampled at the
        rollout's temperature a prompt, a prompt's side by side (pass@k), the training's sampling seeds left as
        they were; with ``max_turns > 1``, whole transcripts, the interaction given each prompt's ``answer`` and
        record ``fields``."""
        if n == 1:
            return self._generate_turns(prompts, 1, True, answers, fields)[1]
        calls = self.calls
        try:
            return self._generate_turns(prompts, n, False, answers, fields)[1]
        finally:
            self.calls = calls

    def sample_completions(
        self, prompt: str, n: int, answer: str | None = None, fields: dict | None = None
    ) -> list[str]:
        """``n`` sampled completions of one prompt, to look at: the batch in progress and the training's
        sampling seeds are left as they were. With ``max_turns > 1``, whole transcripts, the interaction given
        the prompt's ``answer`` and record ``fields``."""
        calls = self.calls
        try:
            return self._generate_turns([prompt], n, False, [answer or ""], [fields or {}])[1]
        finally:
            self.calls = calls

    def state_dict(self) -> dict:
        return {"calls": self.calls, "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.calls, self.version = state["calls"], state["version"]
