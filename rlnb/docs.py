"""Generate the reference pages of the docs from the code, so they cannot drift from it.

Run: ``python -m rlnb.docs docs/reference`` (the docs build does).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing
from pathlib import Path

from rlnb.config.loader import _type_name, field_docs
from rlnb.config.schema import Recipe


def recipe_reference() -> str:
    """Markdown: every recipe key with its type, default and docstring."""
    lines = [
        "# Recipe reference",
        "",
        "Generated from the config dataclasses (`rlnb/config/schema.py`). Every key has a default; a recipe names",
        "only what differs. Override any key on the command line with a dotted path: `rlnb run RECIPE env.num_envs=16`.",
        "",
    ]

    def section(cls, prefix: str):
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        rows, subs = [], []
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            key = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(tp):
                subs.append((tp, key + "."))
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append(f"| `{key}` | {_type_name(tp)} | `{default!r}` | {docs.get(f.name, '')} |")
        if rows:
            lines.extend(
                [
                    f"## `{prefix.rstrip('.') or 'top level'}`",
                    "",
                    (inspect.getdoc(cls) or "").split("\n")[0],
                    "",
                ]
            )
            lines.extend(["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""])
        for sub, p in subs:
            section(sub, p)

    section(Recipe, "")
    return "\n".join(lines)


def _entry_section(reg, name: str, loops: list[str]) -> list[str]:
    """Markdown lines of one registry entry: its name, signature, contract (``loops``: the loops serving it),
    other names and docstring."""
    entry = reg.entry(name)
    sig = str(inspect.signature(entry.fn)).replace("*", "\\*")
    meta = (
        f"Needs: {', '.join(sorted(entry.needs)) or '(nothing)'}. Served by: {', '.join(loops) or 'no loop'}."
    )
    aliases = reg.aliases(name)
    if aliases:
        meta += f" Also named: {', '.join(aliases)}."
    return [
        f"### `{name}`",
        "",
        f"`{entry.fn.__name__}{sig}`",
        "",
        meta,
        "",
        inspect.getdoc(entry.fn) or "",
        "",
    ]


def algorithm_reference() -> str:
    """Markdown: every registered advantage, policy loss, reward and interaction with its docstring."""
    from rlnb.algorithms import ADVANTAGES, INTERACTIONS, POLICY_LOSSES, REWARDS, kl_penalty
    from rlnb.algorithms.contract import EMBODIED, LM
    from rlnb.algorithms.interactions import INTERACTION_INPUTS

    lines = [
        "# Algorithm reference",
        "",
        "Generated from the registries (`rlnb/algorithms/`). Names are case-insensitive. Each entry lists",
        "the inputs it needs and the loops that serve it (see *The algorithm contract* in Concepts).",
        "",
    ]
    kinds = {"advantage": "advantage_inputs", "policy loss": "loss_inputs", "reward": "reward_inputs"}
    for title, reg in (("Advantages", ADVANTAGES), ("Policy losses", POLICY_LOSSES), ("Rewards", REWARDS)):
        lines.extend([f"## {title}", ""])
        for name in reg.names():
            entry = reg.entry(name)
            loops = [c.name for c in (EMBODIED, LM) if entry.serves(getattr(c, kinds[reg.kind]), c.layout)]
            lines.extend(_entry_section(reg, name, loops))
    from rlnb.algorithms import correction
    from rlnb.config.presets import PRESETS

    lines.extend(["## Training-inference mismatch correction", "",
                  "`algorithm.mismatch_correction` (`rlnb.algorithms.correction.mismatch_weights`).", "",
                  inspect.getdoc(correction).split("\n\nExample:")[0], ""])  # fmt: skip

    lines.extend(["## Presets", "", "`algorithm.preset`: a method by its paper's name, the keys it sets "
                  "(`rlnb.config.presets`).", "", "| preset | sets |", "|---|---|"])  # fmt: skip
    for name, keys in PRESETS.items():
        lines.append(f"| `{name}` | {', '.join(f'`{k}: {v}`' for k, v in keys.items())} |")
    lines.append("")
    lines.extend(
        [
            "## Interactions",
            "",
            "What answers the model between its turns (`rollout.max_turns` >= 2, `rollout.interaction`); see",
            "*Multi-turn rollouts* in Concepts.",
            "",
        ]
    )
    for name in INTERACTIONS.names():
        served = INTERACTIONS.entry(name).serves(INTERACTION_INPUTS, LM.layout)
        lines.extend(_entry_section(INTERACTIONS, name, [LM.name] if served else []))
    lines.extend(
        [
            "## KL estimators",
            "",
            "`kl_penalty(logprobs, ref_logprobs, kind)`",
            "",
            inspect.getdoc(kl_penalty),
            "",
        ]
    )
    return "\n".join(lines)


def metrics_reference() -> str:
    """Every logged metric and what it means, grouped by prefix (from :data:`rlnb.metrics.GLOSSARY`)."""
    from rlnb.metrics import GLOSSARY

    lines = [
        "# Metrics glossary",
        "",
        "Every key the loops write to `metrics.jsonl` (and TensorBoard, W&B). The dashboard shows the same "
        "text when you hover over a metric. Generated from `rlnb.metrics.GLOSSARY`.",
    ]
    groups: dict[str, list[str]] = {}
    for key in GLOSSARY:
        groups.setdefault(key.split("/")[0] if "/" in key else "bookkeeping", []).append(key)
    for group, keys in groups.items():
        lines += ["", f"## {group}", "", "| metric | meaning |", "|---|---|"]
        lines += [f"| `{k}` | {GLOSSARY[k]} |" for k in keys]
    return "\n".join(lines)


def write_reference(out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pages = {
        "recipe.md": recipe_reference(),
        "algorithms.md": algorithm_reference(),
        "metrics.md": metrics_reference(),
    }
    for name, text in pages.items():
        (out / name).write_text(text + "\n")
    return [out / n for n in pages]


def github_repository(url: str | None = None) -> tuple[str, str] | None:
    """``(owner, repo)`` of the GitHub repository the notebooks are published from: ``url``, else
    ``$RLNB_REPO_URL``, else this checkout's ``origin`` remote; ``None`` when none of them is on GitHub
    (Binder and Colab badges then stay out of the docs, as neither could open the notebook).

    Example:
        >>> github_repository("git@github.com:rlnb-dev/rlnb.git")
        ('rlnb-dev', 'rlnb')
    """
    import os
    import re
    import subprocess

    if url is None:
        url = os.environ.get("RLNB_REPO_URL")
    if url is None:
        try:
            url = subprocess.run(
                ["git", "remote", "get-url", "origin"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            url = ""
    m = re.fullmatch(r"(?:https://github\.com/|git@github\.com:)([\w.-]+)/([\w.-]+?)(?:\.git)?/?", url or "")
    return (m.group(1), m.group(2)) if m else None


def notebook_badges(repository: tuple[str, str], notebook: str, branch: str = "main") -> str:
    """Markdown badges opening ``notebooks/<notebook>`` of ``repository`` on Binder (its environment is
    ``binder/``) and Colab."""
    owner, repo = repository
    binder = f"https://mybinder.org/v2/gh/{owner}/{repo}/{branch}?labpath=notebooks%2F{notebook}"
    colab = f"https://colab.research.google.com/github/{owner}/{repo}/blob/{branch}/notebooks/{notebook}"
    return (
        f"[![Binder](https://mybinder.org/badge_logo.svg)]({binder}) "
        f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({colab})"
    )


PLOT_SCRIPTS = {
    "bokeh": ("bokeh.min.js", "bokeh-gl.min.js", "bokeh-widgets.min.js", "bokeh-tables.min.js"),
    "panel": ("panel.min.js",),
}
"""What an hvplot/HoloViews chart needs in a page (package -> its files): copied from the installed packages
into the site, so the charts render without a CDN (their notebook loader fetches them from one)."""


def write_plot_scripts(out_dir: str | Path) -> list[Path]:
    """Copy :data:`PLOT_SCRIPTS` from the installed bokeh and panel into ``out_dir``; returns the files."""
    import importlib
    import shutil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for package, names in PLOT_SCRIPTS.items():
        root = Path(importlib.import_module(package).__file__).parent
        static = root / ("server/static/js" if package == "bokeh" else "dist")
        for name in names:
            shutil.copyfile(static / name, out / name)
            written.append(out / name)
    return written


def _cdn_loader(data: dict) -> bool:
    """Whether a notebook output is HoloViews' loader of bokeh and panel from their CDN."""
    js = data.get("application/javascript", "")
    return "application/vnd.holoviews_load.v0+json" in data and "cdn.bokeh.org" in js


