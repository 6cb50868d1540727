"""PPO's value model for an LM (``algorithm.advantage: token_gae``, as InstructGPT's PPO and veRL's, OpenRLHF's and
TRL's PPO trainers have it): a copy of the policy's transformer with a linear value head, one value a token, its own
AdamW at ``actor.critic_lr`` (``actor.lr`` where unset), trained on the returns of token-level GAE with the value
loss clipped around the values the rollout was scored with. Data-parallel ranks average its gradients."""

from __future__ import annotations

import torch
from torch import nn

from rlnb.algorithms.losses import value_loss
from rlnb.components.lm.layout import micro_batches
from rlnb.components.lm.sft import adamw
from rlnb.models.lm import load_lm, no_cache, positions_from_mask
from rlnb.runtime.collective import average_grads_


class ValueModel(nn.Module):
    """The policy's transformer (its decoder, no LM head) and a value head: ``[B, L]`` values, the one at column
    ``t`` the value of the state before token ``t`` (read from the hidden state at ``t - 1``; 0 at column 0)."""

    def __init__(self, model_path: str):
        super().__init__()
        lm, _ = load_lm(model_path)
        self.body = lm.get_decoder()  # (Qwen2Model, LlamaModel...: the decoder without the LM head)
        self.head = nn.Linear(lm.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)  # (values start at 0: no return is guessed before any is seen)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions_from_mask(attention_mask),
            **no_cache(self.body),
        ).last_hidden_state  # fmt: skip
        v = self.head(hidden.float()).squeeze(-1)  # [B, L]: the value after each token
        return torch.cat([v.new_zeros(v.shape[0], 1), v[:, :-1]], dim=1)


class Critic:
    """The value model, its optimizer and its update (held by :class:`rlnb.components.LMActor`): a whole copy a
    rank under DDP, sharded like the policy under FSDP2 (:meth:`shard`)."""

    def __init__(
        self, model_path: str, device: torch.device, lr: float, max_grad_norm: float, world_size: int
    ):
        self.model = ValueModel(model_path).to(device)
        self.optimizer = adamw(self.model, lr, device)
        self.device, self.max_grad_norm, self.world_size = device, max_grad_norm, world_size
        self.lr, self.sharded = lr, False

    def shard(self, strategy) -> None:
        """Sharded as the policy is (``actor.strategy: fsdp2``: ``strategy`` has wrapped it): each decoder layer and
        the root, its AdamW made anew over the shards (before any step: no state to carry). FSDP2 then averages its
        gradients over the ranks."""
        strategy.shard_module(self.model, list(self.model.body.layers))
        self.optimizer = adamw(self.model, self.lr, self.device)
        self.sharded = True

    @torch.no_grad()
    def values(self, batch: dict, micro_batch_size: int) -> torch.Tensor:
        """``[B, L]`` values of the batch's sequences (0 off the response)."""
        out = []
        for sl in micro_batches(batch["input_ids"].shape[0], micro_batch_size):
            ids, attn = batch["input_ids"][sl].to(self.device), batch["attention_mask"][sl].to(self.device)
            out.append(self.model(ids, attn).cpu())
        return torch.cat(out) * batch["response_mask"].float()

    def update(self, batch: dict, rows: torch.Tensor, micro_batch_size: int, clip: float | None) -> dict:
        """One step on ``rows``: ``0.5 (V - R)^2`` over their response tokens, clipped around the rollout's
        values where ``clip`` (PPO2's), gradients averaged over micro-batches and ranks."""
        mask_all = batch["response_mask"][rows].float()
        total = mask_all.sum().clamp(min=1)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for sl in micro_batches(len(rows), micro_batch_size):
            j = rows[sl]
            ids, attn = batch["input_ids"][j].to(self.device), batch["attention_mask"][j].to(self.device)
            mask = batch["response_mask"][j].float().to(self.device)
            returns, old = batch["returns"][j].to(self.device), batch["values"][j].to(self.device)
            # the micro-batch's mean, weighted by its share of the rows' tokens: their mean once summed
            loss = value_loss(self.model(ids, attn), old, returns, mask, clip) * (mask.sum() / total)
            loss.backward()
            loss_sum += float(loss.detach())
        if not self.sharded:  # (DDP's ranks: averaged here; FSDP2 reduce-scatters them itself)
            average_grads_([p.grad for p in self.model.parameters() if p.grad is not None], self.world_size)
        # (sharded: the norm over every rank's shards)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return {"value_loss": loss_sum}

    def explained_variance(self, batch: dict) -> float:
        """``1 - Var(R - V) / Var(R)`` over the batch's response tokens, with the rollout's values."""
        m = batch["response_mask"].bool()
        r, v = batch["returns"][m], batch["values"][m]
        var = float(r.var()) if r.numel() > 1 else 0.0
        return float("nan") if var == 0 else 1.0 - float((r - v).var()) / var

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


__all__ = ["Critic", "ValueModel"]
