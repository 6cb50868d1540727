"""Recipe schema: one dataclass per section, a docstring per field (read by the docs and by errors).

A recipe is YAML with these sections; every key has a default, so a recipe names only what differs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlnb.errors import ConfigError, did_you_mean


@dataclass
class ClusterConfig:
    """Where the components run."""

    address: str | None = None
    """Dask scheduler address (``tcp://host:8786``); empty starts an embedded local cluster."""
    slots: int | None = None
    """CPU worker processes of the embedded cluster (default: one per core, at most 8)."""
    component_placement: dict[str, Any] = field(default_factory=lambda: {"actor,rollout,env": "0"})
    """Component (or comma-joined components) -> slots: ``0-1``, ``2,3``, ``all``, ``{node_group: sim, slots: 0-1}``."""
    call_timeout_s: float = 600.0
    """Timeout of every remote call (seconds); a hung or dead worker surfaces as an error after at most this."""

    def check(self, recipe: Recipe) -> list[str]:
        """A placement given, and a call deadline."""
        errs: list[str] = []
        if not isinstance(self.component_placement, dict) or not self.component_placement:
            errs.append(
                f"cluster.component_placement: expected a mapping like {{actor: 0}}, got {self.component_placement!r}"
            )
        need(
            errs,
            lambda: self.call_timeout_s > 0,
            "cluster.call_timeout_s",
            "a number > 0",
            self.call_timeout_s,
        )
        return errs


@dataclass
class RunnerConfig:
    """How long to run, and what to write."""

    steps: int = 100
    """Training steps (one step = rollout, advantages, train); ``actor.anneal_lr`` decays the learning rate to 0
    over them. ``loop.run(n)`` past them makes this the step it runs to."""
    run_dir: str | None = None
    """Where metrics, checkpoints and the resolved recipe go (default ``runs/<recipe>-<time>``)."""
    save_interval: int = 0
    """Write a checkpoint every this many steps (0: only at the end of ``run``)."""
    keep_checkpoints: int = 3
    """How many complete checkpoints to keep."""
    eval_interval: int = 0
    """Evaluate every this many steps (0: never during ``run``)."""
    completions_interval: int = 0
    """LM loop: every this many steps, append the first prompt's group of completions the actor trained on
    (prompt, completion, reward, advantage...) to ``<run_dir>/completions.jsonl``, as TRL's ``log_completions``
    (0: never). ``rlnb.metrics.read_table(run_dir)`` reads them back."""
    eval_episodes: int = 10
    """Episodes per evaluation: deterministic actions on up to 8 fresh envs, each with a fixed share of the
    episodes (not the first to end, which would favour short ones)."""
    resume: str | None = None
    """``auto`` (latest complete checkpoint of ``run_dir``), a checkpoint path, or empty."""
    stop_return: float | None = None
    """Stop ``run`` once ``env/episode_return_mean`` (last 20 episodes) reaches this."""
    max_restarts: int = 0
    """After a lost worker, rebuild the components and resume from the last checkpoint up to this many times."""
    run_ahead: bool = True
    """Where a whole step runs on one worker (env, rollout and actor collocated on one slot, synchronous), let
    the worker run the next steps of ``run`` (about 0.1 s of them) as soon as it has answered one, while the
    driver logs it; a stop, pause or steering asked for meanwhile then lands after those steps. ``false``:
    every step waits for the driver."""
    tensorboard: bool = True
    """Also write TensorBoard event files when ``tensorboard`` is installed."""
    wandb_project: str | None = None
    """Log to this Weights & Biases project (needs ``wandb``)."""

    def check(self, recipe: Recipe) -> list[str]:
        """This section's range checks and those it shares with others; every problem, as ``key: ...``."""
        errs: list[str] = []
        need(errs, lambda: self.steps >= 0, "runner.steps", "an integer >= 0", self.steps)
        need(
            errs,
            lambda: self.save_interval >= 0,
            "runner.save_interval",
            "an integer >= 0",
            self.save_interval,
        )
        need(
            errs,
            lambda: self.keep_checkpoints >= 1,
            "runner.keep_checkpoints",
            "an integer >= 1",
            self.keep_checkpoints,
        )
        need(errs, lambda: self.completions_interval >= 0, "runner.completions_interval", "an integer >= 0",
             self.completions_interval)  # fmt: skip
        if (
            recipe.loop == "embodied"
            and isinstance(self.completions_interval, int)
            and self.completions_interval
        ):
            errs.append(
                f"runner.completions_interval: {self.completions_interval} logs an LM's completions; this recipe "
                "trains a policy on an env (loop: embodied): look at its batches with loop.sample() instead"
            )
        need(
            errs, lambda: self.max_restarts >= 0, "runner.max_restarts", "an integer >= 0", self.max_restarts
        )
        need(
            errs,
            lambda: self.eval_episodes >= 1,
            "runner.eval_episodes",
            "an integer >= 1",
            self.eval_episodes,
        )
        return errs


@dataclass
class AlgorithmConfig:
    """The RL algorithm: advantage estimator, policy loss and their coefficients (paper names)."""

    advantage: str = "gae"
    """Registered advantage estimator: ``gae``, ``grpo``, ``rloo``, ``reinforce_pp``, ..."""
    policy_loss: str = "ppo_clip_value_entropy"
    """Registered policy loss: ``ppo_clip_value_entropy`` (PPO-clip + value loss - entropy bonus; old name ``actor_critic``), ``ppo``, ``decoupled_ppo``, ..."""
    gamma: float = 0.99
    """Discount factor."""
    gae_lambda: float = 0.95
    """GAE lambda."""
    clip_coef: float = 0.2
    """PPO clip epsilon."""
    clip_coef_high: float | None = None
    """Upper clip epsilon ("clip-higher", DAPO); default ``clip_coef``."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages."""
    vf_coef: float = 0.5
    """Value loss coefficient."""
    ent_coef: float = 0.0
    """Entropy bonus coefficient."""
    clip_vloss: bool = True
    """Clip the value loss around the old values."""
    norm_adv: bool = True
    """Normalise advantages per minibatch."""
    update_epochs: int = 4
    """Passes over each batch."""
    num_minibatches: int = 4
    """Minibatches per epoch (over all actor ranks)."""
    max_grad_norm: float = 0.5
    """Gradient clipping norm."""
    target_kl: float | None = None
    """Stop the epochs early once the approximate KL exceeds this."""
    behave_weight_cap: float | None = None
    """Decoupled PPO (``policy_loss: decoupled_ppo``): drop samples whose behaviour importance weight
    ``pi_prox / pi_behave`` exceeds this (AReaL uses 5); empty: no cap."""
    max_staleness: int = 0
    """Asynchronous RL (AReaL): rollout may run ahead of training by at most this many policy versions. ``0``
    is the synchronous loop. With ``N >= 1`` the next batch is collected while the actor trains (rollout and
    actor must be on different slots), and a batch made by version ``v`` is trained at version ``t`` only if
    ``t - v <= N``. For the LM loop, generation takes new weights mid-way (``rollout.chunk_tokens``) and the
    reward must sit with the rollout."""
    group_size: int = 8
    """Samples per prompt (GRPO/RLOO)."""
    scale: Literal["group", "batch", "none"] = "group"
    """GRPO advantage scaling: ``group`` std, ``batch`` std or ``none`` (Dr. GRPO)."""
    kl_coef: float = 0.0
    """KL penalty coefficient to the reference model (LM RL)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator."""
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """Loss aggregation over tokens (LM RL)."""
    dynamic_sampling: bool = False
    """LM RL, synchronous: DAPO's dynamic sampling (veRL's ``filter_groups``): a group whose completions all scored
    alike (no learning signal) is set aside, and more prompts are sampled until each rollout rank has its share
    of ``data.prompts_per_step`` groups with a signal, or ``max_sampling_rounds`` rounds were made (the batch is
    then topped up with groups set aside). ``rollout/sampling_rounds`` and ``rollout/informative_frac`` say how
    it went; rewards and accuracy are over every completion sampled."""
    max_sampling_rounds: int = 4
    """With ``dynamic_sampling``: generation rounds per step at most."""
    mask_truncated_completions: bool = False
    """LM RL: leave completions that reached ``rollout.max_new_tokens`` without ending (no EOS) out of the loss,
    as TRL's ``mask_truncated_completions`` (DAPO's overlong filtering); their rewards still count in their
    group's advantages. ``rollout/truncated_frac`` says how many there are."""

    def check(self, recipe: Recipe) -> list[str]:
        """This section's range checks, its registered names and whether the loop can serve their combination."""
        from rlnb.algorithms import ADVANTAGES, POLICY_LOSSES

        a, errs = self, []
        need(errs, lambda: 0.0 <= a.gamma <= 1.0, "algorithm.gamma", "a number in [0, 1]", a.gamma)
        need(
            errs,
            lambda: 0.0 <= a.gae_lambda <= 1.0,
            "algorithm.gae_lambda",
            "a number in [0, 1]",
            a.gae_lambda,
        )
        need(errs, lambda: a.clip_coef > 0, "algorithm.clip_coef", "a number > 0", a.clip_coef)
        need(errs, lambda: a.dual_clip is None or a.dual_clip > 1, "algorithm.dual_clip", "a number > 1 (or empty)",
             a.dual_clip)  # fmt: skip
        need(
            errs, lambda: a.update_epochs >= 1, "algorithm.update_epochs", "an integer >= 1", a.update_epochs
        )
        need(errs, lambda: a.behave_weight_cap is None or a.behave_weight_cap > 1, "algorithm.behave_weight_cap",
             "a number > 1 (or empty)", a.behave_weight_cap)  # fmt: skip
        need(errs, lambda: isinstance(a.max_staleness, int) and not isinstance(a.max_staleness, bool)
             and a.max_staleness >= 0, "algorithm.max_staleness", "an integer >= 0 (0: synchronous)",
             a.max_staleness)  # fmt: skip
        need(
            errs,
            lambda: a.num_minibatches >= 1,
            "algorithm.num_minibatches",
            "an integer >= 1",
            a.num_minibatches,
        )
        need(errs, lambda: a.max_grad_norm > 0, "algorithm.max_grad_norm", "a number > 0", a.max_grad_norm)
        need(errs, lambda: a.max_sampling_rounds >= 1, "algorithm.max_sampling_rounds", "an integer >= 1",
             a.max_sampling_rounds)  # fmt: skip
        asynchronous = isinstance(a.max_staleness, int) and a.max_staleness > 0
        if a.dynamic_sampling is True and asynchronous:
            errs.append(
                f"algorithm.dynamic_sampling: it samples more prompts until a synchronous step's batch has enough "
                f"groups with a learning signal; with algorithm.max_staleness={a.max_staleness} (asynchronous) groups "
                "are trained as they finish. Set one of them off"
            )
        if a.dynamic_sampling is True and recipe.loop == "embodied":
            errs.append(
                "algorithm.dynamic_sampling: it filters an LM's groups of completions; this recipe trains a policy on "
                "an env"
            )
        for key, value, reg in (("algorithm.advantage", a.advantage, ADVANTAGES),
                                ("algorithm.policy_loss", a.policy_loss, POLICY_LOSSES)):  # fmt: skip
            if isinstance(value, str) and value not in reg:
                errs.append(
                    f"{key}: unknown {reg.kind} {value!r}; registered: {', '.join(reg.names())}."
                    f"{did_you_mean(value, reg.names())}"
                )
        if all(
            isinstance(v, str) and v in reg
            for v, reg in ((a.advantage, ADVANTAGES), (a.policy_loss, POLICY_LOSSES))
        ):
            from rlnb.algorithms.contract import EMBODIED, LM, check_algorithm

            try:  # a combination the loop cannot serve is refused here, before any worker starts
                check_algorithm(LM if recipe.loop == "grpo" else EMBODIED, a.advantage, a.policy_loss)
            except ConfigError as err:
                errs.append(str(err))
        if (
            a.advantage in ("grpo", "rloo", "reinforce_pp_baseline")
            and isinstance(a.group_size, int)
            and a.group_size < 2
        ):
            errs.append(
                f"algorithm.group_size: {a.advantage} needs at least 2 samples per prompt, got {a.group_size}"
            )
        prompts = recipe.data.prompts_per_step
        batch = prompts * a.group_size if recipe.loop == "grpo" and isinstance(prompts, int) else 0
        if (
            batch
            and isinstance(a.num_minibatches, int)
            and a.num_minibatches >= 1
            and batch % a.num_minibatches
        ):
            errs.append(
                f"algorithm.num_minibatches: {a.num_minibatches} must divide the batch of "
                f"data.prompts_per_step x algorithm.group_size = {batch} sequences"
            )
        return errs


@dataclass
class ModelConfig:
    """The policy network."""

    kind: Literal["mlp", "cnn"] = "mlp"
    """``mlp`` for vector observations, ``cnn`` for images (C, H, W)."""
    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])
    """Hidden layer widths of the MLP trunk(s)."""
    activation: Literal["tanh", "relu"] = "tanh"
    """Hidden activation."""
    shared_trunk: bool = False
    """One trunk for actor and critic heads (else separate networks, as CleanRL)."""


