"""How the test command runs these notebooks: ``pytest --nbmake`` (nbmake), top to bottom in a Jupyter kernel.

Each notebook ends in a cell tagged ``check`` whose asserts say what the notebook shows (a policy that
learned, placements where asked); the docs leave those cells out. ``make notebooks`` runs copies in
``build/notebooks/`` with ``--overwrite``, so the executed copies, outputs included, feed the docs site.

Around each notebook: the kernel gets a temporary directory of its own, removed after it (a kernel that
started child processes is shut down by SIGTERM, so multiprocessing's exit handlers never remove their
``pymp-*`` directories), and the run directories the notebook's loops wrote under ``runs/`` go too.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

NOTEBOOK_TIMEOUT_S = 1200  # a whole notebook (02 trains three GRPO runs); nbmake's cell timeout is apart


def pytest_collection_modifyitems(items):
    for item in items:
        if getattr(item, "nbmake", False):
            item.add_marker(pytest.mark.timeout(NOTEBOOK_TIMEOUT_S))
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if not getattr(item, "nbmake", False):
        return (yield)
    runs = Path(item.path).parent / "runs"  # the notebooks' loops write run directories here (cwd-relative)
    running = _Running(Path(item.path).parent)
    running.enter(runs)
    shared_tmp = Path(tempfile.gettempdir())
    pymp_before = set(shared_tmp.glob("pymp-*"))
    old = os.environ.get("TMPDIR")
    kernel_tmp = tempfile.mkdtemp(prefix="rlnb-kernel-")
    os.environ["TMPDIR"] = kernel_tmp  # the kernel inherits this process's environment
    try:
        result = yield
    finally:
        if old is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old
        shutil.rmtree(kernel_tmp, ignore_errors=True)
        running.leave(runs)
    left = set(shared_tmp.glob("pymp-*")) - pymp_before
    assert not left, f"the notebook's kernel left {sorted(map(str, left))} in {shared_tmp}"
    return result


class _Running:
    """The notebooks running side by side in one directory (pytest-xdist) share its ``runs/``: what they made there
    (run directories, models) is removed once the last of them ends, never while another still uses it (a
    notebook's cleanup removed another's run directory mid-run). The entries there before the first began stay
    (a user's own)."""

    def __init__(self, directory: Path):
        self.state = directory / ".notebooks-running.json"
        self.lock = directory / ".notebooks-running.lock"

    @contextlib.contextmanager
    def _locked(self):
        with open(self.lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _read(self) -> dict:
        state = json.loads(self.state.read_text()) if self.state.exists() else {"running": [], "before": []}
        # (a test process killed mid-notebook left its entry: it runs no notebook any more)
        state["running"] = [pid for pid in state["running"] if _alive(pid)]
        return state

    def _write(self, state: dict) -> None:
        self.state.write_text(json.dumps(state))

    def enter(self, runs: Path, pid: int | None = None) -> None:
        """The test process ``pid`` (this one) begins a notebook."""
        with self._locked():
            state = self._read()
            if not state["running"]:
                state["before"] = sorted(str(p) for p in runs.iterdir()) if runs.exists() else []
            state["running"].append(pid or os.getpid())
            self._write(state)

    def leave(self, runs: Path, pid: int | None = None) -> None:
        """The test process ``pid`` (this one) ended its notebook: the last to end removes what they made."""
        pid = pid or os.getpid()
        with self._locked():
            state = self._read()
            state["running"] = [p for p in state["running"] if p != pid]
            if state["running"]:
                self._write(state)
                return
            self.state.unlink(missing_ok=True)
            before = set(state["before"])
            for made in runs.iterdir() if runs.exists() else ():
                if str(made) not in before:
                    shutil.rmtree(made, ignore_errors=True)  # what the notebooks made (a user's own stay)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
