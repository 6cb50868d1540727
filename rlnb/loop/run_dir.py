"""A run directory has one writer: it is made private to its user, locked while a loop writes into it, and a
run already in it is never silently mixed with a new one.

- Checked before anything starts: a path that is a file, or a directory that cannot be created or written, is
  a :class:`rlnb.errors.ConfigError` naming ``runner.run_dir``.
- Created ``0700`` (checkpoints and metrics inside are ``0600``): a run's weights and data are its user's. A
  directory owned by another user, or writable by others, is refused (as OpenSSH's ``StrictModes``), and so is
  a symbolic link (or a FIFO, a device) where a run's own file or directory goes: rlnb never writes through one.
- Locked with ``flock`` on ``<run_dir>/.lock`` for as long as the loop is open: a second loop writing into
  it is refused, naming the holder. The kernel drops the lock when its process dies, so none goes stale (a
  killed run leaves the file, unlocked; a closed loop removes it).
- A directory that holds a run (metrics or a checkpoint) is refused without ``runner.resume`` (continue it) or
  ``runner.overwrite`` (remove that run's files first).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import stat
import time
from pathlib import Path

from rlnb.errors import ConfigError
from rlnb.files import UnsafePathError, check_owned, open_regular

log = logging.getLogger("rlnb")

KEY = "runner.run_dir"
# what a run writes into its directory, and ``runner.overwrite`` removes (nothing else there is touched)
RUN_FILES = ("metrics.jsonl", "completions.jsonl", "recipe.yaml", "wandb_run_id", "policy.pt")
RUN_DIRS = ("checkpoints", "tensorboard", "sft_model", "model", "wandb")


class RunDirLock:
    """An exclusive ``flock`` on ``<run_dir>/.lock``, held until :meth:`release` (or the process ends)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / ".lock"
        for _ in range(10):
            fd = self._open_locked(run_dir)
            # the file may have been removed by the holder releasing it between our open and our lock: only a
            # lock on the file the path names now counts
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        else:  # pragma: no cover - ten releases in a row between an open and a lock
            raise ConfigError(f"{KEY}: could not lock {run_dir} (its lock file keeps changing)", KEY)
        self._fd: int | None = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(
                fd,
                f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%F %T')}\n".encode(),
                0,
            )
        except OSError as e:  # a disk full already: nothing starts, and no lock file is left behind
            self.release()
            raise ConfigError(f"{KEY}: cannot write into {run_dir} ({e.strerror or e})", KEY) from None

    def _open_locked(self, run_dir: Path) -> int:
        import fcntl

        try:  # (never through a link planted in its place)
            fd = open_regular(self.path, os.O_RDWR | os.O_CREAT)
        except UnsafePathError as e:
            raise ConfigError(f"{KEY}: {e.strerror}; remove it", KEY) from None
        except OSError as e:
            raise ConfigError(f"{KEY}: cannot create {self.path} ({e.strerror or e})", KEY) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            mine = holder.startswith(f"pid {os.getpid()} ")
            hint = "close that loop first (loop.close())" if mine else "wait for it to end"
            raise ConfigError(
                f"{KEY}: {run_dir} is in use by another {'loop of this process' if mine else 'run'} ({holder}); "
                f"{hint}, or choose another directory",
                KEY,
            ) from None
        except OSError as e:  # a file system without locks (some network mounts): go on, and say so
            log.warning("%s: %s cannot be locked (%s); nothing keeps a second run out of it", KEY, run_dir, e)
        return fd

    def release(self) -> None:
        """Remove the lock file and drop the lock (removed first, while held: nobody locks a file going away)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
            os.close(self._fd)  # (closing the descriptor drops the flock)
            self._fd = None


def check_writable(run_dir: Path) -> None:
    """Create ``run_dir`` (``0700``) if needed and make sure a run can write there.

    Raises:
        ConfigError: it is a file, or cannot be created or written (naming ``runner.run_dir``).
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"{KEY}: expected a directory, got {run_dir}, which is a file", KEY)
    try:
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise ConfigError(f"{KEY}: cannot create {run_dir} ({e.strerror or e})", KEY) from None
    try:
        check_owned(run_dir, KEY)
    except UnsafePathError as e:
        raise ConfigError(e.strerror, KEY) from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"{KEY}: {run_dir} is not writable by this user", KEY)
    check_entries(run_dir)


def check_entries(run_dir: Path) -> None:
    """What a run writes in ``run_dir`` (:data:`RUN_FILES`, :data:`RUN_DIRS`, the lock) is, where present, a
    regular file or a directory as it should be: never a symbolic link, a FIFO or a device.

    Raises:
        ConfigError: naming the entry and what it is.
    """
    for name, want in (
        (".lock", stat.S_ISREG),
        *((n, stat.S_ISREG) for n in RUN_FILES),
        *((n, stat.S_ISDIR) for n in RUN_DIRS),
    ):
        try:
            mode = os.lstat(run_dir / name).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode):
            raise ConfigError(
                f"{KEY}: {run_dir / name} is a symbolic link; rlnb never writes a run's files through one: remove it",
                KEY,
            )
        if not want(mode):
            expected = "a directory" if want is stat.S_ISDIR else "a regular file"
            raise ConfigError(f"{KEY}: {run_dir / name} is not {expected}: remove or rename it", KEY)


def holds_run(run_dir: Path) -> str | None:
    """What earlier run ``run_dir`` holds (``"step 12, 2 checkpoints"``), or ``None`` when it holds none."""
    from rlnb.loop.checkpoint import checkpoint_step, complete_checkpoints

    metrics = run_dir / "metrics.jsonl"
    checkpoints = complete_checkpoints(run_dir)
    if not checkpoints and not (metrics.is_file() and metrics.stat().st_size > 0):
        return None
    last = str(checkpoint_step(checkpoints[-1])) if checkpoints else None
    return (
        f"{len(checkpoints)} checkpoint(s)"
        + (f", the latest at step {last}" if last else "")
        + (", metrics" if metrics.is_file() else "")
    )


def take(run_dir: Path, resume: str | None, overwrite: bool) -> RunDirLock:
    """Check, create and lock ``run_dir`` for a loop that writes into it, before anything else starts.

    Raises:
        ConfigError: it cannot be written, another run holds it, or it holds a run and neither ``resume`` nor
            ``overwrite`` says what to do with it.
    """
    check_writable(run_dir)
    lock = RunDirLock(run_dir)
    try:
        earlier = holds_run(run_dir)
        if earlier and not resume:
            if not overwrite:
                raise ConfigError(
                    f"{KEY}: {run_dir} holds a run ({earlier}); continue it with runner.resume=auto, start over "
                    "with runner.overwrite=true (its files are removed), or choose another directory",
                    KEY,
                )
            for name in RUN_FILES:
                (run_dir / name).unlink(missing_ok=True)
            for name in RUN_DIRS:
                shutil.rmtree(run_dir / name, ignore_errors=True)
    except BaseException:
        lock.release()
        raise
    return lock
