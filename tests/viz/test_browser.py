"""The notebooks with widgets in a real browser, used as a student uses them: JupyterLab
with its default settings, *Run > Run All Cells* from the menu bar, then clicks on the
widgets. For each notebook: every figure rendered (a plotly div with its SVG), no "Error
displaying widget", no traceback in any output, and each click changes the figures.

    04 (block playground): allocate, fork, swap out, swap in, free, and an error shown as one line
    06 (stepper): Step, Run N, the slider, Reset; step numbers agree in title, slider and status
    08 (stepper over the swap run): Run N until a request is swapped to host memory
    a stepper on a CPU slowed 20x, run twice: every figure draws (issue #33's blank figures:
    plotly's FigureWidget dropped its data when its module took over 2 s to load)

Every plot must have drawn marks (heatmap cells, bars, lines, points): empty axes fail.

Uses Debian's /usr/bin/chromium through Playwright's Python package (Playwright's own
browser download cannot work offline). Screenshots are kept in tests/artifacts/.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers.browser import CHROMIUM, CHROMIUM_ARGS, skip_without_chromium

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"
NOTEBOOKS = ["04_paged_kv_cache.ipynb", "06_iteration_level_scheduling.ipynb", "08_preemption.ipynb"]
# A stepper on a tiny random model: its figures, not its model, are what a slow machine tests.
TINY_STEPPER = """import torch
from llmlab import EngineConfig, LLMEngine, ModelConfig, SamplingParams, viz
from llmlab.model.llama import LlamaModel

tiny = ModelConfig(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0)
engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", backend="torch", num_gpu_blocks=16, block_size=4),
                   model=LlamaModel.random(tiny, torch.float32, torch.device("cpu"), seed=0))
greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
stepper = viz.Stepper(engine, [viz.Arrival([1, 2, 3, 4, 5, 6], greedy, 0), viz.Arrival([7, 8, 9], greedy, 1)])
stepper.step(3)
stepper"""
SLOW_MACHINE = 20    # CPU throttling of the slow-machine test: a JS loop runs 20x slower
RUN_ALL_TIMEOUT_MS = 420_000    # a notebook's Run All on a loaded 2-core CI machine
ERROR_TEXT = r"Traceback|^\w*Error\b"    # an output that shows an error (re.M: ^ at each line)

# Every plotly figure of the open notebook: its title, whether plotly drew it (its SVG is
# there) and how many marks it drew (heatmap images, bars, lines, markers, table cells: empty
# axes have none), whether it lives in a widget, and its data (to see a click change it).
READ_FIGURES = """(root) => [...(root || document).querySelectorAll('.js-plotly-plot')].map(gd => {
    const title = gd.layout && gd.layout.title;
    return {title: String((title && (title.text !== undefined ? title.text : title)) || ''),
            drawn: !!gd.querySelector('svg.main-svg'),
            marks: gd.querySelectorAll('.heatmaplayer image, .barlayer .point, .scatterlayer .js-line, '
                                       + '.scatterlayer .point, .table .cell-rect').length,
            traces: (gd.data || []).length,
            in_widget: !!gd.closest('.widget-vbox'),
            data: JSON.stringify((gd.data || []).map(t => [t.name, t.x, t.y, t.z, t.text])),
            shapes: JSON.stringify(((gd.layout || {}).shapes || []).map(s => s.x0))};
})"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab with default settings (a fresh, empty settings folder) on 127.0.0.1, serving
    copies of the notebooks; yields (url, token) and shuts it and its kernels down after."""
    skip_without_chromium()
    pytest.importorskip("jupyterlab", reason="jupyterlab is missing")
    tmp = tmp_path_factory.mktemp("browser")
    root = tmp / "notebooks"
    root.mkdir()
    for name in NOTEBOOKS:
        shutil.copy(ROOT / "notebooks" / name, root / name)
    import nbformat

    stepper = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(TINY_STEPPER)], metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}})
    nbformat.write(stepper, root / "tiny_stepper.ipynb")
    token, port = secrets.token_hex(16), free_port()
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), PYTHONPATH=str(ROOT))
    env.pop("LLMLAB_WIDGETS", None)   # the kernel must find out for itself that widgets are drawn
    # one torch thread: on a small shared CI machine a second one only adds contention
    env.setdefault("OMP_NUM_THREADS", "1")
    log_path = tmp / "jupyterlab.log"
    log = open(log_path, "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--ServerApp.port_retries=0", "--ServerApp.allow_root=True"],
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
                    pytest.fail("JupyterLab did not start:\n" + log_path.read_text()[-3000:])
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


@pytest.fixture(scope="module")
def browser(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def open_and_run_all(browser, lab, notebook, cpu_slowdown=1, page=None):
    """Open the notebook (in `page`, or a new one), wait for its kernel, Run > Run All Cells
    from the menu bar, wait until every code cell has run; checks that nothing failed.
    `cpu_slowdown` throttles the page's CPU that many times from Run All on. Returns the page."""
    url, token = lab
    page = page or browser.new_page(viewport={"width": 1400, "height": 1000})
    # ?reset: a fresh workspace, not the tabs an earlier test left open
    page.goto(f"{url}/lab/tree/{notebook}?reset&token={token}")
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell", timeout=120_000)
    # the kernel starts, or JupyterLab asks which one to start: the default, as a student would
    select = page.locator(".jp-Dialog").get_by_role("button", name="Select", exact=True)
    idle = page.locator(".jp-StatusBar-TextItem", has_text=re.compile(r"\| Idle$")).first
    deadline = time.monotonic() + 180
    while not idle.is_visible():
        if select.is_visible():
            select.click()
        assert time.monotonic() < deadline, f"{notebook}: the kernel did not start"
        page.wait_for_timeout(500)
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-item:not(.lm-mod-disabled) .lm-Menu-itemLabel",
                 has_text=re.compile(r"^Run All Cells$")).click()
    throttle = page.context.new_cdp_session(page) if cpu_slowdown > 1 else None
    if throttle:        # while the cells run and their widgets load
        throttle.send("Emulation.setCPUThrottlingRate", {"rate": cpu_slowdown})
    # every cell numbered, or a traceback shown (kernels send them as stderr): after an error
    # Run All stops, the cells below never get a number, and waiting for them would only run
    # out the timeout (7 minutes); assert_nothing_failed then shows the error
    page.wait_for_function(
        "() => { const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');"
        " const prompts = [...panel.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(p => p.textContent.trim());"
        " const failed = [...panel.querySelectorAll('.jp-OutputArea-output[data-mime-type=\"application/vnd.jupyter.stderr\"]')]"
        f".some(o => new RegExp({json.dumps(ERROR_TEXT)}, 'm').test(o.textContent));"
        " return failed || (prompts.length > 0 && prompts.every(t => /^\\[\\d+\\]:$/.test(t))); }",
        timeout=RUN_ALL_TIMEOUT_MS, polling=1000)
    if throttle:
        throttle.send("Emulation.setCPUThrottlingRate", {"rate": 1})
        throttle.detach()
    assert_nothing_failed(page, notebook)
    return page


def assert_no_error_output(page, notebook):
    texts = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output").all_inner_texts()
    tracebacks = [t for t in texts if re.search(ERROR_TEXT, t, re.M)]
    assert not tracebacks, f"{notebook}: an output shows an error:\n{tracebacks[0][-2000:]}"


def assert_nothing_failed(page, notebook):
    assert_no_error_output(page, notebook)     # before waiting a minute for figures that will not come
    try:      # a figure displayed last may still be drawing
        page.wait_for_function(f"() => ({READ_FIGURES})(document.querySelector("
                               "'.jp-NotebookPanel:not(.lm-mod-hidden)')).every(f => f.marks > 0)",
                               timeout=60_000, polling=1000)
    except Exception:   # noqa: BLE001 -- the checks below say what is missing
        pass
    assert_no_error_output(page, notebook)
    body = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)").inner_text()
    assert "Error displaying widget" not in body, f"{notebook}: a widget did not display"
    figures = page.evaluate(READ_FIGURES)
    # every plotly output of a cell (a widget's figures are outputs of its Output widgets) has its figure
    plotly_outputs = page.evaluate("() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) "
                                   ".jp-OutputArea-output.jp-RenderedPlotly')].filter(o => !o.closest('.widget-vbox'))"
                                   ".length")
    assert len([f for f in figures if not f["in_widget"]]) >= plotly_outputs and figures, f"{notebook}: figures missing"
    assert all(f["drawn"] for f in figures), f"{notebook}: figures not drawn: {[f['title'] for f in figures if not f['drawn']]}"
    assert_every_plot_has_marks(figures, notebook)
    assert any(f["in_widget"] for f in figures), f"{notebook}: no widget figure"


