"""Recipe schema: one dataclass per section, a docstring per field (read by the docs and by errors).

A recipe is YAML with these sections; every key has a default, so a recipe names only what differs. The LM side's
sections (rollout, reward, data) are in :mod:`rlnb.config.sections_lm`; each section checks itself (``check``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlnb.config.checks import FAMILY_SECTIONS, LM_BACKENDS, bounded, bounds_errors, changed_keys, need
from rlnb.config.sections_lm import DataConfig, RewardConfig, RolloutConfig
from rlnb.config.sections_sac import BufferConfig, SACConfig
from rlnb.errors import ConfigError, did_you_mean

RUN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")  # a recipe's name: one path component, never '..'
MAX_SEED = 2**31 - 1  # the largest recipe seed: what derives from it stays below numpy's 2**32


@dataclass
class ClusterConfig:
    """Where the components run."""

    address: str | None = None
    """Dask scheduler address (``tcp://host:8786``); empty starts an embedded local cluster."""
    slots: int | None = bounded(
        None, 1, 1024, "worker processes; a bigger cluster is started apart and given by address"
    )
    """CPU worker processes of the embedded cluster (default: one per core, at most 8)."""
    component_placement: dict[str, Any] = field(default_factory=lambda: {"actor,rollout,env": "0"})
    """Component (or comma-joined components) -> slots: ``0-1``, ``2,3``, ``all``, ``{node_group: sim, slots: 0-1}``
    (a worker resource), ``{host: NAME, slots: 0-1}`` (a worker's machine)."""
    call_timeout_s: float = bounded(600.0, 0, 1e7, low_open=True)
    """Timeout of every remote call (seconds); a hung or dead worker surfaces as an error after at most this."""
    start_timeout_s: float = bounded(120.0, 0, 1e5, low_open=True)
    """How long a component's ranks may take to start (seconds): its import and construction on the workers, a
    vLLM engine's start included (minutes on a loaded 2-core machine)."""
    elastic: bool = False
    """Rollout ranks on slots of their own that may leave and join between steps: embodied PPO's and GRPO's env
    and rollout ranks, SAC's collectors, or asynchronous LM GRPO's rollout and reward ranks. A lost worker's
    share of the step's batch is made again by the ranks left (an LM's from the problems it held), a worker that
    joins (a restart, ``scale()``, ``adapt()``) is given ranks and the latest weights, and the run goes on without
    a restart; the actor's slots stay fixed (logged: ``cluster/ranks``, ``cluster/reissued``,
    ``cluster/joined``)."""

    def deadlines(self) -> dict[str, float]:
        """The components' deadlines, as their ``launch`` takes them."""
        return {"call_timeout_s": self.call_timeout_s, "start_timeout_s": self.start_timeout_s}

    def check(self, recipe: Recipe) -> list[str]:
        """A placement given, and a call deadline."""
        errs: list[str] = []
        if not isinstance(self.component_placement, dict) or not self.component_placement:
            errs.append(
                f"cluster.component_placement: expected a mapping like {{actor: 0}}, got {self.component_placement!r}"
            )
        need(errs, lambda: not (isinstance(self.address, str) and not self.address.strip()), "cluster.address",
             "a scheduler address like tcp://host:8786 (or empty for an embedded cluster)", self.address)  # fmt: skip
        return errs


@dataclass
class RunnerConfig:
    """How long to run, and what to write."""

    steps: int = bounded(100, 0, 1e9, "a billion steps is no run that ends")
    """Training steps (one step = rollout, advantages, train); ``actor.anneal_lr`` decays the learning rate to 0
    over them. ``loop.run(n)`` past them makes this the step it runs to."""
    run_dir: str | None = None
    """Where metrics, checkpoints and the resolved recipe go (default ``runs/<recipe>-<time>``)."""
    save_interval: int = bounded(0, 0, 1e9)
    """Write a checkpoint every this many steps (0: only at the end of ``run``)."""
    keep_checkpoints: int = bounded(3, 1, 1000, "each is a whole copy of the run's state")
    """How many complete checkpoints to keep."""
    eval_interval: int = bounded(0, 0, 1e9)
    """Evaluate every this many steps (0: never during ``run``)."""
    video_interval: int = bounded(0, 0, 1e9)
    """Embodied loop: every this many steps, record one deterministic evaluation episode as MP4 in
    ``<run_dir>/videos`` (``loop.record_episode()``: the cameras' frames, or the env's ``render()``), shown in the
    dashboard and logged to TensorBoard and W&B as ``eval/video`` (0: never during ``run``). Needs the ``video``
    extra."""
    completions_interval: int = bounded(0, 0, 1e9)
    """LM loop: every this many steps, append the first prompt's group of completions the actor trained on
    (prompt, completion, reward, advantage...) to ``<run_dir>/completions.jsonl``, as TRL's ``log_completions``
    (0: never). ``rlnb.metrics.read_table(run_dir)`` reads them back."""
    eval_episodes: int = bounded(10, 1, 1_000_000, "more is no evaluation that ends")
    """Episodes per evaluation: deterministic actions on up to 8 fresh envs, each with a fixed share of the
    episodes (not the first to end, which would favour short ones)."""
    resume: str | None = None
    """``auto`` (latest complete checkpoint of ``run_dir``), a checkpoint path, or empty."""
    overwrite: bool = False
    """Start over in a ``run_dir`` that holds a run: its metrics, checkpoints, TensorBoard files and exports are
    removed first. Off: such a directory is refused unless ``resume`` says to continue it."""
    resume_fallback: bool = False
    """With ``resume: auto``, when the latest checkpoint cannot be read, resume from the newest earlier one that
    can (with a warning). Off: that is an error naming the earlier checkpoints, not a run silently continuing
    from older weights."""
    stop_return: float | None = bounded(None, -1e15, 1e15)
    """Stop ``run`` once ``env/episode_return_mean`` (last 20 episodes) reaches this."""
    max_restarts: int = bounded(0, 0, 1000)
    """After a lost worker, rebuild the components and resume from the last checkpoint up to this many times."""
    run_ahead: bool = True
    """Where a whole step runs on one worker (env, rollout and actor collocated on one slot, synchronous), let
    the worker run the next steps of ``run`` (about 0.1 s of them) as soon as it has answered one, while the
    driver logs it; a stop, pause or steering asked for meanwhile then lands after those steps. ``false``:
    every step waits for the driver."""
    tensorboard: bool = True
    """Also write TensorBoard event files, in ``<run_dir>/tensorboard`` (``tensorboard --logdir`` that folder)."""
    wandb_project: str | None = None
    """Log to this Weights & Biases project (needs ``wandb``)."""
    control: Literal["loopback", "network"] = "loopback"
    """Where ``rlnb run``'s driver serves the run's steering (``rlnb attach``, ``rlnb stop``, ``rlnb.attach``):
    ``loopback``, to its owner's other processes on this machine; ``network``, also to other hosts of the
    cluster's network that read the run directory (a shared file system), over TLS with a certificate made for
    the run. Either way the token and the certificate are in the run's ``control.json`` (``0600``): only who can
    read it steers the run."""

    def check(self, recipe: Recipe) -> list[str]:
        """This section's range checks and those it shares with others; every problem, as ``key: ...``."""
        errs: list[str] = []
        need(errs, lambda: not (isinstance(self.run_dir, str) and not self.run_dir.strip()), "runner.run_dir",
             "a directory (or empty for runs/<recipe>-<time>)", self.run_dir)  # fmt: skip
        if (
            recipe.family != "grpo"
            and isinstance(self.completions_interval, int)
            and self.completions_interval
        ):
            errs.append(
                f"runner.completions_interval: {self.completions_interval} logs an LM's completions; this recipe "
                f"trains a policy on an env (family: {recipe.family}): look at its batches with loop.sample() instead"
            )
        if recipe.family == "sac" and isinstance(self.video_interval, int) and self.video_interval:
            errs.append(
                f"runner.video_interval: {self.video_interval}: SAC's family records no episodes; watch "
                "eval/return_mean (runner.eval_interval) instead"
            )
        elif recipe.family != "ppo" and isinstance(self.video_interval, int) and self.video_interval:
            errs.append(
                f"runner.video_interval: {self.video_interval} records an env's episodes; this recipe trains an LM "
                f"(family: {recipe.family}): see its completions with runner.completions_interval instead"
            )
        return errs


@dataclass
class AlgorithmConfig:
    """The RL algorithm: advantage estimator, policy loss and their coefficients (paper names)."""

    preset: Literal["none", "dr_grpo", "gspo", "cispo"] = "none"
    """LM RL: a method by its paper's name, filling the keys it is made of (``rlnb.config.presets.PRESETS``):
    ``dr_grpo`` (Dr. GRPO, Liu et al. 2025: no std scaling, no length mean), ``gspo`` (Zheng et al. 2025: the
    sequence's ratio clipped), ``cispo`` (MiniMax-M1 2025: clipped stop-gradient weights). A key the recipe also
    sets to another value is refused."""
    advantage: str = "gae"
    """Registered advantage estimator: ``gae``, ``grpo``, ``rloo``, ``reinforce_pp``, ..."""
    policy_loss: str = "ppo_clip_value_entropy"
    """Registered policy loss: ``ppo_clip_value_entropy`` (PPO-clip + value loss - entropy bonus; old name ``actor_critic``), ``ppo``, ``decoupled_ppo``,
    ``gspo``, ``cispo``, ..."""
    gamma: float = bounded(0.99, 0, 1)
    """Discount factor."""
    gae_lambda: float = bounded(0.95, 0, 1)
    """GAE lambda."""
    clip_coef: float = bounded(0.2, 0, 10, "a ratio clipped this far is not clipped", low_open=True)
    """PPO clip epsilon."""
    clip_coef_high: float | None = bounded(
        None, 0, 10, "a ratio clipped this far is not clipped", low_open=True
    )
    """Upper clip epsilon ("clip-higher", DAPO); default ``clip_coef``."""
    dual_clip: float | None = bounded(None, 1, 1e6, low_open=True)
    """Dual-clip constant c > 1 for negative advantages."""
    vf_coef: float = bounded(0.5, 0, 1e6)
    """Value loss coefficient."""
    ent_coef: float = bounded(0.0, -1e6, 1e6)
    """Entropy bonus coefficient."""
    clip_vloss: bool = True
    """Clip the value loss around the old values."""
    norm_adv: bool = True
    """Normalise advantages per minibatch."""
    update_epochs: int = bounded(4, 1, 10_000, "passes over one batch")
    """Passes over each batch."""
    num_minibatches: int = bounded(4, 1, 1_000_000)
    """Minibatches per epoch (over all actor ranks)."""
    max_grad_norm: float = bounded(0.5, 0, 1e9, low_open=True)
    """Gradient clipping norm."""
    target_kl: float | None = bounded(None, 0, 1e6, low_open=True)
    """Stop the epochs early once the approximate KL exceeds this."""
    critic_warmup_steps: int = bounded(0, 0, 1_000_000)
    """Embodied PPO: the first this many training steps fit the value function alone (their advantages zeroed, so
    the policy's surrogate adds nothing), so that the first policy updates after a warm start take advantages from
    a value function fitted to the warm-started policy's returns rather than an untrained head's (VLA-RL's and
    RLinf's critic warm-up). Logged as ``train/critic_warmup``."""
    mismatch_correction: Literal["none", "tis", "mis"] = "none"
    """LM RL: correct the gap between the rollout engine's token log-probs and the trainer's (vLLM in bf16 against
    a float32 actor; other kernels) by weighting each token's policy loss with ``w = pi_trainer / pi_engine``,
    gradient stopped (``rlnb.algorithms.correction``): ``tis`` truncated importance sampling, ``w`` capped at
    ``mismatch_cap`` (Yao et al. 2025; veRL's rollout_is, OpenRLHF's TIS); ``mis`` masked importance sampling,
    ``w`` outside ``[mismatch_floor, mismatch_cap]`` weighs 0 (IcePop; veRL's rollout rejection sampling). Where a
    batch is trained against the engine's log-probs already (a stale batch, ``decoupled_ppo``) the ratio itself
    is the correction. Logged as ``rollout/is_*``."""
    mismatch_level: Literal["token", "sequence"] = "token"
    """``mismatch_correction``'s ratio: each token's own, or the whole completion's (the product of its tokens')
    on all its tokens."""
    mismatch_cap: float = bounded(2.0, 1, 1e6, "a weight this large is no truncation", low_open=True)
    """TIS's truncation of ``w``, MIS's upper bound (veRL's default 2)."""
    mismatch_floor: float | None = bounded(None, 0, 1, low_open=True)
    """MIS's lower bound on ``w`` (null: ``1 / mismatch_cap``)."""
    behave_weight_cap: float | None = bounded(None, 1, 1e9, low_open=True)
    """Decoupled PPO (``policy_loss: decoupled_ppo``): drop samples whose behaviour importance weight
    ``pi_prox / pi_behave`` exceeds this (AReaL uses 5); empty: no cap."""
    max_staleness: int = bounded(0, 0, 1000, "policy versions a batch may lag")
    """Asynchronous RL (AReaL): rollout may run ahead of training by at most this many policy versions. ``0``
    is the synchronous loop. With ``N >= 1`` the next batch is collected while the actor trains (rollout and
    actor must be on different slots), and a batch made by version ``v`` is trained at version ``t`` only if
    ``t - v <= N``. For the LM loop the reward must sit with the rollout; HF generation takes new weights
    mid-way (``rollout.chunk_tokens``), while vLLM (whole completions) takes them between batches."""
    group_size: int = bounded(8, 1, 65_536, "samples of one prompt in one step")
    """Samples per prompt (GRPO/RLOO); embodied GRPO (``episode_grpo``): envs per group, which start each episode
    from one state."""
    scale: Literal["group", "batch", "none"] = "group"
    """GRPO advantage scaling: ``group`` std, ``batch`` std or ``none`` (Dr. GRPO)."""
    kl_coef: float = bounded(0.0, 0, 1e6)
    """KL penalty coefficient to the reference model (LM RL)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator."""
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """Loss aggregation over tokens (LM RL)."""
    agg_max_tokens: int | None = bounded(None, 1, 100_000_000, "more tokens than any context")
    """``agg: seq-mean-token-sum-norm`` (Dr. GRPO): the constant each completion's token sum is divided by, the
    same for every batch; null: the rollout's budget of response tokens (``rollout.max_new_tokens`` x
    ``rollout.max_turns``), which the LM family sets (an actor built from objects without it: the batch's width)."""
    dynamic_sampling: bool = False
    """LM RL, synchronous: DAPO's dynamic sampling (veRL's ``filter_groups``): a group whose completions all scored
    alike (no learning signal) is set aside, and more prompts are sampled until each rollout rank has its share
    of ``data.prompts_per_step`` groups with a signal, or ``max_sampling_rounds`` rounds were made (the batch is
    then topped up with groups set aside). ``rollout/sampling_rounds`` and ``rollout/informative_frac`` say how
    it went; rewards and accuracy are over every completion sampled."""
    max_sampling_rounds: int = bounded(4, 1, 10_000)
    """With ``dynamic_sampling``: generation rounds per step at most."""
    mask_truncated_completions: bool = False
    """LM RL: leave completions that reached ``rollout.max_new_tokens`` without ending (no EOS) out of the loss,
    as TRL's ``mask_truncated_completions`` (DAPO's overlong filtering); their rewards still count in their
    group's advantages. ``rollout/truncated_frac`` says how many there are."""

    @property
    def asynchronous(self) -> bool:
        """Whether it trains asynchronously (``max_staleness >= 1``; a value of the wrong type is said by the check)."""
        n = self.max_staleness
        return isinstance(n, int) and not isinstance(n, bool) and n > 0

    def check(self, recipe: Recipe) -> list[str]:
        """This section's range checks, its registered names and whether the loop can serve their combination."""
        from rlnb.algorithms import ADVANTAGES, POLICY_LOSSES

        a, errs = self, []
        if a.dynamic_sampling is True and a.asynchronous:
            errs.append(
                f"algorithm.dynamic_sampling: it samples more prompts until a synchronous step's batch has enough "
                f"groups with a learning signal; with algorithm.max_staleness={a.max_staleness} (asynchronous) groups "
                "are trained as they finish. Set one of them off"
            )
        if recipe.family != "ppo" and isinstance(a.critic_warmup_steps, int) and a.critic_warmup_steps:
            errs.append(
                f"algorithm.critic_warmup_steps: {a.critic_warmup_steps} fits an embodied policy's value function "
                f"first; the {recipe.family} family has none. Set it to 0"
            )
        if a.mismatch_correction != "none" and recipe.family == "ppo":
            errs.append(
                f"algorithm.mismatch_correction: {a.mismatch_correction} weighs an LM engine's tokens against the "
                "trainer's log-probs; this recipe trains a policy on an env, whose rollout and actor run one model. "
                "Set it to none"
            )
        elif a.mismatch_correction != "none" and a.policy_loss == "decoupled_ppo":
            errs.append(
                f"algorithm.mismatch_correction: {a.mismatch_correction} with algorithm.policy_loss decoupled_ppo, "
                "whose ratio to the engine's log-probs (and algorithm.behave_weight_cap) is this correction already. "
                "Set one of them otherwise"
            )
        if recipe.family == "ppo" and a.preset != "none":
            errs.append(
                f"algorithm.preset: {a.preset} is a method for LMs' groups of completions (family: grpo); this "
                "recipe trains a policy on an env. Set it to none"
            )
        critic = recipe.family == "ppo" or (
            isinstance(a.advantage, str)
            and a.advantage in ADVANTAGES
            and "values" in ADVANTAGES.entry(a.advantage).needs
        )  # (an LM's value model: an advantage asking for values, token_gae)
        if not critic and recipe.actor.critic_lr is not None:
            errs.append(
                f"actor.critic_lr: {recipe.actor.critic_lr} is a value model's learning rate; algorithm.advantage "
                f"{a.advantage} uses none (token_gae does). Leave it null"
            )
        if a.dynamic_sampling is True and recipe.family == "ppo":
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
                check_algorithm(LM if recipe.family == "grpo" else EMBODIED, a.advantage, a.policy_loss)
            except ConfigError as err:
                errs.append(str(err))
        if (
            a.advantage in ("grpo", "rloo", "reinforce_pp_baseline", "episode_grpo")
            and isinstance(a.group_size, int)
            and a.group_size < 2
        ):
            errs.append(
                f"algorithm.group_size: {a.advantage} needs at least 2 samples per prompt, got {a.group_size}"
            )
        prompts = recipe.data.prompts_per_step
        batch = prompts * a.group_size if recipe.family == "grpo" and isinstance(prompts, int) else 0
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
class TinyVLAConfig:
    """A small PaliGemma VLA built locally (``rlnb.models.build_tiny_vla``) when ``actor.model.vla.path`` has none."""

    image_size: int = bounded(64, 4, 1024, "a larger side than any released VLA's cameras")
    """The side camera images are resized to, in pixels."""
    patch_size: int = bounded(16, 1, 1024)
    """The vision tower's patch side, in pixels (a divisor of ``image_size``)."""
    hidden_size: int = bounded(64, 8, 65_536)
    """Hidden width of the vision tower and the decoder."""
    num_layers: int = bounded(2, 1, 1024)
    """Layers of each."""
    num_heads: int = bounded(2, 1, 1024)
    """Attention heads (a divisor of ``hidden_size``)."""
    action_bins: int = bounded(256, 2, 1024, "OpenVLA's 256 bins already resolve 1/128 of an action's range")
    """Action tokens: the bins each continuous action dimension is cut into (OpenVLA: 256)."""


# the VLA's choices, read by rlnb.models.vla too (one list of each)
VLAHead = Literal["tokens", "chunk"]
VLAProprio = Literal["logits", "token"]


@dataclass
class VLAConfig:
    """A vision-language-action policy (``actor.model.kind: vla``, ``rlnb.models.VLAPolicy``)."""

    path: str = "runs/models/tiny-vla"
    """A VLA's ``save_pretrained`` directory (a VLM with action tokens, as ``build_tiny_vla`` makes or OpenVLA
    ships), or a hub id where there is a network."""
    build_if_missing: bool = True
    """Build an untrained tiny VLA (``tiny``) at ``path`` when nothing is there (a local path only)."""
    tiny: TinyVLAConfig = field(default_factory=TinyVLAConfig)
    """The tiny VLA's geometry."""
    head: VLAHead = "tokens"
    """``tokens``: one action token a dimension, decoded in turn (OpenVLA); ``chunk``: a Gaussian over a chunk
    of continuous actions from the prompt's last hidden state (OpenVLA-OFT)."""
    cameras: list[str] = field(default_factory=list)
    """The observations' image parts the VLA reads, in order; empty: every image part."""
    instruction: str = ""
    """The observations' text part holding the task's instruction; empty: the first text part."""
    default_instruction: str = ""
    """The instruction where the observations hold none (an env without a text part)."""
    proprio: VLAProprio = "logits"
    """How the proprioception (the observations' vector parts) reaches the action: ``logits``, a linear map of it
    added to each action token's logits, zero at start (OpenVLA reads none); ``token``, a two-layer projection of
    it into one input embedding at the prompt's end, which the decoder reads with the image and the instruction
    (OpenVLA-OFT's proprio projector): the action can then depend on it through the decoder's layers."""
    critic_detached: bool = False
    """The value head reads the VLA's last hidden state without its gradient reaching the VLA: the value loss
    trains the head alone and never moves the policy (the value loss's gradients through a tiny VLA were seen to
    raise its action tokens' entropy and undo its warm start: ``docs/benchmarks.md``). ``false``: shared, as
    RLinf's OpenVLA PPO."""


@dataclass
class ModelConfig:
    """The policy network."""

    kind: Literal["mlp", "cnn", "vla"] = "mlp"
    """``mlp`` for vector observations, ``cnn`` for images (C, H, W), ``vla`` a vision-language-action model
    (``actor.model.vla``) for dict observations with camera images and an instruction."""
    hidden_sizes: list[int] = bounded(
        low=1,
        high=65_536,
        why="a wider layer is no policy a slot holds",
        factory=lambda: [64, 64],
        length=(1, 64),
    )
    """Hidden layer widths of the MLP trunk(s)."""
    activation: Literal["tanh", "relu"] = "tanh"
    """Hidden activation."""
    shared_trunk: bool = False
    """One trunk for actor and critic heads (else separate networks, as CleanRL)."""
    vla: VLAConfig = field(default_factory=VLAConfig)
    """With ``kind: vla``: the VLA, its action head and what it reads."""


@dataclass
class TinyLMConfig:
    """A small causal LM built locally when ``actor.model_path`` does not exist yet."""

    arch: Literal["qwen2", "llama"] = "qwen2"
    """Architecture of the ``transformers`` config."""
    hidden_size: int = bounded(64, 8, 65_536)
    """Hidden width."""
    num_layers: int = bounded(2, 1, 1024)
    """Transformer layers."""
    num_heads: int = bounded(4, 1, 1024)
    """Attention heads (must divide ``hidden_size``)."""
    max_positions: int = bounded(128, 8, 1_000_000, "a context longer than any model's")
    """The model's positions (``max_position_embeddings``): the longest transcript it reads, prompt and turns."""


@dataclass
class LoRAConfig:
    """LoRA adapters on the LM actor (PEFT): only they train; the KL reference is the model with them off."""

    rank: int = bounded(0, 0, 65_536)
    """The adapters' rank ``r``; 0: no LoRA, the whole model trains."""
    alpha: float = bounded(16.0, 0, 1e6, low_open=True)
    """The adapters' scale ``alpha`` (their update is ``B A * alpha / r``)."""
    dropout: float = bounded(0.0, 0, 0.99, "a dropout of 1 drops every input")
    """Dropout on the adapters' input while training."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """The linear layers (by name, as in the model) that get adapters."""
    sync: Literal["adapters", "merged"] = "adapters"
    """What weight sync sends rollout ranks apart from the actor (a channel): ``adapters``, the merged weights and
    the adapted layers' base once (and after a full warm start), then the adapters alone, which the rollout merges
    into the base it keeps (logged as ``sync/bytes``); ``merged``, the merged weights every time (a rollout of
    one's own that takes whole weights only gets them so anyway). Collocated ranks copy in-process either way."""
    warm_start: Literal["full", "adapters"] = "full"
    """What the supervised warm start (``actor.sft_steps``) trains: ``full``, every weight of the base model (as a
    model is fine-tuned before LoRA RL; the KL reference and the rollout start from it), then RL trains the
    adapters alone; ``adapters``, the adapters alone throughout (a model too large to fine-tune whole; with
    ``actor.strategy: fsdp2``, whose shards of the frozen base take no gradient)."""

    def errors(self) -> list[str]:
        errs: list[str] = bounds_errors(self, "actor.lora.")
        need(errs, lambda: len(self.target_modules) >= 1, "actor.lora.target_modules", "a non-empty list of names",
             self.target_modules)  # fmt: skip
        return errs


@dataclass
class WarmStartConfig:
    """Embodied: behaviour cloning on the env's scripted expert before RL's first step (RLinf's and SimpleVLA-RL's
    start from a policy that sometimes succeeds); ``loop.warm_start()`` runs it from a cell."""

    episodes: int = bounded(0, 0, 1_000_000, "a million demonstrations is a dataset, not a warm start")
    """Expert episodes recorded on the driver (the env's ``expert_action()``); 0: no warm start."""
    epochs: int = bounded(20, 1, 10_000)
    """Passes over the demonstrations."""
    lr: float = bounded(3e-4, 0, 10, "a step this long diverges at once", low_open=True)
    """Adam's learning rate for the warm start (its own optimizer; RL's starts fresh after it)."""
    minibatch_size: int = bounded(64, 1, 1_000_000)
    """Demonstration steps per gradient step."""


@dataclass
class ActorConfig:
    """The training component."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy network."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Embodied: behaviour cloning before RL (``actor.warm_start.episodes`` > 0)."""
    lr: float = bounded(2.5e-4, 0, 10, "a step this long diverges at once", low_open=True)
    """Adam learning rate."""
    critic_lr: float | None = bounded(None, 0, 10, "a step this long diverges at once", low_open=True)
    """Embodied PPO: Adam's learning rate for the value function's own weights (``ActorCritic``'s critic trunk
    and head, a VLA's value head), RL4VLA's and RLinf's ``value_lr``: a head that starts untrained on a
    warm-started policy needs a longer step than the policy. Annealed with ``lr``; ``null``: ``lr``."""
    anneal_lr: bool = True
    """Decay the learning rate linearly to 0 over ``runner.steps`` (both loops; ``grpo_arith`` turns it off)."""
    compile: bool | Literal["auto"] = "auto"
    """``torch.compile`` the train step (forward, loss and their backward), compiled on the first step and
    logged as ``time/compile_s``: ``true``, ``false`` or ``auto`` (on where it measured faster: see
    ``rlnb.components.compile.AUTO``). A compile failure trains eager, with one warning. Both loops: the LM
    actor compiles its micro-batch objective, or with ``strategy: fsdp2`` each decoder layer (FSDP2's hooks
    between layers would break a whole graph at each one; identical layers share their compiled code)."""
    fused_step: bool = True
    """Embodied PPO: train the built-in MLP ``ActorCritic`` with the ``ppo_clip_value_entropy`` loss through a
    hand-derived forward and backward (``rlnb.components.fused``) instead of autograd: the same loss, metrics
    and gradients up to float rounding, in about half the time for small policies. It applies with
    ``compile`` off, on one rank or data-parallel ranks; anything else (another policy or loss, hooks) trains
    through autograd, as ``false`` always does."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: the slot's device."""
    torch_threads: int = bounded(1, 1, 256, "more threads than a slot's cores only slow a rank down")
    """Intra-op threads per rank (one slot = one core on CPU)."""
    model_path: str | None = None
    """LM RL: a Hugging Face model directory (``save_pretrained`` layout), loaded with ``from_pretrained``."""
    build_if_missing: bool = True
    """LM RL: build a tiny LM (``actor.tiny_lm``) at ``model_path`` if nothing is there."""
    tiny_lm: TinyLMConfig = field(default_factory=TinyLMConfig)
    """LM RL: the tiny LM to build."""
    micro_batch_size: int = bounded(64, 1, 1_000_000)
    """LM RL: sequences per forward/backward; gradients accumulate over a minibatch."""
    sft_steps: int = bounded(0, 0, 1e9)
    """LM RL: supervised warm-start steps on the answers before RL (0: none)."""
    sft_lr: float = bounded(3e-3, 0, 10, "a step this long diverges at once", low_open=True)
    """LM RL: learning rate of the warm start."""
    sft_batch_size: int = bounded(64, 1, 1_000_000)
    """LM RL: sequences per warm-start step (over all actor ranks)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LM RL: LoRA adapters (``actor.lora.rank > 0``): only they train and carry optimizer state; the rollout and
    ``rlnb export`` get the merged weights."""
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
    max_tokens_per_micro_batch: int | None = bounded(
        None, 1, 100_000_000, "more tokens than a batch of contexts"
    )
    """LM RL: micro-batches by a token budget instead of ``micro_batch_size`` rows, each micro-batch's rows packed
    into one sequence with no padding computed (position ids restarting at each row, which ``transformers`` reads
    as packed sequences: veRL's ``use_dynamic_bsz`` and remove-padding, TRL's ``padding_free``). The same losses and
    gradients as the padded path; the actor checks the two agree on its first micro-batch and pads, with a warning,
    where the model attends across packed rows. Not with ``actor.compile`` (a graph a shape). ``null``: rows. On
    CPUs the padded path, which computes each prompt once and cuts rows by length, was faster here
    (``docs/benchmarks.md``); packing pays where attention runs variable-length kernels."""
    length_buckets: int | None = bounded(None, 1, 1024)
    """LM RL: the most passes a micro-batch's sequences take, grouped by where they end, so that padding is
    not computed (the same log-probs and gradients); ``null``: 4 on CPU, 1 on a GPU."""
    strategy: Literal["ddp", "fsdp2"] = "ddp"
    """LM RL, several actor ranks: ``ddp`` (each rank a whole copy of the model, its gradients and AdamW state;
    gradients all-reduced) or ``fsdp2`` (PyTorch FSDP2, ``fully_shard`` on each decoder layer and the root: each
    rank holds a shard of all three; gloo on CPU, NCCL on GPUs). With ``fsdp2`` every rank computes its
    micro-batches in one pass each, every row (``actor.length_buckets`` and ``actor.skip_zero_advantage`` do
    not apply). Over several ranks the model is built with no storage and each rank reads only its shards from
    a local safetensors checkpoint (a hub id, ``.bin`` weights or LoRA: loaded whole, then sharded)."""
    hsdp_replicas: int = bounded(1, 1, 65_536)
    """LM RL with ``actor.strategy: fsdp2``: HSDP, the model replicated over this many groups of actor ranks and
    sharded within each (FSDP2 over a 2-D device mesh: gradients reduce-scattered within a group, then averaged
    across groups). Place each group on one node: the shard collectives of every layer stay on its fast links
    and only the gradients' all-reduce crosses nodes. 1: plain FSDP over all actor ranks. It must divide the
    number of actor ranks."""
    offload: Literal["none", "params"] = "none"
    """LM RL with ``actor.strategy: fsdp2`` on GPUs: ``params``: FSDP2's CPU offload; each rank's shards of the
    parameters, gradients and AdamW state live in pinned host memory, a layer's parameters are copied to the GPU
    for its forward and backward, and the optimizer steps on the CPU. For a model whose training state does not
    fit in GPU memory, at the cost of the copies and a CPU step; with one actor rank the model is wrapped by FSDP2
    all the same. ``none``: everything on the GPU. Refused on CPU, where there is no GPU memory to free. (There is
    no ``optimizer``-only level: FSDP2's offload moves the three together, and AdamW's state alone on the host
    would mean stepping on the CPU over copies of the master weights, DeepSpeed's ZeRO-Offload.)"""
    gather_bucket_bytes: int = bounded(
        256 * 1024 * 1024, 1, 2**40, "a terabyte at a time is the whole model twice"
    )
    """LM RL with ``actor.strategy: fsdp2`` over several ranks: weight sync gathers the model's whole tensors one
    at a time and sends them to the rollout in buckets of at most this many bytes (a bigger tensor alone), so no
    actor or rollout process holds a second copy of the model beyond one bucket."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """LM RL: the precision of the model's compute. ``bfloat16``: the actor's forward and backward run under bf16
    autocast with float32 master weights, gradients and optimizer state, log-probs and the loss in float32; the
    rollout holds its model in bf16 (half the memory and the bytes read per decoded token), the reference model
    for the KL too; with LoRA the frozen base model too (the adapters, which train, stay float32). Metrics
    ``memory/actor_state_bytes`` and, on a GPU, ``memory/cuda_peak_bytes`` show what it saves."""

    def check(self, recipe: Recipe) -> list[str]:
        """This section's range checks."""
        errs: list[str] = []
        errs += self.lora.errors()
        # a VLA is an embodied policy with a transformer inside: LoRA and checkpointing apply to it
        vla = self.model.kind == "vla"
        if recipe.family == "ppo" and not vla and isinstance(self.lora.rank, int) and self.lora.rank > 0:
            errs.append(
                "actor.lora.rank: LoRA adapts an LM actor (family: grpo) or a VLA (actor.model.kind=vla); set it to 0 "
                "for this embodied policy"
            )
        if recipe.family == "ppo" and not vla and self.gradient_checkpointing is True:
            errs.append(
                "actor.gradient_checkpointing: recomputes a transformer's layers (an LM actor, or actor.model.kind="
                "vla); this embodied policy has none; set it false"
            )
        if recipe.family == "ppo" and not vla and self.strategy != "ddp":
            errs.append(
                f"actor.strategy: {self.strategy} shards a transformer (an LM actor, or actor.model.kind=vla); this "
                "embodied policy trains with ddp; set actor.strategy=ddp"
            )
        lora_sft = isinstance(self.lora.rank, int) and self.lora.rank > 0 and self.sft_steps
        if lora_sft and self.lora.warm_start == "full" and self.strategy == "fsdp2" and not vla:
            errs.append(
                "actor.lora.warm_start: full fine-tunes the base model's weights, which FSDP2 shards frozen under "
                "LoRA (actor.strategy=fsdp2); set actor.lora.warm_start=adapters, or actor.sft_steps=0"
            )
        if self.max_tokens_per_micro_batch is not None and self.compile is True:
            errs.append(
                "actor.max_tokens_per_micro_batch: packed micro-batches change shape at every step, and actor.compile="
                "true compiles one graph a shape; set actor.compile=false (or auto), or the budget to null"
            )
        if self.hsdp_replicas != 1 and self.strategy != "fsdp2":
            errs.append(
                f"actor.hsdp_replicas: {self.hsdp_replicas} replicas of a sharded model need actor.strategy=fsdp2 "
                f"(it is {self.strategy}); set actor.strategy=fsdp2, or actor.hsdp_replicas=1"
            )
        if self.offload != "none" and self.strategy != "fsdp2":
            errs.append(
                f"actor.offload: {self.offload} is FSDP2's CPU offload, which needs actor.strategy=fsdp2 (it is "
                f"{self.strategy}); set actor.strategy=fsdp2, or actor.offload=none"
            )
        if self.offload != "none" and self.device == "cpu":
            errs.append(
                f"actor.offload: {self.offload} moves the actor's state from GPU memory to the host; with "
                "actor.device=cpu it is there already; set actor.offload=none"
            )
        if self.strategy == "fsdp2" and recipe.rollout.weight_sync == "broadcast":
            errs.append(
                "actor.strategy: fsdp2 gathers the weights on every actor rank, which rollout.weight_sync=broadcast "
                "(from actor rank 0 alone) cannot; use rollout.weight_sync=channel or auto"
            )
        if self.model.kind != "vla":  # settings nothing would read: said, not ignored
            errs += [
                f"{key}: a setting of the VLA policy; actor.model.kind={self.model.kind} does not use it; leave it "
                "out, or set actor.model.kind=vla"
                for key in changed_keys(self.model.vla, "actor.model.vla.")
            ]
        elif recipe.family == "grpo":
            errs.append(
                "actor.model.kind: vla is an embodied policy (family: ppo); the LM loop trains actor.model_path"
            )
        if recipe.family == "grpo":
            errs += [
                f"{key}: the embodied warm start (family: ppo); the LM loop's is actor.sft_steps"
                for key in changed_keys(self.warm_start, "actor.warm_start.")
            ]
        elif self.warm_start.episodes and recipe.env.normalize_obs:
            errs.append(
                "actor.warm_start.episodes: the demonstrations are raw observations, which env.normalize_obs would "
                "scale differently in training; set env.normalize_obs=false for a warm start"
            )
        # (an embodied run would ignore it)
        if recipe.family == "ppo" and not vla and self.dtype != "float32":
            errs.append(
                f"actor.dtype: {self.dtype} compute is for transformers (an LM actor, or actor.model.kind=vla); this "
                "embodied policy trains in float32; set actor.dtype=float32"
            )
        if recipe.family == "grpo":
            errs += self._check_lm()
        return errs

    def _check_lm(self) -> list[str]:
        from rlnb.models.lm import is_hub_id

        errs = []
        if self.model_path is None:
            errs.append(
                "actor.model_path: expected a model directory for the LM loop (family: grpo), got nothing"
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
        elif isinstance(self.model_path, str) and not is_hub_id(self.model_path):
            from rlnb.models.lm import near_miss

            errs += near_miss(Path(self.model_path))
        return errs


@dataclass
class EnvConfig:
    """The environments."""

    id: str = "CartPole-v1"
    """A registered gymnasium id (``CartPole-v1``, ``InvertedPendulum-v5``, ``rlnb/SlowCartPole-v1``...) or ``maniskill:PickCube-v1``."""
    num_envs: int = bounded(8, 1, 65_536, "envs of one env rank")
    """Environments per env rank."""
    vector_mode: Literal["sync", "async"] = "sync"
    """Gymnasium vector env: ``sync`` (in-process, fastest for cheap envs) or ``async`` (subprocesses)."""
    pipeline_stages: int = bounded(1, 1, 4096)
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
        ints = all(isinstance(x, int) for x in (e.num_envs, e.pipeline_stages))
        if ints and e.num_envs >= 1 and e.pipeline_stages >= 1 and e.num_envs % e.pipeline_stages:
            errs.append(
                f"env.pipeline_stages: {e.pipeline_stages} stages must divide env.num_envs={e.num_envs}"
            )
        if isinstance(e.id, str) and e.id.startswith("maniskill:") and isinstance(e.kwargs, dict):
            from rlnb.envs.gym_envs import maniskill_misfit

            err = maniskill_misfit(e.num_envs, e.kwargs, e.vector_mode)
            if err:
                errs.append(err)
        if recipe.family in ("ppo", "sac") and isinstance(e.id, str):
            from rlnb.config.envs import check_env_id, check_env_kwargs

            err = check_env_id(e.id) or check_env_kwargs(e.id, e.kwargs)
            if err:
                errs.append(err)
        return errs


@dataclass
class Recipe:
    """A whole recipe."""

    family: Literal["auto", "ppo", "grpo", "sac"] = "auto"
    """The algorithm family that runs the recipe (:mod:`rlnb.loop.families`): ``ppo`` (:class:`rlnb.Loop`: a policy
    on environments), ``grpo`` (:class:`rlnb.GRPOLoop`: an LM on prompts) or ``sac`` (:class:`rlnb.SACLoop`: an
    off-policy learner fed by collectors through a replay buffer). ``auto`` (a recipe that does not say) is
    inferred once from ``rollout.backend`` when the recipe loads, with a message, and recorded in the run's
    ``recipe.yaml``. (Recipes written before families said ``loop: embodied`` or ``loop: grpo``: read as the family.)"""
    seed: int = bounded(1, 0, MAX_SEED, "what derives from it stays within numpy's 32 bits")
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
    sac: SACConfig = field(default_factory=SACConfig)
    """Soft Actor-Critic's settings (``family: sac``)."""
    buffer: BufferConfig = field(default_factory=BufferConfig)
    """The replay buffer (``family: sac``)."""

    def check(self) -> list[str]:
        """Every section's checks (each beside its dataclass), and the loop against its rollout; every problem."""
        errs = bounds_errors(self, "")  # every numeric setting within its bounds (each beside its field)
        if isinstance(self.name, str) and not RUN_NAME.fullmatch(self.name):
            errs.append(
                f"name: expected a name for the run's directory (letters, digits, '.', '_', '-'; at most 100, not "
                f"starting with '.'), got {self.name[:80]!r}"
            )
        lm_backend = self.rollout.backend in LM_BACKENDS
        if self.family == "grpo" and not lm_backend:
            errs.append(
                f"rollout.backend: family: grpo samples an LM (rollout.backend {' or '.join(LM_BACKENDS)}), got "
                f"{self.rollout.backend!r}"
            )
        elif self.family == "ppo" and lm_backend:
            errs.append(
                f"rollout.backend: family: ppo runs a policy on environments (rollout.backend policy), got "
                f"{self.rollout.backend!r}; an LM trains with family: grpo"
            )
        for name, families in FAMILY_SECTIONS.items():
            changed = changed_keys(getattr(self, name), f"{name}.") if self.family not in families else []
            if changed:
                which = " or ".join(families)
                errs.append(
                    f"{changed[0]}: the {name} section is read by family {which} only; this recipe runs "
                    f"family {self.family}, which would ignore it (remove it, or set family: {families[0]})"
                )
        for section in (self.runner, self.data, self.algorithm, self.actor, self.rollout, self.env, self.reward,
                        self.cluster, self.sac, self.buffer):  # fmt: skip
            errs += section.check(self)
        return list(dict.fromkeys(errs))  # (a nested section's own errors() says its bounds again)
