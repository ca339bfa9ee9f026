"""The stepper in a real browser: JupyterLab on a loopback port runs a copy of notebook 06,
headless Chromium clicks the stepper's Step button, and the block-table figure changes.

Uses Debian's /usr/bin/chromium through Playwright's Python package (Playwright's own
browser download cannot work offline). The screenshot is kept in tests/artifacts/.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = "06_iteration_level_scheduling.ipynb"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = ROOT / "tests" / "artifacts"

# the block-table figures on the page: (title, z and text of the device panel) per plotly div
READ_BLOCK_TABLES = """() => [...document.querySelectorAll('.js-plotly-plot')]
    .filter(gd => gd.layout && String((gd.layout.title || {}).text || '').startsWith('KV block table'))
    .map(gd => JSON.stringify([gd.layout.title.text, gd.data[0].z, gd.data[0].text]))"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyterlab(tmp_path):
    """A JupyterLab server on 127.0.0.1 serving a temporary copy of the notebook; yields its URL
    and token, and shuts it (and its kernels) down afterwards."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium; .ci/run installs it)")
    pytest.importorskip("playwright.sync_api", reason="the playwright Python package is missing")
    pytest.importorskip("jupyterlab", reason="jupyterlab is missing")
    root = tmp_path / "lab"
    root.mkdir()
    shutil.copy(ROOT / "notebooks" / NOTEBOOK, root / NOTEBOOK)
    # render every cell (no virtual scrolling), so the figures exist in the page; no news toast
    for name, value in (("notebook-extension/tracker", {"windowingMode": "none"}),
                        ("apputils-extension/notification", {"fetchNews": "false"})):
        path = tmp_path / "settings" / "@jupyterlab" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    token, port = secrets.token_hex(16), free_port()
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), PYTHONPATH=str(ROOT))
    # one torch thread: on a small shared CI machine a second one only adds contention
    env.setdefault("OMP_NUM_THREADS", "1")
    log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.port_retries=0",
         "--ServerApp.allow_root=True",
         "--LabApp.expose_app_in_browser=True"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    log_text = (tmp_path / "jupyterlab.log").read_text()
                    pytest.fail("JupyterLab did not start:\n" + log_text[-3000:])
                time.sleep(0.5)
        yield url, token
    finally:
        try:   # shuts the kernels down too
            urllib.request.urlopen(urllib.request.Request(f"{url}/api/shutdown?token={token}", method="POST"),
                                   timeout=10)
            server.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            server.terminate()
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.kill()
        log.close()


@pytest.mark.slow
def test_stepper_step_button_changes_the_block_table(jupyterlab):
    from playwright.sync_api import sync_playwright

    url, token = jupyterlab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/lab/tree/{NOTEBOOK}?token={token}")
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
            # wait for the kernel, then run every cell as a person would from the Run menu
            page.wait_for_function("() => window.jupyterapp && document.querySelector('.jp-Notebook')",
                                   timeout=60_000)
            page.wait_for_function(
                "() => { const w = window.jupyterapp.shell.currentWidget;"
                " return w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel"
                " && w.sessionContext.session.kernel.connectionStatus === 'connected'; }", timeout=120_000)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            page.wait_for_function(
                "() => { const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]"
                ".map(p => p.textContent.trim());"
                " return prompts.length > 0 && prompts.every(t => /^\\[\\d+\\]:$/.test(t)); }",
                timeout=400_000, polling=1000)
            errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'], "
                                  ".jp-RenderedText[data-mime-type='application/vnd.jupyter.error']")
            tracebacks = [t for t in errors.all_inner_texts() if "Error" in t]
            assert not tracebacks, tracebacks[0][-2000:]

            step = page.get_by_role("button", name="Step", exact=True)
            step.wait_for(timeout=60_000)
            page.wait_for_function(f"({READ_BLOCK_TABLES})().length === 1", timeout=60_000)
            before = page.evaluate(READ_BLOCK_TABLES)[0]
            step.scroll_into_view_if_needed()
            step.click()
            page.wait_for_function(f"({READ_BLOCK_TABLES})()[0] !== {json.dumps(before)}", timeout=120_000,
                                   polling=500)
            after = page.evaluate(READ_BLOCK_TABLES)[0]
            title_before, title_after = json.loads(before)[0], json.loads(after)[0]
            # "KV block table after step 2" -> "... after step 3"
            assert title_before != title_after, (title_before, title_after)
            page.wait_for_timeout(500)    # let plotly finish drawing before the picture
            page.locator(".jp-OutputArea-output:has(.widget-button)").first.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "browser_stepper.png"))
        finally:
            browser.close()
