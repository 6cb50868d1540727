"""Checkpoints: atomic saves (a temporary directory renamed once complete), exact resume, recovery after a lost
worker. Every rank writes its own component state; the loop's own state is ``loop.json``."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from rlnb.config.loader import to_yaml
from rlnb.errors import ConfigError, RemoteError, RlnbError, WorkerLostError
from rlnb.files import check_tree, read_text_regular, torch_load_safe, write_private
from rlnb.runtime.rank import save_state_file

log = logging.getLogger("rlnb")


class CheckpointError(RlnbError, OSError):
    """A checkpoint could not be written or read; the previous complete checkpoint is untouched."""


class TrainingDivergedError(RlnbError, FloatingPointError):
    """The loss became NaN/inf; nothing was saved after it, the last good checkpoint is ``last_checkpoint``."""

    def __init__(self, message: str, step: int = -1, last_checkpoint: str | None = None):
        super().__init__(message)
        self.step, self.last_checkpoint = step, last_checkpoint


def default_run_dir(name: str) -> Path:
    """``runs/<name>-<time>-<4 hex>``; a name that is not one safe path component is refused (it would place the
    run elsewhere)."""
    from rlnb.config.schema import RUN_NAME

    if not isinstance(name, str) or not RUN_NAME.fullmatch(name):
        raise ConfigError(
            f"name: expected a name for the run's directory (letters, digits, '.', '_', '-'), got {str(name)[:80]!r}",
            "name",
        )
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


CHECKPOINT_NAME = re.compile(r"step_([0-9]{1,18})")  # ASCII digits only ("step_²" is no checkpoint)
MAX_LOOP_JSON_BYTES = 64 << 20  # a loop.json bigger than this is no checkpoint rlnb wrote


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first by step number (partial ``.tmp-*`` directories, and names that
    are not ``step_`` and ASCII digits, are ignored; ``step_1000000`` comes after ``step_999999``)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if CHECKPOINT_NAME.fullmatch(p.name) and (p / "COMPLETE").exists()]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path: str | Path) -> int:
    """The step a checkpoint directory's name says (``step_000012`` -> 12)."""
    return int(CHECKPOINT_NAME.fullmatch(Path(path).name).group(1))


# ---------------------------------------------------------------------------- loop.json, checked before use
@dataclass(frozen=True)
class Num:
    """A number in ``[low, high]`` (``integer``: a whole one; ``optional``: or null)."""

    low: float
    high: float
    integer: bool = True
    optional: bool = False


@dataclass(frozen=True)
class ListOf:
    """A list (at most ``max_len`` long) of items matching ``item`` (``None``: a number, a bool or null)."""

    item: object = None
    max_len: int = 1 << 24


@dataclass(frozen=True)
class MapOf:
    """A mapping of names to values matching ``value``."""

    value: object


ANY = object()  # a schema that takes any value (loaded already without running code: plain data)
MAX_STEP = 2**62
LOOP_STATE = {
    "step": Num(0, MAX_STEP),
    "placement": MapOf(ListOf(Num(0, 1 << 20))),
    "in_flight?": bool,  # asynchronous mode: in_flight.pt holds the work that was in flight
}
IN_FLIGHT = "in_flight.pt"
"""What every ``loop.json`` holds; a loop adds its own keys (``LoopBase.STATE``)."""


def check_state(value, schema, where: str) -> None:
    """``value`` (parsed JSON) against ``schema``: a dict of required keys (a key ending in ``?`` is optional;
    keys not named are refused), :class:`Num`, :class:`ListOf`, :class:`MapOf` or ``bool``.

    Raises:
        ValueError: naming ``where``, the key, what was expected and what is there.
    """

    def bad(expected: str):
        return ValueError(f"{where}: expected {expected}, got {str(value)[:80]!r}")

    if isinstance(schema, dict):
        if not isinstance(value, dict):
            raise bad("a mapping")
        keys = {k.rstrip("?"): k for k in schema}
        for name in value:
            if name not in keys:
                raise ValueError(f"{where}.{name}: unknown key (expected {', '.join(sorted(keys))})")
        for name, key in keys.items():
            if name in value:
                check_state(value[name], schema[key], f"{where}.{name}")
            elif not key.endswith("?"):
                raise ValueError(f"{where}.{name}: missing")
    elif schema is ANY:
        return
    elif schema is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
    elif isinstance(schema, Num):
        if value is None and schema.optional:
            return
        kind = int if schema.integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value):
            raise bad("an integer" if schema.integer else "a number")
        if not schema.low <= value <= schema.high:
            raise bad(f"a number in [{schema.low:g}, {schema.high:g}]")
    elif isinstance(schema, ListOf):
        if not isinstance(value, list) or len(value) > schema.max_len:
            raise bad(f"a list of at most {schema.max_len} items")
        for i, item in enumerate(value):
            if schema.item is None:
                if not (item is None or isinstance(item, (bool, int, float))):
                    raise ValueError(f"{where}[{i}]: expected a number, got {str(item)[:80]!r}")
            else:
                check_state(item, schema.item, f"{where}[{i}]")
    elif isinstance(schema, MapOf):
        if not isinstance(value, dict):
            raise bad("a mapping")
        for k, v in value.items():
            check_state(v, schema.value, f"{where}.{k}")
    else:  # pragma: no cover - a schema of the code's own
        raise TypeError(f"check_state: unknown schema {schema!r}")


