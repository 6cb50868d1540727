"""How an actor holds and trains its model over its ranks: one object any actor holds (``actor.strategy`` and the
settings beside it), so that the embodied, LM and vision-language actors get the same levers the same way.

- **Data parallelism**: ``ddp`` (each rank a whole copy, gradients all-reduced) or ``fsdp2`` (PyTorch FSDP2,
  ``fully_shard`` on each block of the model and on the root, over a device mesh of the actor's ranks; HSDP over
  ``actor.hsdp_replicas`` replicas). A sharded rank holds its shard of the parameters, gradients and optimizer
  state; whatever needs the whole model (the rollout's weights, an export) is gathered by every rank together, a
  bucket of whole tensors at a time (:meth:`Strategy.state_buckets`).
- **Precision** (``actor.dtype``): bf16 autocast with float32 master weights, gradients reduced in float32.
- **Activation checkpointing** (``actor.gradient_checkpointing``), **CPU offload** (``actor.offload``, FSDP2's) and
  **LoRA** (``actor.lora``, PEFT's adapters: only they train; the KL reference is the model with them off).
- **Checkpoints** of a sharded model through DCP (every rank its own shards, no gather; :mod:`.lm.dcp`).

FSDP2's collectives need every rank to run the same forwards and backwards: a sharded actor computes its
micro-batches the same way on every rank.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from rlnb.errors import ConfigError
from rlnb.runtime.collective import is_sharded, local_part

STRATEGIES = ("ddp", "fsdp2")
log = logging.getLogger("rlnb")


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks FSDP2 shards one by one: a ``transformers`` model's decoder layers (``model.model.layers``), else
    every direct child."""
    from rlnb.models.lm import base_lm
    from rlnb.models.vla import VLAPolicy

    if isinstance(model, VLAPolicy):  # (its transformer's layers, not its heads one by one)
        return model.blocks()
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


def for_each_bucket(buckets, act) -> None:
    """``act(i, bucket)`` for each of ``buckets`` (every actor rank iterates them together; ``act`` is ``None`` on the
    ranks that only gather). After a failure the rest are still gathered, not acted on, and the failure is raised
    after the last: no other rank is left waiting in a gather."""
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


