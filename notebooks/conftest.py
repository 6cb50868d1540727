"""How the test command runs these notebooks: ``pytest --nbmake`` (nbmake), top to bottom in a Jupyter kernel.

Each notebook ends in a cell tagged ``check`` whose asserts say what the notebook shows (a policy that
learned, placements where asked); the docs leave those cells out. ``make notebooks`` runs copies in
``build/notebooks/`` with ``--overwrite``, so the executed copies, outputs included, feed the docs site.

Around each notebook: the kernel gets a temporary directory of its own, removed after it (a kernel that
started child processes is shut down by SIGTERM, so multiprocessing's exit handlers never remove their
``pymp-*`` directories), and the run directories the notebook's loops wrote under ``runs/`` go too.
"""

from __future__ import annotations

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
    runs_before = set(runs.iterdir()) if runs.exists() else set()
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
        for made in (set(runs.iterdir()) if runs.exists() else set()) - runs_before:
            shutil.rmtree(made, ignore_errors=True)  # the runs this test made (a user's own stay)
    left = set(shared_tmp.glob("pymp-*")) - pymp_before
    assert not left, f"the notebook's kernel left {sorted(map(str, left))} in {shared_tmp}"
    return result
