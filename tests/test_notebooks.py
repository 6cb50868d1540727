"""The notebooks' place in the test command, and their docs pages.

The notebooks themselves run under nbmake (``make notebooks``: ``pytest --nbmake`` on copies in
``build/notebooks/``, as ``notebooks/conftest.py`` sets up), each ending in a cell tagged ``check`` whose
asserts say what it shows; here: that every notebook has such a cell, that nbmake collects them with that
set-up, and that the docs leave the checks out.
"""

import ast
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_every_notebook_ends_in_a_cell_of_checks_the_docs_leave_out(tmp_path):
    from rlnb.docs import CHECK_TAG, write_notebook_pages

    assert len(NOTEBOOKS) >= 6
    for path in NOTEBOOKS:
        cells = nbformat.read(path, as_version=4).cells
        tagged = [c for c in cells if CHECK_TAG in c.metadata.get("tags", [])]
        assert tagged == [cells[-1]], f"{path.name}: the last cell, and only it, is tagged {CHECK_TAG!r}"
        asserts = [n for n in ast.walk(ast.parse(cells[-1].source)) if isinstance(n, ast.Assert)]
        assert asserts, f"{path.name}: its check cell asserts nothing"
    pages = {p.stem: p.read_text() for p in write_notebook_pages(tmp_path, repository="")}
    assert set(pages) == {p.stem for p in NOTEBOOKS}
    for stem, text in pages.items():
        assert "check of what this notebook shows" not in text and "assert " not in text, stem


def test_every_notebook_is_valid_nbformat_as_stored_each_cell_with_its_own_id():
    """As the file stands (nbformat.read fills missing ids in, with a warning that later versions make an error)."""
    import json

    for path in NOTEBOOKS:
        raw = json.loads(path.read_text())
        ids = [c.get("id") for c in raw["cells"]]
        assert None not in ids and len(set(ids)) == len(ids), f"{path.name}: cell ids {ids}"
        nbformat.validate(nbformat.from_dict(raw))


def test_nbmake_collects_the_notebooks_with_their_setup():
    """``pytest --nbmake notebooks/`` as a user types it: one item a notebook, each with the notebook
    timeout of ``notebooks/conftest.py`` (the suite's 300 s would cut the GRPO notebook short)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbmake", "--collect-only", "-q", "-p", "no:cacheprovider",
         "notebooks", "-o", "addopts="],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    collected = [line for line in out.stdout.splitlines() if line.endswith(".ipynb")]
    assert sorted(Path(line.split("::")[0]).name for line in collected) == [p.name for p in NOTEBOOKS], (
        out.stdout
    )
    sys.path.insert(0, str(ROOT / "notebooks"))
    try:
        import conftest as notebook_conftest  # notebooks/conftest.py
    finally:
        sys.path.pop(0)
    assert notebook_conftest.NOTEBOOK_TIMEOUT_S > 300


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
        text = page.read_text()  # (no badge; a chart's script may name colab)
        assert "mybinder.org" not in text and "colab-badge" not in text and "colab.research" not in text


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


def test_every_relative_link_of_the_notebooks_and_the_readme_resolves_in_a_clone(tmp_path):
    """Opened in Jupyter or on GitHub, a notebook's links land on files a clone has: the generated reference pages
    are committed (and must be what ``python -m rlnb.docs`` writes now), the source files exist."""
    import re

    # (written by a process of its own: tests in this one register algorithms of their own)
    subprocess.run(
        [sys.executable, "-m", "rlnb.docs", str(tmp_path)], check=True, capture_output=True, timeout=120
    )
    fresh = {p.name: p.read_text() for p in tmp_path.glob("*.md")}
    committed = {p.name: p.read_text() for p in (ROOT / "docs" / "reference").glob("*.md")}
    stale = sorted(name for name in fresh if committed.get(name) != fresh[name])
    assert not stale, (
        f"docs/reference/{stale}: out of date; run `python -m rlnb.docs docs/reference` and commit it"
    )
    tracked = subprocess.run(
        ["git", "ls-files", "docs/reference"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert sorted(tracked) == sorted(f"docs/reference/{n}" for n in fresh), tracked
    sources = [(p, "".join(c.source for c in nbformat.read(p, as_version=4).cells if c.cell_type == "markdown"))
               for p in NOTEBOOKS] + [(ROOT / "README.md", (ROOT / "README.md").read_text())]  # fmt: skip
    dead = []
    for path, text in sources:
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # (web addresses; a notebook's own headings)
            file = (path.parent / target.split("#")[0]).resolve()
            if not file.exists() or not str(file).startswith(str(ROOT)):
                dead.append(f"{path.name}: {target}")
    assert not dead, dead


def test_a_widget_output_becomes_its_snapshot_on_the_docs_page_or_a_line_saying_what_it_is(tmp_path):
    import base64

    from rlnb.docs import write_notebook_pages

    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"0" * 64).decode()
    view = {"model_id": "m", "version_major": 2, "version_minor": 0}
    nb = nbformat.v4.new_notebook()
    for data in (
        {"text/plain": "Dashboard(...)", "application/vnd.jupyter.widget-view+json": view, "image/png": png},
        {"text/plain": "Dashboard(...)", "application/vnd.jupyter.widget-view+json": view},
    ):
        cell = nbformat.v4.new_code_cell("loop.run(live=True)")
        cell.outputs = [nbformat.v4.new_output("display_data", data=data)]
        nb.cells.append(cell)
    (tmp_path / "src").mkdir()
    nbformat.write(nb, tmp_path / "src" / "99_widgets.ipynb")
    (page,) = write_notebook_pages(tmp_path / "out", source=tmp_path / "src", repository="")
    text = page.read_text()
    assert text.count("![png](99_widgets_files/") == 1, text  # the finished dashboard, as an image
    assert "*[Dashboard: a live widget, shown when the notebook runs]*" in text  # one that gave none
    assert len(list((tmp_path / "out" / "99_widgets_files").glob("*.png"))) == 1


def test_notebooks_side_by_side_keep_each_others_runs_until_the_last_ends(tmp_path):
    """CI: a notebook's cleanup removed the run directory of another notebook still running in the same
    directory. What they made goes once the last one ends; a user's own entries stay, and a test process that
    died mid-notebook does not hold the cleanup back for ever."""
    import subprocess

    sys.path.insert(0, str(ROOT / "notebooks"))
    try:
        import conftest as notebook_conftest  # notebooks/conftest.py
    finally:
        sys.path.pop(0)
    runs = tmp_path / "runs"
    (runs / "users-own").mkdir(parents=True)
    other = subprocess.Popen(["sleep", "60"])  # another test process, still running its notebook
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        running = notebook_conftest._Running(tmp_path)
        running.enter(runs)
        running.enter(runs, pid=other.pid)
        running.enter(runs, pid=dead.pid)  # (killed mid-notebook: it never leaves)
        (runs / "ours").mkdir()
        (runs / "theirs").mkdir()
        running.leave(runs)
        assert sorted(p.name for p in runs.iterdir()) == [
            "ours",
            "theirs",
            "users-own",
        ]  # the other still runs
        running.leave(runs, pid=other.pid)
        assert [p.name for p in runs.iterdir()] == ["users-own"]
        assert not running.state.exists()
    finally:
        other.kill()
        other.wait()
