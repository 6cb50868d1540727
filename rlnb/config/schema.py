"""Recipe schema: one dataclass per section, a docstring per field (read by the docs and by errors).

A recipe is YAML with these sections; every key has a default, so a recipe names only what differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


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
    skip_zero_advantage: bool = True
    """LM RL: leave sequences whose advantages are all 0 (a group whose completions all scored alike) out of
    the update's forward and backward, and out of the old log-probs' recompute, where they add exactly 0: a
    policy loss registered so (``ppo``, ``decoupled_ppo``) and no KL term in the loss. The same gradients;
    the loss's metrics are over the sequences computed. Logged as ``train/rows_computed_frac``."""
    length_buckets: int | None = None
    """LM RL: the most passes a micro-batch's sequences take, grouped by where they end, so that padding is
    not computed (the same log-probs and gradients); ``null``: 4 on CPU, 1 on a GPU."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """LM RL: the precision of the model's compute. ``bfloat16``: the actor's forward and backward run under bf16
    autocast with float32 master weights, gradients and optimizer state, log-probs and the loss in float32; the
    rollout holds its model in bf16 (half the memory and the bytes read per decoded token), the reference model
    for the KL too. Metrics ``memory/actor_state_bytes`` and, on a GPU, ``memory/cuda_peak_bytes`` show what
    it saves."""


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
    gpu_memory_utilization: float = 0.3
    """vLLM: fraction of GPU memory for weights and KV cache."""
    weight_sync: Literal["auto", "channel", "broadcast"] = "auto"
    """How the actor's weights reach rollout ranks outside its process (collocated ones copy in-process):
    ``channel``: worker to worker (CUDA IPC between GPUs of one node, shared memory between CPU
    workers); ``broadcast``: one collective from actor rank 0 to every rollout rank over a process group
    (NCCL on GPUs, gloo on CPU), synchronous mode only; ``auto``: ``broadcast`` when every rollout rank
    is on a GPU of another node than actor rank 0's, else ``channel``."""


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


@dataclass
class Recipe:
    """A whole recipe."""

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
