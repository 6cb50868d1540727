"""A sharded actor's checkpoint through PyTorch Distributed Checkpoint (DCP), read without running code.

Every actor rank writes its own shards of the model and of the AdamW state into one directory beside the rank
files (``<component>_dcp/``: ``__<rank>_0.distcp`` files and a ``.metadata`` index), together, with no gather:
what torchtitan and veRL write, and what ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` turns into
one whole file. The state is keyed by parameter name (``get_state_dict``), not by each rank's shard layout.

DCP's own reader unpickles the index with ``pickle.load`` and the optimizer's plain values with
``torch.load(weights_only=False)``: a checkpoint received from someone else would run code. rlnb reads both
with restricted unpicklers instead (:class:`SafeReader`, :class:`SafeLoadPlanner`): the index may name only DCP's
metadata classes and torch's sizes, dtypes and layouts; the values only what :func:`rlnb.files.torch_load_safe`
allows.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from rlnb.files import UnsafeFileError, check_inside, safe_globals


def shard_dir(rank_path: str | Path) -> Path:
    """``<dir>/<component>_dcp`` for the rank file ``<dir>/<component>_rank<r>.pt``: one directory for every
    rank's shards."""
    path = Path(rank_path)
    return path.parent / f"{path.name.rsplit('_rank', 1)[0]}_dcp"


def _metadata_classes() -> dict[tuple[str, str], object]:
    from torch.distributed.checkpoint import filesystem, metadata

    allowed = [
        metadata.Metadata, metadata.TensorStorageMetadata, metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata, metadata.TensorProperties, metadata.MetadataIndex,
        metadata.StorageMeta, metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo, torch.Size, torch.device,
        pathlib.PosixPath,  # (the id the checkpoint was written under)
    ]  # fmt: skip
    classes = {(c.__module__, c.__qualname__): c for c in allowed}
    # dtypes, layouts and memory formats are pickled as torch's module attributes (``torch.float32``)
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            classes[("torch", name)] = value
    classes[("torch.serialization", "_get_layout")] = (
        torch.serialization._get_layout
    )  # (a layout by its name)
    classes[("collections", "OrderedDict")] = collections.OrderedDict
    classes[("builtins", "set")], classes[("builtins", "frozenset")] = set, frozenset
    return classes


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``, refusing any global but :func:`_metadata_classes`' before it is used."""

    allowed = None

    def find_class(self, module: str, name: str):
        allowed = type(self).allowed = type(self).allowed or _metadata_classes()
        found = allowed.get((module, name))
        if found is None:
            raise UnsafeFileError(
                f"the checkpoint's DCP index names {module}.{name}: rlnb reads only DCP's metadata classes "
                "from it, because unpickling anything else could run code"
            )
        return found


class SafeReader(FileSystemReader):
    """DCP's file-system reader, reading the index with a restricted unpickler."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        for info in (metadata.storage_data or {}).values():  # the shard files the index points at
            _check_shard_name(getattr(info, "relative_path", None), Path(str(self.path)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_shard_name(name, directory: Path) -> None:
    """A shard file named by a DCP index: a plain file name in the checkpoint's own directory (DCP writes
    ``__<rank>_<n>.distcp``), a regular file there; a path elsewhere (``../../x``, ``/etc/x``) is refused before
    anything is read.

    Raises:
        UnsafeFileError: naming the entry.
    """
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise UnsafeFileError(
            f"the checkpoint's DCP index points a shard at {name!r}: rlnb reads shards only from files in "
            f"{directory} itself"
        )
    try:
        check_inside(directory / name, directory)
    except OSError as e:
        raise UnsafeFileError(f"the checkpoint's DCP index: {e.strerror}") from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, reading non-tensor values (the optimizer's hyperparameters) with
    ``weights_only=True`` and numpy allowed, as :func:`rlnb.files.torch_load_safe` does."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        with torch.serialization.safe_globals(safe_globals()):
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                raise UnsafeFileError(
                    f"the checkpoint's DCP value {read_item.dest_index.fqn!r} names code to run "
                    f"({str(e).splitlines()[0][:200]}): rlnb loads only tensors and plain data"
                ) from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # (as DCP's own planner sets it)

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def save_sharded(model: torch.nn.Module, optimizer, directory: Path, process_group) -> None:
    """Every rank's shards of ``model`` and ``optimizer`` into ``directory``, written by all ranks of
    ``process_group`` together."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_state, "optim": optim_state},
        storage_writer=FileSystemWriter(str(directory)),
        process_group=process_group,
    )
    for (
        path
    ) in directory.iterdir():  # (DCP writes with the process's umask: a checkpoint's files are its user's)
        if path.is_file() and not path.is_symlink():
            path.chmod(0o600)


def load_sharded(model: torch.nn.Module, optimizer, directory: Path, process_group) -> None:
    """``model`` and ``optimizer`` restored from ``directory`` (:func:`save_sharded`), by all ranks of
    ``process_group`` together, each reading its own shards; nothing in the files runs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (directory / ".metadata").is_file():
        raise FileNotFoundError(f"{directory}: no DCP checkpoint there (no .metadata)")
    from torch.distributed.checkpoint.api import CheckpointException

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    try:
        dcp.load(
            state,
            storage_reader=SafeReader(str(directory)),
            planner=SafeLoadPlanner(),
            process_group=process_group,
        )
    except CheckpointException as e:  # (a BaseException: as an error the loop's resume_fallback can catch)
        raise DCPReadError(f"{directory}: {_first_failure(e)}") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


class DCPReadError(OSError):
    """A DCP checkpoint could not be read (torch's ``CheckpointException``, a ``BaseException``, made an error
    that a resume can report and fall back from)."""


def _first_failure(error) -> str:
    """The first rank's failure that DCP's ``CheckpointException`` gathered, as one line."""
    failures = getattr(error, "failures", None) or {}
    for rank, failure in sorted(failures.items()):
        inner = failure[0] if isinstance(failure, tuple) else failure  # (DCP keeps (exception, stack) pairs)
        return (
            f"rank {rank}: {type(inner).__name__}: {str(inner).splitlines()[0][:300] if str(inner) else ''}"
        )
    return str(error).splitlines()[0][:300]
