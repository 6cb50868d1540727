"""What a run's slots will hold, before launch: ``rlnb plan RECIPE`` and ``loop.plan()``.

For each slot of the recipe's placement, the bytes of the LM actor's weights, gradients and AdamW state (the
part ``memory/actor_state_bytes`` reports once it trains), its KL reference model, the activations one
micro-batch keeps for the backward, the rollout's copy of the weights and its KV cache, under the chosen
strategy (DDP, FSDP2, HSDP), precision, LoRA and activation checkpointing. Nothing is loaded or computed: the
model is built from its config on PyTorch's meta device (shapes, no storage), LoRA and checkpointing applied as
the actor applies them, FSDP2's shards counted as its ``DTensor`` chunks, and one forward of a micro-batch of the
longest sequences runs on the meta device under a hook that records each tensor autograd keeps for the backward:
the model's own code tells what it keeps. A plan whose slot exceeds the slot's memory (a worker's memory limit,
or ``--slot-memory``) is refused naming ``cluster.component_placement``, with the settings that would fit.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path

from rlnb.components.lm.vllm import _head_dim
from rlnb.errors import ConfigError

PARTS = {
    "weights": "the actor's parameters as this rank holds them (its shard under FSDP2; float32 master weights, "
    "a LoRA base in the compute precision)",
    "gradients": "the trainable parameters' gradients (this rank's shard)",
    "optimizer": "AdamW's two moments and step counts for the trainable parameters (this rank's shard)",
    "reference": "the KL reference model (algorithm.kl_coef > 0 without LoRA; in the compute precision)",
    "critic": "PPO's value model (algorithm.advantage=token_gae): a float32 copy of the transformer and a value "
    "head, its gradients and AdamW state (this rank's shard under FSDP2)",
    "activations": "what one micro-batch's forward keeps for its backward (the longest sequences)",
    "rollout_weights": "the rollout's copy of the model, in its precision",
    "kv_cache": "the rollout's KV cache for the sequences it decodes at once (vLLM: the cache it reserves)",
}
"""The parts of a slot's plan, and what each counts."""
STATE = ("weights", "gradients", "optimizer")
"""The parts ``memory/actor_state_bytes`` measures."""


@dataclass
class SlotPlan:
    """One slot: the components placed on it and the bytes of each part (:data:`PARTS`) they will hold."""

    slot: int
    components: tuple[str, ...]
    parts: dict[str, int]
    capacity_bytes: int = 0
    """The slot's memory (a worker's memory limit, or what was given); 0: not known."""

    @property
    def total_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return not self.capacity_bytes or self.total_bytes <= self.capacity_bytes


