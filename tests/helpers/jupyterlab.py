"""JupyterLab as a student uses it, driven through Debian's chromium: a server with default
settings serving copies of notebooks, a notebook opened in a tab, *Run > Run All Cells* from
the menu bar, and its cells watched while they run (which one is executing, when its output
last changed), then read for what went wrong: an error, a blank plot, labels drawn over each
other. Copies, not notebooks/ itself: JupyterLab autosaves, and the notebooks are committed
without outputs."""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

from llmlab.bench.common import free_port, stop, wait_until_up

from helpers.browser import (CHROMIUM, CHROMIUM_ARGS, READ_FIGURES, READ_LAYOUT, overlapping_labels,
                             skip_without_chromium)

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"
SILENT_CELL_S = 60        # issue #33: a cell this long without new output looks hung to a student
RUN_ALL_TIMEOUT_S = 1200  # a last resort; a silent cell fails long before
ERROR_TEXT = r"Traceback|^\w*Error\b"    # an error output (re.M: ^ at each line)
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"

# Every cell of the open notebook, in order (markdown too: the index is the cell's in the
# .ipynb): whether it is code, its prompt ("[*]:" running or queued, "[3]:" run), a
# fingerprint of its outputs that changes when one is added or its text changes (a print, a
# progress bar, a figure), and the text of the first output that shows an error. Kernels send
# a traceback as an error output, which JupyterLab renders as stderr; a widget's one-line
# "ValueError: ..." is printed to stdout and does not count.
READ_CELLS = """(errorText) => {
    const panel = document.querySelector('""" + PANEL + """');
    const hash = s => { let h = 0; for (let i = 0; i < s.length; i++) h = (h * 31 + s.charCodeAt(i)) | 0; return h; };
    return [...panel.querySelectorAll('.jp-Notebook .jp-Cell')].map(cell => {
        const outputs = [...cell.querySelectorAll('.jp-OutputArea-output')];
        const error = outputs.find(o => o.dataset.mimeType === 'application/vnd.jupyter.stderr'
                                        && new RegExp(errorText, 'm').test(o.textContent));
        const prompt = cell.querySelector('.jp-InputPrompt');
        return {code: cell.classList.contains('jp-CodeCell'), prompt: prompt ? prompt.textContent.trim() : '',
                outputs: outputs.length + ':' + hash(outputs.map(o => o.textContent).join('\\n')),
                error: error ? error.textContent : null,
                widget_error: cell.textContent.includes('Error displaying widget')};
    });
}"""
# Per cell (same order), what its outputs drew: READ_FIGURES and READ_LAYOUT of its figures
# (a widget's figures are outputs of its Output widgets, inside the cell), and how many plotly
# outputs the cell has outside widgets (each must have its figure).
READ_CELL_FIGURES = ("() => [...document.querySelectorAll('" + PANEL + " .jp-Notebook .jp-Cell')].map(cell => ({"
                     "figures: (" + READ_FIGURES + ")(cell), layouts: (" + READ_LAYOUT + ")(cell), "
                     "plotly_outputs: [...cell.querySelectorAll('.jp-OutputArea-output.jp-RenderedPlotly')]"
                     ".filter(o => !o.closest('.widget-vbox')).length}))")


@dataclass(frozen=True)
class Lab:
    url: str
    token: str
    root: Path       # the folder it serves: its notebooks' copies


