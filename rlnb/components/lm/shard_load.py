"""A sharded LM actor loaded rank by rank (``actor.strategy: fsdp2`` over several ranks): the model is built with
no storage (the meta device) and sharded, then each rank reads only its own shard of every tensor from the
checkpoint's safetensors files. No rank ever holds the whole model, as it would loading it whole and sharding it
after (the meta-device start of TorchTitan and veRL).

The buffers a checkpoint does not hold (a rotary embedding's frequencies) are computed by the model's own
initialisation, as ``transformers`` computes them when it loads from the meta device itself.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from rlnb.runtime.collective import is_sharded


def checkpoint_files(ref: str) -> list[Path] | None:
    """The safetensors files of a local ``save_pretrained`` directory (one file, or the shards its index names);
    ``None`` for anything else (a hub id, ``.bin`` weights), which loads whole."""
    local = Path(ref)
    index = local / "model.safetensors.index.json"
    if index.is_file():
        return [local / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = local / "model.safetensors"
    return [single] if single.is_file() else None


def _tensors_and_names(model: torch.nn.Module) -> list[tuple[torch.Tensor, list[str]]]:
    """Each tensor of ``model``'s state with all its names (tied weights: one tensor, two names)."""
    named: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        named.setdefault(id(tensor), (tensor, []))[1].append(name)
    return list(named.values())


def _headers(files: list[Path]) -> dict[Path, tuple[dict, int]]:
    """Each file's :func:`_header`, read once."""
    return {f: _header(f) for f in files}


def _where(headers: dict[Path, tuple[dict, int]]) -> dict[str, Path]:
    """The file holding each tensor name."""
    return {name: f for f, (index, _) in headers.items() for name in index if name != "__metadata__"}


def weight_count(files: list[Path]) -> int:
    """How many numbers the tensors of safetensors ``files`` hold (a checkpoint's size in weights), from their
    headers alone."""
    return sum(
        math.prod(entry["shape"])
        for index, _ in _headers(files).values()
        for name, entry in index.items()
        if name != "__metadata__"
    )


def unmatched(model: torch.nn.Module, files: list[Path]) -> str | None:
    """Why ``model``'s state cannot be read from ``files`` by name (a tensor none of whose names they hold), or
    ``None``: it can. Reads the files' headers only."""
    where = _where(_headers(files))
    for _, names in _tensors_and_names(model):
        if not any(n in where for n in names):
            return f"the checkpoint holds no {names[0]!r}"
    return None


def load_shards(model: torch.nn.Module, files: list[Path], device: torch.device) -> int:
    """Give ``model`` (built by :func:`empty_lm`, then ``fully_shard``-ed) storage on ``device`` and fill it:
    this rank's shard of each parameter and persistent buffer read from ``files`` (a tensor not sharded, whole),
    the buffers no checkpoint holds computed by the model's own initialisation. Returns the bytes read."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    model.to_empty(device=device)
    _init_unsaved_buffers(model)
    headers = _headers(files)
    where, by_file = _where(headers), {}
    for tensor, names in _tensors_and_names(model):
        key = next(n for n in names if n in where)
        by_file.setdefault(where[key], []).append((key, tensor))
    read = 0
    with torch.no_grad():
        for f, items in by_file.items():
            index, data_start = headers[f]
            with open(f, "rb") as handle:
                for key, tensor in items:
                    local = tensor.to_local() if is_sharded(tensor) else tensor
                    if local.numel() == 0:  # (more ranks than rows: this rank holds none)
                        continue
                    shape, offset = (
                        compute_local_shape_and_global_offset(
                            tensor.shape, tensor.device_mesh, tensor.placements
                        )
                        if is_sharded(tensor)
                        else (tuple(tensor.shape), (0,) * tensor.dim())
                    )
                    if tuple(shape[1:]) != tuple(tensor.shape[1:]) or any(offset[1:]):  # (not whole rows)
                        raise ValueError(f"{key}: sharded along another dimension than the first ({shape})")
                    read += _read_rows(handle, index[key], data_start, offset[0] if shape else 0, local)
    return read


# safetensors' dtype names
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}  # fmt: skip


MAX_HEADER_BYTES = 100_000_000


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's index (name -> ``{"dtype", "shape", "data_offsets"}``) and where its data starts."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > MAX_HEADER_BYTES:  # (safetensors' own limit: a corrupt or hostile size allocates nothing)
            raise ValueError(f"{path}: a safetensors header of {size} bytes (at most {MAX_HEADER_BYTES})")
        return json.loads(f.read(size)), 8 + size


def _read_rows(handle, entry: dict, data_start: int, first_row: int, local: torch.Tensor) -> int:
    """Read rows ``first_row ...`` of a stored tensor (``entry``), as many as ``local`` has, into ``local``: one
    contiguous range of the file (FSDP2 shards along the first dimension), read straight into ``local`` where it
    is a contiguous CPU tensor of the stored dtype (else through one buffer of the shard's size). Not a memory
    map, so the rank's memory holds its shard alone. Returns the bytes read."""
    stored = _DTYPES[entry["dtype"]]
    row_bytes = stored.itemsize
    for d in entry["shape"][1:]:
        row_bytes *= d
    into = local
    if local.device.type != "cpu" or local.dtype != stored or not local.is_contiguous():
        into = torch.empty(local.shape, dtype=stored)
    view = memoryview(into.view(-1).view(torch.uint8).numpy()) if into.numel() else memoryview(b"")
    start = data_start + entry["data_offsets"][0] + first_row * row_bytes
    done = 0
    while done < len(view):
        got = os.preadv(handle.fileno(), [view[done:]], start + done)
        if got <= 0:
            raise EOFError(f"{handle.name}: the checkpoint ends inside a tensor")
        done += got
    if into is not local:
        local.copy_(into)
    return len(view)


def _init_unsaved_buffers(model: torch.nn.Module) -> None:
    """The buffers no checkpoint holds (non-persistent: a rotary embedding's frequencies), computed by the model's
    own ``_init_weights``; one it leaves unset is an error naming it, not a silently wrong model."""
    init = getattr(model, "_init_weights", None)
    for prefix, module in model.named_modules():
        unsaved = [
            n
            for n, b in module.named_buffers(recurse=False)
            if n in module._non_persistent_buffers_set and b.is_floating_point()
        ]
        if not unsaved:
            continue
        for n in unsaved:
            getattr(module, n).fill_(float("nan"))
        if init is not None:
            with torch.no_grad():
                init(module)
        left = [f"{prefix}.{n}" for n in unsaved if getattr(module, n).isnan().any()]
        if left:
            raise RuntimeError(
                f"loading the sharded model rank by rank: {left} are in no checkpoint and the model's "
                "_init_weights does not compute them; use actor.strategy=ddp for this model"
            )
