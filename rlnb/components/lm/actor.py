"""The LM actor: GRPO/PPO-clip updates of a causal LM (micro-batched, rows without a learning signal left out,
each distinct prompt computed once), an optional KL to a frozen reference, and HF export. The supervised
warm start is :mod:`.sft`."""

from __future__ import annotations

import dataclasses
import math

import torch

from rlnb.algorithms import kl_penalty
from rlnb.algorithms.advantages import whiten
from rlnb.algorithms.contract import LM, check_algorithm
from rlnb.algorithms.correction import mismatch_weights
from rlnb.algorithms.losses import masked_mean
from rlnb.components.actor_base import ActorBase, with_settings
from rlnb.components.batches import LM_BATCH, LM_OPTIONAL, check_batch
from rlnb.components.compile import StepCompiler
from rlnb.components.launch import launcher
from rlnb.components.lm.critic import Critic
from rlnb.components.lm.forward import CPU_LENGTH_BUCKETS, Forward
from rlnb.components.lm.layout import decode_group, join_batches, micro_batches
from rlnb.components.lm.lora import AdaptersOff, message_bytes
from rlnb.components.lm.sft import WarmStart, adamw
from rlnb.components.optim import ClipAndStep
from rlnb.components.rollout import resolve_device
from rlnb.components.strategy import Strategy, for_each_bucket
from rlnb.config.checks import check_field
from rlnb.config.schema import ActorConfig, LoRAConfig
from rlnb.errors import ConfigError
from rlnb.models.lm import DTYPES, base_lm, hf_quiet, load_lm, pack_rows
from rlnb.runtime.collective import local_part
from rlnb.runtime.rank import RankInfo, current_rank
from rlnb.seeding import rank_seed