@contextlib.contextmanager
def jupyterlab(root: Path, scratch: Path):
    """JupyterLab with default settings (fresh, empty settings and workspace folders under
    `scratch`) on 127.0.0.1, serving `root`; yields a Lab, shuts it and its kernels down after.
    Its kernels import this checkout's llmlab (PYTHONPATH), whatever the venv's editable
    install points at, and run torch on one thread (a second only adds contention on CI's two
    cores, where chromium and the server want one too)."""
    skip_without_chromium()
    pytest.importorskip("jupyterlab", reason="jupyterlab is missing")
    token, port = secrets.token_hex(16), free_port()
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(scratch / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(scratch / "workspaces"),
               JUPYTER_RUNTIME_DIR=str(scratch / "runtime"), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("LLMLAB_WIDGETS", None)   # the kernel must find out for itself that widgets are drawn
    log_path = scratch / "jupyterlab.log"
    log = open(log_path, "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--ServerApp.port_retries=0", "--ServerApp.allow_root=True"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_up(server, lambda: urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2),
                          90, "JupyterLab", interval=0.5)
        except RuntimeError as error:
            pytest.fail(f"{error}:\n" + log_path.read_text()[-3000:])
        yield Lab(url, token, root)
    finally:
        try:   # shuts the kernels down too
            urllib.request.urlopen(urllib.request.Request(f"{url}/api/shutdown?token={token}", method="POST"),
                                   timeout=10)
            server.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            stop(server, 15)
        log.close()


@contextlib.contextmanager
def chromium():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def open_notebook(browser, lab: Lab, notebook: str, page=None):
    """Open the notebook (in `page`, or a new one) and wait until its kernel is idle; JupyterLab
    may ask which kernel to start: the default, as a student would. Returns the page."""
    page = page or browser.new_page(viewport={"width": 1400, "height": 1000})
    # ?reset: a fresh workspace, not the tabs an earlier test left open
    page.goto(f"{lab.url}/lab/tree/{notebook}?reset&token={lab.token}")
    page.wait_for_selector(f"{PANEL} .jp-Cell", timeout=120_000)
    select = page.locator(".jp-Dialog").get_by_role("button", name="Select", exact=True)
    idle = page.locator(".jp-StatusBar-TextItem", has_text=re.compile(r"\| Idle$")).first
    deadline = time.monotonic() + 180
    while not idle.is_visible():
        if select.is_visible():
            select.click()
        assert time.monotonic() < deadline, f"{notebook}: the kernel did not start"
        page.wait_for_timeout(500)
    return page


def run_all(page, lab: Lab, notebook: str, cpu_slowdown: int = 1) -> float:
    """*Run > Run All Cells* from the menu bar; returns when every code cell has run again (its
    number above any before) or one shows an error (Run All stops there), in seconds. Fails
    on a cell that runs SILENT_CELL_S without new output, naming it. `cpu_slowdown` throttles
    the page's CPU that many times while the cells run and their widgets load."""
    sources = [cell.source for cell in nbformat.read(lab.root / notebook, as_version=4).cells]
    before = max((int(n) for cell in page.evaluate(READ_CELLS, ERROR_TEXT)
                  for n in re.findall(r"^\[(\d+)\]:$", cell["prompt"])), default=0)
    start = time.monotonic()
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-item:not(.lm-mod-disabled) .lm-Menu-itemLabel",
                 has_text=re.compile(r"^Run All Cells$")).click()
    throttle = page.context.new_cdp_session(page) if cpu_slowdown > 1 else None
    if throttle:
        throttle.send("Emulation.setCPUThrottlingRate", {"rate": cpu_slowdown})
    try:
        watch(page, notebook, sources, before, start)
    finally:
        if throttle:
            throttle.send("Emulation.setCPUThrottlingRate", {"rate": 1})
            throttle.detach()
    return time.monotonic() - start


def watch(page, notebook: str, sources: list[str], before: int, start: float) -> None:
    """Poll the cells twice a second until the run is over; the running cell is the first one
    queued ("[*]:"), silent since it started or its outputs last changed."""
    running, outputs, since = None, None, time.monotonic()
    while True:
        cells = page.evaluate(READ_CELLS, ERROR_TEXT)
        if any(cell["error"] for cell in cells):
            return
        code = [i for i, cell in enumerate(cells) if cell["code"] and sources[i].strip()]
        numbers = [re.fullmatch(r"\[(\d+)\]:", cells[i]["prompt"]) for i in code]
        if all(n and int(n[1]) > before for n in numbers):
            return
        now = time.monotonic()
        queued = next((i for i in code if cells[i]["prompt"] == "[*]:"), None)
        if queued != running or (queued is not None and cells[queued]["outputs"] != outputs):
            running, outputs, since = queued, cells[queued]["outputs"] if queued is not None else None, now
        if now - since > SILENT_CELL_S:
            status = page.locator(".jp-StatusBar-TextItem", has_text="|").first.inner_text()
            what = (f"ran {now - since:.0f} s without new output (kernel: {status})" if running is not None else
                    f"Run All stopped {now - since:.0f} s ago with no cell running and no error shown "
                    f"(kernel: {status})")
            index = running if running is not None else code[0]
            scroll_to_cell(page, index)
            screenshot(page, f"browser_{Path(notebook).stem}_failed.png")
            raise AssertionError(cell_line(notebook, index, sources, what))
        if now - start > RUN_ALL_TIMEOUT_S:
            raise AssertionError(f"{notebook}: Run All still running after {RUN_ALL_TIMEOUT_S} s")
        page.wait_for_timeout(500)


