"""Checkpoints: atomic saves (a temporary directory renamed once complete) and exact resume. Every rank writes its
own component state; the loop's own state is ``loop.json``, checked against a schema before anything is restored."""

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


class Checkpoints:
    """A run's checkpoints: written atomically (a temporary directory renamed once complete), read back exactly.
    Every rank writes its own component state; the family's and the schedule's state go into ``loop.json``, the
    schedule's work in flight (asynchronous mode) into ``in_flight.pt``."""

    def __init__(self, session, family, schedule):
        self.session, self.family, self.schedule = session, family, schedule

    @property
    def directory(self) -> Path:
        return self.session.run_dir / "checkpoints"

    def state_schema(self) -> dict:
        """The keys of ``loop.json`` beyond the common ones: the family's and the schedule's."""
        extra = {**(self.family.STATE or {}), **self.schedule.STATE}
        # (a checkpoint from before in_flight.pt was written said whether it had dropped the batch in flight)
        return {**extra, "in_flight_dropped?": bool}

    def save(self) -> Path:
        """Write a complete checkpoint atomically: into a temporary directory, then renamed (see
        :meth:`rlnb.Loop.save`)."""
        s = self.session
        if s.read_only:
            raise CheckpointError(
                f"{s.run_dir} was opened read-only (Loop.resume(read_only=True)): nothing is saved"
            )
        final = self.directory / f"step_{s.step:06d}"
        tmp = self.directory / f".tmp-step_{s.step:06d}-{uuid.uuid4().hex[:6]}"
        for stale in self.directory.glob(".tmp-step_*"):  # left by a save that was killed
            shutil.rmtree(stale, ignore_errors=True)
        try:
            tmp.mkdir(parents=True, mode=0o700)
            # (first: the work in flight finishes, and the ranks' states are saved after it)
            in_flight = self.schedule.in_flight_state()
            pending = [g.save_state(str(tmp)) for g in s.groups.values()]
            for res in pending:
                res.result()
            state = {
                "step": s.step,
                "placement": {k: list(v) for k, v in s.placement.slots.items()},
                **self.family.state(),
                **self.schedule.state(),
            }
            if in_flight is not None:
                state["in_flight"] = True
                save_state_file(self, in_flight, str(tmp / IN_FLIGHT))
            _write_synced(tmp / "loop.json", json.dumps(state))
            self.family.save_extra(tmp)
            _write_synced(tmp / "COMPLETE", "ok\n")
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.directory)  # the rename itself survives a power cut
        except WorkerLostError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise  # a lost worker, not a disk problem: run() may recover from it
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"could not write checkpoint {final}: {type(e).__name__}: {e}") from e
        for old in complete_checkpoints(s.run_dir)[: -s.recipe.runner.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load(self, which: str | Path = "auto", fallback: bool = False) -> Path | None:
        """Restore every component and the loop's state from ``which`` (a checkpoint directory, or ``"auto"``: the
        latest complete one; with ``fallback``, the newest earlier one that can be read). Returns the checkpoint
        restored, or ``None`` where there was none (see :meth:`rlnb.Loop.load_checkpoint`).

        Raises:
            CheckpointError: it cannot be read (naming the earlier complete checkpoints).
        """
        s = self.session
        if str(which) != "auto":
            path = Path(which)
            if not (path / "COMPLETE").exists():
                raise CheckpointError(f"{path} is not a complete checkpoint (no COMPLETE marker)")
            return self._load_from(path)
        found = complete_checkpoints(s.run_dir)
        if not found:
            log.warning("nothing to resume in %s (no complete checkpoint): starting at step 1", s.run_dir)
            s.logger.truncate_after(0)  # (what an earlier run logged there would be logged again)
            return None
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

    def _load_from(self, path: Path) -> Path:
        s = self.session
        try:
            check_tree(path, path)  # nothing read through a link out of the checkpoint, nor from a FIFO
        except OSError as e:
            raise CheckpointError(f"could not restore {path}: {e.strerror or e}") from None
        state = read_loop_state(path, self.state_schema())
        try:
            for g in s.groups.values():
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
        s.step = state["step"]
        try:
            self.family.load_state(state)
            self.schedule.load_state(state)
        except ConfigError as e:
            raise CheckpointError(f"could not restore {path}: {e}") from e
        if state.get("in_flight"):
            try:
                saved = torch_load_safe(path / IN_FLIGHT)
                values = (
                    {k: v for k, v in saved.items() if k != "batches"} if isinstance(saved, dict) else saved
                )
                check_state(values, {"values": ListOf(ListOf(ANY))}, IN_FLIGHT)
                self.schedule.restore_in_flight(saved)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"could not restore {path}: {e}") from e
        s.logger.truncate_after(s.step)
        return path