@dataclass
class TinyLMConfig:
    """A small causal LM built locally when ``actor.model_path`` does not exist yet."""

    arch: Literal["qwen2", "llama"] = "qwen2"
    """Architecture of the ``transformers`` config."""
    hidden_size: int = 64
    """Hidden width."""
    num_layers: int = 2
    """Transformer layers."""
    num_heads: int = 4
    """Attention heads (must divide ``hidden_size``)."""


@dataclass
class ActorConfig:
    """The training component."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy network."""
    lr: float = 2.5e-4
    """Adam learning rate."""
    anneal_lr: bool = True
    """Decay the learning rate linearly to 0 over ``runner.steps`` (both loops; ``grpo_arith`` turns it off)."""
    compile: bool | Literal["auto"] = "auto"
    """``torch.compile`` the train step (forward, loss and their backward), compiled on the first step and
    logged as ``time/compile_s``: ``true``, ``false`` or ``auto`` (on where it measured faster: see
    ``rlnb.components.compile.AUTO``). A compile failure trains eager, with one warning. Both loops: the LM
    actor compiles its micro-batch objective."""
    fused_step: bool = True
    """Embodied PPO: train the built-in MLP ``ActorCritic`` with the ``ppo_clip_value_entropy`` loss through a
    hand-derived forward and backward (``rlnb.components.fused``) instead of autograd: the same loss, metrics
    and gradients up to float rounding, in about half the time for small policies. It applies with
    ``compile`` off, on one rank or data-parallel ranks; anything else (another policy or loss, hooks) trains
    through autograd, as ``false`` always does."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: the slot's device."""
    torch_threads: int = 1
    """Intra-op threads per rank (one slot = one core on CPU)."""
    model_path: str | None = None
    """LM RL: a Hugging Face model directory (``save_pretrained`` layout), loaded with ``from_pretrained``."""
    build_if_missing: bool = True
    """LM RL: build a tiny LM (``actor.tiny_lm``) at ``model_path`` if nothing is there."""
    tiny_lm: TinyLMConfig = field(default_factory=TinyLMConfig)
    """LM RL: the tiny LM to build."""
    micro_batch_size: int = 64
    """LM RL: sequences per forward/backward; gradients accumulate over a minibatch."""
    sft_steps: int = 0
    """LM RL: supervised warm-start steps on the answers before RL (0: none)."""
    sft_lr: float = 3e-3
    """LM RL: learning rate of the warm start."""
    sft_batch_size: int = 64
    """LM RL: sequences per warm-start step (over all actor ranks)."""
    gradient_checkpointing: bool = False
    """LM RL: keep only each decoder layer's inputs from the forward and compute the rest again in the backward
    (``transformers``' gradient checkpointing): the activations' memory of one layer instead of all, for about a
    third more compute. The same gradients; each sequence's prompt then goes through the model with it (no
    shared-prompt forward, which needs the KV cache that checkpointing turns off)."""
    skip_zero_advantage: bool = True
    """LM RL: leave sequences whose advantages are all 0 (a group whose completions all scored alike) out of
    the update's forward and backward, and out of the old log-probs' recompute, where they add exactly 0: a
    policy loss registered so (``ppo``, ``decoupled_ppo``) and no KL term in the loss. The same gradients;
    the loss's metrics are over the sequences computed. Logged as ``train/rows_computed_frac``."""
    length_buckets: int | None = None
    """LM RL: the most passes a micro-batch's sequences take, grouped by where they end, so that padding is
    not computed (the same log-probs and gradients); ``null``: 4 on CPU, 1 on a GPU."""
    strategy: Literal["ddp", "fsdp2"] = "ddp"
    """LM RL, several actor ranks: ``ddp`` (each rank a whole copy of the model, its gradients and AdamW state;
    gradients all-reduced) or ``fsdp2`` (PyTorch FSDP2, ``fully_shard`` on each decoder layer and the root: each
    rank holds a shard of all three; gloo on CPU, NCCL on GPUs). With ``fsdp2`` every rank computes its
    micro-batches in one pass each, every row (``actor.length_buckets`` and ``actor.skip_zero_advantage`` do
    not apply)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """LM RL: the precision of the model's compute. ``bfloat16``: the actor's forward and backward run under bf16
    autocast with float32 master weights, gradients and optimizer state, log-probs and the loss in float32; the
    rollout holds its model in bf16 (half the memory and the bytes read per decoded token), the reference model
    for the KL too. Metrics ``memory/actor_state_bytes`` and, on a GPU, ``memory/cuda_peak_bytes`` show what
    it saves."""

    def check(self, recipe: Recipe) -> list[str]:
        """This section's range checks."""
        errs: list[str] = []
        need(errs, lambda: self.lr > 0, "actor.lr", "a number > 0", self.lr)
        need(
            errs,
            lambda: self.torch_threads >= 1,
            "actor.torch_threads",
            "an integer >= 1",
            self.torch_threads,
        )
        need(errs, lambda: all(h > 0 for h in self.model.hidden_sizes), "actor.model.hidden_sizes", "positive widths",
             self.model.hidden_sizes)  # fmt: skip
        if recipe.loop == "embodied" and self.gradient_checkpointing is True:
            errs.append(
                "actor.gradient_checkpointing: recomputes an LM's decoder layers (loop: grpo); an embodied policy "
                "has none; set it false"
            )
        if recipe.loop == "embodied" and self.strategy != "ddp":
            errs.append(
                f"actor.strategy: {self.strategy} shards an LM actor (loop: grpo); an embodied policy trains with "
                "ddp; set actor.strategy=ddp"
            )
        if self.strategy == "fsdp2" and recipe.rollout.weight_sync == "broadcast":
            errs.append(
                "actor.strategy: fsdp2 gathers the weights on every actor rank, which rollout.weight_sync=broadcast "
                "(from actor rank 0 alone) cannot; use rollout.weight_sync=channel or auto"
            )
        if recipe.loop == "embodied" and self.dtype != "float32":  # (an embodied run would ignore it)
            errs.append(
                f"actor.dtype: {self.dtype} compute is for LM actors (loop: grpo); an embodied policy trains in "
                "float32; set actor.dtype=float32"
            )
        if recipe.loop == "grpo":
            errs += self._check_lm()
        return errs

    def _check_lm(self) -> list[str]:
        from rlnb.models.lm import is_hub_id

        errs = []
        if self.model_path is None:
            errs.append(
                "actor.model_path: expected a model directory for the LM loop (loop: grpo), got nothing"
            )
        elif (
            not self.build_if_missing
            and not is_hub_id(self.model_path)
            and not (Path(self.model_path) / "config.json").exists()
        ):
            errs.append(
                f"actor.model_path: {self.model_path!r} has no config.json (not a save_pretrained directory); "
                "fix the path or set actor.build_if_missing=true to build a tiny LM there"
            )
        return errs + at_least(
            ("actor.micro_batch_size", self.micro_batch_size, 1), ("actor.sft_steps", self.sft_steps, 0),
            ("actor.sft_batch_size", self.sft_batch_size, 1), ("actor.length_buckets", self.length_buckets, 1),
        )  # fmt: skip


