"""LM RL components: HF (and vLLM) rollout, reward, and an actor for GRPO-style training.

Batch layout (B = prompts x group_size sequences, L = prompt + response tokens, left-padded)::

    input_ids [B, L]  attention_mask [B, L]  response_mask [B, L] (1 on generated tokens incl. EOS)
    logprobs [B, L]   (behaviour log-probs on response tokens, 0 elsewhere)
    rewards [B]       group_index [B]   version (policy version that generated it)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time

import torch

from rlnb.algorithms import kl_penalty
from rlnb.algorithms.contract import LM, check_algorithm, check_rewards
from rlnb.algorithms.interactions import SafeInteraction, check_interaction
from rlnb.algorithms.losses import masked_mean
from rlnb.algorithms.rewards import SafeReward
from rlnb.components.actor import ActorBase, with_settings
from rlnb.components.compile import StepCompiler
from rlnb.components.launch import launcher
from rlnb.components.optim import ClipAndStep, build_optimizer
from rlnb.components.rollout import RolloutBase, resolve_device
from rlnb.config.schema import ActorConfig
from rlnb.data.prompts import template_prompts
from rlnb.errors import ConfigError
from rlnb.models.lm import (
    DTYPES,
    encode_prompts,
    first_response_column,
    hf_quiet,
    load_lm,
    load_tokenizer,
    logits_kept,
    new_cache,
    positions_from_mask,
    prompt_ids,
    shared_prompt_logprobs,
    token_logprobs,
)
from rlnb.runtime.rank import RankInfo, current_rank, local_peer
from rlnb.seeding import rank_seed

log = logging.getLogger("rlnb")

# On a GPU, computing shared prompts once pays only when they are much of the batch: a second forward's
# kernel launches cost more than a short prompt's repeats. Measured on an H100 (forward + backward, 16
# prompts x 8, 32 response tokens): 6-token prompts 0.56-1.13x (4 M to 1 B parameters); 89-token prompts
# 1.87-2.64x from 25 M parameters up (0.56x for a 4 M one). On CPU it paid at every size tried (1.24x for
# 6-token prompts, 4.3x for 89-token ones).
GPU_MIN_SHARED_FRACTION = 0.5
# On CPU a micro-batch's rows go through in up to this many passes grouped by where they end, each cut at
# its longest row (rlnb.models.lm.length_buckets): a padded position costs as much as a real one there.
CPU_LENGTH_BUCKETS = 4
# HFRollout's decoding drops the sequences that have ended once they are 1/8 of its batch: dropping copies
# the KV cache (~1/5 of a decoding step's time on CPU at the GRPO bench's sizes), so not every step
DROP_ENDED_SHARE = 8
# rollout.static_cache: prompts are left-padded to a multiple of this many tokens, so that a run's batches
# take a few shapes (each new shape compiles generate's decoding step again)
STATIC_PROMPT_MULTIPLE = 32


def _adamw(model: torch.nn.Module, lr: float, device: torch.device) -> torch.optim.AdamW:
    """AdamW, fused where torch has the kernel (CPU, CUDA): one kernel for all parameters, where the
    default runs a few per parameter tensor (4 ms against 14 ms a step for a 4 M-parameter model on a CPU core)."""
    fused = device.type in ("cpu", "cuda") and all(p.is_floating_point() for p in model.parameters())
    return build_optimizer(
        torch.optim.AdamW, model.parameters(), lr=lr, weight_decay=0.0, fused=fused or None
    )


def _pad_left(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long)


def _pad_right(rows: list[list], pad) -> torch.Tensor:
    """``rows`` right-padded with ``pad`` to the longest: ``[B, W]`` (the dtype of ``pad``'s kind)."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows])


def _micro_batches(n: int, size: int):
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


class RewardWorker:
    """Applies a reward, or several summed with weights, to completions; may sit on its own slot or next to
    the rollout.

    Args:
        name: a registered reward (``math``, ``arithmetic``...), or a list of them.
        fn: instead, a function (e.g. defined in a notebook cell) taking some of ``completion``,
            ``answer`` and ``prompt`` by keyword and returning a float, or a registered name
            (``RewardWorker.launch(cluster, "0", fn="math")``), or a list of either (TRL's ``reward_funcs``).
        weights: with several rewards, one weight each (default 1.0 each; TRL's ``reward_weights``). A
            completion's reward is the weighted sum; each reward is also kept apart (:meth:`score_terms`),
            and the first is the one accuracy counts (a score >= 1): put the correctness reward first.
        fields: the prompt records' fields the rewards may read by name besides ``completion``, ``answer``
            and ``prompt`` (e.g. a coding task's ``tests``), as TRL passes a dataset's columns; a loop passes
            those every record has.

    Example:
        >>> RewardWorker(fn=lambda completion, answer: float(completion.strip() == answer)).score(["4"], ["4"])
        [1.0]
        >>> RewardWorker(fn=["arithmetic", "format"], weights=[1.0, 0.5]).score_terms(["4 #### 4"], ["4"])
        {'rewards': [1.5], 'terms': {'arithmetic': [1.0], 'format': [1.0]}}
    """

    launch = launcher("reward")

    @classmethod
    def prepare_launch(cls, kwargs: dict) -> dict:
        """On the driver: resolve the rewards into registry entries (they travel by value) or refuse them."""
        kwargs = dict(kwargs)
        fn, name = kwargs.pop("fn", None), kwargs.pop("name", "arithmetic")
        kwargs["fields"] = tuple(kwargs.get("fields", ()))
        kwargs["fn"], kwargs["weights"] = check_rewards(
            fn if fn is not None else name, kwargs.get("weights"), kwargs["fields"]
        )
        return kwargs

    def __init__(
        self, name="arithmetic", fn=None, weights=None, fields=(), rank_info: RankInfo | None = None
    ):
        # refuses a function the loop cannot call, a repeated name, or weights that do not fit
        entries, self.weights = check_rewards(fn if fn is not None else name, weights, tuple(fields))
        self.fields = tuple(fields)
        self.rewards = [SafeReward(e.name, e) for e in entries]
        self.names = [e.name for e in entries]
        self.name = "+".join(self.names)
        self.fn = self.rewards[0]

    def score(
        self,
        completions: list[str],
        answers: list[str],
        prompts: list[str] | None = None,
        fields: list[dict] | None = None,
    ) -> list[float]:
        """Each completion's reward: the weighted sum of the rewards. ``fields``: each completion's prompt
        record's other fields (``None``: none)."""
        return self._score_terms(completions, answers, prompts, fields)["rewards"]

    def score_terms(
        self,
        completions: list[str],
        answers: list[str],
        prompts: list[str] | None = None,
        fields: list[dict] | None = None,
    ) -> dict:
        """``{"rewards": [weighted sum per completion], "terms": {reward name: [its score per completion]}}``
        (what the loop logs apart). A subclass overriding :meth:`score` alone has its scores as one term."""
        if type(self).score is not RewardWorker.score:
            scored = (  # (a subclass's score may predate fields)
                self.score(completions, answers, prompts, fields)
                if fields and any(fields)
                else self.score(completions, answers, prompts)
            )
            rewards = [float(r) for r in scored]
            return {"rewards": rewards, "terms": {self.name: rewards}}
        return self._score_terms(completions, answers, prompts, fields)

    def _score_terms(self, completions, answers, prompts, fields) -> dict:
        n = len(completions)
        inputs = (list(completions), list(answers), list(prompts or [None] * n), list(fields or [{}] * n))
        terms = {r.name: r.many(*inputs) for r in self.rewards}
        if len(terms) == 1 and self.weights[0] == 1.0:
            return {"rewards": terms[self.names[0]], "terms": terms}
        per_completion = zip(*(terms[name] for name in self.names))
        rewards = [sum(w * s for w, s in zip(self.weights, each)) for each in per_completion]
        return {"rewards": rewards, "terms": terms}

    def state_dict(self) -> dict:  # stateless; kept so every component checkpoints the same way
        return {"name": self.name}

    def load_state_dict(self, state: dict) -> None:
        self.name = state["name"]


# a batch's [B, W] columns, left-padded to a common width when batches are put together, and their padding
_WIDE = {"attention_mask": 0, "response_mask": 0, "logprobs": 0.0, "versions": -1}


def _batch_rows(batch: dict, rows: torch.Tensor) -> dict:
    """The rows ``rows`` (a bool mask or indices over ``B``) of a rollout batch: its tensors and per-sequence
    lists; the rest (``version``, ``reward_names``) as it is."""
    n = len(batch["texts"])
    index = rows.nonzero().squeeze(1).tolist() if rows.dtype == torch.bool else rows.tolist()
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == n:
            out[key] = value[index]
        elif isinstance(value, list) and len(value) == n:
            out[key] = [value[i] for i in index]
        else:
            out[key] = value
    return out


def _join_batches(parts: list[dict], pad_token_id: int) -> dict:
    """Rollout batches as one: ``[B, W]`` columns left-padded to the widest (as an actor joins its ranks'
    batches), the rest concatenated; ``version`` the oldest."""
    width = max(p["input_ids"].shape[1] for p in parts)

    def left(t: torch.Tensor, value) -> torch.Tensor:
        return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

    out = {}
    for key, value in parts[0].items():
        if key == "input_ids" or key in _WIDE:
            pad = pad_token_id if key == "input_ids" else _WIDE[key]
            out[key] = torch.cat([left(p[key], pad) for p in parts])
        elif isinstance(value, torch.Tensor) and value.dim():
            out[key] = torch.cat([p[key] for p in parts])
        elif isinstance(value, list):
            out[key] = [x for p in parts for x in p[key]]
        elif key == "version":
            out[key] = min(p[key] for p in parts)
        else:
            out[key] = value
    return out


def check_dtype(dtype: str, key: str = "dtype") -> str:
    """``dtype`` if it names a precision an LM component takes (:data:`rlnb.models.lm.DTYPES`), else a
    :class:`ConfigError` naming ``key``."""
    if dtype not in DTYPES:
        raise ConfigError(f"{key}: expected one of {sorted(DTYPES)}, got {dtype!r}", key)
    return dtype


def _same(a: list, b: list) -> bool:
    """Whether two lists hold the same objects in the same order."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


@dataclasses.dataclass
class _Decoding:
    """Where decoding stands for ``N`` running rows: the KV ``cache`` of every token but each row's ``last``
    (``[N]``, fed next at ``position [N]``), and the attention mask ``attn [N, C]`` over the cache and
    ``last``. A state :meth:`HFRollout._decode_from` hands back also says which ``rows [N]`` of the batch it
    was given are still running."""

    cache: object
    attn: torch.Tensor
    last: torch.Tensor
    position: torch.Tensor
    rows: torch.Tensor | None = None

    @classmethod
    def start(cls, ids: torch.Tensor, attn: torch.Tensor, cache) -> _Decoding:
        """From sequences ``ids [N, P]`` (mask ``attn``) whose columns but the last are in ``cache``."""
        return cls(cache, attn, ids[:, -1], positions_from_mask(attn)[:, -1])


class HFRollout(RolloutBase):
    """Batched sampling from a ``transformers`` causal LM; ``HFRollout.launch(cluster, "0", model_path=...)``.

    Args:
        model_path: a ``save_pretrained`` directory.
        max_new_tokens, temperature, top_p, top_k: sampling parameters (``top_k=0``: all tokens), applied
            as ``transformers``' ``generate`` applies them: temperature, then top-k, then top-p.
        seed: rank ``r`` seeds each call from ``rlnb.seeding.rank_seed(seed, r, "lm_rollout")`` and a call
            counter (reproducible).
        share_prompt_prefill: compute each prompt's KV cache once for its ``n`` completions and repeat
            it, where ``generate`` would compute it ``n`` times (same tokens and log-probs). If a model's
            cache cannot be shared this way, the rollout says why once and prefills per completion.
        drop_finished: decode with rlnb's own sampling loop, from which a sequence leaves once it has
            ended (EOS): ``generate`` goes on computing every ended sequence until the longest ends,
            which in a batch of long-tailed lengths is most of its work. It samples each token from
            the model's distribution at ``temperature`` (and ``top_p``), as ``generate`` does with the
            same seed while no sequence has ended. If a model cannot be decoded this way, the rollout
            says why once and uses ``generate``; ``False`` always uses ``generate``.
        max_turns: turns the model takes per completion at most (multi-turn rollouts); between two of them
            ``interaction`` answers (:mod:`rlnb.algorithms.interactions`), and only the model's own tokens
            are trained on.
        interaction: a registered interaction's name or a function: ``(completion, turn, answer, prompt,
            fields...) -> str | None``, the text that follows the model's turn, or ``None`` to end there.
        dtype: ``float32`` or ``bfloat16``: the precision the model is held and run in (the actor's
            ``dtype``; weights synced from a float32 actor are cast as they load).
        static_cache: sample with ``generate`` on a static KV cache, its decoding step compiled on a GPU
            (CUDA graphs); prompts left-padded to a multiple of ``STATIC_PROMPT_MULTIPLE`` tokens so that a
            run compiles a few shapes. Ended rows are computed to the end and each completion prefills its
            prompt. Synchronous generation only (asynchronous chunks decode with rlnb's loop).

    Example:
        >>> rollout = HFRollout(path, max_new_tokens=16, dtype="bfloat16")  # doctest: +SKIP
        >>> rollout.generate(["1+2="], ["3"], n=4)["response_len_mean"]  # doctest: +SKIP
    """

    launch = launcher("rollout")
    # what generation_stats() reports for a subclass with its own engine (vLLM caches prefixes itself)
    share_prompt_prefill, shared_prefills, prefill_fallback = False, 0, None
    drop_finished, decode_fallback = False, None
    static_cache, dtype = False, "float32"  # (a subclass with its own engine and __init__ uses neither)
    KEEP_CACHE_ACROSS_CHUNKS = True  # asynchronous mode: a chunk goes on from the last one's KV cache
    # asynchronous mode: stream() generates chunks of tokens (a subclass with its own engine, as vLLM, cannot)
    CHUNKED_GENERATION = True
    _carried: tuple | None = None
    max_turns, interaction = 1, None  # one turn, unless told (a subclass with its own __init__ too)
    turns_cut = 0  # transcripts ended because their next turn would not fit in the model's positions

    @classmethod
    def prepare_launch(cls, kwargs: dict) -> dict:
        """On the driver, before launch: refuse a ``max_turns`` below 1, more turns with nothing to answer between
        them, and an interaction the loop cannot call; resolve a registered one (it travels by value)."""
        kwargs = dict(kwargs)
        turns, interaction = kwargs.get("max_turns", 1), kwargs.get("interaction")
        if not isinstance(turns, int) or isinstance(turns, bool) or turns < 1:
            raise ConfigError(f"max_turns: expected an integer >= 1, got {turns!r}", "max_turns")
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
        self, model_path: str, max_new_tokens: int = 8, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
        device: str = "auto", torch_threads: int = 1, rank_info: RankInfo | None = None,
        share_prompt_prefill: bool = True, drop_finished: bool = True, top_k: int = 0, max_turns: int = 1,
        interaction=None, dtype: str = "float32", static_cache: bool = False,
    ):  # fmt: skip
        rank_info = rank_info or current_rank()  # subclasses need not pass it on
        self.dtype, self.static_cache = check_dtype(dtype), bool(static_cache)
        self.max_turns = max_turns
        self.interaction = SafeInteraction(interaction) if interaction is not None else None
        torch.set_num_threads(torch_threads)
        self.share_prompt_prefill = share_prompt_prefill
        self.drop_finished = drop_finished
        self.decode_fallback: str | None = None  # why rlnb's decoding loop gave way to generate, if it did
        self.prefill_fallback: str | None = None  # why prompts could not share their prefill, if so
        self.shared_prefills = 0  # generate calls whose prompts were prefilled once for all completions
        self.rank = rank_info.rank if rank_info else 0
        self.device = resolve_device(device, rank_info)
        self.model_path = model_path
        self.model, self.tok = load_lm(model_path, self.device, dtype=self.dtype)
        self.model.eval().requires_grad_(False)
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.top_k = top_k
        self.seed, self.calls = rank_seed(seed, self.rank, "lm_rollout"), 0
        self.version = 0
        self.batch = None
        self.offloaded = False
        self.pool: list[dict] = []  # asynchronous mode: groups admitted and not yet handed over
        # asynchronous mode: (version, the sequences still running, their decoding state) after a chunk
        self._carried: tuple | None = None

    def load_weights(self, state_dict: dict, version: int) -> int:
        self.model.load_state_dict(state_dict)
        self.version = version
        self._carried = None  # a KV cache of the old weights
        return version

    # GPU memory for collocated training: park the rollout model on the CPU while the actor trains
    def offload(self) -> bool:
        if self.device.type == "cuda" and not self.offloaded:
            self.model.to("cpu")
            self._carried = None  # its KV cache would hold GPU memory the actor needs
            torch.cuda.empty_cache()
            self.offloaded = True
        return self.offloaded

    def onload(self) -> bool:
        if self.offloaded:
            self.model.to(self.device)
            self.offloaded = False
        return not self.offloaded

    def memory_stats(self) -> dict:
        """Where the model is (``offloaded`` while a collocated actor trains) and this process's GPU memory."""
        cuda = self.device.type == "cuda"
        return {
            "device": str(self.device),
            "model_device": next(self.model.parameters()).device.type,
            "model_dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "offloaded": self.offloaded,
            "cuda_allocated_bytes": torch.cuda.memory_allocated(self.device) if cuda else 0,
        }

    @torch.no_grad()
    def _generate(self, prompts: list[str], n: int, greedy: bool):
        self.onload()
        enc = encode_prompts(self.tok, prompts).to(self.device)
        seed = self.seed * 1_000_003 + self.calls
        if not greedy:  # greedy decoding draws nothing: evaluating does not shift training's sampling seeds
            self.calls += 1

        def seeded(sampler):  # both samplers draw from the same per-call seed
            if not greedy:
                torch.manual_seed(seed)
            return sampler(enc, n, greedy)

        sampled = seeded(self._static_generate) if self.static_cache else None
        if sampled is None and self.drop_finished and self.decode_fallback is None:
            prefills = self.shared_prefills
            try:
                sampled = seeded(self._decode)
            except Exception as e:  # a model this loop cannot drive (its forward needs generate's inputs)
                self.shared_prefills = prefills  # generate prefills again: count the call once
                self._decoding_failed(e)
        if sampled is None:
            sampled = seeded(self._hf_generate)
        seqs, logp = sampled  # (B*n, P+R), (B*n, R)
        prompt_len = enc["input_ids"].shape[1]
        response = seqs[:, prompt_len:]  # (B*n, R)
        # response mask: tokens up to and including the first EOS
        is_eos = response == self.tok.eos_token_id
        after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0
        resp_mask = (~after_eos).long()
        logp = torch.where(resp_mask.bool(), logp, torch.zeros_like(logp)).float()
        attn = torch.cat([enc["attention_mask"].repeat_interleave(n, 0), resp_mask], dim=1)
        zeros = torch.zeros(seqs.shape[0], prompt_len, dtype=torch.long, device=seqs.device)
        texts = self.tok.batch_decode(
            response * resp_mask + self.tok.pad_token_id * (1 - resp_mask), skip_special_tokens=True
        )
        return {
            "input_ids": seqs.cpu(),
            "attention_mask": attn.cpu(),
            "response_mask": torch.cat([zeros, resp_mask], dim=1).cpu(),
            "logprobs": torch.cat([zeros.float(), logp], dim=1).cpu(),
        }, texts

    def _sampling(self, greedy: bool) -> dict:
        """``generate``'s sampling arguments, returning the scores the log-probs are computed from."""
        return dict(
            do_sample=not greedy, temperature=self.temperature if not greedy else None,
            top_p=self.top_p if not greedy else None, top_k=(self.top_k or None) if not greedy else None,
            max_new_tokens=self.max_new_tokens,
            pad_token_id=self.tok.pad_token_id, eos_token_id=self.tok.eos_token_id,
            return_dict_in_generate=True, output_scores=True,
        )  # fmt: skip

    def _hf_generate(self, enc, n: int, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``transformers``' ``generate``: sequences ``[B*n, P+R]`` and the sampled tokens' log-probs ``[B*n, R]``."""
        sampling = self._sampling(greedy)
        cache = self._shared_prompt_cache(enc, n)
        if cache is not None:  # every completion starts from its prompt's cache: only its last token is left
            out = self.model.generate(
                input_ids=enc["input_ids"].repeat_interleave(n, 0),
                attention_mask=enc["attention_mask"].repeat_interleave(n, 0),
                past_key_values=cache,
                **sampling,
            )
        else:
            out = self.model.generate(**enc, num_return_sequences=n, **sampling)
        # behaviour log-probs of the sampled tokens under the sampling distribution
        return out.sequences, self.model.compute_transition_scores(
            out.sequences, out.scores, normalize_logits=True
        )

    def _static_generate(self, enc, n: int, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`_hf_generate`, on a static KV cache (``rollout.static_cache``; on a GPU ``generate`` compiles
        its decoding step): prompts left-padded to a multiple of ``STATIC_PROMPT_MULTIPLE`` columns, which
        are taken off again, so a batch's sequences are ``[B*n, P+R]`` as from the other samplers."""
        ids, attn = enc["input_ids"], enc["attention_mask"]
        pad = -ids.shape[1] % STATIC_PROMPT_MULTIPLE
        ids = torch.cat([ids.new_full((len(ids), pad), self.tok.pad_token_id), ids], dim=1)
        attn = torch.cat([attn.new_zeros((len(attn), pad)), attn], dim=1)
        out = self.model.generate(
            input_ids=ids.repeat_interleave(n, 0), attention_mask=attn.repeat_interleave(n, 0),
            cache_implementation="static", **self._sampling(greedy),
        )  # fmt: skip
        logp = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        return out.sequences[:, pad:], logp

    def _decode(self, enc, n: int, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """rlnb's decoding loop: as :meth:`_hf_generate`, but a sequence that has ended leaves the batch
        (:meth:`_decode_from`), from each prompt's KV cache computed once for its ``n`` completions."""
        ids = enc["input_ids"].repeat_interleave(n, 0)  # (N, P), N = B * n
        attn = enc["attention_mask"].repeat_interleave(n, 0)
        cache = self._shared_prompt_cache(enc, n)
        if cache is None:  # each row's prompt but its last token, prefilled row by row
            cache = self._prefill(ids, attn)
        tokens, logps, _ = self._decode_from(_Decoding.start(ids, attn, cache), self.max_new_tokens, greedy)
        return torch.cat([ids, tokens], dim=1), logps

    def _decode_from(
        self, state: _Decoding, steps: int, greedy: bool, budget: torch.Tensor | None = None, going_on: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, _Decoding | None]:  # fmt: skip
        """Up to ``steps`` new tokens ``[N, S]`` and their log-probs for each of ``state``'s ``N`` rows and, with
        ``going_on``, the state of the rows still running after them (else, or when every row ended, ``None``).

        Each step feeds the running sequences' last tokens, samples the next from the logits at
        ``temperature`` (float32, then top-p; greedy: the argmax), as ``generate`` does, and keeps its
        log-prob under that distribution. A sequence that sampled EOS, or made its ``budget [N]`` of tokens,
        pads from then on, as in ``generate``, and the ended ones leave the batch (and the KV cache) once
        they are ``1 / DROP_ENDED_SHARE`` of it.
        """
        cache, attn, last, position = state.cache, state.attn, state.last, state.position
        rows = last.shape[0]
        tokens = torch.full((rows, steps), self.tok.pad_token_id, dtype=torch.long, device=last.device)
        logps = torch.zeros(rows, steps, device=last.device)
        live = torch.arange(rows, device=last.device)  # the rows in the decoding batch
        ended = torch.zeros(rows, dtype=torch.bool, device=last.device)  # of those, the ones that are done
        made = 0
        for step in range(steps):
            logits = self.model(
                input_ids=last[:, None], attention_mask=attn, position_ids=position[:, None],
                past_key_values=cache, use_cache=True,
            ).logits[:, -1].float()  # fmt: skip
            token, logp = self._sample(logits, greedy)
            token = torch.where(ended, self.tok.pad_token_id, token)  # an ended row only pads, as in generate
            tokens[live, step], logps[live, step] = token, torch.where(ended, 0.0, logp)
            made = step + 1
            ended = ended | (token == self.tok.eos_token_id)
            if budget is not None:
                ended = ended | (budget <= made)
            n_ended = int(ended.sum())
            if n_ended == len(live) or (step == steps - 1 and not going_on):
                return tokens[:, :made], logps[:, :made], None
            # ended rows leave once they are 1/DROP_ENDED_SHARE of the batch (each leaving copies the KV cache),
            # and after the last step, so that what goes on holds only the rows still running
            if n_ended * DROP_ENDED_SHARE >= len(live) or (step == steps - 1 and n_ended):
                keep = (~ended).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                live, token, attn, position, ended = (
                    live[keep],
                    token[keep],
                    attn[keep],
                    position[keep],
                    ended[keep],
                )
                budget = None if budget is None else budget[keep]
            attn = torch.cat([attn, attn.new_ones(len(live), 1)], dim=1)
            last, position = token, position + 1
        return tokens[:, :made], logps[:, :made], _Decoding(cache, attn, last, position, live)

    def _decoding_failed(self, error: Exception) -> None:
        """Sample with ``generate`` from now on, and say why once: a model this loop cannot drive (its
        forward needs ``generate``'s inputs)."""
        self.decode_fallback = f"{type(error).__name__}: {error}"[:300]
        log.warning(
            "rollout[%d]: decoding with transformers' generate, ended sequences included; rlnb's "
            "decoding loop failed (%s)", self.rank, self.decode_fallback,
        )  # fmt: skip

    def _sample(self, logits: torch.Tensor, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The next token of each row from ``logits [N, V]`` and its log-prob under the distribution it
        was drawn from (``generate``'s warpers: temperature, then top-k, then top-p keeping at least one token)."""
        if greedy:
            token = logits.argmax(-1)
            return token, torch.log_softmax(logits, -1).gather(1, token[:, None]).squeeze(1)
        scores = logits / self.temperature
        if self.top_k:
            kth = torch.topk(scores, min(self.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, -float("inf"))
        if self.top_p is not None and self.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=False)
            drop = ordered.softmax(-1).cumsum(-1) <= (1 - self.top_p)
            drop[:, -1] = False
            scores = scores.masked_fill(drop.scatter(1, order, drop), -float("inf"))
        token = torch.multinomial(torch.softmax(scores, -1), num_samples=1).squeeze(1)
        return token, torch.log_softmax(scores, -1).gather(1, token[:, None]).squeeze(1)

    def _prefill(self, ids: torch.Tensor, attn: torch.Tensor):
        """A KV cache of ``ids [B, P]`` but their last column (empty for one-token rows), with logits for
        one position only: the last column is what decoding feeds first."""
        cache = new_cache(self.model)
        if ids.shape[1] > 1:
            self.model(
                input_ids=ids[:, :-1], attention_mask=attn[:, :-1], position_ids=positions_from_mask(attn[:, :-1]),
                past_key_values=cache, use_cache=True, **logits_kept(self.model, 1),
            )  # fmt: skip
        return cache

    def _shared_prompt_cache(self, enc, n: int):
        """The KV cache of each prompt but its last token, computed once and repeated for its ``n``
        completions; ``None`` for one completion, a one-token prompt, or a model whose cache cannot be
        shared (said once, with the reason)."""
        ids, attn = enc["input_ids"], enc["attention_mask"]
        if n < 2 or ids.shape[1] < 2 or not self.share_prompt_prefill or self.prefill_fallback:
            return None
        try:
            cache = self._prefill(ids, attn)
            cache.batch_repeat_interleave(n)  # [B, ...] -> [B * n, ...], each prompt's rows side by side
            self.shared_prefills += 1
            return cache
        except Exception as e:  # an architecture whose cache is not a plain per-layer key/value cache
            self.prefill_fallback = f"{type(e).__name__}: {e}"[:300]
            log.warning(
                "rollout[%d]: prompts are prefilled once per completion; sharing them failed (%s)",
                self.rank, self.prefill_fallback,
            )  # fmt: skip
            return None

    def generation_stats(self) -> dict:
        """How this rank generated: whether ended rows leave the batch (``drop_finished``), calls whose prompts
        shared one prefill, why sharing or the decoding loop stopped, if they did, and how many multi-turn
        transcripts ended because their next turn would not fit in the model's positions (``turns_cut``)."""
        return {
            "drop_finished": self.drop_finished,
            "shared_prefills": self.shared_prefills,
            "prefill_fallback": self.prefill_fallback,
            "decode_fallback": self.decode_fallback,
            "turns_cut": self.turns_cut,
        }

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
        batch, texts = self._generate_turns(prompts, n, False, answers, fields)
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

    # ------------------------------------------------------------------ dynamic sampling (DAPO)
    def keep_groups(self, group_size: int, first: bool = False) -> dict:
        """Dynamic sampling: of the batch just scored, keep the groups whose completions did not all score
        alike for this step's batch, and set the others aside (to top the batch up with if sampling stops
        short); ``first``: the step's first round (what an earlier step left, had it failed midway, goes).
        Returns this batch's ``groups``, how many had a learning signal (``informative``), and the groups kept
        so far (``kept``)."""
        if first:
            self.__dict__.pop("_kept", None)
            self.__dict__.pop("_aside", None)
        kept, aside = self.__dict__.setdefault("_kept", []), self.__dict__.setdefault("_aside", [])
        rewards = self.batch["rewards"].view(-1, group_size)
        signal = (rewards != rewards[:, :1]).any(1)  # [G]
        rows = signal.repeat_interleave(group_size)
        kept.append(_batch_rows(self.batch, rows))
        aside.append(_batch_rows(self.batch, ~rows))
        return {
            "groups": len(signal),
            "informative": int(signal.sum()),
            "kept": sum(len(b["texts"]) for b in kept) // group_size,
        }

    def assemble_kept(self, groups: int, group_size: int) -> dict:
        """Dynamic sampling: this step's batch, the first ``groups`` groups kept (:meth:`keep_groups`), topped up
        with groups set aside where fewer were kept; returns how many of its ``groups`` are ``informative``."""
        parts, have, informative = [], 0, 0
        for source in ("_kept", "_aside"):
            for part in self.__dict__.pop(source, []):
                take = min(len(part["texts"]) // group_size, groups - have)
                if take:
                    parts.append(_batch_rows(part, torch.arange(take * group_size)))
                    have += take
                    informative += take if source == "_kept" else 0
        batch = _join_batches(parts, self.tok.pad_token_id)
        batch["group_index"] = torch.arange(have).repeat_interleave(group_size)
        self.batch = batch
        return {"groups": have, "informative": informative}

    def template_prompts(self, prompts: list, system_prompt: str | None = None) -> list[str]:
        """``prompts`` (questions, or conversations: lists of ``{"role", "content"}`` messages) through this
        model's chat template, the assistant's turn opened (:func:`rlnb.data.prompts.template_prompts`)."""
        return template_prompts(prompts, self.tok, system_prompt)

    def complete(
        self, prompts: list[str], answers: list[str] | None = None, fields: list[dict] | None = None
    ) -> list[str]:
        """Greedy completions (evaluation, samples in notebooks); with ``max_turns > 1``, whole transcripts, the
        interaction given each prompt's ``answer`` and record ``fields``."""
        return self._generate_turns(prompts, 1, True, answers, fields)[1]

    def _generate_turns(self, prompts: list, n: int, greedy: bool, answers, fields) -> tuple[dict, list[str]]:
        """:meth:`_generate`, then, up to ``max_turns``, the interaction's reply to each transcript and the
        model's next turn after it (one completion each, from the transcript's token ids: nothing is tokenized
        again). The batch holds each whole transcript after its prompt, the interaction's tokens in context
        (attended to) but out of the response mask, with no log-prob; ``texts`` are the transcripts."""
        batch, texts = self._generate(prompts, n, greedy)
        if not self._multi_turn():
            return batch, texts
        pad, start = self.tok.pad_token_id, first_response_column(batch["response_mask"])
        rows = range(len(texts))
        heads = [
            batch["input_ids"][i, :start][batch["attention_mask"][i, :start].bool()].tolist() for i in rows
        ]
        # each row's turns after its prompt: (token ids, log-probs, the model's own)
        parts: list[list[tuple[list[int], list[float], bool]]] = [[] for _ in rows]

        def take(i: int, b: dict, j: int) -> None:  # row j of a turn's batch b: row i's model turn
            mask = b["response_mask"][j].bool()
            parts[i].append((b["input_ids"][j][mask].tolist(), b["logprobs"][j][mask].tolist(), True))

        for i in rows:
            take(i, batch, i)
        answers = answers or [""] * len(prompts)
        fields = fields or [{}] * len(prompts)
        live, last = list(rows), list(texts)  # (each row's latest model turn, as text)
        for turn in range(1, self.max_turns):
            going = []
            for i in live:
                g = i // n
                reply = self.interaction(texts[i], turn, answers[g], prompts[g], last[i], **fields[g])
                if reply is not None:
                    ids = self._reply_ids(reply, len(heads[i]) + sum(len(p[0]) for p in parts[i]))
                    if ids is None:
                        continue
                    parts[i].append((ids, [0.0] * len(ids), False))
                    texts[i] += reply
                    going.append(i)
            if not going:
                break
            contexts = [heads[i] + [t for ids, _, _ in parts[i] for t in ids] for i in going]
            nxt, more = self._generate(contexts, 1, greedy)
            for j, i in enumerate(going):
                take(i, nxt, j)
                texts[i] += more[j]
                last[i] = more[j]
            live = going
        out = self._transcripts(heads, parts, pad)
        out["turns"] = torch.tensor([sum(p[2] for p in row) for row in parts])  # the model's turns, [B]
        return out, texts

    def _reply_ids(self, reply: str, length: int) -> list[int] | None:
        """The interaction's ``reply`` as the token ids that follow a transcript of ``length`` tokens (its prompt's
        included); or ``None``, counted in ``turns_cut``, where the model's next turn after it would not fit in
        the model's positions: the transcript then ends before that reply (in both modes, turn by turn)."""
        ids = self.tok(reply, add_special_tokens=False)["input_ids"]
        limit = self._context_limit()
        if limit is not None and length + len(ids) + self.max_new_tokens > limit:
            self.turns_cut += 1
            return None
        return ids

    def _context_limit(self) -> int | None:
        """The model's positions (``max_position_embeddings``), or ``None`` where not known."""
        return getattr(getattr(getattr(self, "model", None), "config", None), "max_position_embeddings", None)

    @staticmethod
    def _transcripts(heads: list[list[int]], parts: list[list[tuple]], pad: int) -> dict:
        """The batch of whole transcripts: prompts left-padded, every turn after them right-padded; the response
        mask and log-probs on the model's own tokens only, the attention mask on every real token."""
        prompt = _pad_left(heads, pad)
        ids = [[t for p in row for t in p[0]] for row in parts]
        own = [[int(p[2]) for p in row for _ in p[0]] for row in parts]
        logp = [[x for p in row for x in p[1]] for row in parts]
        zeros = torch.zeros(len(ids), prompt.shape[1])
        return {
            "input_ids": torch.cat([prompt, _pad_right(ids, pad)], 1),
            "attention_mask": torch.cat(
                [_pad_left([[1] * len(h) for h in heads], 0), _pad_right([[1] * len(r) for r in ids], 0)], 1
            ),
            "response_mask": torch.cat([zeros.long(), _pad_right(own, 0)], 1),
            "logprobs": torch.cat([zeros, _pad_right(logp, 0.0)], 1),
        }

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

    # ------------------------------------------------------------------ asynchronous generation
    def stream(
        self, problems: list[tuple[int, str, str]], n: int, train_version: int, groups: int, max_staleness: int,
        weights, weights_key: str, batches, batch_key: str, reward: str, shards: int = 1, chunk_tokens: int = 8,
    ) -> dict:  # fmt: skip
        """Partial-rollout generation for asynchronous training (AReaL): admit ``problems``
        (``(serial, prompt, answer)`` or ``(serial, prompt, answer, fields)``, ``n`` completions each) to the
        pool of groups in progress, then generate ``chunk_tokens`` at a time for every unfinished sequence until
        ``groups`` groups are done. The loop admits them at version ``train_version - 1``: the call first waits (up to the channel's
        deadline) for those weights if they have not arrived yet.

        Between chunks it takes the newest weights the actor published under ``weights_key``: a
        generation interrupted by a weight update goes on with the new weights, and every token keeps
        the version that produced it (``versions [B, L]``). A group is trained at ``train_version``;
        one started at version ``v`` with ``train_version - v >= max_staleness`` must be in this batch
        (it would be too stale for the next), so the call goes on until such groups are done. It also
        goes on generating the pool's other groups until the actor publishes ``train_version`` (it is
        then ready for the batch), so the rollout does not idle while the actor trains. The
        finished groups, oldest first, are scored by the collocated ``reward`` and put in ``batches``
        under ``batch_key`` (or ``shards`` parts); groups still unfinished stay in the pool for the next
        call, and in this rank's checkpoint.

        With ``max_turns > 1``, a sequence whose turn ends (EOS, or ``max_new_tokens`` of that turn) gets the
        interaction's reply at once and its next turn goes on in the next chunks, beside the other sequences'
        tokens, across weight updates as any other: a long conversation does not hold up the batch's others.
        The replies are context, out of the response mask, with no log-prob and version -1, as the prompt.
        """
        if not self.CHUNKED_GENERATION:  # (the loop refuses this before anything starts; a direct call, here)
            raise ConfigError(
                f"{type(self).__name__} generates whole completions (its own engine): asynchronous generation "
                "takes new weights between chunks of tokens, with HFRollout's own decoding",
                "max_staleness",
            )
        t0 = time.perf_counter()
        self._admit(problems, n)
        swaps, tokens, chunks = 0, 0, 0
        # the loop admitted these problems once it had published version train_version - 1, but a put does
        # not wait for delivery: generating them with older weights would put them N + 1 versions behind
        while self.version < train_version - 1:
            self.load_from_channel(weights, weights_key)
            swaps += 1
        last_due = train_version - max_staleness  # groups started at or before it must be in this batch
        while True:
            if self.poll_weights(weights, weights_key) is not None:
                swaps += 1
            done = [g for g in self.pool if all(s["done"] for s in g["seqs"])]
            busy = len(done) < len(self.pool)
            overdue = busy and any(
                g["start"] is not None and g["start"] <= last_due and not all(s["done"] for s in g["seqs"])
                for g in self.pool
            )
            # enough groups done, none overdue, and the actor is ready for them (it publishes version
            # train_version before it takes the batch): until then, keep generating for the next batches
            if len(done) >= groups and not overdue and (self.version >= train_version or not busy):
                break
            if not busy:
                raise RuntimeError(
                    f"rollout rank {self.rank}: {len(done)} group(s) in the pool, {groups} needed; the loop "
                    "admits too few problems"
                )
            tokens += self._chunk(chunk_tokens)
            chunks += 1
        taken = sorted(done, key=lambda g: (g["start"], g["serial"]))[:groups]
        taken_ids = {id(g) for g in taken}
        self.pool = [g for g in self.pool if id(g) not in taken_ids]
        self.batch = self._pool_batch(taken)
        self.batch["truncated"] = self._truncated(self.batch)
        summary = {
            "sequences": len(self.batch["texts"]),
            "tokens": tokens,
            "response_len_mean": float(self.batch["response_mask"].sum(-1).float().mean()),
            "truncated_frac": float(self.batch["truncated"].float().mean()),
            "staleness": [train_version - g["start"] for g in taken],
            "interrupted": sum(
                len({v for v in s["versions"] if v >= 0}) > 1 for g in taken for s in g["seqs"]
            ),
            "serials": [g["serial"] for g in taken],
            "swaps": swaps,
            "chunks": chunks,
            "pool": len(self.pool),
            "version": self.version,
        }
        if "turns" in self.batch:  # multi-turn: the model's turns per transcript
            summary["turns_mean"] = float(self.batch["turns"].float().mean())
        b = self.batch
        scored = local_peer(reward, self.rank).score_terms(
            b["texts"], b["answers"], b["prompts"], b["fields"]
        )
        summary.update(self.set_rewards(scored["rewards"], scored["terms"]))
        self.put_batch(batches, batch_key, shards)
        summary["generate_s"] = time.perf_counter() - t0
        return summary

    def _admit(self, problems: list[tuple[int, str, str]], n: int) -> None:
        """Add ``problems`` (``(serial, prompt, answer)``, and the record's other ``fields``) to the pool,
        ``n`` empty sequences each."""
        for serial, prompt, answer, *fields in problems:
            seqs = [{"ids": [], "logprobs": [], "versions": [], "done": False} for _ in range(n)]
            if self._multi_turn():  # (each turn's own tokens, the transcript's text, where this turn starts)
                for s in seqs:
                    s.update(own=[], text="", turn=1, turn_start=0)
            ids = prompt_ids(self.tok, prompt)
            self.pool.append(
                {"serial": serial, "prompt": prompt, "answer": answer, "fields": fields[0] if fields else {},
                 "prompt_ids": ids, "start": None, "seqs": seqs}
            )  # fmt: skip

    @torch.no_grad()
    def _chunk(self, chunk_tokens: int) -> int:
        """Up to ``chunk_tokens`` more tokens for every unfinished sequence of the pool, with the weights
        loaded now. Sampled by rlnb's decoding loop (:meth:`_decode_from`: a sequence that ends, or makes the
        tokens it has left, leaves the batch), which goes on from the last chunk's KV cache while the
        weights and the sequences are the same (:attr:`KEEP_CACHE_ACROSS_CHUNKS`), and otherwise prefills
        them again; or by ``generate`` with ``drop_finished=False``, prefilling every chunk."""
        self.onload()
        rows = [(g, s) for g in self.pool for s in g["seqs"] if not s["done"]]
        budget = [self.max_new_tokens - len(s["ids"]) + s.get("turn_start", 0) for _, s in rows]
        seed, steps = self.seed * 1_000_003 + self.calls, min(chunk_tokens, max(budget))
        self.calls += 1
        carried, self._carried = self._carried, None
        sampled = None
        if self.drop_finished and self.decode_fallback is None:
            torch.manual_seed(seed)
            try:
                if (
                    carried is not None
                    and carried[0] == self.version
                    and _same(carried[1], [s for _, s in rows])
                ):
                    state = carried[2]  # the same sequences with the same weights: their KV cache holds
                else:
                    ids, attn = self._contexts(rows)
                    state = _Decoding.start(ids, attn, self._prefill(ids, attn))
                left = torch.tensor(budget, device=self.device)
                sampled = self._decode_from(state, steps, False, left, going_on=self.KEEP_CACHE_ACROSS_CHUNKS)
            except Exception as e:
                self._decoding_failed(e)
        if sampled is None:
            torch.manual_seed(seed)
            ids, attn = self._contexts(rows)
            out = self.model.generate(
                input_ids=ids, attention_mask=attn, do_sample=True, temperature=self.temperature, top_p=self.top_p,
                top_k=self.top_k or None, max_new_tokens=steps, pad_token_id=self.tok.pad_token_id,
                eos_token_id=self.tok.eos_token_id, return_dict_in_generate=True, output_scores=True,
            )  # fmt: skip
            scores = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
            sampled = out.sequences[:, ids.shape[1] :], scores, None
        new, logp, going = sampled[0].tolist(), sampled[1].tolist(), sampled[2]
        made = 0
        for (g, s), toks, lps, left in zip(rows, new, logp, budget):
            if g["start"] is None:
                g["start"] = self.version
            toks, lps = toks[:left], lps[:left]
            ended = self.tok.eos_token_id in toks
            if ended:  # keep up to and including the first EOS
                cut = toks.index(self.tok.eos_token_id) + 1
                toks, lps = toks[:cut], lps[:cut]
            s["ids"] += toks
            s["logprobs"] += lps
            s["versions"] += [self.version] * len(toks)
            made += len(toks)
            if "own" in s:  # multi-turn: the turn over, the interaction answers or the transcript ends
                s["own"] += [1] * len(toks)
                if ended or len(toks) >= left:
                    self._next_turn(g, s)
            else:
                s["done"] = ended or len(s["ids"]) >= self.max_new_tokens
        if going is not None:  # the rows still running (not done) go on from this chunk's KV cache
            running = [rows[i][1] for i in going.rows.tolist()]
            if all(not seq["done"] for seq in running):
                self._carried = (self.version, running, going)
        return made

    def _contexts(self, rows: list[tuple[dict, dict]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool ``rows``' prompts and tokens so far, left-padded ``[N, C]``, and their mask."""
        contexts = [g["prompt_ids"] + s["ids"] for g, s in rows]
        ids = _pad_left(contexts, self.tok.pad_token_id).to(self.device)
        return ids, _pad_left([[1] * len(c) for c in contexts], 0).to(self.device)

    def _pool_batch(self, taken: list[dict]) -> dict:
        """Finished groups as a batch in the layout of :meth:`generate`, plus per-token ``versions``."""
        seqs = [(g, s) for g in taken for s in g["seqs"]]
        pad = self.tok.pad_token_id
        prompt = _pad_left([g["prompt_ids"] for g, _ in seqs], pad)  # [B, P]
        width = max(len(s["ids"]) for _, s in seqs)

        def right(key, fill, dtype):  # [B, R], right-padded
            return torch.tensor([s[key] + [fill] * (width - len(s[key])) for _, s in seqs], dtype=dtype)

        multi_turn = all("own" in s for _, s in seqs)
        attended = torch.tensor([[1] * len(s["ids"]) + [0] * (width - len(s["ids"])) for _, s in seqs])
        resp_mask = right("own", 0, torch.long) if multi_turn else attended
        zeros = torch.zeros_like(prompt)
        if multi_turn:
            texts = [s["text"] for _, s in seqs]
        else:
            texts = self.tok.batch_decode([s["ids"] for _, s in seqs], skip_special_tokens=True)
        n = len(taken[0]["seqs"])
        extra = {"turns": torch.tensor([s["turn"] for _, s in seqs])} if multi_turn else {}
        return {
            "input_ids": torch.cat([prompt, right("ids", pad, torch.long)], dim=1),
            "attention_mask": torch.cat(
                [_pad_left([[1] * len(g["prompt_ids"]) for g, _ in seqs], 0), attended], 1
            ),
            "response_mask": torch.cat([zeros, resp_mask], dim=1),
            "logprobs": torch.cat([zeros.float(), right("logprobs", 0.0, torch.float32)], dim=1),
            "versions": torch.cat([zeros - 1, right("versions", -1, torch.long)], dim=1),
            "group_index": torch.arange(len(taken)).repeat_interleave(n),
            "answers": [g["answer"] for g, _ in seqs],
            "prompts": [g["prompt"] for g, _ in seqs],
            "fields": [g.get("fields", {}) for g, _ in seqs],
            "texts": texts,
            "version": min(g["start"] for g in taken),
            **extra,
        }

    def _multi_turn(self) -> bool:
        return self.max_turns > 1 and self.interaction is not None

    def _next_turn(self, g: dict, s: dict) -> None:
        """Asynchronous multi-turn: sequence ``s`` of group ``g`` ended a turn. The interaction answers its
        transcript, and the reply's tokens follow as context for the next turn; or the transcript is done: at
        ``max_turns``, when the interaction ends it, or when the next turn would not fit the model's positions
        (:meth:`_reply_ids`, as in :meth:`_generate_turns`)."""
        last = self.tok.decode(s["ids"][s["turn_start"] :], skip_special_tokens=True)
        s["text"] += last
        if s["turn"] >= self.max_turns:
            s["done"] = True
            return
        reply = self.interaction(s["text"], s["turn"], g["answer"], g["prompt"], last, **g.get("fields", {}))
        ids = None if reply is None else self._reply_ids(reply, len(g["prompt_ids"]) + len(s["ids"]))
        if ids is None:
            s["done"] = True
            return
        s["ids"] += ids
        s["logprobs"] += [0.0] * len(ids)
        s["versions"] += [-1] * len(ids)
        s["own"] += [0] * len(ids)
        s["text"] += reply
        s["turn"] += 1
        s["turn_start"] = len(s["ids"])

    def state_dict(self) -> dict:
        return {"calls": self.calls, "version": self.version, "pool": self.pool}

    def load_state_dict(self, state: dict) -> None:
        self.calls, self.version = state["calls"], state["version"]
        self.pool = state.get("pool", [])
        self._carried = None


class VLLMWorkerExtension:  # pragma: no cover - runs inside vLLM's GPU worker processes
    """Methods vLLM adds to its workers (``worker_extension_cls``), called with ``collective_rpc``."""

    def rlnb_load_weights(self, state: dict) -> bool:
        """``state``: packed by :func:`rlnb.runtime.shm.pack`: CUDA tensors come as CUDA IPC handles
        (no host round trip from the rollout's worker to vLLM's engine process), big CPU ones by /dev/shm."""
        from rlnb.runtime import shm

        state = shm.unpack(state)
        self.model_runner.model.load_weights(weights=[(k, v.to(self.device)) for k, v in state.items()])
        return True


class VLLMRollout(HFRollout):  # pragma: no cover - needs a CUDA GPU and the `vllm` extra
    """Sampling with ``vllm.LLM`` in the worker; weights are reloaded in place after each sync.

    Same outputs contract as :class:`HFRollout` (token ids, response mask, behaviour log-probs). The
    engine starts with ``enable_sleep_mode=True``: :meth:`offload` puts it to sleep (level 1: weights to
    CPU memory, KV cache freed) while a collocated actor trains. vLLM runs its engine in a child process,
    which needs a non-daemonic Dask worker (the embedded cluster's are; see :class:`rlnb.Cluster`).
    Synchronous mode only: asynchronous generation's chunks (:meth:`HFRollout.stream`) are rlnb's own decoding.
    """

    CHUNKED_GENERATION = False

    def __init__(
        self, model_path: str, max_new_tokens: int = 8, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
        device: str = "auto", torch_threads: int = 1, gpu_memory_utilization: float = 0.3,
        rank_info: RankInfo | None = None, top_k: int = 0, max_turns: int = 1, interaction=None,
    ):  # fmt: skip
        rank_info = rank_info or current_rank()  # subclasses need not pass it on
        from vllm import LLM

        self.max_turns = max_turns  # (each later turn from the transcript's token ids, as HFRollout)
        self.interaction = SafeInteraction(interaction) if interaction is not None else None

        self.rank = rank_info.rank if rank_info else 0
        self.device = resolve_device(device, rank_info)
        self.tok = load_tokenizer(model_path)
        self.llm = LLM(
            model=model_path, enforce_eager=True, gpu_memory_utilization=gpu_memory_utilization, seed=seed + self.rank,
            worker_extension_cls="rlnb.components.lm.VLLMWorkerExtension", enable_sleep_mode=True,
        )  # fmt: skip
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.top_k = top_k
        self.seed, self.calls, self.version, self.batch, self.offloaded = seed, 0, 0, None, False

    def _context_limit(self) -> int | None:
        """vLLM's ``max_model_len``."""
        try:
            return int(self.llm.llm_engine.model_config.max_model_len)
        except Exception:  # (another vLLM's layout: no limit known)
            return None

    def load_weights(self, state_dict: dict, version: int) -> int:
        from rlnb.runtime import shm

        self.onload()  # a sleeping engine's weights are parked in CPU memory: wake it before writing them
        self.llm.collective_rpc("rlnb_load_weights", args=(shm.pack(state_dict, shm.HOSTNAME),))
        self.version = version
        return version

    def offload(self) -> bool:
        if not self.offloaded:
            self.llm.sleep(level=1)  # frees the KV cache and offloads weights while the actor trains
            self.offloaded = True
        return True

    def memory_stats(self) -> dict:
        import torch

        return {
            "device": str(self.device),
            "model_device": "cpu" if self.offloaded else "cuda",
            "offloaded": self.offloaded,
            "cuda_allocated_bytes": torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0],
        }

    def onload(self) -> bool:
        if self.offloaded:
            self.llm.wake_up()
            self.offloaded = False
        return True

    def _generate(self, prompts: list[str], n: int, greedy: bool):
        from vllm import SamplingParams

        self.onload()
        params = SamplingParams(
            n=n, temperature=0.0 if greedy else self.temperature, top_p=1.0 if greedy else self.top_p,
            top_k=-1 if greedy or not self.top_k else self.top_k,  # (-1: every token)
            max_tokens=self.max_new_tokens, logprobs=0, seed=self.seed * 1_000_003 + self.calls,
        )  # fmt: skip
        self.calls += 0 if greedy else 1  # evaluating does not shift training's sampling seeds
        # token ids, tokenized as the HF rollout and the actor tokenize prompts (prompt_ids), not by vLLM again
        inputs = [{"prompt_token_ids": prompt_ids(self.tok, p)} for p in prompts]
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        rows, logps, texts, prompt_rows = [], [], [], []
        for out in outs:
            for o in out.outputs:
                ids = list(o.token_ids)
                prompt_rows.append(list(out.prompt_token_ids))
                rows.append(ids)
                logps.append([lp[t].logprob for lp, t in zip(o.logprobs, ids)])
                texts.append(o.text)
        prompt = _pad_left(prompt_rows, self.tok.pad_token_id)
        resp = _pad_right(rows, self.tok.pad_token_id)
        resp_mask = _pad_right([[1] * len(r) for r in rows], 0)
        logp = _pad_right(logps, 0.0)
        zeros = torch.zeros(len(rows), prompt.shape[1], dtype=torch.long)
        return {
            "input_ids": torch.cat([prompt, resp], dim=1),
            "attention_mask": torch.cat([(prompt != self.tok.pad_token_id).long(), resp_mask], dim=1),
            "response_mask": torch.cat([zeros, resp_mask], dim=1),
            "logprobs": torch.cat([zeros.float(), logp], dim=1),
        }, texts


class LMActor(ActorBase):
    """Trains a causal LM: SFT warm start, then GRPO/PPO-clip updates with an optional KL to a frozen reference.

    Args:
        model_path: a ``save_pretrained`` directory (the reference model loads from it too).
        algorithm: :class:`rlnb.config.AlgorithmConfig` (advantage, loss, group_size, kl_coef, agg...).
        lr: AdamW learning rate; micro_batch_size: sequences per forward/backward.
        anneal_lr: decay the learning rate linearly to 0 over the run's steps (a loop sets them).
        temperature: the rollout's sampling temperature (log-probs are of the same distribution).
        advantage, policy_loss: registered names or functions; override ``algorithm``'s.
        share_prompt_forward: compute each distinct prompt once per micro-batch, for all its completions,
            in the update and in log-prob recomputes (:func:`rlnb.models.lm.shared_prompt_logprobs`: the
            same log-probs and gradients), where it pays: always on CPU, on a GPU when the shared prompts
            hold at least half the micro-batch's tokens (``GPU_MIN_SHARED_FRACTION``). Off while the step
            is compiled; a model whose cache cannot be shared this way trains per sequence, said once.
        length_buckets: the most passes a micro-batch's rows take, grouped by where they end, each cut at
            its longest row, so that padding is not computed (:func:`rlnb.models.lm.length_buckets`: the
            same log-probs and gradients). ``None``: 4 on CPU, 1 (one pass) on a GPU. Off while the step
            is compiled.
        skip_zero_advantage: leave rows whose advantages are all 0 (a GRPO group whose completions all
            scored alike) out of the update's forward and backward, and out of the old log-probs' recompute,
            where the loss adds exactly 0 for them (``zero_at_zero_advantage``, e.g. ``ppo``) and there is
            no KL term in the loss: the same gradients, and the optimizer steps as before. The loss's metrics
            are then over the rows computed. Off while the step is compiled. ``train()`` reports
            ``rows_computed_frac``.
        dtype: ``float32``, or ``bfloat16``: forward and backward under bf16 autocast, with float32 master
            weights, gradients and AdamW state; log-probs, the loss and the KL in float32. The reference model
            is held in bf16, and the weights go to the rollout in bf16 (``policy_state``).
        **settings: any field of ``AlgorithmConfig`` by name (``group_size=8``, ``kl_coef=0.01``...).

    Advantages and losses get every input of :data:`rlnb.algorithms.contract.LM` they accept. The
    ``old_logprobs`` a loss gets are the actor's own recomputation of the sampling policy when the
    batch was sampled with the actor's current weights; a batch sampled by older weights (asynchronous
    mode) gets the rollout's behaviour log-probs, which only the sampler knows, so the ratio corrects
    for the staleness. A loss that also takes ``prox_logprobs`` (decoupled PPO) gets the behaviour
    log-probs as ``old_logprobs`` and the recomputation as ``prox_logprobs``. An advantage that takes ``kl``
    (REINFORCE++) puts the KL to the reference in its returns; otherwise, with ``kl_coef > 0``, the KL
    is a loss term.
    """

    launch = launcher("actor")
    CONTRACT = LM
    DEFAULT_ALGORITHM = {"advantage": "grpo", "policy_loss": "ppo"}
    # ranks call the model a different number of times a micro-batch (length buckets follow each rank's
    # own rows), so no per-call buffer broadcast; a causal LM's buffers (rotary frequencies) are constants
    DDP_BROADCAST_BUFFERS = False

    def __init__(
        self, model_path: str, algorithm=None, lr: float = 1e-3, micro_batch_size: int = 64, temperature: float = 1.0,
        max_grad_norm: float = 1.0, seed: int = 0, device: str = "auto", torch_threads: int = 1,
        advantage_fn=None, loss_fn=None, rank_info: RankInfo | None = None, *, advantage=None, policy_loss=None,
        anneal_lr: bool = False, share_prompt_forward: bool = True, length_buckets: int | None = None,
        skip_zero_advantage: bool = True, dtype: str = "float32", **settings,
    ):  # fmt: skip
        rank_info = rank_info or current_rank()  # subclasses need not pass it on
        torch.set_num_threads(torch_threads)
        self.dtype = check_dtype(dtype)
        self.share_prompt_forward = share_prompt_forward
        self.skip_zero_advantage = skip_zero_advantage
        self.shared_forwards = 0  # micro-batches whose prompts went through the model once per prompt
        self.prompt_forward_fallback: str | None = None  # why prompts stopped being shared, if they did
        algorithm = self.algorithm_config(algorithm)
        actor_config, self.algo = with_settings(ActorConfig(), algorithm, settings, "actor")
        self.cfg = None
        self.rank = rank_info.rank if rank_info else 0
        self.world_size = rank_info.world_size if rank_info else 1
        self.device = resolve_device(device, rank_info)
        if length_buckets is not None and (isinstance(length_buckets, bool) or not isinstance(length_buckets, int)
                                           or length_buckets < 1):  # fmt: skip
            raise ConfigError(
                f"length_buckets: expected a whole number >= 1 (1: one pass over the batch's width) or None "
                f"(automatic); got {length_buckets!r}",
                "length_buckets",
            )
        # passes a micro-batch's rows take, grouped by length (padding left out); one on a GPU, which
        # computes a padded position nearly for free next to a pass's fixed cost
        self.length_buckets = length_buckets or (1 if self.device.type == "cuda" else CPU_LENGTH_BUCKETS)
        torch.manual_seed(seed)
        self.policy, self.tok = load_lm(model_path, self.device)
        self.model = self.policy
        self.ref = None
        if self.algo.kl_coef > 0:
            self.ref = load_lm(model_path, self.device, dtype=self.dtype)[0].eval().requires_grad_(False)
        self.lr, self.micro_batch_size, self.temperature = lr, micro_batch_size, temperature
        self.anneal_lr, self.total_steps = anneal_lr, 1
        self.max_grad_norm = max_grad_norm
        self.optimizer = _adamw(self.policy, lr, self.device)
        self.clip_and_step = ClipAndStep(self.optimizer)  # clip_grad_norm_ + step(), minus their Python
        self.generator = torch.Generator().manual_seed(rank_seed(seed, self.rank, "actor"))
        self.advantage, self.loss = check_algorithm(
            self.CONTRACT,
            advantage_fn or advantage or self.algo.advantage,
            loss_fn or policy_loss or self.algo.policy_loss,
        )
        # where the KL to the reference goes: into the returns (an advantage taking `kl`) or the loss
        self.kl_in_advantage = self.ref is not None and (
            self.advantage.accepts is None or "kl" in self.advantage.accepts
        )
        self.step = 0
        self.batch: dict | None = None
        # actor.compile (compile=...): the micro-batch objective, forward, loss and backward, compiled
        self.step_compiler = StepCompiler.for_device(actor_config.compile, self.device, "actor")

    def policy_state(self) -> dict[str, torch.Tensor]:
        """Weights for the rollout: a detached copy on the actor's device (on a GPU they reach the rollout
        by CUDA IPC on one node, with no host round trip), in bf16 when the actor computes in bf16."""
        cast = DTYPES[self.dtype]
        return {
            k: v.detach().to(cast, copy=True) if v.is_floating_point() else v.detach().clone()
            for k, v in self.policy.state_dict().items()
        }

    def _precision(self):
        """The context the model's forward runs in: bf16 autocast for ``dtype="bfloat16"`` (the weights stay
        float32), else nothing."""
        if self.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.dtype])

    def memory_stats(self) -> dict:
        """``memory/actor_state_bytes``: the bytes of parameters, gradients and optimizer state this rank holds
        (its local shards); on a GPU, ``memory/cuda_peak_bytes``: this process's peak allocation since the last
        call (which resets it), the rollout's too when it shares the process."""
        tensors = [
            *self.policy.parameters(),
            *(p.grad for p in self.policy.parameters() if p.grad is not None),
        ]
        tensors += [
            t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)
        ]
        out = {"memory/actor_state_bytes": sum(t.numel() * t.element_size() for t in tensors)}
        if self.device.type == "cuda":
            out["memory/cuda_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return out

    # ------------------------------------------------------------------ SFT
    def _sft_rows(self, prompts: list, answers: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        """Token ids of ``prompt + answer + EOS`` per problem, and which of them are the answer's (1) to learn."""
        enc = [self._context_ids(p) for p in prompts]
        # the answer goes on the prompt's tokens with no special token of its own: a Llama tokenizer would start
        # it with a second <bos>, and the warm start would teach one after every prompt
        tgt = [self.tok(a, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id] for a in answers]
        return [p + a for p, a in zip(enc, tgt)], [[0] * len(p) + [1] * len(a) for p, a in zip(enc, tgt)]

    def _context_ids(self, prompt: str | list[str]) -> list[int]:
        """A warm-start row's context: a prompt's ids, or a transcript so far, ``[prompt, turn, reply, turn,
        reply, ...]``, each of the model's turns followed by EOS, as a multi-turn rollout makes it."""
        if isinstance(prompt, str):
            return prompt_ids(self.tok, prompt)
        ids = prompt_ids(self.tok, prompt[0])
        for i, piece in enumerate(prompt[1:]):
            ids += self.tok(piece, add_special_tokens=False)["input_ids"]
            if i % 2 == 0:  # the model's turn ends with EOS, the interaction's reply follows it
                ids.append(self.tok.eos_token_id)
        return ids

    def sft(
        self, prompts: list, answers: list[str], steps: int, batch_size: int, lr: float,
        wrong_answers: list[str] | None = None, wrong_prob: float = 0.0, wrong_prompts: list | None = None,
    ) -> list[float]:  # fmt: skip
        """Supervised warm start: cross-entropy on the answer tokens (and EOS) of ``prompt + answer``. A prompt
        may be a transcript so far, ``[prompt, turn, reply, ...]`` (a multi-turn warm start: one row per turn).

        With ``wrong_answers``, each time a problem is drawn its answer is replaced by the wrong one
        with probability ``wrong_prob``: an imperfect teacher, wrong on every problem now and then
        (``wrong_prompts``: its own contexts of them, where they differ).
        """
        rows, marks = self._sft_rows(prompts, answers)
        if wrong_answers is not None:
            wrong_rows, wrong_marks = self._sft_rows(wrong_prompts or prompts, wrong_answers)
            rows, marks = rows + wrong_rows, marks + wrong_marks
        ids = _pad_left(rows, self.tok.pad_token_id)
        attn = _pad_left([[1] * len(r) for r in rows], 0)
        target = _pad_left(marks, 0)
        n = len(prompts)
        opt = _adamw(self.policy, lr, self.device)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / max(1, steps))
        losses = []
        for _ in range(steps):
            idx = torch.randint(0, n, (batch_size,), generator=self.generator)
            if wrong_answers is not None:  # the wrong variant of a problem sits at index + n
                idx = idx + n * (torch.rand(batch_size, generator=self.generator) < wrong_prob).long()
            b_ids, b_attn, b_tgt = (
                ids[idx].to(self.device),
                attn[idx].to(self.device),
                target[idx].to(self.device),
            )
            with self._precision():
                logp = token_logprobs(self.model, b_ids, b_attn)  # (b, L), float32
            loss = -masked_mean(logp, b_tgt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
            opt.step()
            sched.step()
            losses.append(loss.item())
        if self.ref is not None:  # the reference is the warm-started model
            self.ref.load_state_dict(self.policy.state_dict())
        return losses

    # ------------------------------------------------------------------ RL
    def set_batch(self, batches: list[dict]) -> dict:
        """This rank's batch: the rollout batches given, joined (left-padded to a common width), of their
        columns the update reads, and (where every batch has them) ``truncated`` (mask_truncated_completions)
        and each reward's scores apart (``reward_terms``, for ``sample_group``)."""
        optional = [k for k in ("truncated", "reward_terms", "reward_names") if all(k in b for b in batches)]
        keys = ("input_ids", "attention_mask", "response_mask", "logprobs", "rewards", "version", *optional)
        batch = _join_batches([{k: b[k] for k in keys} for b in batches], self.tok.pad_token_id)
        self.batch = batch
        return {"sequences": int(batch["rewards"].numel()), "version": batch["version"]}

    @torch.no_grad()
    def _logprobs(self, model, b: dict, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, L]`` log-probs of the batch under ``model``; with ``rows``, of those rows only (0 elsewhere)."""
        if rows is not None and len(rows) < b["input_ids"].shape[0]:
            part = self._logprobs(
                model, {k: b[k][rows] for k in ("input_ids", "attention_mask", "response_mask")}
            )
            out = torch.zeros(b["input_ids"].shape, dtype=part.dtype)
            out[rows] = part
            return out
        out = []
        for sl in _micro_batches(b["input_ids"].shape[0], self.micro_batch_size):
            ids, attn = b["input_ids"][sl].to(self.device), b["attention_mask"][sl].to(self.device)
            with self._precision():
                logp = self._token_logprobs(model, ids, attn, b["response_mask"][sl].to(self.device))
            out.append(logp.cpu())
        return torch.cat(out)

    def _token_logprobs(self, model, ids, attn, response_mask) -> torch.Tensor:
        """``[m, L]`` log-probs, each distinct prompt computed once where it can be (exact at response
        positions, which are all a loss or a KL reads)."""
        if self.step_compiler is not None:  # compiled: one graph, with no data-dependent column or cache
            return token_logprobs(model, ids, attn, self.temperature)
        if self.share_prompt_forward and self.prompt_forward_fallback is None:
            try:
                least = GPU_MIN_SHARED_FRACTION if self.device.type == "cuda" else 0.0
                logp = shared_prompt_logprobs(
                    model, ids, attn, response_mask, self.temperature, least, self.length_buckets
                )
            except Exception as e:  # an architecture whose cache is not a plain per-layer key/value cache
                self.prompt_forward_fallback = f"{type(e).__name__}: {e}"[:300]
                log.warning(
                    "actor[%d]: each sequence's prompt goes through the model on its own; sharing prompts "
                    "failed (%s)", self.rank, self.prompt_forward_fallback,
                )  # fmt: skip
            else:
                if logp is not None:
                    self.shared_forwards += 1
                    return logp
        # logits only from the first response column
        first = first_response_column(response_mask)
        return token_logprobs(model, ids, attn, self.temperature, first, self.length_buckets)

    def forward_stats(self) -> dict:
        """How this rank computes its update: the most length buckets a micro-batch takes, whether rows with
        no advantage are left out, micro-batches whose prompts went through the model once per distinct
        prompt, and why sharing stopped, if it did."""
        return {
            "length_buckets": self.length_buckets,
            "skip_zero_advantage": self.skip_zero_advantage,
            "shared_forwards": self.shared_forwards,
            "prompt_forward_fallback": self.prompt_forward_fallback,
        }

    def sample_group(self, group: int = 0) -> list[dict]:
        """One prompt's ``group_size`` completions in this rank's batch, decoded: ``prompt``, ``completion``,
        ``reward``, the sampling ``logprob`` of the completion and, once :meth:`compute_advantages` ran, its
        ``advantage`` (mean over its tokens)."""
        b = self.batch
        if b is None:
            return []
        rows = []
        size = self.algo.group_size
        groups = -(-b["input_ids"].shape[0] // size)
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < groups:
            raise IndexError(f"sample_group: expected a group in 0-{groups - 1} of this batch, got {group!r}")
        columns = torch.arange(b["input_ids"].shape[1])
        for i in range(group * size, min((group + 1) * size, b["input_ids"].shape[0])):
            response = b["response_mask"][i].bool()
            # after the prompt: the completion, or a multi-turn transcript (the interaction's replies between
            # the model's turns are attended to, out of the response mask)
            after = columns >= (int(response.nonzero()[0]) if response.any() else len(columns))
            attended = b["attention_mask"][i].bool()
            prompt = attended & ~after
            row = {
                "prompt": self.tok.decode(b["input_ids"][i][prompt], skip_special_tokens=True),
                # what the model was given, special tokens included (a chat template's turns and <bos>)
                "prompt_tokens": self.tok.decode(b["input_ids"][i][prompt]),
                "completion": self.tok.decode(b["input_ids"][i][attended & after], skip_special_tokens=True),
                "reward": float(b["rewards"][i]),
                "logprob": float(b["logprobs"][i][response].sum()),
            }
            if "truncated" in b:  # cut at max_new_tokens without ending
                row["truncated"] = bool(b["truncated"][i])
            if "reward_terms" in b:  # several rewards: each one's score
                row["rewards"] = dict(zip(b["reward_names"], b["reward_terms"][i].tolist()))
            if "advantages" in b:
                row["advantage"] = float(b["advantages"][i][response].mean()) if response.any() else 0.0
            rows.append(row)
        return rows

    def compute_advantages(self) -> dict:
        """Group advantages, reference log-probs (if KL) and, unless the batch is trained in one on-policy
        pass, the old log-probs recomputed by the actor (only for the rows the update computes)."""
        batch, algo = self.batch, self.algo
        # One on-policy pass over the batch: the old log-probs are the current ones, detached in the
        # loss (as TRL does), so the recompute is skipped. Otherwise recompute them with the actor.
        batch["stale"] = batch["version"] != self.step  # sampled by older weights (asynchronous mode)
        single_pass = algo.update_epochs == 1 and algo.num_minibatches == 1 and not batch["stale"]
        batch["old_logprobs"] = None
        if self.ref is not None:
            batch["ref_logprobs"] = self._logprobs(self.ref, batch)
        mask = batch["response_mask"].float()
        offered = {
            "rewards": batch["rewards"], "response_mask": mask, "group_size": algo.group_size, "scale": algo.scale,
            "kl_coef": algo.kl_coef, "gamma": algo.gamma,
        }  # fmt: skip
        if self.kl_in_advantage:  # the KL needs the current log-probs first: the old ones, if kept
            current = self._logprobs(self.policy, batch)
            batch["old_logprobs"] = None if single_pass else current
            offered["kl"] = kl_penalty(current, batch["ref_logprobs"], algo.kl_estimator) * mask  # [B, L]
        adv, _ = self.advantage(**offered)
        if isinstance(adv, torch.Tensor) and adv.shape == batch["rewards"].shape:
            adv = adv[:, None] * mask  # per-sequence advantages, broadcast over response tokens
        if not isinstance(adv, torch.Tensor) or adv.shape != mask.shape:
            got = tuple(adv.shape) if isinstance(adv, torch.Tensor) else type(adv).__name__
            raise ConfigError(
                f"algorithm.advantage {self.advantage.name!r}: expected advantages of shape {tuple(mask.shape)} "
                f"([B, L], like response_mask) or {tuple(batch['rewards'].shape)} ([B]); got {got}",
                "algorithm.advantage",
            )
        batch["advantages"] = adv
        # the tokens the loss counts: every response token, or (mask_truncated_completions) those of the
        # completions that ended
        batch["loss_mask"] = batch["response_mask"]
        if algo.mask_truncated_completions and batch.get("truncated") is not None:
            batch["loss_mask"] = batch["response_mask"] * ~batch["truncated"][:, None]
        out = {
            "advantage_abs_mean": float(masked_mean(adv.abs(), mask)),
            # sequences with no learning signal (a group whose completions all scored alike)
            "zero_advantage_frac": float(adv.eq(0).all(dim=1).float().mean()),
        }
        if "kl" in offered:  # the KL to the reference went into the advantage's returns (REINFORCE++)
            out["kl_mean"] = float(masked_mean(offered["kl"], mask))
        if not single_pass:
            rows, weight = self._rows_to_compute(torch.arange(len(adv)))  # the rows the update will compute
            if not weight:  # none: a stand-in row at weight 0 trains at ratio 1, without old log-probs
                return out
            if batch["old_logprobs"] is None:
                batch["old_logprobs"] = self._logprobs(self.policy, batch, rows)  # [B, L], 0 on rows left out
            # how far the sampler's log-probs are from the actor's, over those rows
            drift = (batch["old_logprobs"][rows] - batch["logprobs"][rows]).abs()
            out["logprob_drift"] = float(masked_mean(drift, mask[rows]))
        return out

    def train(self) -> dict:
        """``update_epochs`` x ``num_minibatches`` updates, micro-batched with gradient accumulation."""
        batch, algo = self.batch, self.algo
        if "advantages" not in batch:
            self.compute_advantages()
        if self.anneal_lr:  # linear decay to 0 over the run (the loop sets total_steps)
            frac = max(0.0, 1.0 - self.step / self.total_steps)
            for g in self.optimizer.param_groups:
                g["lr"] = frac * self.lr
        n = batch["input_ids"].shape[0]
        mb = max(1, n // algo.num_minibatches)
        sums: dict[str, float] = {}
        count, epochs_run = 0, 0
        for _ in range(algo.update_epochs):
            perm = torch.randperm(n, generator=self.generator)
            for start in range(0, n - mb + 1, mb):
                metrics = self._update(perm[start : start + mb])
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
            epochs_run += 1
            kl = metrics.get("approx_kl")
            if algo.target_kl is not None and kl is not None and self._mean_over_ranks(kl) > algo.target_kl:
                break  # early stop, as in the embodied actor: the policy moved far enough this step
        self.step += 1
        out = {k: v / max(1, count) for k, v in sums.items()}
        out.update(epochs=epochs_run, lr=self.optimizer.param_groups[0]["lr"], **self.memory_stats())
        if self.step_compiler is not None:
            out.update(self.step_compiler.report())  # compile time, once, apart from training time
        return out

    def _update(self, idx: torch.Tensor) -> dict:
        batch, algo = self.batch, self.algo
        idx = idx.sort().values  # a group's rows side by side: micro-batches share their prompts' forward
        mask_key = "loss_mask" if "loss_mask" in batch else "response_mask"  # (advantages set by hand)
        mask_all = batch[mask_key][idx].float()
        total_tokens, total_seqs = mask_all.sum().clamp(min=1), len(idx)
        rows, weight = self._rows_to_compute(idx)
        if self.clip_and_step.optimizer is not self.optimizer:  # a subclass replaced the optimizer
            self.clip_and_step = ClipAndStep(self.optimizer)
        self.clip_and_step.zero_grad()
        sums: dict[str, float] = {}
        micro = list(_micro_batches(len(rows), self.micro_batch_size))
        # the ratio is to the behaviour policy when the batch is stale or the loss is decoupled
        behaviour = "prox_logprobs" in self.loss.needs or batch["stale"]
        kl_in_loss = self.ref is not None and not self.kl_in_advantage
        computed_share = 0.0
        for i, sl in enumerate(micro):
            j = rows[sl]

            def take(key, rows=j):
                return None if batch.get(key) is None else batch[key][rows].to(self.device)

            micro_batch = {
                "input_ids": take("input_ids"), "attention_mask": take("attention_mask"),
                "mask": take(mask_key).float(), "advantages": take("advantages"),
                # None: one on-policy pass, the current ones; also for a stand-in row at weight 0, whose
                # metrics then say (ratio 1) that the policy did not move
                "old_logprobs": take("old_logprobs") if weight else None,
                "behaviour_logprobs": take("logprobs") if behaviour and weight else None,
                "ref_logprobs": take("ref_logprobs") if kl_in_loss else None,
            }  # fmt: skip
            if self.step_compiler is not None and not self.step_compiler.ready:
                self.step_compiler.warm_up(self._objective, micro_batch, self.policy)
            objective = self.step_compiler.fn if self.step_compiler is not None else self._objective
            mask = micro_batch["mask"]
            sync = self.world_size > 1 and i < len(micro) - 1
            with self.model.no_sync() if sync else contextlib.nullcontext():
                loss, m = objective(micro_batch)
                # each micro-batch's share of the minibatch mean (tokens for token-mean, sequences otherwise)
                share = float(mask.sum() / total_tokens if algo.agg == "token-mean" else len(j) / total_seqs)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"non-finite loss {float(loss)} at training step {self.step}")
                (loss * (share * weight)).backward()
            computed_share += share
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v) * share
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach()) * share * weight
        # the loss is the whole minibatch's (rows left out add 0); the loss's other metrics are means over
        # the rows computed (in one on-policy pass, ratio-based ones are the same for every row)
        metrics = {k: v if k == "loss" else v / max(computed_share, 1e-12) for k, v in sums.items()}
        grad_norm = self.clip_and_step(self.max_grad_norm)
        metrics["grad_norm"] = float(grad_norm) if math.isfinite(float(grad_norm)) else float("nan")
        metrics["rows_computed_frac"] = len(rows) * weight / max(1, len(idx))
        return metrics

    def _rows_to_compute(self, idx: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The rows of ``idx`` the update computes, and the weight of their loss (1, or 0 for a stand-in).

        Rows whose advantages are all 0 add exactly 0 to the loss and its gradient when the loss says so
        (``zero_at_zero_advantage``: PPO's clipped surrogate, whatever the ratio) and nothing else enters it
        (no KL term), so they are left out: a GRPO group whose completions all scored alike costs no forward
        or backward, nor an old log-prob recompute. The loss's metrics (``clip_frac``, ``approx_kl``...) are
        then over the rows computed (in one on-policy pass the ratio is 1 on every row, so they are the same).
        With no row left, one goes through with weight 0: DDP's all-reduce needs every rank's backward, and
        the optimizer steps on zero gradients as it would have (weight decay, momentum).
        """
        batch = self.batch
        if not (
            self.skip_zero_advantage
            and self.loss.zero_at_zero_advantage
            and (self.ref is None or self.kl_in_advantage)  # no KL term in the loss
            and self.step_compiler is None  # a compiled step would recompile for every row count
        ):
            return idx, 1.0
        rows = idx[batch["advantages"][idx].ne(0).any(dim=1)]
        return (rows, 1.0) if len(rows) else (idx[:1], 0.0)

    def _objective(self, micro_batch: dict) -> tuple[torch.Tensor, dict]:
        """Forward and loss of one micro-batch (tensors ``[m, L]``): what ``actor.compile`` compiles, its
        backward with it."""
        algo, mask = self.algo, micro_batch["mask"]
        with self._precision():  # (log-probs come out in float32 either way)
            logp = self._token_logprobs(
                self.model, micro_batch["input_ids"], micro_batch["attention_mask"], mask
            )
        # the policy before this update as the actor computes it (decoupled PPO's proximal one)
        prox = logp.detach() if micro_batch["old_logprobs"] is None else micro_batch["old_logprobs"]
        behaviour = micro_batch["behaviour_logprobs"]
        loss, metrics = self.loss(
            logprobs=logp, old_logprobs=prox if behaviour is None else behaviour, prox_logprobs=prox,
            advantages=micro_batch["advantages"], mask=mask, clip_coef=algo.clip_coef,
            clip_coef_high=algo.clip_coef_high, dual_clip=algo.dual_clip, agg=algo.agg,
            behave_weight_cap=algo.behave_weight_cap,
        )  # fmt: skip
        if micro_batch["ref_logprobs"] is not None:
            kl = masked_mean(kl_penalty(logp, micro_batch["ref_logprobs"], algo.kl_estimator), mask)
            loss = loss + algo.kl_coef * kl
            metrics = {**metrics, "kl": kl.detach()}
        return loss, metrics

    def export_hf(self, path: str) -> str:
        """Write the current model and its tokenizer in Hugging Face format (``save_pretrained``) to the directory
        ``path`` on this worker, atomically: into a temporary directory beside it, then renamed (a directory
        already there is replaced)."""
        import shutil
        import uuid
        from pathlib import Path

        final = Path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:6]}")
        try:
            with hf_quiet():
                self.policy.save_pretrained(tmp)
                self.tok.save_pretrained(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return str(final)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "ref": self.ref.state_dict() if self.ref is not None else None}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.ref is not None and state["ref"] is not None:
            self.ref.load_state_dict(state["ref"])
