"""LoRA for the LM actor (``actor.lora.rank > 0``), through PEFT: low-rank adapters on the chosen linear layers are
all that trains (and all that carries AdamW state); the base model is frozen. The KL reference is the same model with
its adapters off, never a second copy. The rollout and an export get the merged weights, ``W + B A * alpha / r``,
under the base model's own names (computed afresh each time: the base weights are never changed in place)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

from rlnb.errors import ConfigError


def add_adapters(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """``model`` with LoRA adapters (``cfg``: :class:`rlnb.config.LoRAConfig`), only they trainable."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # pragma: no cover - peft is a dependency of the lora extra and of dev
        raise ConfigError(
            f"actor.lora.rank: LoRA needs the peft package (pip install 'rlnb[lora]'): {e}", "actor.lora.rank"
        ) from None
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in cfg.target_modules if m not in present]
    if missing:
        raise ConfigError(
            f"actor.lora.target_modules: {missing} are not modules of this model; its linear layers include "
            f"{sorted(n for n in present if n.endswith('proj'))}",
            "actor.lora.target_modules",
        )
    config = LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules),
        bias="none",
    )  # fmt: skip
    with warnings.catch_warnings():
        # PEFT reads transformers' is_gradient_checkpointing, deprecated from 5.24: a FutureWarning on every LoRA
        # run that no setting of rlnb's or the user's can avoid
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter merged in (``W + delta``), under the base model's names."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            deltas[f"{name}.weight"] = module.get_delta_weight(module.active_adapters[0])
    out = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        out[key] = value + deltas[key].to(value.dtype) if key in deltas else value
    return out


def adapter_state(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """Each adapted layer's ``(A [r, in], B [out, r], scaling)``, detached copies, under its base weight's name
    (``model.layers.0.self_attn.q_proj.weight``): what an adapters-only weight sync sends."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, module in model.get_base_model().named_modules():
        if isinstance(module, LoraLayer):
            adapter = module.active_adapters[0]
            out[f"{name}.weight"] = (
                module.lora_A[adapter].weight.detach().clone(),
                module.lora_B[adapter].weight.detach().clone(),
                float(module.scaling[adapter]),
            )
    return out


def adapted_base(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base weights of the adapted layers (without their adapters), under the base model's names: what a
    rollout keeps to merge adapters sent alone (:func:`merge_adapters`)."""
    names = set(adapter_state(model))
    state = model.get_base_model().state_dict()
    return {k.replace(".base_layer.", "."): v.detach().clone() for k, v in state.items()
            if k.replace(".base_layer.", ".") in names}  # fmt: skip


def merge_adapters(base: dict[str, torch.Tensor], adapters: dict) -> dict[str, torch.Tensor]:
    """``W + B A * scaling`` for each adapted layer, from its base ``W`` and the adapters sent
    (:func:`adapter_state`): the merged weights :func:`merged_state` gives, computed as PEFT computes a delta."""
    out = {}
    for name, (a, b, scaling) in adapters.items():
        w = base[name]
        out[name] = w + ((b.to(torch.float32) @ a.to(torch.float32)) * scaling).to(w.dtype)
    return out


def write_peft_adapter(adapters: dict, directory: str | os.PathLike) -> Path:
    """Adapters sent alone (:func:`adapter_state`) as a PEFT adapter directory (``adapter_config.json`` and
    ``adapter_model.safetensors``), what vLLM's ``LoRARequest`` and PEFT's ``from_pretrained`` read. Their scale
    is written as ``lora_alpha = scaling * r`` (plain LoRA's ``alpha / r``), so rsLoRA's scaling round-trips too.

    Raises:
        ValueError: adapters of different ranks or scales (one file holds one of each).
    """
    from safetensors.torch import save_file

    shapes = {(a.shape[0], scaling) for a, _, scaling in adapters.values()}
    if len(shapes) != 1:
        raise ValueError(
            f"adapters of several ranks or scales {sorted(shapes)}: a PEFT file holds one of each"
        )
    ((rank, scaling),) = shapes
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (a, b, _) in adapters.items():
        layer = f"base_model.model.{name.removesuffix('.weight')}"
        tensors[f"{layer}.lora_A.weight"] = a.detach().cpu().contiguous()
        tensors[f"{layer}.lora_B.weight"] = b.detach().cpu().contiguous()
    targets = sorted({name.removesuffix(".weight").rsplit(".", 1)[-1] for name in adapters})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank), "lora_alpha": float(scaling * rank),
              "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
              "fan_in_fan_out": False, "base_model_name_or_path": None}  # fmt: skip
    save_file(tensors, directory / "adapter_model.safetensors", metadata={"format": "pt"})
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return directory


def message_bytes(obj) -> int:
    """The bytes of the tensors in a weight-sync message (dicts, lists and tuples of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(message_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(message_bytes(v) for v in obj)
    return 0


class AdaptersOff(torch.nn.Module):
    """The KL reference of a LoRA actor: its model with the adapters disabled (PEFT's ``disable_adapter``), called
    like a model. Holds no weights of its own: nothing to checkpoint, nothing to load."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.__dict__["lm"] = model  # (not a submodule: its parameters are the actor's, not this one's)

    @property
    def config(self):
        return self.lm.config

    def forward(self, **kwargs):
        with self.lm.disable_adapter():
            return self.lm(**kwargs)

    def state_dict(self, *args, **kwargs) -> dict:
        return {}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return None