@dataclass
class VLLMConfig:
    """The vLLM engine of ``rollout.backend: vllm`` (``vllm.LLM``'s arguments of the same names)."""

    tensor_parallel_size: int = 1
    """GPUs one engine shards the model over (tensor parallelism)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The precision the engine holds and runs the model in; ``auto``: the checkpoint's."""
    max_num_seqs: int = 256
    """Sequences the engine schedules at once."""
    gpu_memory_utilization: float = 0.3
    """Fraction of a GPU's memory for the engine's weights and KV cache (the rest is the collocated actor's)."""
    enforce_eager: bool = True
    """Run eager, without CUDA graphs: no capture time at start, slower decoding."""
    weight_bucket_bytes: int = 256 * 1024 * 1024
    """Weight sync sends the actor's tensors in buckets of at most this many bytes (a bigger tensor alone), so
    no process holds a second copy of the model beyond one bucket."""

    def errors(self, prefix: str = "rollout.vllm") -> list[str]:
        errs: list[str] = []
        for name in ("tensor_parallel_size", "max_num_seqs", "weight_bucket_bytes"):
            value = getattr(self, name)
            need(errs, lambda v=value: isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{prefix}.{name}",
                 "an integer >= 1", value)  # fmt: skip
        need(errs, lambda: 0.0 < self.gpu_memory_utilization <= 1.0, f"{prefix}.gpu_memory_utilization",
             "a number in (0, 1]", self.gpu_memory_utilization)  # fmt: skip
        return errs


