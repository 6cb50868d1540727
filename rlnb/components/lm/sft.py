"""The LM actor's supervised warm start: cross-entropy on the answer tokens (and EOS) of ``prompt + answer``."""

from __future__ import annotations

import torch

from rlnb.algorithms.losses import masked_mean
from rlnb.components.lm.layout import pad_left
from rlnb.components.optim import build_optimizer
from rlnb.models.lm import prompt_ids, token_logprobs
from rlnb.runtime.collective import average_grads_


def adamw(model: torch.nn.Module, lr: float, device: torch.device) -> torch.optim.AdamW:
    """AdamW, fused where torch has the kernel (CPU, CUDA): one kernel for all parameters, where the
    default runs a few per parameter tensor."""
    params = [p for p in model.parameters() if p.requires_grad]  # (LoRA: the adapters alone)
    fused = device.type in ("cpu", "cuda") and all(
        p.is_floating_point() and not hasattr(p, "full_tensor") and not p.is_meta for p in params
    )
    return build_optimizer(torch.optim.AdamW, params, lr=lr, weight_decay=0.0, fused=fused or None)


class WarmStart:
    """A mixin of :class:`rlnb.components.LMActor` (it holds ``policy``, ``tok``, ``device``, ``generator``,
    ``max_grad_norm``, ``ref`` and its precision context ``_precision``)."""

    _base_training = False  # a LoRA actor's base weights train (its full warm start, under way)

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

    def _base_trains(self, on: bool) -> None:
        """With LoRA, the base model's weights (all but the adapters) trainable or frozen again. DDP's reducer
        knows only the adapters (frozen weights are not its parameters): :meth:`_reduce_base_grads` averages the
        base's gradients over the ranks meanwhile."""
        if not self.lora:
            return
        for name, p in self.policy.named_parameters():
            if ".lora_" not in name:
                p.requires_grad_(on)
                if not on:
                    p.grad = None  # (the warm start's gradients of the base: held for nothing after it)
        self._base_training = on

    def _reduce_base_grads(self) -> None:
        """The base model's gradients averaged over the data-parallel ranks, in one all-reduce (a LoRA actor's
        full warm start under DDP)."""
        if not self._base_training or self.world_size == 1:
            return
        grads = [
            p.grad for n, p in self.policy.named_parameters() if ".lora_" not in n and p.grad is not None
        ]
        average_grads_(grads, self.world_size)

    def sft(
        self, prompts: list, answers: list[str], steps: int, batch_size: int, lr: float,
        wrong_answers: list[str] | None = None, wrong_prob: float = 0.0, wrong_prompts: list | None = None,
    ) -> list[float]:  # fmt: skip
        """Supervised warm start: cross-entropy on the answer tokens (and EOS) of ``prompt + answer``. A prompt
        may be a transcript so far, ``[prompt, turn, reply, ...]`` (a multi-turn warm start: one row per turn).

        With ``wrong_answers``, each time a problem is drawn its answer is replaced by the wrong one
        with probability ``wrong_prob``: an imperfect teacher, wrong on every problem now and then
        (``wrong_prompts``: its own contexts of them, where they differ). Returns each step's loss.

        The same as :meth:`sft_begin` and then :meth:`sft_steps` called until the ``steps`` are done, in calls of
        any size (the driver's progress bar takes them a few at a time)."""
        self.sft_begin(prompts, answers, steps, batch_size, lr, wrong_answers, wrong_prob, wrong_prompts)
        return self.sft_steps(steps)

    def sft_begin(
        self, prompts: list, answers: list[str], steps: int, batch_size: int, lr: float,
        wrong_answers: list[str] | None = None, wrong_prob: float = 0.0, wrong_prompts: list | None = None,
    ) -> None:  # fmt: skip
        """Set up a warm start of ``steps`` steps (:meth:`sft`'s arguments); :meth:`sft_steps` runs them."""
        self.strategy.check_loaded()
        rows, marks = self._sft_rows(prompts, answers)
        if wrong_answers is not None:
            wrong_rows, wrong_marks = self._sft_rows(wrong_prompts or prompts, wrong_answers)
            rows, marks = rows + wrong_rows, marks + wrong_marks
        # LoRA: the warm start fine-tunes the whole base (actor.lora.warm_start: full), then RL trains the adapters
        self._base_trains(self.lora and self.cfg.lora.warm_start == "full" and steps > 0)
        opt = adamw(self.policy, lr, self.device)
        self._sft_run = {
            "ids": pad_left(rows, self.tok.pad_token_id), "attn": pad_left([[1] * len(r) for r in rows], 0),
            "target": pad_left(marks, 0), "n": len(prompts), "wrong": wrong_answers is not None,
            "wrong_prob": wrong_prob, "batch_size": batch_size, "left": steps, "opt": opt,
            "sched": torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / max(1, steps)),
        }  # fmt: skip

    def sft_steps(self, steps: int) -> list[float]:
        """Up to ``steps`` more steps of the warm start :meth:`sft_begin` set up; their losses. Its last step
        ends it (the reference model, if any, becomes the warm-started one)."""
        run = self._sft_run
        if run is None:
            raise RuntimeError("sft_steps: no warm start is under way; sft_begin() sets one up")
        n, batch_size, opt, sched = run["n"], run["batch_size"], run["opt"], run["sched"]
        losses = []
        for _ in range(min(steps, run["left"])):
            idx = torch.randint(0, n, (batch_size,), generator=self.generator)
            if run["wrong"]:  # the wrong variant of a problem sits at index + n
                idx = idx + n * (torch.rand(batch_size, generator=self.generator) < run["wrong_prob"]).long()
            b_ids, b_attn, b_tgt = (
                run["ids"][idx].to(self.device),
                run["attn"][idx].to(self.device),
                run["target"][idx].to(self.device),
            )
            with self.strategy.precision():
                logp = token_logprobs(self.model, b_ids, b_attn)  # (b, L), float32
            loss = -masked_mean(logp, b_tgt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            self._reduce_base_grads()
            torch.nn.utils.clip_grad_norm_(
                [p for p in self.policy.parameters() if p.requires_grad], self.max_grad_norm
            )
            opt.step()
            sched.step()
            losses.append(loss.item())
        run["left"] -= len(losses)
        if run["left"] <= 0:
            self._sft_run = None
            if self._base_training:  # the rollouts' copy of the base is stale: the next sync sends it again
                self.base_version += 1
            self._base_trains(False)
            if self.ref is not None:  # the reference is the warm-started model
                self.reset_reference()
        return losses
