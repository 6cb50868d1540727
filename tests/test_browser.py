"""A real browser: Voila serves a notebook whose loop trains in the background; headless Chromium
(Debian's package, driven by Playwright) must see the dashboard render, its step counter and its curves
advance while the run trains, a hovered point show its step and value, and the toolbar's zoom work."""

import contextlib
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = [
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (.ci/run installs it)"
    ),
    pytest.mark.skipif(
        any(__import__("importlib").util.find_spec(m) is None for m in ("playwright", "voila")),
        reason="playwright and voila are not installed (dev extra)",
    ),
]
NOTEBOOK = Path(__file__).parent / "browser" / "dashboard_live.ipynb"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# points of the return curve drawn in the page: the SVG path's segments + 1
POINTS = """() => { const f = Array.from(document.querySelectorAll('.bqplot')).find(e => e.textContent.includes('return / reward'));
  if (!f) return -1; const l = f.querySelector('path.line'); if (!l) return 0;  /* the figure before its line */
  const d = l.getAttribute('d') || '';
  return d ? (d.match(/L/g) || []).length + 1 : 0; }"""
TICKS = """() => Array.from(Array.from(document.querySelectorAll('.bqplot')).find(e => e.textContent.includes('return / reward'))
  .querySelectorAll('g.axis')[0].querySelectorAll('g.tick text')).map(t => t.textContent)"""


# how much of its figure's plot area the return curve spans, left to right (a collapsed x range gives ~0)
SPREAD = """() => { const f = Array.from(document.querySelectorAll('.bqplot')).find(e => e.textContent.includes('return / reward'));
  const line = f.querySelector('path.line').getBoundingClientRect();
  return line.width / f.querySelector('rect.plotarea_background').getBoundingClientRect().width; }"""

# the progress label's step, the return curve's points and its spread, read in one go: read one after
# another, a loaded machine finishes steps in between (a step takes ~0.1 s)
SNAPSHOT = (
    "() => { const m = document.body.innerText.match(/step (\\d+)\\/60/); "
    f"let spread = -1; try {{ spread = ({SPREAD})(); }} catch (e) {{}} "  # no figure yet
    f"return [m ? Number(m[1]) : -1, ({POINTS})(), spread]; }}"
)


def _chromium(p):
    return p.chromium.launch(
        executable_path=CHROMIUM,
        args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync"],
    )  # fmt: skip


def _kernel_env() -> dict:
    """The server's environment, its kernels' temporary files in a directory of their own, removed with the
    test process: a kernel that started child processes is shut down by SIGTERM (ipykernel waits on
    multiprocessing's resource tracker, which ignores it, past jupyter_client's deadline), so its exit handlers
    never remove multiprocessing's temporary directory. Short, under the system's temporary directory: a
    socket's path holds at most 107 bytes, and one under pytest's ``tmp_path`` (``pytest-110/popen-gw2/...``)
    passed that (the kernel's ``rlnb.Cluster()`` failed with "AF_UNIX path too long")."""
    import atexit
    import os
    import shutil
    import tempfile

    short = tempfile.mkdtemp(prefix="rlnb-k")
    atexit.register(shutil.rmtree, short, True)
    return {**os.environ, "TMPDIR": short}


def _multiprocessing_files() -> set:
    import tempfile

    return set(Path(tempfile.gettempdir()).glob("pymp-*"))