@dataclass
class Plan:
    """The memory a recipe's run will take, slot by slot (:func:`plan_recipe`)."""

    recipe: str
    setup: str
    """The actor's strategy and levers, in words (``fsdp2 over 2 ranks, bf16, LoRA r=8``)."""
    parameters: int
    trainable: int
    slots: list[SlotPlan]
    notes: list[str] = field(default_factory=list)

    @property
    def actor_state_bytes(self) -> int:
        """Weights, gradients and optimizer state of the first actor rank: what its ``memory/actor_state_bytes``
        will say."""
        first = next(s for s in self.slots if "actor" in s.components)
        return sum(first.parts.get(k, 0) for k in STATE)

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.slots)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "actor_state_bytes": self.actor_state_bytes, "fits": self.fits}

    def __str__(self) -> str:
        cols = list(PARTS)
        head = ["slot", "components", *cols, "total", "memory"]
        rows = [
            [str(s.slot), ",".join(s.components), *(_size(s.parts.get(c, 0)) for c in cols), _size(s.total_bytes),
             (_size(s.capacity_bytes) if s.capacity_bytes else "?") + ("" if s.fits else "  DOES NOT FIT")]
            for s in self.slots
        ]  # fmt: skip
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        lines = [
            f"{self.recipe}: {self.setup}; {self.parameters:,} parameters, {self.trainable:,} trained",
            "  ".join(h.ljust(w) for h, w in zip(head, widths)),
            *("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows),
        ]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    def _repr_html_(self) -> str:
        import html

        cols = list(PARTS)
        th = "".join(f"<th title='{html.escape(PARTS[c])}'>{c}</th>" for c in cols)
        body = "".join(
            f"<tr><td>{s.slot}</td><td>{','.join(s.components)}</td>"
            + "".join(f"<td>{_size(s.parts.get(c, 0))}</td>" for c in cols)
            + f"<td><b>{_size(s.total_bytes)}</b></td>"
            + f"<td style='color:{'inherit' if s.fits else 'crimson'}'>"
            + (_size(s.capacity_bytes) if s.capacity_bytes else "?")
            + "</td></tr>"
            for s in self.slots
        )
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in self.notes)
        return (
            f"<b>{html.escape(self.recipe)}</b>: {html.escape(self.setup)}; {self.parameters:,} parameters, "
            f"{self.trainable:,} trained<table><tr><th>slot</th><th>components</th>{th}<th>total</th>"
            f"<th>memory</th></tr>{body}</table><ul>{notes}</ul>"
        )

    def check(self, alternatives: dict[str, Plan] | None = None) -> None:
        """Refuse a plan that does not fit, naming the slot, and the settings (``alternatives``: override ->
        its plan) that would.

        Raises:
            ConfigError: (key ``cluster.component_placement``) a slot needs more than its memory.
        """
        over = [s for s in self.slots if not s.fits]
        if not over:
            return
        s = over[0]
        fits = [f"{k} ({_size(max(x.total_bytes for x in p.slots))} a slot)" for k, p in (alternatives or {}).items()
                if p.fits]  # fmt: skip
        raise ConfigError(
            f"cluster.component_placement: slot {s.slot} ({','.join(s.components)}) would hold "
            f"{_size(s.total_bytes)}, more than its {_size(s.capacity_bytes)} of memory ({self.setup}). "
            + (f"These would fit: {'; '.join(fits[:3])}" if fits else "None of FSDP2, bf16, activation "
               "checkpointing and LoRA fits it, alone or together: more slots, or slots with more memory"),
            "cluster.component_placement",
        )  # fmt: skip


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def parse_bytes(text: str, key: str = "--slot-memory") -> int:
    """``80GB``, ``24GiB``, ``512M``, ``1e9``: bytes (decimal units for ``GB``, binary for ``GiB`` and ``G``).

    Raises:
        ConfigError: (``key``) not a size.
    """
    t = str(text).strip().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "b": 1}  # fmt: skip
    for unit in sorted(units, key=len, reverse=True):
        if t.lower().endswith(unit):
            number, scale = t[: -len(unit)], units[unit]
            break
    else:
        number, scale = t, 1
    try:
        value = float(number) * scale
    except ValueError:
        value = -1
    if not 2**20 <= value <= 2**50:
        raise ConfigError(
            f"{key}: expected a size from 1 MiB to 1 PiB, like 80GB or 24GiB; got {text!r}", key
        )
    return int(value)


