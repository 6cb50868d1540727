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
import logging
from pathlib import Path

import torch

from rlnb.errors import ConfigError

STRATEGIES = ("ddp", "fsdp2")
log = logging.getLogger("rlnb")


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


def weight_buckets(pairs, bucket_bytes: int):
    """``(name, tensor)`` ``pairs``, taken one at a time, in order, in dicts of at most ``bucket_bytes`` (a bigger
    tensor goes alone)."""
    bucket, size = {}, 0
    for name, tensor in pairs:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name], size = tensor, size + nbytes
    if bucket:
        yield bucket


class Sharded:
    """A mixin of :class:`rlnb.components.LMActor` (it holds ``cfg``, ``policy``, ``device``, ``dtype``)."""

    sharded = False  # FSDP2 in force (after setup_data_parallel)
    lora = False  # adapters on the model (actor.lora.rank > 0)
    shard_files = None  # the checkpoint's files, where each rank reads only its shards of the model from them
    loaded_bytes: int | None = None  # what this rank read of them

    def _check_offload(self) -> None:
        """``actor.offload`` where it can work: FSDP2's CPU offload of GPU memory."""
        cfg = self.cfg
        if cfg.offload != "none" and (self.device.type != "cuda" or cfg.strategy != "fsdp2"):
            raise ConfigError(
                f"actor.offload={cfg.offload} is FSDP2's CPU offload of GPU memory: it needs actor.strategy=fsdp2 "
                f"(it is {cfg.strategy}) and a GPU (this actor is on {self.device}); set actor.offload=none",
                "actor.offload",
            )

    def _rank_by_rank(self, model_path: str) -> list | None:
        """The checkpoint files each rank reads its shards from (``actor.strategy: fsdp2`` over several ranks,
        no LoRA, a local safetensors checkpoint whose names are the model's), else ``None``: loaded whole."""
        if self.cfg.strategy != "fsdp2" or self.world_size < 2 or self.cfg.lora.rank > 0:
            return None
        from rlnb.components.lm.shard_load import checkpoint_files, empty_lm, unmatched
        from rlnb.models.lm import resolve_model

        ref = resolve_model(model_path)
        files = checkpoint_files(ref)
        why = "not a local safetensors checkpoint" if files is None else unmatched(empty_lm(ref), files)
        if why is not None:
            log.info("actor[%d]: the model loads whole, then is sharded: %s", self.rank, why)
            return None
        return files

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
        extra = {}
        if self.cfg.offload == "params":  # shards, gradients and AdamW state in pinned host memory
            from torch.distributed.fsdp import CPUOffloadPolicy

            extra["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        # actor.compile: each decoder layer, FSDP2's hooks outside its graph
        if self.step_compiler is not None:
            self.step_compiler.compile_layers(decoder_layers(self.policy))
        for layer in decoder_layers(self.policy):
            fully_shard(layer, mesh=mesh, mp_policy=mp, **extra)
        fully_shard(self.policy, mesh=mesh, mp_policy=mp, **extra)
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

    def _check_loaded(self) -> None:
        """A model built to be read rank by rank has no weights until :meth:`setup_data_parallel` shards it: say
        so, rather than compute on the meta device."""
        if self.shard_files is not None and not self.sharded:
            raise RuntimeError(
                f"actor[{self.rank}]: with actor.strategy=fsdp2 over {self.world_size} ranks each rank reads its "
                "shards of the model in setup_data_parallel(), which comes after init_process_group() (a loop calls "
                "both when it is built)"
            )

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
        from rlnb.files import nonfinite, torch_load_safe

        state = torch_load_safe(path)
        bad = nonfinite(state.get("policy"), "policy")
        if bad is not None:  # a diverged or damaged checkpoint: refused, not trained on or exported
            raise ValueError(f"{Path(path).name}: {bad} holds NaN or inf values")
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

    def state_buckets(self, for_rollout: bool = True, tied: bool = True):
        """The whole model's weights in buckets of at most ``actor.gather_bucket_bytes``, gathered one tensor at a
        time: every actor rank iterates it together, and none holds more than a bucket of whole tensors
        (:meth:`full_state` gathers the whole model). ``for_rollout``: in the precision the rollout takes (else
        the master weights'); ``tied=False``: a tensor under several names (tied embeddings) under its first."""
        from rlnb.models.lm import DTYPES

        cast = DTYPES[self.dtype] if for_rollout else None
        state, seen = self._own_state(), set()

        def gathered():
            for name, tensor in state.items():
                if not tied and id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                whole = self._whole(tensor).detach()
                yield (
                    name,
                    whole.to(cast or whole.dtype, copy=True) if whole.is_floating_point() else whole.clone(),
                )

        self.last_sync = {"buckets": 0, "largest_bucket_bytes": 0, "bytes": 0}
        for bucket in weight_buckets(gathered(), self.cfg.gather_bucket_bytes):
            size = sum(t.numel() * t.element_size() for t in bucket.values())
            s = self.last_sync
            s["buckets"], s["bytes"] = s["buckets"] + 1, s["bytes"] + size
            s["largest_bucket_bytes"] = max(s["largest_bucket_bytes"], size)
            yield bucket

    def sync_report(self) -> dict:
        """The last weight sync of a sharded actor (:meth:`state_buckets`): how many buckets, the largest one's
        bytes (what a rank held of whole tensors at once) and the bytes sent in all."""
        return dict(getattr(self, "last_sync", {}))

    def publish_weights(self, channel, keys: list[str], version: int) -> int:
        """Disaggregated weight sync. Sharded, bucket by bucket (:meth:`state_buckets`), every actor rank
        gathering and rank 0 (the one given ``keys``) putting each: ``{"state": bucket, "version", "more": True}``,
        then ``{"state": {}, "more": False}`` (the rollout loads each as it comes,
        :meth:`rlnb.components.rollout.RolloutBase.load_weights_in_parts`)."""
        if not self.sharded:
            return super().publish_weights(channel, keys, version)

        def put(_, bucket: dict) -> None:
            for k in keys:
                channel.put({"state": bucket, "version": version, "more": True}, key=k)

        self._for_each_bucket(self.state_buckets(), put if keys else None)
        for k in keys:
            channel.put({"state": {}, "version": version, "more": False}, key=k)
        return version

    def _write_buckets(self, directory) -> None:
        """A sharded model's weights as a Hugging Face checkpoint's safetensors files, one a bucket of
        :meth:`state_buckets` (the master weights' precision), and their index, into ``directory`` (rank 0; the
        other ranks give ``None`` and only gather; a failure to write is raised after the last bucket)."""
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

        self._for_each_bucket(
            self.state_buckets(for_rollout=False, tied=False), write if directory is not None else None
        )
        if directory is not None:
            index = {"metadata": {"total_size": self.last_sync["bytes"]}, "weight_map": weight_map}
            (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    @staticmethod
    def _for_each_bucket(buckets, act) -> None:
        """``act(i, bucket)`` for each of ``buckets`` (every actor rank iterates them together; ``act`` is ``None``
        on the ranks that only gather). After a failure the rest are still gathered, not acted on, and the failure
        is raised after the last: no other rank is left waiting in a gather."""
        failed = None
        for i, bucket in enumerate(buckets):
            if act is None or failed is not None:
                continue
            try:
                act(i, bucket)
            except Exception as e:
                failed = e
        if failed is not None:
            raise failed

    def _whole(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` whole: gathered from every rank's shard if it is sharded (every actor rank calls it with the
        same tensor), on the actor's device (offloaded shards are gathered there, as NCCL gathers GPU memory)."""
        if not is_sharded(tensor):
            return tensor
        if tensor.device != self.device:
            tensor = tensor.to(self.device)
        return tensor.full_tensor()

    def _own_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict under the base model's names (LoRA: the adapters merged in), sharded or not."""
        if self.lora:
            from rlnb.components.lm.lora import merged_state

            return merged_state(self.policy)
        return self.policy.state_dict()

    def full_state(self) -> dict[str, torch.Tensor]:
        """The model's whole state dict: gathered from every rank's shards when sharded (every actor rank must
        call it together), else the module's own."""
        self._check_loaded()
        state = self._own_state()
        if not self.sharded:
            return state
        return {k: self._whole(v) for k, v in state.items()}
