"""Every notebook as a student runs it (issue #33): JupyterLab with its default settings,
*Run > Run All Cells* from the menu bar, in Debian's chromium. A notebook fails, with the cell
(its index in the .ipynb) and how its source starts, on

- an output that shows an error (a traceback);
- a plotly output without its figure, or a plot drawn as axes without marks;
- labels drawn over each other (title, subtitle, annotations and subplot titles, legend,
  table, plotly's toolbar), measured on the live page as tests/viz/test_figure_layout.py
  measures figures on a page of their own;
- a cell that runs 60 s without new output (helpers.jupyterlab.SILENT_CELL_S): to a student
  it looks hung, so a long cell prints its progress.

A notebook of test_notebook_reruns.RERUN then runs all its cells again in the same kernel,
checked the same way (issue #38: a cell that reuses a name another cell changed, a server
started twice). The notebooks with widgets are then used, on the page of their last run:
04's block playground and 06's and 08's steppers, clicked as a student would; each click
must change the figures and leave no plot blank.

Where chromium is here this is the notebook's execution in `make test`: conftest.py leaves
out nbval's run of each notebook run here and the rerun test of each run twice here, so each
notebook runs once (twice for RERUN), as before. Without chromium these tests skip and nbval
and the rerun test run the notebooks as they did. The copies run in a folder without data/,
so every notebook must find its data through teach.data_file. Screenshots of failures, and
of the widgets after their clicks, are kept in tests/artifacts/.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers.browser import READ_FIGURES
from helpers.jupyterlab import (blank_plots, chromium, close, figures_of, jupyterlab, open_notebook, problems,
                                run_all, screenshot, scroll_to_cell, widget)
from test_notebook_reruns import RERUN     # one list of the notebooks run twice, for both ways of running them

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"

pytestmark = pytest.mark.slow     # a notebook and its kernel: minutes


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab serving copies of every notebook (this worker's own, under pytest-xdist)."""
    scratch = tmp_path_factory.mktemp("jupyterlab")
    root = scratch / "notebooks"
    root.mkdir()
    for path in NOTEBOOKS.glob("*.ipynb"):
        shutil.copy(path, root / path.name)
    with jupyterlab(root, scratch) as server:
        yield server


@pytest.fixture(scope="module")
def browser(lab):
    with chromium() as browser:
        yield browser


def check(page, lab, notebook: str, run: int) -> None:
    found = problems(page, lab, notebook)
    if found:
        scroll_to_cell(page, found[0][0])
        screenshot(page, f"browser_{Path(notebook).stem}_failed.png")
        raise AssertionError(f"run {run}: " + "\n".join(line for _, line in found))


@pytest.mark.parametrize("name", sorted(path.stem for path in NOTEBOOKS.glob("*.ipynb")))
def test_every_notebook_runs_in_jupyterlab(browser, lab, name):
    notebook = f"{name}.ipynb"
    page = open_notebook(browser, lab, notebook)
    try:
        for run in range(1, 3 if name in RERUN else 2):
            seconds = run_all(page, lab, notebook)
            print(f"{notebook}: Run All {run} took {seconds:.0f} s")
            check(page, lab, notebook, run)
        if name in WIDGETS:
            WIDGETS[name](page)
    finally:
        close(page, lab)


# ---- the widgets, clicked ------------------------------------------------------------------
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
        blank = blank_plots(figures_of(box))
        assert not blank, f"after {button}: {blank}"
    return titled(box, prefix)


def trace_y(figure, index):
    return json.loads(figure["data"])[index][2]


def click_block_playground(page):
    """04: allocate, fork, swap out, swap in, free, and an error shown as one line."""
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


def click_stepper(page):
    """06: Step, Run N, the slider, Reset; step numbers agree in title, slider and status."""
    from playwright.sync_api import expect

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


def run_stepper_until_a_swap(page):
    """08: Run N until a request is swapped to host memory."""
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


WIDGETS = {"04_paged_kv_cache": click_block_playground, "06_iteration_level_scheduling": click_stepper,
           "08_preemption": run_stepper_until_a_swap}