def read_loop_state(path: str | Path, extra: dict | None = None) -> dict:
    """A checkpoint's ``loop.json``, checked against :data:`LOOP_STATE` plus ``extra`` (the loop's own keys, or
    ``None``: any beyond the common ones), its step agreeing with the directory's name.

    Raises:
        CheckpointError: unreadable, not JSON, or not what rlnb writes (naming the key).
    """
    path = Path(path)
    file = path / "loop.json"
    try:
        state = json.loads(read_text_regular(file, MAX_LOOP_JSON_BYTES))
        if extra is None:
            check_state({k: v for k, v in state.items() if k in LOOP_STATE} if isinstance(state, dict) else state,
                        LOOP_STATE, "loop.json")  # fmt: skip
        else:
            check_state(state, {**LOOP_STATE, **extra}, "loop.json")
    except (OSError, ValueError) as e:  # (json's errors are ValueErrors)
        raise CheckpointError(f"could not restore {path}: {file.name}: {e}") from None
    named = CHECKPOINT_NAME.fullmatch(path.name)
    if named and int(named.group(1)) != state["step"]:
        raise CheckpointError(
            f"could not restore {path}: loop.json says step {state['step']}, its directory step {int(named.group(1))}"
        )
    return state


def _write_synced(path: Path, text: str) -> None:
    write_private(path, text, sync=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointing:
    """A mixin of :class:`rlnb.loop.base.LoopBase` (it holds ``run_dir``, ``groups``, ``placement``, ``step``)."""

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    def save(self) -> Path:
        """Write a complete checkpoint atomically: into a temporary directory, then renamed.

        Every rank writes its own component state (big state stays on workers). A failure (disk
        full...) removes the partial directory and raises :class:`CheckpointError`; the previous
        complete checkpoint stays the latest. In asynchronous mode ``run()`` checkpoints with nothing in
        flight at its save steps; a save while rollout runs ahead (a run stopped by a signal or ``stop()``, a
        notebook's own) waits for that work to finish and keeps it in the checkpoint (``in_flight.pt``: its
        batches and summaries), so a resume trains on it next, as the uninterrupted run would have.
        """
        if self.read_only:
            raise CheckpointError(
                f"{self.run_dir} was opened read-only (Loop.resume(read_only=True)): nothing is saved"
            )
        final = self.checkpoint_dir / f"step_{self.step:06d}"
        tmp = self.checkpoint_dir / f".tmp-step_{self.step:06d}-{uuid.uuid4().hex[:6]}"
        for stale in self.checkpoint_dir.glob(".tmp-step_*"):  # left by a save that was killed
            shutil.rmtree(stale, ignore_errors=True)
        try:
            tmp.mkdir(parents=True, mode=0o700)
            # (first: the work in flight finishes, and the ranks' states are saved after it)
            in_flight = self._in_flight_state() if self._in_flight is not None else None
            pending = [g.save_state(str(tmp)) for g in self.groups.values()]
            for res in pending:
                res.result()
            state = {
                "step": self.step,
                "placement": {k: list(v) for k, v in self.placement.slots.items()},
                **self._extra_state(),
            }
            if in_flight is not None:
                state["in_flight"] = True
                save_state_file(self, in_flight, str(tmp / IN_FLIGHT))
            _write_synced(tmp / "loop.json", json.dumps(state))
            self._save_extra(tmp)
            _write_synced(tmp / "COMPLETE", "ok\n")
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.checkpoint_dir)  # the rename itself survives a power cut
        except WorkerLostError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise  # a lost worker, not a disk problem: run() may recover from it
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"could not write checkpoint {final}: {type(e).__name__}: {e}") from e
        for old in complete_checkpoints(self.run_dir)[: -self.recipe.runner.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load_checkpoint(self, which: str | Path = "auto", fallback: bool = False) -> int:
        """Restore every component and the loop state.

        Args:
            which: a checkpoint directory, or ``"auto"``: the latest complete checkpoint of the run.
            fallback: with ``"auto"``, when the latest cannot be read, restore the newest earlier one that can
                (with a warning). Off by default: a run silently continuing from older weights hides the fault.

        Raises:
            CheckpointError: it cannot be read (a file that is not rlnb's, or one that names code to run: see
                :func:`rlnb.files.torch_load_safe`); the message names the earlier complete checkpoints.
        """
        if str(which) != "auto":
            path = Path(which)
            if not (path / "COMPLETE").exists():
                raise CheckpointError(f"{path} is not a complete checkpoint (no COMPLETE marker)")
            return self._load_from(path)
        found = complete_checkpoints(self.run_dir)
        if not found:
            log.warning("nothing to resume in %s (no complete checkpoint): starting at step 1", self.run_dir)
            self.logger.truncate_after(0)  # (what an earlier run logged there would be logged again)
            return self.step
        for i, path in enumerate(reversed(found)):
            try:
                return self._load_from(path)
            except CheckpointError as e:
                earlier = found[: len(found) - 1 - i]
                if not earlier:
                    raise
                if not fallback:
                    raise CheckpointError(
                        f"{e}. Earlier complete checkpoints: {', '.join(p.name for p in earlier)}; resume one by "
                        f"path (runner.resume={earlier[-1]}) or load_checkpoint(fallback=True)"
                    ) from e
                log.warning("%s; falling back to the previous complete checkpoint", e)
        raise AssertionError("unreachable")  # pragma: no cover

    def _load_from(self, path: Path) -> int:
        try:
            check_tree(path, path)  # nothing read through a link out of the checkpoint, nor from a FIFO
        except OSError as e:
            raise CheckpointError(f"could not restore {path}: {e.strerror or e}") from None
        state = read_loop_state(path, self.STATE)
        try:
            for g in self.groups.values():
                g.load_state(str(path)).result()
        except RemoteError as e:
            if isinstance(e, WorkerLostError):
                raise
            raise CheckpointError(
                f"could not restore {path}: {e.component}[rank {e.rank}] failed to load "
                f"{e.component}_rank{e.rank}.pt: {e.args[0]}"
            ) from e
        except (OSError, ValueError) as e:
            raise CheckpointError(f"could not restore {path}: {type(e).__name__}: {e}") from e
        self.step = state["step"]
        self._load_extra_state(state)
        if state.get("in_flight"):
            try:
                saved = torch_load_safe(path / IN_FLIGHT)
                check_state(
                    {k: v for k, v in saved.items() if k != "batches"} if isinstance(saved, dict) else saved,
                    {"values": ListOf(ListOf(ANY))}, IN_FLIGHT,
                )  # fmt: skip
            except (OSError, ValueError) as e:
                raise CheckpointError(f"could not restore {path}: {e}") from e
            self._restore_in_flight(saved)
        self.logger.truncate_after(self.step)
        self.resumed_from = path
        return self.step

    def recover(self, timeout_s: float = 120.0) -> int:
        """After a lost worker: rebuild every component on the cluster's (restarted) workers and
        continue from the latest complete checkpoint (or from scratch if there is none).

        Returns the step the loop continues from.
        """
        old = dict(self.groups)
        self._free_components()
        self.cluster.refresh(timeout_s)
        if self.built_from_objects:  # the same classes and arguments, on the same slots
            self.groups = {role: g.relaunch() for role, g in old.items()}
        else:
            c = self.recipe.cluster
            self.placement = self.cluster.place(
                c.component_placement, required=self.COMPONENTS, known=self.COMPONENTS
            )
            self._launch()
        self._compose()
        self.step, self._pending = 0, {}
        self._reset_state()
        if complete_checkpoints(self.run_dir):
            return self.load_checkpoint("auto", fallback=True)  # (what the lost worker may have half-written)
        self.logger.truncate_after(0)
        return 0

    def _write_recipe(self) -> None:
        """The run's ``recipe.yaml`` as the recipe is now (a resume continues with it)."""
        if not self.read_only and self.run_dir is not None and self.run_dir.exists():
            write_private(self.run_dir / "recipe.yaml", to_yaml(self.recipe))