def assert_every_plot_has_marks(figures, where):
    """No blank plot: empty axes (plotly drew its SVG but no trace) are what a student saw when
    a widget's figure lost its traces on the way to the front end."""
    blank = [f"{f['title'] or '(untitled)'} ({f['traces']} traces in the page's data)" for f in figures
             if not f["marks"]]
    assert not blank, f"{where}: blank plots, axes but no marks: {blank}"


def widget(page, button: str):
    """The widget box (the outermost VBox) that holds a button with this label."""
    return page.locator(".widget-vbox").filter(has=page.get_by_role("button", name=button, exact=True)).first


def figures_of(box):
    return box.evaluate(f"(el) => ({READ_FIGURES})(el)")


def titled(box, prefix):
    return next(f for f in figures_of(box) if f["title"].startswith(prefix))


def click_and_wait(box, button, prefix, title=None, timeout=120_000):
    """Click a widget's button; wait until the figure whose title starts with `prefix` changes
    (to `title`, when given: a long Run N redraws before its end too)."""
    before = titled(box, prefix)
    box.get_by_role("button", name=button, exact=True).click()
    box.page.wait_for_function(
        f"([el, prefix, before, title]) => ({READ_FIGURES})(el).some(f => f.title.startsWith(prefix) && "
        "(title === null ? (f.data !== before.data || f.title !== before.title || f.shapes !== before.shapes)"
        " : f.title === title))",
        arg=[box.element_handle(), prefix, before, title], timeout=timeout, polling=250)
    if button != "Reset":         # after a Reset no step has run: the step figures are empty
        assert_every_plot_has_marks(figures_of(box), f"after {button}")
    return titled(box, prefix)


def close(page, lab):
    """Close the tab and shut its kernel down (each holds a copy of the model)."""
    url, token = lab
    page.close()
    sessions = json.load(urllib.request.urlopen(f"{url}/api/sessions?token={token}", timeout=10))
    for session in sessions:
        urllib.request.urlopen(urllib.request.Request(f"{url}/api/sessions/{session['id']}?token={token}",
                                                      method="DELETE"), timeout=30)


def screenshot(page, name):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.wait_for_timeout(300)    # let plotly finish drawing
    page.screenshot(path=str(ARTIFACTS / name))


def trace_y(figure, index):
    return json.loads(figure["data"])[index][2]


@pytest.mark.slow
def test_04_block_playground(browser, lab):
    page = open_and_run_all(browser, lab, "04_paged_kv_cache.ipynb")
    box = widget(page, "swap out")
    box.scroll_into_view_if_needed()
    table = click_and_wait(box, "allocate", "KV block table")          # "a", 6 tokens
    assert trace_y(table, 0) == ["device pool", "req a"]
    table = click_and_wait(box, "fork", "KV block table")              # to the suggested "b"
    assert trace_y(table, 0) == ["device pool", "req a", "req b"]
    table = click_and_wait(box, "swap out", "KV block table")
    assert trace_y(table, 1) == ["host pool", "req a"] and "req a" not in trace_y(table, 0)
    table = click_and_wait(box, "swap in", "KV block table")
    assert trace_y(table, 1) == ["host pool"] and "req a" in trace_y(table, 0)
    table = click_and_wait(box, "free", "KV block table")
    assert trace_y(table, 0) == ["device pool", "req b"]
    box.get_by_role("button", name="free", exact=True).click()         # "a" is gone: one line says so
    log = box.locator(".widget-output").last
    log.get_by_text("no request 'a'").wait_for(timeout=30_000)
    lines = [line for line in log.inner_text().splitlines() if line.strip()]
    assert lines == ["ValueError: no request 'a' (there are: b)"], lines
    screenshot(page, "browser_playground.png")
    close(page, lab)