_SOURCE_LINK = r"\[([^\]]+)\]\(\.\./((?:rlnb|recipes|tests|bench)/[^)\s]+)\)"


def _link_source(body: str, repository: tuple[str, str] | None) -> str:
    """The notebooks link rlnb's source as ``../rlnb/...`` (right in a clone): on the site, the file on GitHub
    where the repository is there, else its name as code (no link to a page the site does not have)."""
    import re

    def replace(m):
        text, target = m.group(1), m.group(2)
        if repository is None:
            return text if text.startswith("`") else f"`{target}`" if text == "source" else text
        owner, repo = repository
        return f"[{text}](https://github.com/{owner}/{repo}/blob/main/{target})"

    return re.sub(_SOURCE_LINK, replace, body)


CHECK_TAG = "check"
"""The tag of a notebook's last cell: the asserts the test command (``pytest --nbmake``) runs, left out of the
docs."""


def write_notebook_pages(
    out_dir: str | Path = "docs/notebooks", source: str | Path = "notebooks", repository: str | None = None
) -> list[Path]:
    """One docs page per notebook, with its outputs: the copy the notebook tests executed
    (``build/notebooks/``) when there is one, else the notebook as committed (no outputs), said so on top.
    Each page opens with Binder and Colab badges when the repository is on GitHub (:func:`github_repository`
    of ``repository``)."""
    github = github_repository(repository)
    import nbformat
    from nbconvert import MarkdownExporter

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pages, any_charts = [], False
    for path in sorted(Path(source).glob("*.ipynb")):
        executed = Path("build") / "notebooks" / path.name
        nb = nbformat.read(executed if executed.exists() else path, as_version=4)
        # the cells of checks that end each notebook are for the test command (nbmake), not the reader
        nb.cells = [c for c in nb.cells if CHECK_TAG not in c.get("metadata", {}).get("tags", [])]
        charts = False  # HoloViews charts: the page loads bokeh and panel from the site (PLOT_SCRIPTS)
        # a widget has no static form: its snapshot where it gave one, else a line saying what it is
        for cell in nb.cells:
            outputs = cell.get("outputs", [])
            # the notebook's loader of bokeh and panel (from a CDN) makes way for the site's own copies; the
            # rest of HoloViews' set-up (its comm manager) runs in the page as it ran in the notebook
            outputs[:] = [o for o in outputs if not _cdn_loader(o.get("data", {}))]
            for output in outputs:
                data = output.get("data", {})
                charts |= "application/vnd.holoviews_exec.v0+json" in data
                if "application/vnd.holoviews_load.v0+json" in data:
                    js = data.get("application/javascript", "")
                    output["data"] = {"text/html": f'<script type="text/javascript">\n{js}\n</script>'}
                elif "application/vnd.jupyter.widget-view+json" in data and "image/png" in data:
                    output["data"] = {"image/png": data["image/png"]}  # a finished dashboard's snapshot
                elif "application/vnd.jupyter.widget-view+json" in data:
                    kind = data.get("text/plain", "widget").split("(")[0]
                    output["data"] = {
                        "text/markdown": f"*[{kind}: a live widget, shown when the notebook runs]*"
                    }
        body, resources = MarkdownExporter().from_notebook_node(
            nb, resources={"output_files_dir": f"{path.stem}_files"}
        )
        for name, data in (resources.get("outputs") or {}).items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(data)
        note = (
            f"*Executed by the test command; the notebook is `notebooks/{path.name}`.*"
            if executed.exists()
            else f"*Not executed in this docs build (run `make test`); the notebook is `notebooks/{path.name}`.*"
        )
        # the notebooks link the docs as ../docs/... (right from notebooks/ on GitHub and in Jupyter);
        # their pages live in docs/notebooks/
        body = _link_source(body.replace("](../docs/", "](../"), github)
        any_charts |= charts
        if charts:  # (a page's URL is notebooks/<name>/: the site's root is two levels up)
            names = [n for names in PLOT_SCRIPTS.values() for n in names]
            body = "".join(f'<script src="../../assets/js/{n}"></script>\n' for n in names) + "\n" + body
        if github is not None:
            note = f"{notebook_badges(github, path.name)}\n\n{note}"
        page = out / f"{path.stem}.md"
        page.write_text(f"{note}\n\n{body}")
        pages.append(page)
    if any_charts:
        write_plot_scripts(out.parent / "assets" / "js")
    return pages


if __name__ == "__main__":
    for p in write_reference(sys.argv[1] if len(sys.argv) > 1 else "docs/reference"):
        print(p)
    for p in write_notebook_pages():
        print(p)