@dataclass
class RolloutConfig:
    """The inference component that runs the policy."""

    backend: Literal["policy", "hf", "vllm"] = "policy"
    """``policy`` (MLP/CNN policies), ``hf`` (a transformers causal LM, sampled by rlnb's decoding loop) or ``vllm`` (GPU)."""
    steps_per_rollout: int = 128
    """Env steps per env per training step (T)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: the slot's device."""
    max_new_tokens: int = 8
    """LM RL: tokens generated per completion at most."""
    temperature: float = 1.0
    """LM RL: sampling temperature (the actor's log-probs use the same)."""
    top_p: float = 1.0
    """LM RL: nucleus sampling threshold."""
    top_k: int = 0
    """LM RL: sample among the ``top_k`` likeliest tokens only (after the temperature, before ``top_p``, as
    ``transformers`` orders them); ``0``: all."""
    drop_finished: bool = True
    """LM RL, ``hf`` backend: completions that ended leave the decoding batch (rlnb's decoding loop, the
    same tokens as ``generate``); ``false``: sample with ``transformers``' ``generate``."""
    max_turns: int = 1
    """LM RL: turns the model takes per completion at most (multi-turn rollouts, as veRL's and AReaL's agents).
    After each turn but the last, ``interaction`` answers the transcript so far (a tool's output, a user's
    follow-up) or ends the episode, and the model's next turn reads the whole transcript. Only the model's own
    tokens are trained on; rewards score the whole transcript after the prompt. In asynchronous mode
    (``algorithm.max_staleness``), a conversation's next turn goes on in the next chunks, across weight
    updates."""
    interaction: str | None = None
    """LM RL, with ``max_turns`` >= 2: a registered interaction (``arithmetic_retry``; a notebook's own through
    ``rlnb.algorithms.interactions.register_interaction``, or a function given to ``HFRollout(interaction=...)``)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """LM RL, ``hf`` backend: the precision the rollout holds and runs its model in; ``auto``: ``actor.dtype``."""
    static_cache: bool = False
    """LM RL, ``hf`` backend: sample with ``transformers``' ``generate`` on a static KV cache, whose decoding step
    is compiled on a GPU (``torch.compile``, CUDA graphs: one launch a token instead of one a kernel). Pays for
    models large enough to repay its compile (each new batch shape compiles; prompts are left-padded to a
    multiple of 32 tokens to bound them); ended sequences are computed to the end, as ``generate`` does, and
    each prompt is prefilled per completion. Synchronous generation only (asynchronous chunks decode with
    rlnb's loop)."""
    chunk_tokens: int = 8
    """LM RL, asynchronous mode (``algorithm.max_staleness >= 1``): tokens generated between two checks
    for new weights; a generation spanning a weight update goes on with the new ones (partial rollouts)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """``rollout.backend: vllm``: the engine's settings."""
    weight_sync: Literal["auto", "channel", "broadcast"] = "auto"
    """How the actor's weights reach rollout ranks outside its process (collocated ones copy in-process):
    ``channel``: worker to worker (CUDA IPC between GPUs of one node, shared memory between CPU
    workers); ``broadcast``: one collective from actor rank 0 to every rollout rank over a process group
    (NCCL on GPUs, gloo on CPU), synchronous mode only; ``auto``: ``broadcast`` when every rollout rank
    is on a GPU of another node than actor rank 0's, else ``channel``."""

    def check(self, recipe: Recipe) -> list[str]:
        """This section's range checks and which backend each setting belongs to."""
        from rlnb.algorithms.interactions import INTERACTIONS

        ro, errs = self, []
        need(errs, lambda: ro.steps_per_rollout >= 1, "rollout.steps_per_rollout", "an integer >= 1",
             ro.steps_per_rollout)  # fmt: skip
        need(errs, lambda: isinstance(ro.max_turns, int) and not isinstance(ro.max_turns, bool) and ro.max_turns >= 1,
             "rollout.max_turns", "an integer >= 1", ro.max_turns)  # fmt: skip
        errs += ro.vllm.errors()
        if ro.backend != "vllm":  # settings nothing would read: said, not ignored
            default = VLLMConfig()
            for f in dataclasses.fields(VLLMConfig):
                if getattr(ro.vllm, f.name) != getattr(default, f.name):
                    errs.append(
                        f"rollout.vllm.{f.name}: a setting of the vllm backend's engine; rollout.backend={ro.backend} "
                        "does not use it; leave it out, or set rollout.backend=vllm"
                    )
        staleness = recipe.algorithm.max_staleness
        if ro.backend in SYNCHRONOUS_BACKENDS and isinstance(staleness, int) and staleness > 0:
            errs.append(
                f"rollout.backend: {ro.backend} generates whole completions in its engine, and asynchronous generation "
                f"(algorithm.max_staleness={staleness}) takes new weights between chunks of tokens, with rlnb's "
                "own decoding; use rollout.backend=hf, or algorithm.max_staleness=0"
            )
        if ro.dtype != "auto" and ro.backend != "hf":
            errs.append(
                f"rollout.dtype: the precision of the hf backend's model; rollout.backend={ro.backend} does not use "
                "it; leave rollout.dtype=auto"
            )
        if ro.static_cache is True and ro.backend != "hf":
            errs.append(
                f"rollout.static_cache: a static KV cache for the hf backend's generate; rollout.backend={ro.backend} "
                "does not use it (vLLM manages its own cache); set rollout.static_cache=false"
            )
        if isinstance(ro.max_turns, int) and ro.max_turns >= 2:
            if recipe.loop == "embodied":
                errs.append(
                    "rollout.max_turns: turns of an LM's conversation; this recipe trains a policy on an env"
                )
            elif ro.interaction is None:
                errs.append(
                    f"rollout.interaction: with rollout.max_turns={ro.max_turns} something must answer between the "
                    f"model's turns; registered interactions: {', '.join(INTERACTIONS.names())}"
                )
        elif ro.interaction is not None:
            errs.append(
                f"rollout.interaction: it answers between the model's turns, and with rollout.max_turns={ro.max_turns} "
                "there are none; set rollout.max_turns >= 2, or drop the interaction"
            )
        if isinstance(ro.interaction, str) and ro.interaction not in INTERACTIONS:
            errs.append(
                f"rollout.interaction: unknown interaction {ro.interaction!r}; registered: "
                f"{', '.join(INTERACTIONS.names())}.{did_you_mean(ro.interaction, INTERACTIONS.names())}"
            )
        if recipe.loop == "grpo":
            errs += at_least(("rollout.max_new_tokens", ro.max_new_tokens, 1), ("rollout.chunk_tokens", ro.chunk_tokens, 1),
                             ("rollout.top_k", ro.top_k, 0))  # fmt: skip
            if isinstance(ro.temperature, float) and ro.temperature <= 0:
                errs.append(f"rollout.temperature: expected a number > 0, got {ro.temperature!r}")
            if isinstance(ro.top_p, float) and not 0 < ro.top_p <= 1:
                errs.append(f"rollout.top_p: expected a number in (0, 1], got {ro.top_p!r}")
        return errs


@dataclass
class EnvConfig:
    """The environments."""

    id: str = "CartPole-v1"
    """A registered gymnasium id (``CartPole-v1``, ``InvertedPendulum-v5``, ``rlnb/SlowCartPole-v1``...) or ``maniskill:PickCube-v1``."""
    num_envs: int = 8
    """Environments per env rank."""
    vector_mode: Literal["sync", "async"] = "sync"
    """Gymnasium vector env: ``sync`` (in-process, fastest for cheap envs) or ``async`` (subprocesses)."""
    pipeline_stages: int = 1
    """Split each env rank's envs into this many stages that step while the rollout infers the others."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments to ``gymnasium.make``."""
    normalize_obs: bool = False
    """Normalise observations with running statistics (continuous control); evaluation (and an exported policy)
    normalise with env rank 0's statistics as training left them, frozen."""
    normalize_reward: bool = False
    """Scale rewards by a running std of discounted returns (continuous control)."""

    def check(self, recipe: Recipe) -> list[str]:
        """This section's range checks and (embodied loop) that its id is a registered environment."""
        e, errs = self, []
        need(errs, lambda: e.num_envs >= 1, "env.num_envs", "an integer >= 1", e.num_envs)
        need(
            errs, lambda: e.pipeline_stages >= 1, "env.pipeline_stages", "an integer >= 1", e.pipeline_stages
        )
        ints = all(isinstance(x, int) for x in (e.num_envs, e.pipeline_stages))
        if ints and e.num_envs >= 1 and e.pipeline_stages >= 1 and e.num_envs % e.pipeline_stages:
            errs.append(
                f"env.pipeline_stages: {e.pipeline_stages} stages must divide env.num_envs={e.num_envs}"
            )
        if recipe.loop == "embodied" and isinstance(e.id, str):
            from rlnb.config.loader import check_env_id

            err = check_env_id(e.id)
            if err:
                errs.append(err)
        return errs


@dataclass
class RewardConfig:
    """Reward function (LM RL)."""

    name: str | list[str] = "arithmetic"
    """Registered reward (``math``, ``arithmetic``, ``format``...), or a list of them summed with ``weights``, as
    TRL's ``reward_funcs``: each is logged apart (``reward/<name>/mean``), and accuracy counts the first (a
    score >= 1), so put the correctness reward first."""
    weights: list[float] | None = None
    """With a list of rewards: one weight each (default 1.0 each), as TRL's ``reward_weights``."""
    model_path: str | None = None
    """A learned reward model (a sequence classifier: local ``save_pretrained`` directory or hub id), scoring
    prompt + completion as one more reward, ``reward_model``, after those of ``name`` (which may then be ``[]``);
    its weight is the last of ``weights``. It loads where the reward component runs."""
    model_batch_size: int = 16
    """Texts per forward of the reward model."""

    def check(self, recipe: Recipe) -> list[str]:
        """Registered reward names, the reward model's batch size and path, and that the rewards take what the
        prompts' records have."""
        from rlnb.algorithms import REWARDS

        errs: list[str] = []
        if self.model_path is not None:
            need(errs, lambda: self.model_batch_size >= 1, "reward.model_batch_size", "an integer >= 1",
                 self.model_batch_size)  # fmt: skip
            if recipe.loop == "grpo":
                from rlnb.models.lm import resolve_model

                try:  # before any worker starts: a missing directory, or a hub id not in this machine's cache
                    resolve_model(self.model_path, "reward.model_path")
                except ConfigError as err:
                    errs.append(str(err))
        several = isinstance(self.name, list)  # rewards summed with reward.weights
        rewards = self.name if several else [self.name]
        for i, name in enumerate(rewards):
            if isinstance(name, str) and name not in REWARDS:
                key = f"reward.name[{i}]" if several else "reward.name"
                errs.append(
                    f"{key}: unknown {REWARDS.kind} {name!r}; registered: {', '.join(REWARDS.names())}."
                    f"{did_you_mean(name, REWARDS.names())}"
                )
        if recipe.loop == "grpo" and all(isinstance(r, str) and r in REWARDS for r in rewards):
            from rlnb.algorithms.contract import check_rewards
            from rlnb.algorithms.rewards import recipe_rewards

            # a data file's fields are known once it is read: the loop checks them then
            fields = () if recipe.data.task == "arithmetic" else None
            try:
                check_rewards(
                    recipe_rewards(self.name, self.model_path, self.model_batch_size), self.weights, fields
                )
            except ConfigError as err:
                errs.append(str(err))
        return errs


@dataclass
class DataConfig:
    """Prompt data (LM RL)."""

    task: Literal["arithmetic", "file"] = "arithmetic"
    """``arithmetic`` (procedural) or ``file`` (local ``.jsonl``/``.parquet`` at ``path``)."""
    path: str | None = None
    """Local data file (question/answer layout, GSM8K-style ``#### answer``); its other columns are fields a reward
    may read by name (``def passes(completion, tests)``)."""
    max_operand: int = 20
    """Arithmetic: operands from ``min_operand`` to this (difficulty)."""
    min_operand: int = 0
    """Arithmetic: the smallest operand (``10`` with ``max_operand: 99``: two-digit operands only)."""
    ops: str = "+"
    """Arithmetic: operators to use, from ``+-*``."""
    held_out_frac: float = 0.2
    """Fraction of problems held out for evaluation."""
    prompts_per_step: int = 16
    """Prompts per training step (each sampled ``algorithm.group_size`` times)."""
    eval_size: int = 200
    """Held-out problems per evaluation."""
    sft_noise: float = 0.0
    """Fraction of warm-start answers made deliberately wrong (off by one, or ``sft_noise_turns``): an imperfect
    teacher for RL to beat."""
    sft_turns: list[str] | None = None
    """A multi-turn warm start (with ``rollout.max_turns``): the teacher's turns for each problem, format strings
    over ``{expression}`` (the prompt without its ``=``), ``{answer}``, ``{a}``, ``{op}``, ``{b}`` (arithmetic) and
    the record's fields; between two of them ``rollout.interaction`` replies, as it will in training, and the
    warm start learns each turn after the transcript before it. E.g. ``["calc({expression})", "{answer}"]``:
    call the calculator, then give its result."""
    sft_noise_turns: list[str | None] | None = None
    """With ``sft_turns`` and ``sft_noise``: the imperfect teacher's turns, each used instead of the right one on
    that fraction of the demonstrations of that turn (after its own transcript so far); ``null``: that turn as
    ``sft_turns`` has it. E.g. ``["calc({a}+{b})", null]``: a wrong call, then the result copied."""
    question_key: str = "question"
    """File data: the question column."""
    answer_key: str = "answer"
    """File data: the answer column (GSM8K-style ``#### 72`` keeps the final answer)."""
    chat_template: bool = False
    """Give the model each question as a user turn of its tokenizer's chat template, with the assistant's turn
    opened (``apply_chat_template(..., add_generation_prompt=True)``), as TRL does with conversational data: for
    instruct models. The warm start's answers and the rewards' prompts are those of the templated prompts."""
    system_prompt: str | None = None
    """With ``chat_template``: a system turn before each question (e.g. the answer format to use)."""

    def check(self, recipe: Recipe) -> list[str]:
        """This section's range checks, the warm start's turns and (LM loop) where the problems come from."""
        d, errs = self, []
        need(errs, lambda: 0.0 <= d.sft_noise <= 1.0, "data.sft_noise", "a number in [0, 1]", d.sft_noise)
        need(
            errs,
            lambda: 0.0 < d.held_out_frac < 1.0,
            "data.held_out_frac",
            "a number in (0, 1)",
            d.held_out_frac,
        )
        need(errs, lambda: 0 <= d.min_operand <= d.max_operand, "data.min_operand",
             f"an integer from 0 to data.max_operand ({d.max_operand})", d.min_operand)  # fmt: skip
        errs += _sft_turns_errors(d, recipe.rollout)
        if recipe.loop != "grpo":
            return errs
        if d.task == "file" and (d.path is None or not Path(d.path).exists()):
            errs.append(f"data.path: data.task=file needs an existing .jsonl/.parquet file, got {d.path!r}")
        if d.system_prompt is not None and not d.chat_template:  # it would be dropped without a word
            errs.append(
                f"data.system_prompt: {d.system_prompt!r} is set, but data.chat_template is false, which gives the "
                "model bare questions; set data.chat_template=true to open each prompt with it"
            )
        if d.task == "arithmetic" and d.path is not None:  # it would train on generated problems instead
            errs.append(
                f"data.path: {d.path!r} is set, but data.task is 'arithmetic', which generates its problems and "
                "would ignore the file; set data.task=file to train on it"
            )
        errs += at_least(("data.prompts_per_step", d.prompts_per_step, 1), ("data.eval_size", d.eval_size, 1))
        return errs


@dataclass
class Recipe:
    """A whole recipe."""

    loop: Literal["auto", "embodied", "grpo"] = "auto"
    """Which loop runs the recipe: ``embodied`` (:class:`rlnb.Loop`: a policy on environments) or ``grpo``
    (:class:`rlnb.GRPOLoop`: an LM on prompts). ``auto`` (a recipe that does not say) is inferred once from
    ``rollout.backend`` when the recipe loads, with a message, and recorded in the run's ``recipe.yaml``."""
    seed: int = 1
    """Seed of every RNG (per-rank seeds derive from it)."""
    name: str = "recipe"
    """Name used for the run directory."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Cluster and placement."""
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    """Run length, checkpoints, evaluation, logging."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Algorithm and coefficients."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Training component."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Inference component."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Environments."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward (LM RL)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data (LM RL)."""

    def check(self) -> list[str]:
        """Every section's checks (each beside its dataclass), and the loop against its rollout; every problem."""
        errs: list[str] = []
        lm_backend = self.rollout.backend in LM_BACKENDS
        if self.loop == "grpo" and not lm_backend:
            errs.append(
                f"rollout.backend: loop: grpo samples an LM (rollout.backend {' or '.join(LM_BACKENDS)}), got "
                f"{self.rollout.backend!r}"
            )
        elif self.loop == "embodied" and lm_backend:
            errs.append(
                f"rollout.backend: loop: embodied runs a policy on environments (rollout.backend policy), got "
                f"{self.rollout.backend!r}; an LM trains with loop: grpo"
            )
        for section in (self.runner, self.data, self.algorithm, self.actor, self.rollout, self.env, self.reward,
                        self.cluster):  # fmt: skip
            errs += section.check(self)
        return errs


LM_BACKENDS = ("hf", "vllm")  # rollout.backend values of the LM loop
SYNCHRONOUS_BACKENDS = ("vllm",)  # LM backends that generate whole completions: no asynchronous mode


def infer_loop(backend: str) -> str:
    """The loop a recipe with no ``loop:`` runs, from its ``rollout.backend``."""
    return "grpo" if backend in LM_BACKENDS else "embodied"


def need(errs: list[str], ok, key: str, expected: str, given) -> None:
    """Add ``key: expected ..., got ...`` to ``errs`` unless ``ok()``; a value of the wrong type was reported when
    it was converted, so a ``TypeError`` here adds nothing."""
    try:
        passed = ok()
    except TypeError:
        return
    if not passed:
        errs.append(f"{key}: expected {expected}, got {given!r}")


def at_least(*checks: tuple[str, object, int]) -> list[str]:
    """``(key, value, low)``: an error for each whole-number value below its ``low``."""
    return [f"{key}: expected an integer >= {low}, got {value!r}" for key, value, low in checks
            if isinstance(value, int) and value < low]  # fmt: skip


SFT_TURN_FIELDS = ("expression", "answer", "a", "op", "b")  # data.sft_turns' names for arithmetic problems


def _sft_turns_errors(d, ro) -> list[str]:
    """``data.sft_turns`` and ``data.sft_noise_turns``: format strings over a problem's names, as many turns as
    the rollout takes, an interaction to reply between them."""
    import string

    errs = []
    turns, noisy = d.sft_turns, d.sft_noise_turns
    if turns is None:
        if noisy is not None:
            errs.append(
                "data.sft_noise_turns: the imperfect teacher's turns need data.sft_turns, the right ones"
            )
        return errs
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        return [f"data.sft_turns: expected a non-empty list of format strings, got {turns!r}"]
    if noisy is None and isinstance(d.sft_noise, (int, float)) and d.sft_noise > 0:
        errs.append(
            f"data.sft_noise: {d.sft_noise} of a multi-turn warm start's demonstrations come from an imperfect "
            "teacher, whose turns data.sft_noise_turns gives (null for a turn it gets right); set it, or sft_noise=0"
        )
    if len(turns) > 1 and (not isinstance(ro.max_turns, int) or ro.max_turns < len(turns)):
        errs.append(
            f"data.sft_turns: {len(turns)} turns, and the rollout takes rollout.max_turns={ro.max_turns}; set it to "
            f"{len(turns)} or more"
        )
    if noisy is not None and (
        not isinstance(noisy, list)
        or len(noisy) != len(turns)
        or not all(t is None or isinstance(t, str) for t in noisy)
    ):
        errs.append(
            f"data.sft_noise_turns: expected a list of {len(turns)} format strings or nulls (one per data.sft_turns "
            f"entry), got {noisy!r}"
        )
        noisy = None
    for key, texts in (("data.sft_turns", turns), ("data.sft_noise_turns", noisy or [])):
        for text in (t for t in texts if t is not None):
            try:
                names = [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]
            except ValueError as e:
                errs.append(f"{key}: {text!r} is not a format string ({e})")
                continue
            unknown = [n for n in names if n not in SFT_TURN_FIELDS]
            if d.task == "arithmetic" and unknown:
                hint = did_you_mean(unknown[0], SFT_TURN_FIELDS)
                errs.append(
                    f"{key}: {text!r} names {{{unknown[0]}}}; an arithmetic problem has "
                    f"{', '.join('{' + n + '}' for n in SFT_TURN_FIELDS)}.{hint}"
                )
    return errs