@pytest.mark.slow
def test_06_stepper(browser, lab):
    from playwright.sync_api import expect

    page = open_and_run_all(browser, lab, "06_iteration_level_scheduling.ipynb")
    box = widget(page, "Step")
    status = box.locator(".widget-html").first
    box.scroll_into_view_if_needed()
    assert titled(box, "KV block table")["title"] == "KV block table after step 2"   # stepper.step(3)
    table = click_and_wait(box, "Step", "KV block table")
    assert table["title"] == "KV block table after step 3"
    expect(status).to_contain_text("4 steps run")       # the status is redrawn right after the figures
    box.locator(".widget-text:has(label.widget-label:text-is('N')) input").fill("4")
    table = click_and_wait(box, "Run N", "KV block table", title="KV block table after step 7")
    page.wait_for_timeout(500)                           # the other figures follow in the same refresh
    bars = titled(box, "Batch composition")
    assert json.loads(bars["data"])[0][1] == list(range(8))          # x: steps 0..7
    # the slider: back to step 0 (the readout is editable, as a student would type a number)
    readout = box.locator(".widget-slider .widget-readout").first
    readout.click()
    page.keyboard.press("Control+A")
    page.keyboard.type("0")
    page.keyboard.press("Enter")
    page.wait_for_function(f"(el) => ({READ_FIGURES})(el).some(f => f.title === 'KV block table after step 0')",
                           arg=box.element_handle(), timeout=60_000)
    expect(status).to_contain_text("showing step 0 of 0..7")
    table = click_and_wait(box, "Reset", "KV block table")
    assert table["title"] == "KV block table (no step yet)"
    expect(status).to_contain_text("0 steps run")
    table = click_and_wait(box, "Step", "KV block table")
    # the issue this guards: after Reset, "1 steps", slider 0 and "after step 11" disagreed
    assert table["title"] == "KV block table after step 0"
    expect(status).to_contain_text("1 step run (showing step 0 of 0..0)")
    rows = [line.split("\t") for line in box.locator(".widget-html").nth(1).inner_text().splitlines()[1:]]
    assert rows and all(not row[-1].strip().startswith("ass") for row in rows), rows   # answers, not "assistant..."
    screenshot(page, "browser_stepper.png")
    close(page, lab)


@pytest.mark.slow
def test_08_stepper_until_a_swap(browser, lab):
    page = open_and_run_all(browser, lab, "08_preemption.ipynb")
    box = widget(page, "Run N")
    box.scroll_into_view_if_needed()
    assert titled(box, "KV block table")["title"] == "KV block table after step 1"
    box.locator(".widget-text:has(label.widget-label:text-is('N')) input").fill("60")
    click_and_wait(box, "Run N", "KV block table", timeout=300_000)
    page.wait_for_function("(el) => el.innerText.includes('all done')", arg=box.element_handle(), timeout=300_000)
    memory = titled(box, "KV cache blocks in use")
    host_used = trace_y(memory, 1)
    assert max(host_used) > 0, "the swap run should move blocks to host memory"
    timeline = titled(box, "Request timeline")
    swapped = next(t for t in json.loads(timeline["data"]) if t[0] == "swapped")
    assert swapped[2], "the timeline should show a swapped request"
    screenshot(page, "browser_preemption.png")
    close(page, lab)


@pytest.mark.slow
def test_a_stepper_draws_every_figure_on_a_slow_machine(browser, lab):
    """Issue #33: on a loaded machine the stepper's figures were blank axes for good. They were
    plotly FigureWidgets: anywidget loads a widget's module (plotly's 5 MB bundle, once per
    figure) before it handles any of its messages and drops them all when that takes over 2 s,
    among them the figure's data, sent just after the widget opens. Run twice in a row, as
    the blank figures came in one run of three."""
    page = None
    for run in range(2):
        page = open_and_run_all(browser, lab, "tiny_stepper.ipynb", cpu_slowdown=SLOW_MACHINE, page=page)
        box = widget(page, "Step")
        assert len(figures_of(box)) == 3, f"run {run}: {figures_of(box)}"
        assert_every_plot_has_marks(figures_of(box), f"run {run}")
    close(page, lab)
