"""A stepper's figures in a real browser on a slow machine: JupyterLab with its default
settings, *Run > Run All Cells* from the menu bar, with chromium's CPU throttled 20x while the
cells run and the widgets load. Every figure must draw with marks (issue #33's blank figures:
plotly's FigureWidget dropped its data when its module took over 2 s to load).

The notebooks themselves, their widgets clicked, run in a browser in
tests/notebooks/test_notebooks_in_browser.py. Uses Debian's /usr/bin/chromium through
Playwright's Python package (Playwright's own browser download cannot work offline).
"""
from __future__ import annotations

import pytest

from helpers.jupyterlab import (blank_plots, chromium, close, figures_of, jupyterlab, open_notebook, problems, run_all,
                                widget)

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
SLOW_MACHINE = 20    # CPU throttling: a JS loop runs 20x slower


@pytest.mark.slow
def test_a_stepper_draws_every_figure_on_a_slow_machine(tmp_path):
    """Issue #33: on a loaded machine the stepper's figures were blank axes for good. They were
    plotly FigureWidgets: anywidget loads a widget's module (plotly's 5 MB bundle, once per
    figure) before it handles any of its messages and drops them all when that takes over 2 s,
    among them the figure's data, sent just after the widget opens. Run twice in a row, as
    the blank figures came in one run of three."""
    import nbformat

    root = tmp_path / "notebooks"
    root.mkdir()
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(TINY_STEPPER)], metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}}),
        root / "tiny_stepper.ipynb")
    with jupyterlab(root, tmp_path) as lab, chromium() as browser:
        page = None
        for run in range(2):     # the second in a page loaded again: every module loads again
            page = open_notebook(browser, lab, "tiny_stepper.ipynb", page=page)
            run_all(page, lab, "tiny_stepper.ipynb", cpu_slowdown=SLOW_MACHINE)
            box = widget(page, "Step")
            assert len(figures_of(box)) == 3, f"run {run}: {figures_of(box)}"
            assert not blank_plots(figures_of(box)), f"run {run}: {blank_plots(figures_of(box))}"
            found = [line for _, line in problems(page, lab, "tiny_stepper.ipynb")]
            assert not found, f"run {run}: {found}"
        close(page, lab)
