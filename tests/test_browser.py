"""A real browser: Voila serves a notebook whose loop trains in the background; headless Chromium
(Debian's package, driven by Playwright) must see the dashboard render and its step counter advance."""

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
            deadline = time.time() + 120
            while later <= first + 2 and time.time() < deadline:  # the loop trains in the kernel's background
                time.sleep(0.5)
                later = _step(page.get_by_text(re.compile(r"step \d+/60")).inner_text())
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            assert later > first + 2, f"the dashboard did not advance: step {first} -> {later}"
            assert page.locator("[class*='progress']").count() >= 1  # the progress bar rendered
            curves = page.locator("img[src^='data:image/png'], img[src^='blob:']")
            curves.first.wait_for(timeout=60_000)  # the curves, drawn as an image
            assert curves.first.bounding_box()["height"] > 100
            assert page.get_by_text("time per phase (s)").count() == 1
            browser.close()
    finally:
        voila.terminate()
        try:
            voila.wait(timeout=20)
        except subprocess.TimeoutExpired:
            voila.kill()