def plan_recipe(recipe, slots=None, slot_memory_bytes: int | None = None) -> Plan:
    """The plan of ``recipe`` (a :class:`rlnb.config.Recipe` of the ``grpo`` family) on ``slots`` (a cluster's
    :class:`rlnb.cluster.Slot` list; ``None``: the embedded cluster the recipe would start). Each slot's memory:
    ``slot_memory_bytes`` if given, else the worker's memory limit (the embedded cluster's: the machine's memory
    over its workers, as Dask's ``auto``).

    Raises:
        ConfigError: another family (key ``family``), or a placement the slots cannot hold (its key).
    """
    from rlnb.cluster.placement import resolve_placement

    if recipe.family != "grpo":
        raise ConfigError(
            f"family: a plan sizes the grpo family's language-model slots; this recipe is {recipe.family!r}, whose "
            "policies hold a few megabytes (memory/* metrics show them as it runs)",
            "family",
        )
    if slots is not None:
        count = len(slots)
        capacity = {s.rank: s.memory_limit_bytes for s in slots}
    else:
        from rlnb.cluster.cluster import default_cpu_slots

        count = recipe.cluster.slots or default_cpu_slots()
        capacity = {i: _embedded_worker_memory(count) for i in range(count)}
    if slot_memory_bytes:
        capacity = dict.fromkeys(capacity, slot_memory_bytes)
    placement = resolve_placement(
        recipe.cluster.component_placement, count, required=("actor", "rollout"),
        known=("actor", "rollout", "reward"),
    )  # fmt: skip
    actor_slots, rollout_slots = placement.slots["actor"], placement.slots["rollout"]
    lm = _LMShapes(recipe)
    actor = lm.actor_rank(len(actor_slots))
    rollout = lm.rollout_rank(len(rollout_slots))
    out = []
    for slot in sorted({s for ss in placement.slots.values() for s in ss}):
        on = tuple(c for c in ("actor", "rollout", "reward") if slot in placement.slots.get(c, ()))
        parts = dict.fromkeys(PARTS, 0)
        if slot in actor_slots:
            parts.update(actor)
        if slot in rollout_slots:
            parts.update(rollout)
        out.append(SlotPlan(slot, on, parts, capacity.get(slot, 0)))
    if slots is None and recipe.cluster.address:
        lm.notes.append(
            f"the cluster at {recipe.cluster.address} was not asked: {count} slots of "
            + ("--slot-memory" if slot_memory_bytes else "this machine's memory over them")
            + " assumed (loop.plan() reads its workers' memory limits)"
        )
    return Plan(recipe.name, lm.setup(len(actor_slots)), lm.parameters, lm.trainable, out, lm.notes)


def alternatives(recipe, slots=None, slot_memory_bytes: int | None = None) -> dict[str, Plan]:
    """The plans of the levers a user would reach for first (FSDP2 over the actor's ranks, bf16, activation
    checkpointing, LoRA of rank 8), each alone, then together one after another; keyed by their overrides."""
    from rlnb.config import LoRAConfig

    a = recipe.actor
    levers = {}
    if a.strategy != "fsdp2":
        levers["actor.strategy=fsdp2"] = {"strategy": "fsdp2"}
    if a.dtype != "bfloat16":
        levers["actor.dtype=bfloat16"] = {"dtype": "bfloat16"}
    if not a.gradient_checkpointing:
        levers["actor.gradient_checkpointing=true"] = {"gradient_checkpointing": True}
    if a.lora.rank == 0:
        levers["actor.lora.rank=8"] = {"lora": dataclasses.replace(LoRAConfig(), rank=8)}
    tries = dict(levers)
    names = list(levers)
    for n in range(2, len(names) + 1):  # (together, in the order above)
        tries[" ".join(names[:n])] = {k: v for name in names[:n] for k, v in levers[name].items()}
    out = {}
    for key, change in tries.items():
        changed = dataclasses.replace(recipe, actor=dataclasses.replace(a, **change))
        try:
            out[key] = plan_recipe(changed, slots, slot_memory_bytes)
        except ConfigError:  # (a lever this model cannot take)
            continue
    return out


