"""How the LM actor computes log-probs: micro-batched, under its precision (bf16 autocast or float32), each
distinct prompt once for its completions where that pays, rows grouped by length so padding is not computed.
Every path returns float32 log-probs ``[B, L]`` (exact at response positions, all a loss or a KL reads)."""

from __future__ import annotations

import logging

import torch

from rlnb.components.lm.layout import micro_batches
from rlnb.models.lm import (
    first_response_column,
    packed_token_logprobs,
    shared_prompt_logprobs,
    token_logprobs,
)

log = logging.getLogger("rlnb")

# On a GPU, computing shared prompts once pays only when they are much of the batch (a second forward's kernel
# launches cost more than a short prompt's repeats); on CPU it pays at every size. Figures: docs/gpu.md.
GPU_MIN_SHARED_FRACTION = 0.5
# On CPU a micro-batch's rows go through in up to this many passes grouped by where they end, each cut at
# its longest row (rlnb.models.lm.length_buckets): a padded position costs as much as a real one there.
CPU_LENGTH_BUCKETS = 4
# packed and padded log-probs agree to float32 rounding (4.8e-7 seen); a model attending across rows, by far more
PACKING_TOLERANCE = 1e-3


class Forward:
    """A mixin of :class:`rlnb.components.LMActor` (it holds ``dtype``, ``device``, ``temperature``,
    ``micro_batch_size``, ``share_prompt_forward``, ``length_buckets`` and ``step_compiler``)."""

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
        for sl in micro_batches(b["input_ids"].shape[0], self.micro_batch_size):
            ids, attn = b["input_ids"][sl].to(self.device), b["attention_mask"][sl].to(self.device)
            with self.strategy.precision():
                logp = self._token_logprobs(model, ids, attn, b["response_mask"][sl].to(self.device))
            out.append(logp.cpu())
        return torch.cat(out)

    def _token_logprobs(self, model, ids, attn, response_mask) -> torch.Tensor:
        """``[m, L]`` log-probs, each distinct prompt computed once where it can be (exact at response
        positions, which are all a loss or a KL reads)."""
        if self.step_compiler is not None:  # compiled: one graph, with no data-dependent column or cache
            return token_logprobs(model, ids, attn, self.temperature)
        if self.packing is not False:
            packed = packed_token_logprobs(model, ids, attn, self.temperature)
            if self.packing is None:  # the first micro-batch: does this model keep packed rows apart?
                self._check_packing(model, ids, attn, response_mask, packed)
            if self.packing:
                return packed
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

    def _check_packing(self, model, ids, attn, response_mask, packed: torch.Tensor) -> None:
        """Packing stays on where its log-probs are the padded path's at the response positions (a model whose
        attention reads no packed sequences from position ids attends across rows: padded, with a warning)."""
        with torch.no_grad():
            padded = token_logprobs(model, ids, attn, self.temperature)
        at = response_mask.bool()
        gap = float((packed.detach() - padded)[at].abs().max()) if at.any() else 0.0
        self.packing = gap <= PACKING_TOLERANCE
        if not self.packing:
            self.packing_fallback = (
                f"packed rows' log-probs differ from the padded rows' by {gap:.3g} (> {PACKING_TOLERANCE}): this "
                f"model ({type(getattr(model, 'module', model)).__name__}) attends across packed rows"
            )
            log.warning("actor[%d]: micro-batches padded, not packed: %s", self.rank, self.packing_fallback)

    def forward_stats(self) -> dict:
        """How this rank computes its update: the most length buckets a micro-batch takes, whether rows with
        no advantage are left out, micro-batches whose prompts went through the model once per distinct
        prompt, and why sharing stopped, if it did."""
        return {
            "length_buckets": self.length_buckets,
            "skip_zero_advantage": self.skip_zero_advantage,
            "shared_forwards": self.shared_forwards,
            "prompt_forward_fallback": self.prompt_forward_fallback,
            "packed": bool(self.packing),
            "packing_fallback": self.packing_fallback,
        }