def problems(page, lab: Lab, notebook: str) -> list[tuple[int, str]]:
    """What a student would see go wrong after a run, as (cell index, a line naming it): an
    error in an output, a widget that did not display, a plotly output without its figure, a
    plot with axes but no marks, labels (title, subtitle, annotations and subplot titles,
    legend, table, toolbar) drawn over each other. Waits up to a minute for figures displayed
    last to finish drawing."""
    sources = [cell.source for cell in nbformat.read(lab.root / notebook, as_version=4).cells]
    cells = page.evaluate(READ_CELLS, ERROR_TEXT)
    found = [(i, cell_line(notebook, i, sources, "an output shows an error:\n" + cell["error"][-2000:]))
             for i, cell in enumerate(cells) if cell["error"]]
    if found:      # Run All stopped there: the cells below never ran
        return found
    found = [(i, cell_line(notebook, i, sources, "a widget did not display")) for i, cell in enumerate(cells)
             if cell["widget_error"]]
    try:
        page.wait_for_function(f"() => ({READ_CELL_FIGURES})().every(c => c.figures.length >= c.plotly_outputs "
                               "&& c.figures.every(f => f.drawn && f.marks > 0))", timeout=60_000, polling=1000)
    except Exception:   # noqa: BLE001 -- the lines below say what is missing
        pass
    for i, cell in enumerate(page.evaluate(READ_CELL_FIGURES)):
        figures = cell["figures"]
        lines = [f"{cell['plotly_outputs']} plotly outputs, {len(figures)} figures drawn"] * (
            len(figures) < cell["plotly_outputs"])
        lines += blank_plots(figures)
        lines += [f"figure {layout['title'][:60]!r}: {line}" for layout in cell["layouts"]
                  for line in overlapping_labels(layout)]
        found += [(i, cell_line(notebook, i, sources, line)) for line in lines]
    return found


def blank_plots(figures: list[dict]) -> list[str]:
    """Figures not drawn, or drawn as empty axes: what a student saw when a widget's figure
    lost its traces on the way to the front end (issue #33)."""
    return [f"blank plot {f['title'][:60] or '(untitled)'!r}: "
            + ("not drawn" if not f["drawn"] else f"axes but no marks ({f['traces']} traces in the page's data)")
            for f in figures if not (f["drawn"] and f["marks"])]


def cell_line(notebook: str, index: int, sources: list[str], what: str) -> str:
    """One problem, where a reader finds it: the notebook, the cell (its index in the .ipynb,
    markdown cells counted, as nbformat and nbclient count) and how its source starts."""
    start = sources[index].strip().splitlines()[:2] if index < len(sources) else []
    return f"{notebook}, cell {index} ({' / '.join(line.strip() for line in start)[:100]}): {what}"


def scroll_to_cell(page, index: int) -> None:
    page.locator(f"{PANEL} .jp-Notebook .jp-Cell").nth(index).scroll_into_view_if_needed()


def screenshot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.wait_for_timeout(300)    # let plotly finish drawing
    page.screenshot(path=str(ARTIFACTS / name))


def close(page, lab: Lab) -> None:
    """Close the tab and shut its kernel down (each holds a copy of the model)."""
    page.close()
    sessions = json.load(urllib.request.urlopen(f"{lab.url}/api/sessions?token={lab.token}", timeout=10))
    for session in sessions:
        urllib.request.urlopen(urllib.request.Request(f"{lab.url}/api/sessions/{session['id']}?token={lab.token}",
                                                      method="DELETE"), timeout=30)


def widget(page, button: str):
    """The widget box (the outermost VBox) that holds a button with this label."""
    return page.locator(".widget-vbox").filter(has=page.get_by_role("button", name=button, exact=True)).first


def figures_of(box) -> list[dict]:
    return box.evaluate(f"(el) => ({READ_FIGURES})(el)")
