"""How :class:`rlnb.components.lm.HFRollout` samples tokens from a ``transformers`` model: ``generate`` (a dynamic
or a static KV cache), or rlnb's own decoding loop, from which a sequence leaves once it has ended, from each
prompt's KV cache computed once for its completions. Every sampler returns sequences ``[N, P+R]`` and the
sampled tokens' log-probs ``[N, R]`` under the distribution they were drawn from."""

from __future__ import annotations

import dataclasses
import logging

import torch

from rlnb.models.lm import cache_kwarg, logits_kept, new_cache, positions_from_mask

log = logging.getLogger("rlnb")

# ended sequences leave the decoding batch once they are 1/8 of it: leaving copies the KV cache (a fifth of
# a decoding step's time on CPU at the GRPO bench's sizes), so not at every step
DROP_ENDED_SHARE = 8
# rollout.static_cache: prompts are left-padded to a multiple of this many tokens, so that a run's batches
# take a few shapes (each new shape compiles generate's decoding step again)
STATIC_PROMPT_MULTIPLE = 32


@dataclasses.dataclass
class Decoding:
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
    def start(cls, ids: torch.Tensor, attn: torch.Tensor, cache) -> Decoding:
        """From sequences ``ids [N, P]`` (mask ``attn``) whose columns but the last are in ``cache``."""
        return cls(cache, attn, ids[:, -1], positions_from_mask(attn)[:, -1])


class Decoder:
    """The samplers of an HF rollout (a mixin: the rollout holds ``model``, ``tok``, the sampling parameters,
    ``max_new_tokens``, ``share_prompt_prefill`` and the fallback fields :meth:`generation_stats` reports)."""

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
                **cache_kwarg(self.model, cache),
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
        are taken off again, so a batch's sequences are ``[B*n, P+R]`` as from the other samplers. Each prompt
        is prefilled once for its ``n`` completions (:meth:`_shared_prompt_cache`), into the static cache."""
        ids, attn = enc["input_ids"], enc["attention_mask"]
        pad = -ids.shape[1] % STATIC_PROMPT_MULTIPLE
        ids = torch.cat([ids.new_full((len(ids), pad), self.tok.pad_token_id), ids], dim=1)
        attn = torch.cat([attn.new_zeros((len(attn), pad)), attn], dim=1)
        shared = self._shared_prompt_cache({"input_ids": ids, "attention_mask": attn}, n)
        cache = {"cache_implementation": "static"}  # (generate prefills each completion's prompt itself)
        if shared is not None:
            cache = cache_kwarg(
                self.model, self._static_cache_from(shared, ids.shape[1] + self.max_new_tokens)
            )
        out = self.model.generate(
            input_ids=ids.repeat_interleave(n, 0), attention_mask=attn.repeat_interleave(n, 0), **cache,
            **self._sampling(greedy),
        )  # fmt: skip
        logp = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        return out.sequences[:, pad:], logp

    def _static_cache_from(self, shared, columns: int):
        """A ``StaticCache`` of ``columns`` positions whose first ones hold ``shared`` (the prompts' KV cache, one
        row a completion). The one of the last call is reset and reused while the shape is the same: on a GPU
        the compiled decoding step is captured for its tensors, as ``generate``'s own static cache is."""
        from transformers import StaticCache

        shape = (shared.layers[0].keys.shape[0], columns)
        if self._static is None or self._static[0] != shape:
            self._static = (shape, StaticCache(config=self.model.config, max_cache_len=columns))
        else:
            self._static[1].reset()
        cache = self._static[1]
        for i, layer in enumerate(shared.layers):
            where = torch.arange(layer.keys.shape[2], device=layer.keys.device)
            cache.update(layer.keys, layer.values, i, {"cache_position": where})
        return cache

    def _decode(self, enc, n: int, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """rlnb's decoding loop: as :meth:`_hf_generate`, but a sequence that has ended leaves the batch
        (:meth:`_decode_from`), from each prompt's KV cache computed once for its ``n`` completions."""
        ids = enc["input_ids"].repeat_interleave(n, 0)  # (N, P), N = B * n
        attn = enc["attention_mask"].repeat_interleave(n, 0)
        cache = self._shared_prompt_cache(enc, n)
        if cache is None:  # each row's prompt but its last token, prefilled row by row
            cache = self._prefill(ids, attn)
        tokens, logps, _ = self._decode_from(Decoding.start(ids, attn, cache), self.max_new_tokens, greedy)
        return torch.cat([ids, tokens], dim=1), logps

    def _decode_from(
        self, state: Decoding, steps: int, greedy: bool, budget: torch.Tensor | None = None, going_on: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, Decoding | None]:  # fmt: skip
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
                use_cache=True, **cache_kwarg(self.model, cache),
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
        return tokens[:, :made], logps[:, :made], Decoding(cache, attn, last, position, live)

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
                use_cache=True, **cache_kwarg(self.model, cache), **logits_kept(self.model, 1),
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