class LMActor(Forward, WarmStart, ActorBase):
    """Trains a causal LM: SFT warm start, then GRPO/PPO-clip updates with an optional KL to a frozen reference.

    Args:
        model_path: a ``save_pretrained`` directory (the reference model loads from it too).
        algorithm: :class:`rlnb.config.AlgorithmConfig` or a dict of its fields (advantage, loss, group_size,
            kl_coef, max_grad_norm...); given as a dict, over this actor's defaults (``max_grad_norm=1.0``).
        actor: :class:`rlnb.config.ActorConfig` or a dict of its fields (lr, micro_batch_size, dtype...); given
            as a dict, over this actor's defaults (``lr=1e-3``, ``anneal_lr=False``). The named arguments below
            and ``**settings`` override both; whatever trains is what :meth:`describe` reports and a loop
            records in ``recipe.yaml``.
        lr: AdamW learning rate; micro_batch_size: sequences per forward/backward.
        max_grad_norm: the norm gradients are clipped to (``algorithm.max_grad_norm``).
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
        actor={"lora": {"rank": 8}}: LoRA adapters (``actor.lora``, :class:`rlnb.config.LoRAConfig`): only they train;
            the KL reference is the model with them off; the rollout and :meth:`export_hf` get merged weights.
        gradient_checkpointing: recompute each decoder layer in the backward instead of keeping its activations
            (``actor.gradient_checkpointing``).
        dtype: ``float32``, or ``bfloat16``: forward and backward under bf16 autocast, with float32 master
            weights, gradients and AdamW state; log-probs, the loss and the KL in float32. The reference model
            is held in bf16, and the weights go to the rollout in bf16 (``policy_state``).
        **settings: any field of ``ActorConfig`` or ``AlgorithmConfig`` by name (``group_size=8``, ``kl_coef=0.01``...).

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
    DEFAULT_ALGORITHM = {"advantage": "grpo", "policy_loss": "ppo", "max_grad_norm": 1.0}
    DEFAULT_ACTOR = {"lr": 1e-3, "anneal_lr": False}
    # ranks call the model a different number of times a micro-batch (length buckets follow each rank's
    # own rows), so no per-call buffer broadcast; a causal LM's buffers (rotary frequencies) are constants
    DDP_BROADCAST_BUFFERS = False

    def __init__(
        self, model_path: str, algorithm=None, lr: float | None = None, micro_batch_size: int | None = None,
        temperature: float = 1.0, max_grad_norm: float | None = None, seed: int = 0, device: str | None = None,
        torch_threads: int | None = None, advantage_fn=None, loss_fn=None, rank_info: RankInfo | None = None, *,
        actor=None, advantage=None, policy_loss=None, anneal_lr: bool | None = None, share_prompt_forward: bool = True,
        length_buckets: int | None = None, skip_zero_advantage: bool | None = None, dtype: str | None = None,
        gradient_checkpointing: bool | None = None,
        **settings,
    ):  # fmt: skip
        rank_info = rank_info or current_rank()  # subclasses need not pass it on
        # one source of truth: every setting lands in the actor's two config sections (what describe() reports
        # and a loop records), the named arguments and **settings over `actor` and `algorithm`
        named = dict(
            lr=lr, micro_batch_size=micro_batch_size, max_grad_norm=max_grad_norm, device=device,
            torch_threads=torch_threads, anneal_lr=anneal_lr, length_buckets=length_buckets,
            gradient_checkpointing=gradient_checkpointing,
            skip_zero_advantage=skip_zero_advantage, dtype=dtype,
        )  # fmt: skip
        settings = {**{k: v for k, v in named.items() if v is not None}, **settings}
        self.cfg, self.algo = with_settings(
            self.actor_config(actor), self.algorithm_config(algorithm), settings, "actor"
        )
        lora = self.cfg.lora if isinstance(self.cfg.lora, LoRAConfig) else LoRAConfig(**dict(self.cfg.lora))
        errors = lora.errors()
        if errors:
            raise ConfigError(errors[0], errors[0].split(":")[0])
        self.cfg = dataclasses.replace(
            self.cfg, model_path=str(model_path), lora=lora
        )  # (recorded as what trained)
        cfg = self.cfg
        torch.set_num_threads(cfg.torch_threads)
        self.share_prompt_forward = share_prompt_forward
        self.skip_zero_advantage = cfg.skip_zero_advantage
        self.shared_forwards = 0  # micro-batches whose prompts went through the model once per prompt
        self._sft_run: dict | None = None  # a warm start under way (sft_begin -> sft_steps)
        self.prompt_forward_fallback: str | None = None  # why prompts stopped being shared, if they did
        self.base_version = 0  # LoRA: bumped when a full warm start changed the base (rollouts need it again)
        self._sent_base: dict[str, int] = {}  # the base version each rollout key holds (adapters-only sync)
        self.last_sync: dict = {"kind": None, "bytes": None}
        self.max_tokens = cfg.max_tokens_per_micro_batch  # (None: micro-batches of micro_batch_size rows)
        self.packing: bool | None = (
            None if self.max_tokens else False
        )  # (None: not checked against padding yet)
        self.packing_fallback: str | None = None  # why the rows are padded after all, if they are
        self.rank = rank_info.rank if rank_info else 0
        self.world_size = rank_info.world_size if rank_info else 1
        self.device = resolve_device(cfg.device, rank_info)
        buckets = cfg.length_buckets
        if buckets is not None:  # (None: automatic)
            check_field(ActorConfig, "length_buckets", buckets)
        # passes a micro-batch's rows take, grouped by length (padding left out); one on a GPU, which
        # computes a padded position nearly for free next to a pass's fixed cost
        self.length_buckets = buckets or (1 if self.device.type == "cuda" else CPU_LENGTH_BUCKETS)
        # parallelism, precision and memory levers: DDP or FSDP2, bf16, checkpointing, offload, LoRA
        self.strategy = strategy = Strategy(cfg, self.device, self.rank, self.world_size)
        self.dtype = strategy.dtype
        torch.manual_seed(seed)
        # FSDP2 over several ranks: built with no storage, each rank reads its own shards once sharded
        empty = strategy.rank_by_rank(str(model_path)) is not None
        self.policy, self.tok = load_lm(model_path, self.device, dtype=strategy.master_dtype, empty=empty)
        self.policy = strategy.adapt(self.policy)  # (LoRA: only the adapters train; checkpointing)
        if cfg.gradient_checkpointing:
            self.share_prompt_forward = False  # (its prefix's KV cache is what checkpointing turns off)
        self.model = self.policy
        self.ref = None
        if self.algo.kl_coef > 0:  # (with LoRA: the model with its adapters off, never a second copy)
            self.ref = (
                AdaptersOff(self.policy)
                if strategy.lora
                else load_lm(model_path, self.device, dtype=self.dtype, empty=empty)[0]
                .eval()
                .requires_grad_(False)
            )
        self.micro_batch_size, self.temperature, self.total_steps = cfg.micro_batch_size, temperature, 1
        self.optimizer = adamw(self.policy, cfg.lr, self.device)
        self.clip_and_step = ClipAndStep(self.optimizer)  # clip_grad_norm_ + step(), minus their Python
        self.generator = torch.Generator().manual_seed(rank_seed(seed, self.rank, "actor"))
        self.advantage, self.loss = check_algorithm(
            self.CONTRACT,
            advantage_fn or advantage or self.algo.advantage,
            loss_fn or policy_loss or self.algo.policy_loss,
        )
        # PPO with a value model (an advantage asking for values: token_gae): a critic of its own, data-parallel
        self.critic: Critic | None = None
        if "values" in self.advantage.needs:
            self.critic = Critic(str(model_path), self.device, cfg.critic_lr or cfg.lr, self.algo.max_grad_norm,
                                 self.world_size)  # fmt: skip
        # where the KL to the reference goes: into the returns (an advantage taking `kl`) or the loss
        self.kl_in_advantage = self.ref is not None and (
            self.advantage.accepts is None or "kl" in self.advantage.accepts
        )
        self.step = 0
        self.batch: dict | None = None
        # actor.compile (compile=...): the micro-batch objective, forward, loss and backward, compiled
        # (packed micro-batches change shape at every step: never compiled)
        compile_ = False if cfg.max_tokens_per_micro_batch is not None else cfg.compile
        self.step_compiler = StepCompiler.for_device(compile_, self.device, "actor")

    @property
    def max_grad_norm(self) -> float:
        """The norm gradients are clipped to: ``algorithm.max_grad_norm``."""
        return self.algo.max_grad_norm

    def policy_state(self) -> dict[str, torch.Tensor]:
        """Weights for the rollout: a detached copy on the actor's device (on a GPU they reach the rollout
        by CUDA IPC on one node, with no host round trip), in bf16 when the actor computes in bf16."""
        cast = DTYPES[self.dtype]
        return {
            k: v.detach().to(cast, copy=True) if v.is_floating_point() else v.detach().clone()
            for k, v in self.full_state().items()
        }

    @property
    def lora(self) -> bool:
        """LoRA adapters on the model (``actor.lora.rank > 0``)."""
        return self.strategy.lora

    def publish_weights(self, channel, keys: list[str], version: int, adapters: bool = False) -> int:
        """Disaggregated weight sync (:meth:`ActorBase.publish_weights`); with ``adapters`` (``actor.lora.sync:
        adapters``, a rollout that merges them itself) a LoRA actor sends each rollout rank the merged weights and
        the adapted layers' base once (and again after a full warm start changed the base), then the adapters
        alone. The bytes put are :meth:`sync_stats`'s."""
        if not (adapters and self.lora and not self.sharded):
            self.last_sync = {"kind": "merged", "bytes": None}
            return super().publish_weights(channel, keys, version)
        from rlnb.components.lm.lora import adapted_base, adapter_state

        cast = DTYPES[self.dtype]
        full = small = None
        sent, kind = 0, "adapters"
        for key in keys:
            if self._sent_base.get(key) == self.base_version:
                if small is None:
                    small = {"adapters": adapter_state(self.policy), "base_version": self.base_version,
                             "version": version}  # fmt: skip
                msg = small
            else:
                if full is None:
                    base = {k: v.to(cast) for k, v in adapted_base(self.policy).items()}
                    # (the adapters beside the base: an engine applying them itself, vLLM's LoRA, takes both)
                    lora = {
                        "base": base,
                        "base_version": self.base_version,
                        "adapters": adapter_state(self.policy),
                    }
                    full = {"state": self.policy_state(), "version": version, "lora": lora}
                msg, kind = full, "merged"
                self._sent_base[key] = self.base_version
            channel.put(msg, key=key)
            sent += message_bytes(msg)
        self.last_sync = {"kind": kind, "bytes": sent}
        return version

    def sync_stats(self) -> dict:
        """The last disaggregated weight sync: what it sent (``merged`` weights or ``adapters`` alone) and its
        bytes over all rollout ranks (``None``: not counted, a sync of merged weights without adapters)."""
        return dict(self.last_sync)

    def setup_data_parallel(self) -> str:
        """Data-parallel over the actor's ranks: DDP, or with ``actor.strategy: fsdp2`` FSDP2 (the strategy's).
        Sharded, every rank computes its micro-batches the same way (FSDP2 gathers each block's parameters in every
        forward): one pass each, every row, no shared-prompt forward."""
        made = super().setup_data_parallel()
        if self.sharded:
            self.length_buckets, self.share_prompt_forward, self.skip_zero_advantage = 1, False, False
            if self.critic is not None:  # the value model sharded alike: no whole copy a rank
                self.critic.shard(self.strategy)
        return made

    def memory_stats(self) -> dict:
        """``memory/actor_state_bytes``: the bytes of parameters, gradients and optimizer state this rank holds
        (its local shards); ``memory/ref_bytes``: those of the KL reference model, where there is one of its own;
        ``memory/critic_bytes``: the value model's parameters, gradients and AdamW state (PPO's critic); on a GPU,
        ``memory/cuda_peak_bytes``: this process's peak allocation since the last call (which resets it), the
        rollout's too when it shares the process."""
        out = {"memory/actor_state_bytes": self.strategy.held_bytes(self.policy, self.optimizer)}
        if self.ref is not None and not self.lora:  # (with LoRA the reference is the policy, adapters off)
            out["memory/ref_bytes"] = sum(
                local_part(p).numel() * p.element_size() for p in self.ref.parameters()
            )
        if self.critic is not None:
            out["memory/critic_bytes"] = self.strategy.held_bytes(self.critic.model, self.critic.optimizer)
        if self.device.type == "cuda":
            out["memory/cuda_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return out

    def set_batch(self, batches: list[dict]) -> dict:
        """This rank's batch: the rollout batches given, joined (left-padded to a common width), of their
        columns the update reads, and (where every batch has them) ``truncated`` (mask_truncated_completions)
        and each reward's scores apart (``reward_terms``, for ``sample_group``). Each batch is checked against
        :data:`~rlnb.components.batches.LM_BATCH` first."""
        self.strategy.check_loaded()
        for b in batches:
            check_batch(b, LM_BATCH, LM_OPTIONAL)
        optional = [k for k in ("truncated", "reward_terms", "reward_names") if all(k in b for b in batches)]
        keys = ("input_ids", "attention_mask", "response_mask", "logprobs", "rewards", "version", *optional)
        batch = join_batches([{k: b[k] for k in keys} for b in batches], self.tok.pad_token_id)
        self.batch = batch
        return {"sequences": int(batch["rewards"].numel()), "version": batch["version"]}

    def sample_group(self, group: int = 0) -> list[dict]:
        """One prompt's ``group_size`` completions in this rank's batch, decoded: ``prompt``, ``completion``,
        ``reward``, the sampling ``logprob`` of the completion and, once :meth:`compute_advantages` ran, its
        ``advantage`` (mean over its tokens)."""
        return [] if self.batch is None else decode_group(self.batch, self.tok, group, self.algo.group_size)

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
            "kl_coef": algo.kl_coef, "gamma": algo.gamma, "gae_lambda": algo.gae_lambda,
        }  # fmt: skip
        if self.critic is not None:  # the value model's values of the batch (PPO's critic)
            batch["values"] = offered["values"] = self.critic.values(batch, self.micro_batch_size)
        if self.kl_in_advantage:  # the KL needs the current log-probs first: the old ones, if kept
            current = self._logprobs(self.policy, batch)
            batch["old_logprobs"] = None if single_pass else current
            offered["kl"] = kl_penalty(current, batch["ref_logprobs"], algo.kl_estimator) * mask  # [B, L]
        adv, returns = self.advantage(**offered)
        if self.critic is not None:
            batch["returns"] = returns
            if algo.norm_adv:  # whitened over the batch's response tokens
                adv = whiten(adv, mask)
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
        if self.cfg.anneal_lr:  # linear decay to 0 over the run (the loop sets total_steps)
            frac = max(0.0, 1.0 - self.step / self.total_steps)
            for g in self.optimizer.param_groups:
                g["lr"] = frac * self.cfg.lr
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
        if self.critic is not None:  # the value model: the same epochs and minibatches, its own optimizer
            clip = algo.clip_coef if algo.clip_vloss else None
            losses = []
            for _ in range(epochs_run):
                perm = torch.randperm(n, generator=self.generator)
                for start in range(0, n - mb + 1, mb):
                    rows = perm[start : start + mb].sort().values
                    losses.append(self.critic.update(batch, rows, self.micro_batch_size, clip)["value_loss"])
            sums["value_loss"] = sum(losses) / len(losses) * max(1, count)
            sums["explained_variance"] = self.critic.explained_variance(batch) * max(1, count)
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
        if not self.sharded and self.clip_and_step.optimizer is not self.optimizer:  # a subclass replaced it
            self.clip_and_step = ClipAndStep(self.optimizer)
        self.strategy.zero_grad(self.optimizer, self.clip_and_step)
        sums: dict[str, float] = {}
        micro = (
            pack_rows(batch["attention_mask"][rows], self.max_tokens)
            if self.max_tokens
            else list(micro_batches(len(rows), self.micro_batch_size))
        )
        # the ratio is to the behaviour policy when the batch is stale or the loss is decoupled
        behaviour = "prox_logprobs" in self.loss.needs or batch["stale"]
        kl_in_loss = self.ref is not None and not self.kl_in_advantage
        correct = algo.mismatch_correction != "none"  # (and the ratio taken to the trainer's log-probs)
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
                "engine_logprobs": take("logprobs") if correct and not behaviour else None,
                "ref_logprobs": take("ref_logprobs") if kl_in_loss else None,
            }  # fmt: skip
            if self.step_compiler is not None and not self.step_compiler.ready:
                self.step_compiler.warm_up(self._objective, micro_batch, self.policy)
            objective = self.step_compiler.fn if self.step_compiler is not None else self._objective
            mask = micro_batch["mask"]
            sync = self.world_size > 1 and i < len(micro) - 1
            with self.strategy.gradient_sync(self.model, not sync):
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
        grad_norm = self.strategy.clip_and_step(
            self.policy, self.optimizer, self.clip_and_step, self.max_grad_norm
        )
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
        with self.strategy.precision():  # (log-probs come out in float32 either way)
            logp = self._token_logprobs(
                self.model, micro_batch["input_ids"], micro_batch["attention_mask"], mask
            )
        # the policy before this update as the actor computes it (decoupled PPO's proximal one)
        prox = logp.detach() if micro_batch["old_logprobs"] is None else micro_batch["old_logprobs"]
        behaviour, advantages, corrected = micro_batch["behaviour_logprobs"], micro_batch["advantages"], {}
        engine = micro_batch["engine_logprobs"]
        if engine is not None:  # the ratio is to the trainer's: weigh by trainer / engine
            weights, corrected = mismatch_weights(
                prox, engine, mask, algo.mismatch_correction, algo.mismatch_level,
                algo.mismatch_cap, algo.mismatch_floor,
            )  # fmt: skip
            # (every loss here is linear in the advantage with a ratio > 0: a weight on it weighs the token's loss)
            advantages = advantages * weights
        loss, metrics = self.loss(
            logprobs=logp, old_logprobs=prox if behaviour is None else behaviour, prox_logprobs=prox,
            advantages=advantages, mask=mask, clip_coef=algo.clip_coef,
            clip_coef_high=algo.clip_coef_high, dual_clip=algo.dual_clip, agg=algo.agg,
            max_len=algo.agg_max_tokens, behave_weight_cap=algo.behave_weight_cap,
        )  # fmt: skip
        if micro_batch["ref_logprobs"] is not None:
            kl = masked_mean(kl_penalty(logp, micro_batch["ref_logprobs"], algo.kl_estimator), mask)
            loss = loss + algo.kl_coef * kl
            metrics = {**metrics, "kl": kl.detach()}
        return loss, {**metrics, **{f"rollout/{k}": v for k, v in corrected.items()}}

    def export_hf(self, path: str) -> str:
        """Write the current model and its tokenizer in Hugging Face format (``save_pretrained``) to the directory
        ``path`` on this worker, atomically: into a fresh temporary directory beside it, then renamed (only an
        earlier export, or an empty directory, is replaced: :func:`rlnb.files.check_export_target`). A sharded
        actor's ranks all call it: they gather the model, rank 0 writes."""
        import shutil
        import tempfile
        from pathlib import Path

        from rlnb.files import check_export_target, replace_dir

        final = Path(path)
        if self.sharded and self.rank != 0:  # it gathers with rank 0, bucket by bucket; rank 0 writes
            self._write_buckets(None)
            return str(final)
        check_export_target(final, "directory")
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            with hf_quiet():
                if self.sharded:  # the weights a file a bucket (no rank holds the whole model), then the rest
                    self._write_buckets(tmp)
                    base_lm(self.policy).config.save_pretrained(tmp)
                    base_lm(self.policy).generation_config.save_pretrained(tmp)
                else:
                    base_lm(self.policy).save_pretrained(tmp, state_dict=self.full_state())  # (LoRA: merged)
                self.tok.save_pretrained(tmp)
            replace_dir(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return str(final)

    def export_adapter(self, path: str) -> str:
        """Write the LoRA adapters alone (PEFT's format: ``adapter_config.json`` and the adapters' weights) to the
        directory ``path``; the merged model is :meth:`export_hf`'s."""
        if not self.lora:
            raise ConfigError(
                "export_adapter: this actor has no LoRA adapters (actor.lora.rank is 0)", "actor.lora.rank"
            )
        with hf_quiet():
            self.policy.save_pretrained(path)
        return str(path)

    def reset_reference(self) -> None:
        """The KL reference becomes the policy as it is now (after the warm start). Sharded, shard to shard: both are
        laid out alike, and nothing is gathered."""
        if self.sharded and not self.lora:
            self.ref.load_state_dict(self.policy.state_dict())
        else:
            self.ref.load_state_dict(self.full_state())

    def _write_buckets(self, directory) -> None:
        """A sharded model's weights as a Hugging Face checkpoint's safetensors files, one a bucket of
        :meth:`state_buckets` (the master weights' precision), and their index, into ``directory`` (rank 0; the other
        ranks give ``None`` and only gather; a failure to write is raised after the last bucket)."""
        import json

        from safetensors.torch import save_file

        weight_map = {}

        def write(i: int, bucket: dict) -> None:
            name = f"model-{i + 1:05d}.safetensors"
            directory.mkdir(parents=True, exist_ok=True)
            save_file(
                {k: v.contiguous() for k, v in bucket.items()}, directory / name, metadata={"format": "pt"}
            )
            weight_map.update(dict.fromkeys(bucket, name))

        for_each_bucket(
            self.state_buckets(for_rollout=False, tied=False), write if directory is not None else None
        )
        if directory is not None:
            index = {"metadata": {"total_size": self.strategy.last_sync["bytes"]}, "weight_map": weight_map}
            (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    def _rest_state(self) -> dict:
        return {**super()._rest_state(), "ref": self.ref.state_dict() if self.ref is not None else None,
                "critic": self.critic.state_dict() if self.critic is not None else None}  # fmt: skip

    def _load_rest(self, state: dict) -> None:
        super()._load_rest(state)
        if self.ref is not None and state["ref"] is not None:
            self.ref.load_state_dict(state["ref"])
        if self.critic is not None and state.get("critic") is not None:
            self.critic.load_state_dict(state["critic"])
