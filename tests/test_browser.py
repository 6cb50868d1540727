"""A real browser: Voila serves a notebook whose loop trains in the background; headless Chromium
(Debian's package, driven by Playwright) must see the dashboard render, its step counter and its curves
advance while the run trains, a hovered point show its step and value, and the toolbar's zoom work."""

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
  if (!f) return -1; const d = f.querySelector('path.line').getAttribute('d') || '';
  return d ? (d.match(/L/g) || []).length + 1 : 0; }"""
TICKS = """() => Array.from(Array.from(document.querySelectorAll('.bqplot')).find(e => e.textContent.includes('return / reward'))
  .querySelectorAll('g.axis')[0].querySelectorAll('g.tick text')).map(t => t.textContent)"""


def _ticks(page) -> str:
    import json

    return json.dumps(page.evaluate(TICKS))


def _step(text: str) -> int:
    m = re.search(r"step (\d+)/", text)
    return int(m.group(1)) if m else -1


def test_dashboard_renders_and_updates_in_chromium(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("browser")
    from playwright.sync_api import sync_playwright

    port = _free_port()
    voila = subprocess.Popen(
        [sys.executable, "-m", "voila", str(NOTEBOOK), "--no-browser", f"--port={port}", "--Voila.ip=127.0.0.1",
         "--Voila.tornado_settings={'headers': {'Content-Security-Policy': ''}}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM,
                args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                      "--disable-background-networking", "--disable-component-update", "--disable-sync"],
            )  # fmt: skip
            page = browser.new_page()
            deadline = time.time() + 60
            while True:  # Voila needs a moment to listen
                try:
                    page.goto(f"http://127.0.0.1:{port}/", timeout=120_000)
                    break
                except Exception:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.5)
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
            assert page.get_by_text("time per phase (s)").count() == 1
            label.filter(has_text="done").wait_for(timeout=120_000)
            figure = page.locator(".bqplot", has_text="return / reward").first
            assert page.evaluate(POINTS) == 60  # one point a step
            figure.locator("path.dot").nth(30).hover()  # hovering a point shows its step and value
            tooltip = page.locator(".bqplot_tooltip_div", has_text="env/episode_return_mean")
            shown = " ".join(tooltip.first.inner_text().split())
            assert re.fullmatch(r"step 31 env/episode_return_mean [-\d.]+", shown), shown
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
    finally:
        voila.terminate()
        try:
            voila.wait(timeout=20)
        except subprocess.TimeoutExpired:
            voila.kill()
