"""Collectives on a rank's process group, for code running inside component ranks.

They accept either torch's default group (``process_group("default")``) or a standalone group
made by :func:`rlnb.runtime.init_collective` (e.g. actor + rollout ranks for weight sync).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _is_default(pg) -> bool:
    return isinstance(pg, dist.ProcessGroup)


def all_reduce_(tensor: torch.Tensor, pg, average: bool = False) -> torch.Tensor:
    """Sum (or average) ``tensor`` in place across the group."""
    if _is_default(pg):
        dist.all_reduce(tensor, group=pg)
        size = dist.get_world_size(pg)
    else:
        pg.allreduce([tensor]).wait()
        size = pg.size()
    if average:
        tensor.div_(size)
    return tensor


def average_grads_(grads: list[torch.Tensor], world_size: int) -> None:
    """``grads`` averaged over the default process group's ``world_size`` ranks, in place, in one all-reduce of them
    flattened (gradients no DDP reducer holds: a LoRA base's in a full warm start, a value model's)."""
    if world_size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads]).div_(world_size)
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def broadcast_(tensor: torch.Tensor, src: int, pg) -> torch.Tensor:
    """Broadcast ``tensor`` in place from rank ``src`` of the group."""
    if _is_default(pg):
        dist.broadcast(tensor, src=src, group=pg)
    else:
        pg.broadcast(tensor, src).wait()
    return tensor


def broadcast_state_dict(
    state_dict: dict[str, torch.Tensor], src: int, pg, device: str | None = None
) -> dict:
    """Broadcast a state dict's tensors from ``src`` into every rank's ``state_dict`` (in place).

    Every rank passes a state dict with the same keys, shapes and dtypes (the receivers' own model
    state). Tensors are packed into one flat buffer per dtype, so a model costs a few collectives,
    not one per parameter.
    """
    by_dtype: dict[torch.dtype, list[str]] = {}
    for k in sorted(state_dict):
        by_dtype.setdefault(state_dict[k].dtype, []).append(k)
    for keys in by_dtype.values():
        tensors = [state_dict[k] for k in keys]
        flat = torch.cat([t.detach().reshape(-1).to(device or t.device) for t in tensors])  # (sum numel,)
        broadcast_(flat, src, pg)
        offset = 0
        for t in tensors:
            n = t.numel()
            with torch.no_grad():
                t.copy_(flat[offset : offset + n].view_as(t))
            offset += n
    return state_dict


def is_sharded(tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a shard of a tensor spread over ranks, as FSDP2 holds parameters)."""
    return hasattr(tensor, "full_tensor")


def local_part(tensor):
    """This rank's shard of a DTensor (the tensor itself otherwise): what the rank holds in memory."""
    return tensor.to_local() if is_sharded(tensor) else tensor
