"""The LM actor's sharded mode (``actor.strategy: fsdp2``): PyTorch FSDP2 (``fully_shard``) on each decoder layer and
the root, over a device mesh of the actor's ranks (gloo on CPU, NCCL on GPUs). Each rank holds its shard of the
parameters, gradients and AdamW state; a forward gathers one layer's parameters at a time. With ``actor.dtype:
bfloat16`` the gathered parameters are bf16 and gradients are reduced in float32 (FSDP2's ``MixedPrecisionPolicy``),
the master weights staying float32.

FSDP2's collectives need every rank to run the same forwards and backwards, so a sharded actor computes its
micro-batches the same way on every rank: one pass each (no length buckets, no shared-prompt forwards) and every
row (rows without advantage are not left out). Whatever needs the whole model (the rollout's weights, an export)
is gathered by every rank together: a loop calls those on every actor rank.
"""

from __future__ import annotations

import contextlib

import torch

STRATEGIES = ("ddp", "fsdp2")


def is_sharded(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "full_tensor")  # a DTensor


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise): what the rank holds in memory."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a ``transformers`` causal LM (``model.model.layers``), else every direct child."""
    from rlnb.models.lm import base_lm

    layers = getattr(getattr(base_lm(model), "model", None), "layers", None)
    return list(layers) if layers is not None else list(model.children())


class Sharded:
    """A mixin of :class:`rlnb.components.LMActor` (it holds ``cfg``, ``policy``, ``device``, ``dtype``)."""

    sharded = False  # FSDP2 in force (after setup_data_parallel)
    lora = False  # adapters on the model (actor.lora.rank > 0)
    shard_files = None  # the checkpoint's files, where each rank reads only its shards of the model from them
    loaded_bytes: int | None = None  # what this rank read of them

    def _shard(self) -> str:
        """``fully_shard`` each decoder layer, then the root, over the actor ranks' default process group (over a
        2-D mesh of ``actor.hsdp_replicas`` replicas, each sharded, where that is above 1)."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from rlnb.models.lm import DTYPES
        from rlnb.runtime.rank import process_group

        group = process_group("default")
        replicas, world = self.cfg.hsdp_replicas, group.size()
        if replicas == 1:
            mesh = DeviceMesh.from_group(group, self.device.type)
        elif world % replicas:
            from rlnb.errors import ConfigError

            raise ConfigError(
                f"actor.hsdp_replicas={replicas} must divide the {world} actor rank(s) into equal groups",
                "actor.hsdp_replicas",
            )
        else:  # HSDP: replicated over the first dimension, sharded over the second (ranks next to each other)
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(
                self.device.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
            )
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[self.dtype], reduce_dtype=torch.float32)
        for layer in decoder_layers(self.policy):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(self.policy, mesh=mesh, mp_policy=mp)
        if self.ref is not None and not self.lora:  # the KL reference sharded alike: not a whole copy a rank
            for layer in decoder_layers(self.ref):
                fully_shard(layer, mesh=mesh, mp_policy=mp)
            fully_shard(self.ref, mesh=mesh, mp_policy=mp)
        if self.shard_files is not None:  # built with no storage: each rank reads its own shards now
            from rlnb.components.lm.shard_load import load_shards

            models = [self.policy] + ([self.ref] if self.ref is not None and not self.lora else [])
            self.loaded_bytes = sum(load_shards(m, self.shard_files, self.device) for m in models)
        self.model, self.sharded = self.policy, True
        # the same work on every rank: FSDP2 gathers each layer's parameters in every forward
        self.length_buckets, self.share_prompt_forward, self.skip_zero_advantage = 1, False, False
        # the optimizer over the sharded parameters (its state sharded too); foreach, which DTensors take
        trained = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=self.cfg.lr, weight_decay=0.0)
        return "fsdp2" if replicas == 1 else f"hsdp ({replicas} replicas)"

    def load_report(self) -> dict:
        """How this rank got its weights: ``rank_by_rank`` (built with no storage, then only its shards read
        from the checkpoint, :mod:`.shard_load`) or loaded whole, and the bytes it read that way."""
        return {"rank_by_rank": self.shard_files is not None, "read_bytes": self.loaded_bytes}

    def _gradient_sync(self, sync_now: bool):
        """DDP's ``no_sync`` for a micro-batch that is not the last; FSDP2 reduces gradients or not as told."""
        if self.sharded:
            self.model.set_requires_gradient_sync(sync_now)
            return contextlib.nullcontext()
        return self.model.no_sync() if not sync_now else contextlib.nullcontext()

    def _clip_and_step(self, max_grad_norm: float) -> torch.Tensor:
        """Clip to a global norm (over every rank's shards when sharded) and step; the norm before clipping."""
        if not self.sharded:
            return self.clip_and_step(max_grad_norm)
        norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.policy.parameters() if p.requires_grad], max_grad_norm
        )
        self.optimizer.step()
        return norm.full_tensor() if is_sharded(norm) else norm

    def _zero_grad(self) -> None:
        if self.sharded:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.clip_and_step.zero_grad()

    def save_state_to(self, path: str) -> int:
        """The actor's part of a checkpoint. Sharded, the model and AdamW state go through DCP, every actor rank
        writing its own shards into one directory beside the rank files together
        (:mod:`rlnb.components.lm.dcp`), and the rank file ``path`` holds the rest (RNGs, step, reference
        model); else all of ``state_dict()`` goes into ``path``. Returns the bytes this rank wrote."""
        from rlnb.runtime.rank import process_group, save_state_file

        if not self.sharded:
            return save_state_file(self, self.state_dict(), path)
        from rlnb.components.lm.dcp import save_sharded, shard_dir

        directory = shard_dir(path)
        save_sharded(self.policy, self.optimizer, directory, process_group("default"))
        rest = self._rest_state()
        ours = sum(f.stat().st_size for f in directory.glob(f"__{self.rank}_*.distcp"))
        return save_state_file(self, {**rest, "shards": "dcp"}, path) + ours

    def load_state_from(self, path: str) -> None:
        """Restore what :meth:`save_state_to` wrote (or a rank file holding the whole state, as checkpoints of
        an unsharded actor, and sharded ones before DCP, do); nothing in the files runs."""
        from rlnb.files import torch_load_safe

        state = torch_load_safe(path)
        if state.get("shards") != "dcp":
            return self.load_state_dict(state)
        if not self.sharded:
            raise ValueError(
                "this checkpoint was written by a sharded actor (actor.strategy: fsdp2, its weights in DCP "
                "shards): resume it with actor.strategy=fsdp2"
            )
        from rlnb.components.lm.dcp import load_sharded, shard_dir
        from rlnb.runtime.rank import process_group

        load_sharded(self.policy, self.optimizer, shard_dir(path), process_group("default"))
        self._load_rest(state)
        return None

    def reset_reference(self) -> None:
        """The KL reference becomes the policy as it is now (after the warm start). Sharded, shard to shard:
        both are laid out alike, and nothing is gathered."""
        if self.sharded and not self.lora:
            self.ref.load_state_dict(self.policy.state_dict())
        else:
            self.ref.load_state_dict(self.full_state())

    def full_state(self) -> dict[str, torch.Tensor]:
        """The model's whole state dict: gathered from every rank's shards when sharded (every actor rank must
        call it together), else the module's own."""
        if self.lora:  # the adapters merged in, under the base model's names
            from rlnb.components.lm.lora import merged_state

            state = merged_state(self.policy)
        else:
            state = self.policy.state_dict()
        if not self.sharded:
            return state
        return {k: v.full_tensor() if is_sharded(v) else v for k, v in state.items()}
