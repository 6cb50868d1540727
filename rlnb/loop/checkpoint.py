"""Checkpoints: atomic saves (a temporary directory renamed once complete), exact resume, recovery after a lost
worker. Every rank writes its own component state; the loop's own state is ``loop.json``."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

from rlnb.config.loader import to_yaml
from rlnb.errors import RemoteError, RlnbError, WorkerLostError
from rlnb.files import write_private

log = logging.getLogger("rlnb")


class CheckpointError(RlnbError, OSError):
    """A checkpoint could not be written or read; the previous complete checkpoint is untouched."""


class TrainingDivergedError(RlnbError, FloatingPointError):
    """The loss became NaN/inf; nothing was saved after it, the last good checkpoint is ``last_checkpoint``."""

    def __init__(self, message: str, step: int = -1, last_checkpoint: str | None = None):
        super().__init__(message)
        self.step, self.last_checkpoint = step, last_checkpoint


def default_run_dir(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first by step number (partial ``.tmp-*`` directories are
    ignored; ``step_1000000`` comes after ``step_999999``)."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    found = [p for p in root.glob("step_*") if (p / "COMPLETE").exists() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


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
        flight; a manual save while rollout runs ahead waits for it, and the batch it finished is not in
        the checkpoint: a resume from it drops that batch (a warning says so).
        """
        if self._in_flight is not None:  # asynchronous mode, a manual save mid-pipeline
            self._settle_in_flight()
            log.warning(
                "checkpoint at step %d: rollout work was running ahead (algorithm.max_staleness); the batch it "
                "finished is not in the checkpoint, so a resume from it drops that batch (run() checkpoints "
                "with nothing in flight)",
                self.step,
            )
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
            pending = [g.save_state(str(tmp)) for g in self.groups.values()]
            for res in pending:
                res.result()
            state = {
                "step": self.step,
                "placement": {k: list(v) for k, v in self.placement.slots.items()},
                **self._extra_state(),
            }
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
            state = json.loads((path / "loop.json").read_text())
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