def _embedded_worker_memory(count: int) -> int:
    from distributed.system import MEMORY_LIMIT

    return int(MEMORY_LIMIT // max(1, count))


class _LMShapes:
    """The recipe's model on the meta device, and the byte counts of its actor and rollout ranks."""

    def __init__(self, recipe):
        import torch

        from rlnb.components.strategy import Strategy
        from rlnb.models.lm import DTYPES, hf_quiet

        self.recipe, self.notes = recipe, []
        a = recipe.actor
        self.config, self.tok = self._config()
        self.compute = a.dtype
        self.master = a.dtype if a.lora.rank > 0 else "float32"  # (as Strategy.master_dtype)
        from transformers import AutoModelForCausalLM

        def build(cfg):
            with torch.device("meta"), hf_quiet():
                model = AutoModelForCausalLM.from_config(self.config, dtype=DTYPES[self.master])
            # (LoRA's adapters, checkpointing: as the actor applies them)
            return Strategy(cfg, torch.device("meta"), 0, 1).adapt(model)

        self.model = build(a)
        # the backward of a checkpointed model recomputes one layer at a time, keeping that layer's activations
        self.plain = (
            build(dataclasses.replace(a, gradient_checkpointing=False)) if a.gradient_checkpointing else None
        )
        params = list(self.model.parameters())
        self.parameters = sum(p.numel() for p in params)
        self.trainable = sum(p.numel() for p in params if p.requires_grad)
        self.params = params

    def _config(self):
        from rlnb.models.lm import TOOL_CHARS, load_tokenizer, tiny_lm_config

        a = self.recipe.actor
        path = a.model_path
        if path and (Path(path) / "config.json").is_file():
            from transformers import AutoConfig

            return AutoConfig.from_pretrained(path), load_tokenizer(path)
        if not a.build_if_missing:
            raise ConfigError(f"actor.model_path: no model at {path} to plan for", "actor.model_path")
        t = a.tiny_lm
        self.notes.append(f"the tiny LM actor.tiny_lm describes (not built yet at {path})")
        extra = TOOL_CHARS if self.recipe.rollout.tools else ""
        return tiny_lm_config(t.hidden_size, t.num_layers, t.num_heads, t.arch, t.max_positions, extra)

    def setup(self, ranks: int) -> str:
        a = self.recipe.actor
        words = [f"{self._strategy(ranks)} over {ranks} rank{'s' if ranks > 1 else ''}", a.dtype]
        if a.lora.rank:
            words.append(f"LoRA r={a.lora.rank}")
        if a.gradient_checkpointing:
            words.append("activation checkpointing")
        return ", ".join(words)

    def _strategy(self, ranks: int) -> str:
        a = self.recipe.actor
        if a.strategy != "fsdp2":
            return "ddp"
        return "fsdp2" if a.hsdp_replicas == 1 else f"hsdp ({a.hsdp_replicas} replicas)"

    def actor_rank(self, ranks: int) -> dict[str, int]:
        """The first actor rank's parts (FSDP2's first rank holds the largest chunks)."""
        a, algo = self.recipe.actor, self.recipe.algorithm
        shard = ranks // a.hsdp_replicas if a.strategy == "fsdp2" else 1

        def held(p) -> int:  # the first rank's chunk of dim 0 (torch.chunk's, as DTensor's Shard(0))
            if shard == 1 or p.dim() == 0:
                return p.numel()
            rows = -(-p.shape[0] // shard)
            return min(rows, p.shape[0]) * (p.numel() // max(1, p.shape[0]))

        trained = [p for p in self.params if p.requires_grad]
        out = {
            "weights": sum(held(p) * p.element_size() for p in self.params),
            "gradients": sum(held(p) * p.element_size() for p in trained),
            # exp_avg and exp_avg_sq as the parameter, and a float32 step count a tensor
            "optimizer": sum(2 * held(p) * p.element_size() + 4 for p in trained),
        }
        if algo.kl_coef > 0 and a.lora.rank == 0:
            item = 2 if a.dtype == "bfloat16" else 4
            out["reference"] = sum(held(p) * item for p in self.params)
        # the critic: the decoder without its LM head (a tied one is the embedding), float32, trained whole
        if self.critic:
            body = [p for n, p in self.model.named_parameters()
                    if ".lora_" not in n and not n.endswith("lm_head.weight")]  # fmt: skip
            params = sum(held(p) for p in body) + self.config.hidden_size + 1  # (and the value head)
            # weights, gradients, AdamW's two moments, and its step count a tensor (FSDP2: this rank's shards)
            out["critic"] = 4 * 4 * params + 4 * (len(body) + 2)
        out["activations"] = self._activations(ranks)
        return out

    @property
    def critic(self) -> bool:
        """Whether the actor holds a value model (an advantage that reads values)."""
        from rlnb.algorithms.advantages import ADVANTAGES

        return "values" in ADVANTAGES.entry(self.recipe.algorithm.advantage).needs  # (as LMActor decides)

    @functools.cached_property
    def _longest(self) -> tuple[int, int]:
        """The longest prompt in tokens, and the longest sequence a row trains on (read once: it tokenises every
        prompt)."""
        from rlnb.loop.families.grpo.data import recipe_task
        from rlnb.models.lm import prompt_ids

        r = self.recipe
        try:
            task, _ = recipe_task(r, r.actor.model_path)
            prompts = [p.prompt for p in task.train + task.held_out]
            longest = max(len(prompt_ids(self.tok, p)) for p in prompts) if prompts else 1
        except (ConfigError, OSError) as e:  # (a data file not there yet: the context's length instead)
            self.notes.append(f"prompt lengths unknown ({e}); the model's whole context assumed")
            return self.config.max_position_embeddings, self.config.max_position_embeddings
        ro = r.rollout
        # each later turn: the transcript so far, the model's reply, the interaction's (about as long)
        seq = longest + ro.max_new_tokens * (2 * ro.max_turns - 1)
        return longest, min(seq, self.config.max_position_embeddings)

    def _activations(self, ranks: int) -> int:
        import torch

        r = self.recipe
        rows_per_rank = max(1, r.data.prompts_per_step * r.algorithm.group_size // ranks)
        rows = min(r.actor.micro_batch_size, max(1, rows_per_rank // r.algorithm.num_minibatches))
        _, seq = self._longest
        half = torch.bfloat16 if r.actor.dtype == "bfloat16" else None
        kept = _saved_bytes(self.model, rows, seq, half)
        if self.plain is not None:
            kept += _saved_bytes(self.plain, rows, seq, half) // self.config.num_hidden_layers
        return kept

    def rollout_rank(self, ranks: int) -> dict[str, int]:
        r = self.recipe
        ro = r.rollout
        dtype = r.actor.dtype if ro.dtype == "auto" else ro.dtype
        item = 2 if dtype == "bfloat16" else 4
        weights = sum(p.numel() for n, p in self.model.named_parameters() if ".lora_" not in n) * item
        c = self.config
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = _head_dim(c)
        if ro.backend == "vllm":
            from rlnb.components.lm.vllm import cpu_kv_cache_bytes

            kv = ro.vllm.kv_cache_bytes or cpu_kv_cache_bytes(c, ro.vllm)
            self.notes.append(
                "vLLM's KV cache: the bytes it reserves (rollout.vllm.kv_cache_bytes or its sizing)"
            )
        else:
            rows = max(1, r.data.prompts_per_step * r.algorithm.group_size // ranks)
            _, seq = self._longest
            kv = rows * seq * 2 * c.num_hidden_layers * heads * head_dim * item
        return {"rollout_weights": weights, "kv_cache": int(kv)}


def _saved_bytes(model, rows: int, seq: int, autocast_dtype=None) -> int:
    """The bytes autograd keeps for the backward of ``model``'s forward over ``rows`` sequences of ``seq`` tokens
    and the log-softmax of its logits, on the meta device (no storage, no compute); a view counts as its base.
    ``autocast_dtype``: bf16 compute, approximated by running the meta model in that precision."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        base = t._base if t._base is not None else t
        seen[id(base)] = base.numel() * base.element_size()
        return t

    if autocast_dtype is not None:
        import copy

        model = copy.deepcopy(model).to(autocast_dtype)  # (the plan's own model stays as the actor holds it)
    from torch._subclasses.fake_tensor import FakeTensorMode

    was = model.training
    model.train()  # (checkpointing applies in training mode only)
    # fake tensors over the meta model: transformers skips its data-dependent checks for them, as under tracing
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.enable_grad():
            ids = torch.zeros(rows, seq, dtype=torch.long, device="meta")
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                logits = model(input_ids=ids, use_cache=False).logits
                torch.log_softmax(logits.float(), -1)
    finally:
        model.train(was)
    return int(sum(seen.values()))


__all__ = ["PARTS", "Plan", "SlotPlan", "alternatives", "parse_bytes", "plan_recipe"]