def _voila(notebook: Path, port: int, log_path: Path):
    """``(server, its log file)``: Voila serving ``notebook`` on ``port``. The server's and its kernel's output go
    to the file, read on failure (a pipe nobody reads fills up and stops whoever writes to it next: the kernel,
    mid-run); close it after the server stopped."""
    log = open(log_path, "wb")  # noqa: SIM115 (the caller's to close)
    server = subprocess.Popen(
        [sys.executable, "-m", "voila", str(notebook), "--no-browser", f"--port={port}", "--Voila.ip=127.0.0.1",
         "--Voila.tornado_settings={'headers': {'Content-Security-Policy': ''}}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=_kernel_env(),
    )  # fmt: skip
    return server, log


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()


def _ticks(page) -> str:
    import json

    return json.dumps(page.evaluate(TICKS))


def _open(page, url: str, timeout_s: float = 60) -> None:
    """Load ``url``, retrying while the server is still starting to listen."""
    deadline = time.time() + timeout_s
    while True:
        try:
            page.goto(url, timeout=120_000)
            return
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


def _close_dialogs(page) -> list[str]:
    """Accept the dialogs JupyterLab put over the notebook (a kernel to pick, a server slow to answer under
    load: seen on CI, where one took every click), returning what each said."""
    said = []
    for _ in range(5):
        dialog = page.locator(".jp-Dialog")
        if not dialog.count() or not dialog.first.is_visible():
            break
        said.append(" ".join(dialog.first.inner_text().split()))
        accept = dialog.first.locator(".jp-Dialog-button.jp-mod-accept")
        if accept.count():
            accept.first.click(timeout=10_000)
        else:
            page.keyboard.press("Escape")
        page.wait_for_timeout(500)
    return said


def _step(text: str) -> int:
    m = re.search(r"step (\d+)/", text)
    return int(m.group(1)) if m else -1


def test_dashboard_renders_and_updates_in_chromium(tmp_path_factory):
    """...and says how the run ended. Screenshots of it running and finished go to ``$RLNB_SCREENSHOTS``
    (``docs/img/`` has the latest taken), else beside the test's files."""
    import os

    tmp_path = tmp_path_factory.mktemp("browser")
    shots = Path(os.environ.get("RLNB_SCREENSHOTS") or tmp_path)
    from playwright.sync_api import expect, sync_playwright

    port = _free_port()
    # served from a copy in the test's directory: the kernel runs there, and its loop's run directory with it
    beside, multiprocessing_files = set(NOTEBOOK.parent.iterdir()), _multiprocessing_files()
    notebook = tmp_path / NOTEBOOK.name
    shutil.copy(NOTEBOOK, notebook)
    log_path = tmp_path / "voila.log"
    voila, log = _voila(notebook, port, log_path)
    try:
        with sync_playwright() as p:
            browser = _chromium(p)
            page = browser.new_page()
            _open(page, f"http://127.0.0.1:{port}/")
            label = page.get_by_text(re.compile(r"step \d+/60"))
            label.wait_for(timeout=120_000)
            first = later = _step(label.inner_text())
            plotted = [page.evaluate(POINTS)]
            deadline = time.time() + 120
            while later <= first + 2 and time.time() < deadline:  # the loop trains in the kernel's background
                time.sleep(0.5)
                later = _step(page.get_by_text(re.compile(r"step \d+/60")).inner_text())
                plotted.append(page.evaluate(POINTS))
            assert later > first + 2, f"the dashboard did not advance: step {first} -> {later}"
            # the return curve in the page grows while the run trains, not only once it has finished
            assert later < 60 and plotted[-1] > plotted[0] >= 0 and abs(plotted[-1] - later) <= 2, (
                plotted,
                later,
            )
            assert page.locator("[class*='progress']").count() >= 1  # the progress bar rendered
            assert page.get_by_text("time per phase (s, mean of the last 20 steps)").count() == 1
            page.screenshot(path=str(shots / "dashboard_running.png"), full_page=True)
            # finished: it says so, with the final step and the wall time, and steers no more
            page.get_by_text(re.compile(r"done at step 60 · \d+ s")).wait_for(timeout=120_000)
            # each control's disabled state reaches the page in its own widget message, after the label's: waited
            # for (playwright's expect retries until it holds), not read once
            expect(page.get_by_role("button", name="stop")).to_be_disabled(timeout=10_000)
            expect(page.get_by_role("button", name="apply")).to_be_disabled(timeout=10_000)
            # the latest evaluation episode's video (runner.video_interval=30) plays under the curves
            page.get_by_text(re.compile(r"evaluation episode, step 60")).wait_for(timeout=30_000)
            page.wait_for_function(
                "() => { const v = document.querySelector('video'); return v && v.src.startsWith('blob:'); }",
                timeout=30_000,
            )
            page.screenshot(path=str(shots / "dashboard_finished.png"), full_page=True)
            figure = page.locator(".bqplot", has_text="return / reward").first
            assert page.evaluate(POINTS) == 60  # one point a step
            assert page.evaluate(SPREAD) > 0.9  # across the whole step axis
            figure.locator("path.dot").nth(30).hover()  # hovering a point shows its step and value
            tooltip = page.locator(".bqplot_tooltip_div", has_text="env/episode_return_mean")
            shown = " ".join(tooltip.first.inner_text().split())  # x in env steps, the training step beside
            assert re.fullmatch(r"env steps [\d,]+ step 31 env/episode_return_mean [-\d.]+", shown), shown
            before = _ticks(page)
            figure.locator("xpath=..").locator("button").first.click()  # the toolbar's pan/zoom toggle
            box = figure.bounding_box()
            page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            page.mouse.wheel(0, -400)
            page.wait_for_function(
                f"() => JSON.stringify({TICKS}()) !== {before!r}", timeout=30_000
            )  # zoomed
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            browser.close()
    except BaseException:
        _stop(voila)
        print("the server's output, last 6000 characters:\n" + log_path.read_text(errors="replace")[-6000:])
        raise
    finally:
        _stop(voila)
        log.close()
    assert (
        set(NOTEBOOK.parent.iterdir()) == beside
    )  # nothing left beside the notebook (its run is in tmp_path)
    assert _multiprocessing_files() <= multiprocessing_files  # the kernel's went with tmp_path


def test_the_grpo_dashboard_shows_its_own_panels_and_the_completions_in_chromium(tmp_path):
    """An LM run's dashboard in Voila: reward, held-out accuracy, response length, KL, clip fraction and tokens
    per second (not the embodied panels), and the latest group of completions it trained on, as the
    run trains. A screenshot goes to ``$RLNB_SCREENSHOTS`` (``docs/img/dashboard_grpo.png``), else beside the
    test's files."""
    import os

    from playwright.sync_api import sync_playwright

    shots = Path(os.environ.get("RLNB_SCREENSHOTS") or tmp_path)
    notebook = tmp_path / "dashboard_grpo.ipynb"
    shutil.copy(NOTEBOOK.with_name(notebook.name), notebook)
    port, log_path = _free_port(), tmp_path / "voila.log"
    voila, log = _voila(notebook, port, log_path)
    try:
        with sync_playwright() as p:
            browser = _chromium(p)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            _open(page, f"http://127.0.0.1:{port}/")
            label = page.get_by_text(re.compile(r"step \d+/40"))
            label.wait_for(timeout=240_000)  # (its warm start first)
            deadline = time.time() + 120
            while _step(label.inner_text()) < 12 and time.time() < deadline:  # (an evaluation at step 10)
                time.sleep(0.5)
            titles = page.evaluate(
                "() => Array.from(document.querySelectorAll('.bqplot .mainheading')).map(t => t.textContent)"
            )
            # (a panel shows once its metric is logged: entropy where the loss computes it)
            for panel in (
                "reward",
                "accuracy",
                "response length",
                "KL",
                "clip fraction",
                "tokens per second",
            ):
                assert panel in titles, titles
            assert "return / reward" not in titles and "value loss" not in titles, titles  # (PPO's)
            page.get_by_text(re.compile(r"completions trained on at step \d+")).wait_for(timeout=60_000)
            assert page.locator("table", has_text="advantage").count() >= 1
            page.screenshot(path=str(shots / "dashboard_grpo.png"), full_page=True)
            page.get_by_text(re.compile(r"done at step 40")).wait_for(timeout=240_000)
            browser.close()
    except BaseException:
        print("the server's output, last 6000 characters:\n" + log_path.read_text(errors="replace")[-6000:])
        raise
    finally:
        _stop(voila)
        log.close()


@contextlib.contextmanager
def _lab_page(tmp_path: Path, notebook: Path):
    """A Chromium page on JupyterLab serving a copy of ``notebook`` from ``tmp_path`` (its settings there too),
    the notebook open; the server stopped after."""
    from playwright.sync_api import sync_playwright

    shutil.copy(notebook, tmp_path / notebook.name)
    port = _free_port()
    env = {**_kernel_env(), "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "ws")}  # fmt: skip
    lab = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
         "--IdentityProvider.token=rlnb-test", f"--ServerApp.root_dir={tmp_path}", "--allow-root",
         "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env,
    )  # fmt: skip
    try:
        with sync_playwright() as p:
            browser = _chromium(p)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            _open(page, f"http://127.0.0.1:{port}/lab/tree/{notebook.name}?token=rlnb-test", timeout_s=120)
            yield page
            browser.close()
    finally:
        _stop(lab)


def _run_first_cell(page, label) -> None:
    """Run the notebook's first cell until ``label`` shows (the dashboard's step counter)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    cell = page.locator(".jp-Notebook .jp-Cell").first
    dialogs, presses, shown_by = [], 0, time.time() + 300  # (one bound: a loaded machine starts slowly)
    while True:
        dialogs += _close_dialogs(page)
        prompt = cell.locator(".jp-InputPrompt").inner_text(timeout=30_000)
        # a keypress before the notebook or its kernel is ready can be lost: pressed again only while the
        # cell has not started ("[*]" running, "[1]" done), never queued behind a run in progress
        if "*" not in prompt and not re.search(r"\d", prompt):
            cell.click(timeout=30_000)
            page.keyboard.press("Shift+Enter")
            presses += 1
        try:
            label.wait_for(timeout=15_000)
            return
        except PlaywrightTimeout as e:
            if time.time() > shown_by:
                raise AssertionError(
                    f"no step shown after {presses} press(es), the cell's prompt {prompt!r}; JupyterLab's "
                    f"dialogs on the way: {dialogs}"
                ) from e


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("jupyterlab") is None,
    reason="jupyterlab is not installed (dev extra)",
)
# (35-90 s here; the bounds inside: 300 s to the first step, 300 s of the run)
@pytest.mark.timeout(900)
def test_dashboard_curves_stream_in_jupyterlab(tmp_path):
    """JupyterLab shows the dashboard before its first point (Voila, above, renders it mid-run): the
    curves must still grow and span their axes while the run trains."""
    with _lab_page(tmp_path, NOTEBOOK) as page:
        _run_first_cell(page, page.get_by_text(re.compile(r"step \d+/60")))
        seen, deadline = [], time.time() + 300
        while not seen or (seen[-1][0] < 30 and time.time() < deadline):
            step, points, spread = page.evaluate(SNAPSHOT)
            if step >= 3:
                seen.append((step, points, spread))
            time.sleep(0.5)
        middle = [s for s in seen if s[0] < 60]
        assert middle and all(abs(points - step) <= 2 for step, points, _ in middle), (
            seen
        )  # grows as it trains
        # and spans its axis, not one x (where it has two points: under load the first sample can have one)
        assert all(spread > 0.8 for _, points, spread in middle if points >= 2), seen


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("jupyterlab") is None,
    reason="jupyterlab is not installed (dev extra)",
)
@pytest.mark.timeout(900)
def test_the_dashboards_controls_steer_a_run_in_the_foreground_in_jupyterlab(tmp_path):
    """``loop.run(live=True)`` in the cell, as the README teaches it: pause holds the run within a step while
    the cell is still running, a new lr applied then is logged from the next step, resume goes on, and stop
    ends the run within a step (the clicks waited for the run's end before the controls had a subshell)."""
    from playwright.sync_api import expect

    notebook = Path(__file__).parent / "browser" / "dashboard_foreground.ipynb"
    with _lab_page(tmp_path, notebook) as page:
        label = page.get_by_text(re.compile(r"step \d+/200"))
        _run_first_cell(page, label)

        def step() -> int:
            return _step(label.inner_text(timeout=30_000))

        deadline = time.time() + 300
        while step() < 3 and time.time() < deadline:
            time.sleep(0.3)
        page.get_by_role("button", name="pause").click()
        page.get_by_text(re.compile(r"step \d+/200 · paused")).wait_for(timeout=30_000)
        time.sleep(2.0)  # the step under way when clicked ends; then nothing moves
        held = step()
        time.sleep(3.0)
        assert step() == held, f"a paused run went on: step {held} -> {step()}"
        lr = page.locator(".widget-text", has_text="lr").locator("input")
        lr.fill("0.0005")
        lr.press("Enter")
        page.get_by_role("button", name="apply").click()
        page.get_by_text(re.compile(r"from step \d+: \{'lr': 0\.0005\}")).wait_for(timeout=30_000)
        page.get_by_role("button", name="resume").click()
        deadline = time.time() + 120
        while step() < held + 3 and time.time() < deadline:
            time.sleep(0.3)
        assert step() >= held + 3, f"the run did not resume: step {step()}"
        clicked_at = step()
        page.get_by_role("button", name="stop").click()
        asked = page.get_by_text(re.compile(r"stop asked after step \d+"))
        asked.wait_for(timeout=30_000)
        asked_at = int(re.search(r"stop asked after step (\d+)", asked.inner_text()).group(1))
        ended = page.get_by_text(re.compile(r"stopped at step \d+ of 200"))
        ended.wait_for(timeout=60_000)
        stopped = int(re.search(r"stopped at step (\d+)", ended.inner_text()).group(1))
        # the step under way when the kernel had the click ends, and the one the worker runs ahead at this pace,
        # no other (the click took 3 s and more to reach the kernel under CI's load: bounded by the wait above, not
        # counted in steps)
        assert clicked_at <= asked_at <= stopped <= asked_at + 2, (clicked_at, asked_at, stopped)
        expect(page.get_by_role("button", name="stop")).to_be_disabled(timeout=10_000)
        # the cell ended with the run, and the lr applied while paused was logged from the next step
        printed = page.get_by_text(re.compile(r"after the run: step \d+, steered"))
        printed.wait_for(timeout=60_000)
        assert f"steered [({held + 1}, 0.0005)]" in printed.inner_text(), (held, printed.inner_text())


def test_the_docs_pages_draw_the_notebooks_hvplot_charts_with_no_cdn(tmp_path):
    """A notebook's hvplot chart, executed, rendered to a docs page and built by mkdocs, draws in Chromium
    from the site's own copies of bokeh and panel: this browser reaches no CDN (nor does CI's)."""
    import functools
    import http.server
    import threading

    import nbformat
    from nbclient import NotebookClient
    from playwright.sync_api import sync_playwright

    from rlnb.docs import write_notebook_pages

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import pandas as pd\nimport hvplot.pandas  # noqa: F401"),
        nbformat.v4.new_code_cell(
            'pd.DataFrame({"phase": ["rollout", "train"], "s": [0.02, 0.03]}).hvplot.barh(x="phase", y="s", '
            'title="seconds by phase")'
        ),
    ]
    src = tmp_path / "src"
    src.mkdir()
    NotebookClient(nb, timeout=120, kernel_name="python3").execute(env=_kernel_env())
    nbformat.write(nb, src / "zz_chart.ipynb")
    docs = tmp_path / "docs"
    (page,) = write_notebook_pages(docs / "notebooks", source=src, repository="")
    assert "cdn.bokeh.org" not in page.read_text()  # the notebook's loader from the CDN is gone
    (docs / "index.md").write_text("# home\n")
    (tmp_path / "mkdocs.yml").write_text(
        "site_name: t\ndocs_dir: docs\nsite_dir: site\nnav:\n  - Home: index.md\n  - Chart: notebooks/zz_chart.md\n"
    )
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "-q"], cwd=tmp_path, check=True, timeout=120)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(tmp_path / "site"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with sync_playwright() as p:
            browser = _chromium(p)
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{server.server_port}/notebooks/zz_chart/")
            canvas = page.locator("canvas").first  # (in bokeh's shadow DOM, which locators pierce)
            canvas.wait_for(timeout=30_000)
            box = canvas.bounding_box()
            assert box["width"] > 200 and box["height"] > 100, box  # the chart drawn, at its size
            page.screenshot(path=str(tmp_path / "chart.png"))
            browser.close()
    finally:
        server.shutdown()
        server.server_close()
