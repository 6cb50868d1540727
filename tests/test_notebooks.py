"""The notebooks, executed as a user runs them (a Jupyter kernel, top to bottom), and their learning checked.

Notebooks end in prose and plots, not asserts: after the last cell, each test asks the same kernel for the
variables that show the notebook worked (``CHECKS``) and checks them here, so a notebook that stops
learning fails CI. The executed copies, outputs included, go to ``build/notebooks/`` for the docs site
(``python -m rlnb.docs`` renders them).
"""

import json
import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXECUTED = ROOT / "build" / "notebooks"

# per notebook: an expression evaluated in its kernel after the last cell -> a JSON-able dict
CHECKS = {
    "01_quickstart": '{"return": loop.episode_stats()["episode_return_mean"], "exported": episode_return}',
    "02_grpo_arithmetic": '{"first": float(acc["eval/accuracy"].iloc[0]), "last": float(acc["eval/accuracy"].iloc[-1]), '
    '"logged_steps": sorted(set(logged["step"].tolist())), '
    '"turns": float(retry.history[-1]["rollout/turns_mean"]), "tool_first": tool_first, "tool_last": tool_last, '
    '"models_left": __import__("os").path.exists(model_dir)}',
    "04_custom_algorithm": '{"return": final_return}',
    "06_build_your_own": '{"return": final_return, "eval": evaluation["eval/return_mean"]}',
}


def _execute(path: Path) -> tuple[dict, object]:
    runs = path.parent / "runs"  # where the notebooks' loops write their run directories (cwd-relative)
    before = set(runs.iterdir()) if runs.exists() else set()
    try:
        return _execute_in_kernel(path)
    finally:  # the runs this test made leave the checkout (a user's own stay)
        for made in (set(runs.iterdir()) if runs.exists() else set()) - before:
            shutil.rmtree(made, ignore_errors=True)


def _execute_in_kernel(path: Path) -> tuple[dict, object]:
    import os
    import tempfile

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    found = {}
    # the kernel's temporary files in a directory removed after it: a kernel that started child processes is
    # shut down by SIGTERM (ipykernel waits on multiprocessing's resource tracker, which ignores it, past
    # jupyter_client's deadline), so its exit handlers never remove multiprocessing's temporary directory
    with (
        tempfile.TemporaryDirectory() as kernel_tmp,
        client.setup_kernel(env={**os.environ, "TMPDIR": kernel_tmp}),
    ):
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
        expression = CHECKS.get(path.stem)
        if expression:
            probe = nbformat.v4.new_code_cell(f"import json as _json; print(_json.dumps({expression}))")
            nb.cells.append(probe)  # the client records outputs by index into nb.cells
            client.execute_cell(probe, len(nb.cells) - 1)
            nb.cells.pop()
            text = "".join(o.get("text", "") for o in probe.outputs if o.get("output_type") == "stream")
            found = json.loads(text.strip().splitlines()[-1])
    EXECUTED.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, EXECUTED / path.name)
    return found, nb


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_does_what_it_says(path):
    import tempfile

    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("pymp-*"))
    found, nb = _execute(path)
    assert set(tmp.glob("pymp-*")) <= before  # the kernel's multiprocessing files went with its own directory
    assert not any(
        o.get("output_type") == "error" for c in nb.cells if c.cell_type == "code" for o in c.outputs
    )
    if path.stem == "01_quickstart":
        assert found["return"] >= 475, found  # solved, as its last section says
        assert found["exported"] >= 300, found  # the exported policy, loaded in the kernel, plays as trained
    elif path.stem == "02_grpo_arithmetic":
        assert found["last"] >= found["first"] + 0.05, found  # GRPO lifted held-out accuracy
        assert found["logged_steps"] == [30, 60, 90, 120], found  # runner.completions_interval=30
        assert 1 < found["turns"] <= 2, found  # some first answers wrong, answered again (max_turns=2)
        assert found["tool_first"] <= 0.2 and found["tool_last"] >= 0.8, found  # GRPO found the right call
        assert not found["models_left"], found  # the models it built went with its temporary directory
    elif path.stem == "04_custom_algorithm":
        assert found["return"] >= 300, found
    elif path.stem == "06_build_your_own":
        assert found["return"] >= 0.9 and found["eval"] >= 0.9, found


def test_every_notebook_is_checked_or_said_why_not():
    unchecked = {p.stem for p in NOTEBOOKS} - set(CHECKS)
    assert unchecked == {"03_placement", "05_remote_cluster"}, unchecked  # they show placements, not learning


def test_notebook_pages_open_with_binder_and_colab_badges_when_the_repository_is_on_github(
    tmp_path, monkeypatch
):
    from rlnb.docs import github_repository, write_notebook_pages

    monkeypatch.delenv("RLNB_REPO_URL", raising=False)
    assert github_repository("https://github.com/rlnb-dev/rlnb") == ("rlnb-dev", "rlnb")
    assert github_repository("https://gitlab.com/rlnb-dev/rlnb.git") is None  # Colab opens GitHub only
    pages = write_notebook_pages(tmp_path / "on", repository="https://github.com/rlnb-dev/rlnb.git")
    assert len(pages) == len(list(Path("notebooks").glob("*.ipynb"))) >= 5
    for page in pages:
        first = page.read_text().splitlines()[0]
        name = page.stem + ".ipynb"
        assert f"(https://mybinder.org/v2/gh/rlnb-dev/rlnb/main?labpath=notebooks%2F{name})" in first, first
        assert f"(https://colab.research.google.com/github/rlnb-dev/rlnb/blob/main/notebooks/{name})" in first
    monkeypatch.setenv("RLNB_REPO_URL", "")  # no GitHub repository known: no badges pointing nowhere
    for page in write_notebook_pages(tmp_path / "off"):
        assert "mybinder" not in page.read_text() and "colab" not in page.read_text()


def test_notebook_links_to_the_algorithm_reference_land_on_its_entries(tmp_path):
    """The phase cells link the function they run in the docs' algorithm reference: from the notebook (in
    notebooks/) and from its docs page (in docs/notebooks/), each link names an entry the reference has."""
    import re

    from rlnb.docs import algorithm_reference, write_notebook_pages

    entries = set(re.findall(r"^### `(\w+)`", algorithm_reference(), flags=re.M))
    linked = set()
    for path in Path("notebooks").glob("*.ipynb"):
        text = "".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")
        linked |= set(re.findall(r"\]\(\.\./docs/reference/algorithms\.md#(\w+)\)", text))
    assert {"gae", "ppo_clip_value_entropy", "grpo", "ppo"} <= linked <= entries, (linked, entries)
    pages = "".join(p.read_text() for p in write_notebook_pages(tmp_path))
    assert set(re.findall(r"\]\(\.\./reference/algorithms\.md#(\w+)\)", pages)) == linked
    assert "](../docs/" not in pages