class Strategy:
    """An actor's parallelism, precision and memory levers (see the module's docstring).

    Args:
        cfg: the actor's :class:`rlnb.config.ActorConfig` (``strategy``, ``hsdp_replicas``, ``offload``, ``dtype``,
            ``gradient_checkpointing``, ``lora``, ``gather_bucket_bytes``).
        device: the actor's device; rank, world_size: the actor rank and how many there are.

    Attributes:
        sharded: FSDP2 in force (after :meth:`wrap`). lora: adapters on the model (after :meth:`adapt`).
        shard_files: the checkpoint's files, where each rank reads only its shards of the model from them.
    """

    def __init__(self, cfg, device: torch.device, rank: int = 0, world_size: int = 1):
        from rlnb.models.lm import check_dtype

        self.cfg, self.device, self.rank, self.world_size = cfg, device, rank, world_size
        self.dtype = check_dtype(cfg.dtype, "actor.dtype")
        self.sharded = False
        self.lora = False
        self.shard_files: list | None = None
        self.loaded_bytes: int | None = None  # what this rank read of them
        self.last_sync: dict = {}
        if cfg.offload != "none" and (device.type != "cuda" or cfg.strategy != "fsdp2"):
            raise ConfigError(
                f"actor.offload={cfg.offload} is FSDP2's CPU offload of GPU memory: it needs actor.strategy=fsdp2 "
                f"(it is {cfg.strategy}) and a GPU (this actor is on {device}); set actor.offload=none",
                "actor.offload",
            )

    # ------------------------------------------------------------------ building the model
    def rank_by_rank(self, model_path: str) -> list | None:
        """The checkpoint files each rank reads its shards from (``fsdp2`` over several ranks, no LoRA, a local
        safetensors checkpoint whose names are the model's; kept as :attr:`shard_files`), else ``None``: the model
        loads whole."""
        if self.cfg.strategy != "fsdp2" or self.world_size < 2 or self.cfg.lora.rank > 0:
            return None
        from rlnb.components.lm.shard_load import checkpoint_files, unmatched
        from rlnb.models.lm import empty_lm, resolve_model

        ref = resolve_model(model_path)
        files = checkpoint_files(ref)
        why = "not a local safetensors checkpoint" if files is None else unmatched(empty_lm(ref), files)
        if why is not None:
            log.info("actor[%d]: the model loads whole, then is sharded: %s", self.rank, why)
            return None
        self.shard_files = files
        return files

    @property
    def master_dtype(self) -> str:
        """The precision the trained model is held in: float32 master weights; with LoRA the frozen base in the
        compute precision (half the bytes in bf16), its adapters in float32."""
        return self.dtype if self.cfg.lora.rank > 0 else "float32"

    def adapt(self, policy: torch.nn.Module) -> torch.nn.Module:
        """``policy`` with LoRA adapters (``actor.lora.rank > 0``: only they train) and activation checkpointing
        (``actor.gradient_checkpointing``: non-reentrant, the recomputed forward sees the same autocast and RNG)."""
        if self.cfg.lora.rank > 0:
            from rlnb.components.lm.lora import add_adapters

            policy, self.lora = add_adapters(policy.requires_grad_(True), self.cfg.lora), True
        if self.cfg.gradient_checkpointing:
            from rlnb.models.lm import enable_checkpointing

            enable_checkpointing(policy)
            policy.train()  # (transformers checkpoints in training mode only; the dropouts of its LMs are 0)
        return policy

    def wrap(self, policy, ref=None, compiler=None, broadcast_buffers: bool = True):
        """Data-parallel over the default process group: DDP, or FSDP2 on each block and the root (``ref``, a KL
        reference, sharded alike). Returns ``(the module the train step calls, a new optimizer or None)``: a
        sharded model trains with an optimizer over its sharded parameters."""
        if self.cfg.strategy == "fsdp2":
            return self._shard(policy, ref, compiler)
        import inspect

        from torch.nn.parallel import DistributedDataParallel

        from rlnb.runtime.rank import process_group

        ids = [self.device.index] if self.device.type == "cuda" else None
        # torch 2.13 renamed broadcast_buffers (buffers from rank 0 at each forward) forward_sync_buffers
        renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        buffers = {"forward_sync_buffers" if renamed else "broadcast_buffers": broadcast_buffers}
        model = DistributedDataParallel(
            policy, device_ids=ids, process_group=process_group("default"), **buffers
        )
        return model, None

    # the methods besides forward() that run a sharded model's parameters: FSDP2 gathers the root's for them too
    FORWARD_METHODS = {"VLAPolicy": ("act", "value")}

    def _shard(self, policy, ref, compiler):
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
        self._fsdp = {"mesh": mesh, "mp_policy": mp, **extra}  # (for shard_module: a second model alike)
        if compiler is not None:  # actor.compile: each block, FSDP2's hooks outside its graph
            compiler.compile_layers(blocks(policy))
        for block in blocks(policy):
            fully_shard(block, mesh=mesh, mp_policy=mp, **extra)
        fully_shard(policy, mesh=mesh, mp_policy=mp, **extra)
        for method in self.FORWARD_METHODS.get(type(policy).__name__, ()):  # gathered like forward()
            from torch.distributed.fsdp import register_fsdp_forward_method

            register_fsdp_forward_method(policy, method)
        if ref is not None and not self.lora:  # the KL reference sharded alike: not a whole copy a rank
            for block in blocks(ref):
                fully_shard(block, mesh=mesh, mp_policy=mp)
            fully_shard(ref, mesh=mesh, mp_policy=mp)
        if self.shard_files is not None:  # built with no storage: each rank reads its own shards now
            from rlnb.components.lm.shard_load import load_shards

            models = [policy] + ([ref] if ref is not None and not self.lora else [])
            self.loaded_bytes = sum(load_shards(m, self.shard_files, self.device) for m in models)
        self.sharded = True
        # the optimizer over the sharded parameters (its state sharded too); foreach, which DTensors take
        trained = [p for p in policy.parameters() if p.requires_grad]
        return policy, torch.optim.AdamW(trained, lr=self.cfg.lr, weight_decay=0.0)

    def shard_module(self, module: torch.nn.Module, module_blocks: list[torch.nn.Module]) -> None:
        """``module`` sharded as :meth:`wrap` sharded the policy (the same mesh, precision and offload): each of
        ``module_blocks``, then the root. For a model the actor trains beside the policy (PPO's value model)."""
        from torch.distributed.fsdp import fully_shard

        if not self.sharded:
            raise RuntimeError("shard_module: the policy is not sharded (actor.strategy: fsdp2, after wrap)")
        for block in module_blocks:
            fully_shard(block, **self._fsdp)
        fully_shard(module, **self._fsdp)

    def describe(self) -> str:
        """What :meth:`wrap` made: ``ddp``, ``fsdp2`` or ``hsdp (N replicas)``."""
        if not self.sharded:
            return "ddp"
        replicas = self.cfg.hsdp_replicas
        return "fsdp2" if replicas == 1 else f"hsdp ({replicas} replicas)"

    def check_loaded(self) -> None:
        """A model built to be read rank by rank has no weights until :meth:`wrap` shards it: say so, rather than
        compute on the meta device."""
        if self.shard_files is not None and not self.sharded:
            raise RuntimeError(
                f"actor[{self.rank}]: with actor.strategy=fsdp2 over {self.world_size} ranks each rank reads its "
                "shards of the model in setup_data_parallel(), which comes after init_process_group() (a loop calls "
                "both when it is built)"
            )

    def load_report(self) -> dict:
        """How this rank got its weights: ``rank_by_rank`` (built with no storage, then only its shards read from
        the checkpoint) or loaded whole, and the bytes it read that way."""
        return {"rank_by_rank": self.shard_files is not None, "read_bytes": self.loaded_bytes}

    # ------------------------------------------------------------------ a step
    def precision(self):
        """The context the model's forward runs in: bf16 autocast for ``dtype="bfloat16"`` (the weights stay
        float32), else nothing."""
        if self.dtype == "float32":
            return contextlib.nullcontext()
        from rlnb.models.lm import DTYPES

        return torch.autocast(self.device.type, dtype=DTYPES[self.dtype])

    def gradient_sync(self, model, sync_now: bool):
        """DDP's ``no_sync`` for a micro-batch that is not the last; FSDP2 reduces gradients or not as told."""
        if self.sharded:
            model.set_requires_gradient_sync(sync_now)
            return contextlib.nullcontext()
        return model.no_sync() if not sync_now else contextlib.nullcontext()

    def clip_and_step(self, policy, optimizer, clipper, max_grad_norm: float) -> torch.Tensor:
        """Clip to a global norm (over every rank's shards when sharded) and step; the norm before clipping.
        ``clipper``: the actor's :class:`rlnb.components.optim.ClipAndStep` (unsharded)."""
        if not self.sharded:
            return clipper(max_grad_norm)
        norm = torch.nn.utils.clip_grad_norm_(
            [p for p in policy.parameters() if p.requires_grad], max_grad_norm
        )
        optimizer.step()
        return norm.full_tensor() if is_sharded(norm) else norm

    def zero_grad(self, optimizer, clipper) -> None:
        if self.sharded:
            optimizer.zero_grad(set_to_none=True)
        else:
            clipper.zero_grad()

    # ------------------------------------------------------------------ the whole model's weights
    def whole(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` whole: gathered from every rank's shard if it is sharded (every actor rank calls it with the
        same tensor), on the actor's device (offloaded shards are gathered there, as NCCL gathers GPU memory)."""
        if not is_sharded(tensor):
            return tensor
        if tensor.device != self.device:
            tensor = tensor.to(self.device)
        return tensor.full_tensor()

    def own_state(self, policy) -> dict[str, torch.Tensor]:
        """The model's state dict under the base model's names (LoRA: the adapters merged in), sharded or not."""
        from rlnb.models.vla import VLAPolicy

        if self.lora:
            from rlnb.components.lm.lora import merged_state

            return merged_state(policy)
        if isinstance(
            policy, VLAPolicy
        ):  # (its own adapters, merged into its transformer's names, and its heads)
            return policy.plain_state()
        return policy.state_dict()

    def full_state(self, policy) -> dict[str, torch.Tensor]:
        """The model's whole state dict: gathered from every rank's shards when sharded (every actor rank must call
        it together), else the module's own."""
        self.check_loaded()
        state = self.own_state(policy)
        return state if not self.sharded else {k: self.whole(v) for k, v in state.items()}

    def state_buckets(self, policy, for_rollout: bool = True, tied: bool = True):
        """The whole model's weights in buckets of at most ``actor.gather_bucket_bytes``, gathered one tensor at a
        time: every actor rank iterates it together, and none holds more than a bucket of whole tensors.
        ``for_rollout``: in the compute precision (else the master weights'); ``tied=False``: a tensor under several
        names (tied embeddings) under its first. :attr:`last_sync` counts them."""
        from rlnb.models.lm import DTYPES

        cast = DTYPES[self.dtype] if for_rollout else None
        state, seen = self.own_state(policy), set()

        def gathered():
            for name, tensor in state.items():
                if not tied and id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                whole = self.whole(tensor).detach()
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

    def held_bytes(self, policy, optimizer) -> int:
        """The bytes of parameters, gradients and optimizer state this rank holds (its local shards)."""
        params = list(policy.parameters())
        tensors = [*params, *(p.grad for p in params if p.grad is not None)]
        tensors += [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        return sum(local_part(t).numel() * t.element_size() for t in tensors)
