"""Figures read cleanly where a browser draws them: no title, note ("measured on ..."),
subplot title, legend or table hidden under another or under plotly's toolbar, and log axes
labelled in whole numbers. The figures of notebooks 12 and 13 (and the timing figures), on
small data, drawn by Debian's chromium at two widths a notebook gives them."""
from __future__ import annotations

import pathlib

import pytest
import torch

from llmlab import EngineConfig, viz
from llmlab.experiments import (CostModel, Workload, compare, latency_cdf, prediction_error, request_timeline,
                                simulate, step_predictions, step_timeline, sweep, workload_figure)
from llmlab.engine.parallel.pipeline import StageSpan
from llmlab.hooks import Trace
from llmlab.viz import kv_quant_figures, parallel_figures
from llmlab.viz.figures import log_ticks, title_band

from helpers.browser import CHROMIUM, CHROMIUM_ARGS, READ_LAYOUT, overlapping_labels, skip_without_chromium

BUSY = {"device": "Intel(R) Xeon(R) Platinum 8488C", "cores": 2, "torch_threads": 1, "load": 5.6, "gpu": False}


def figures() -> dict:
    workload = Workload.poisson(12, rate=4.0, prompt_len=(16, 200), output_len=(4, 12), seed=0, vocab_size=1000)
    meta = {"num_gpu_blocks": 64, "max_model_len": 2048, "recorded_on": "CPU (2 cores), torch 2.13.0, 1 threads"}

    def config(budget=256):
        return EngineConfig(device="cpu", block_size=16, num_gpu_blocks=64, max_num_batched_tokens=budget,
                            max_num_seqs=8)
    cost = CostModel({"intercept": 0.02, "prefill_tokens": 1e-4, "decode_tokens": 1e-3}, meta)
    simulated = simulate(workload, config(), cost, record_trace=True)
    measured = simulate(workload, config(), CostModel({"intercept": 0.022, "prefill_tokens": 1.1e-4}, meta),
                        record_trace=True)
    measured.meta.update(kind="run", machine=BUSY)       # as run() records a busy machine
    budgets = {b: simulate(workload, config(b), cost) for b in (256, 512, 1024, 2048)}
    errors = torch.rand(30, 512, 3, generator=torch.Generator().manual_seed(0)) * 0.02
    schemes = ("int8 per token-head", "int8 per channel per block", "int8 per tensor",
               "int8 per token-head, Hadamard-rotated", "fp8 e4m3 per token-head", "fp8 e4m3 scale 1")
    rows = [{"cache": cache, "bytes_per_token_per_layer": 400, "perplexity": 3.2, "ppl_change_pct": 0.1,
             "mean_kl": 5e-4, "top1_agreement_pct": 98.7}
            for cache in ("full precision (auto)", "int8, per token-head (engine)",
                          "int8, K per channel per block, V per token-head (KIVI-style)")]
    timed = Trace(steps=measured.trace.steps, meta={"machine": BUSY})
    return {
        "workload": workload_figure(workload),
        "request timeline": request_timeline(measured),
        "compare": compare({"budget 512": measured, "budget 32": simulated}),
        "step timeline": step_timeline(measured),
        "latency CDFs": latency_cdf({"fcfs": measured, "shortest prompt first": simulated}),
        "prediction error": prediction_error(measured, simulated),
        "sweep": sweep(budgets, keys=("ttft_p50", "ttft_p90", "itl_p90", "itl_p99"),
                       parameter="token budget (max_num_batched_tokens)"),
        "step predictions": step_predictions(measured.trace, cost),
        "error heatmaps": kv_quant_figures.error_heatmaps(errors, "K"),
        "granularity": kv_quant_figures.granularity_errors([{"scheme": s, "k_rel_err_mean": 0.01,
                                                             "v_rel_err_mean": 0.008} for s in schemes]),
        "accuracy table": kv_quant_figures.accuracy_table(rows),
        "blocks per budget": kv_quant_figures.blocks_per_budget(
            {"float32 (auto on a CPU)": 14, "bfloat16 (auto on a GPU)": 29, "int8": 54}, 0.01),
        "requests in cache": kv_quant_figures.requests_in_cache({"float32": measured.trace,
                                                                "int8": simulated.trace}, 5),
        "phase timings": viz.phase_timings([timed, timed]),
        "latency comparison": viz.latency_comparison({"run": timed}),
        "pipeline timeline": parallel_figures.pipeline_timeline(
            [StageSpan(step, rank, rank, m, 8, step + 0.1 * (rank + m), step + 0.1 * (rank + m + 1))
             for step in range(3) for rank in range(2) for m in range(2)]),
        "kernel benchmark": viz.kernel_benchmark(
            [{"shape": s, "impl": impl, "ms": ms * (1 + i)} for i, s in enumerate(("batch 1", "batch 8", "batch 64"))
             for impl, ms in (("v1", 0.3), ("v2", 0.12))], "decode attention, ms per call",
            machine=viz.machine_note(BUSY)),
    }


def test_log_ticks_are_whole_numbers_at_decades():
    assert log_ticks(256, 2048) == {"tickvals": [500.0, 1000.0, 2000.0], "ticktext": ["500", "1,000", "2,000"]}
    assert log_ticks(1, 10_000)["tickvals"] == [1, 10, 100, 1000, 10_000]        # wide: decades only
    assert log_ticks(300, 400)["ticktext"] == ["300", "400"]                       # narrow: its ends
    with pytest.raises(ValueError):
        log_ticks(0, 10)


def test_notes_go_under_the_title_above_the_subplot_titles():
    fig = latency_cdf({"run": simulate(Workload.offline(4, prompt_len=8, output_len=2, vocab_size=100),
                                       EngineConfig(device="cpu", num_gpu_blocks=16),
                                       CostModel.constant(0.01, {"recorded_on": "a test machine"}))})
    assert "<sup>simulated with a cost model recorded on a test machine</sup>" in fig.layout.title.text
    assert [a.text for a in fig.layout.annotations] == ["TTFT (s)", "TPOT (s)", "E2E latency (s)"]   # titles only
    one_line = title_band(latency_cdf({}), "Latency CDFs").layout.margin.t
    assert fig.layout.margin.t > one_line      # the note's line is added to the margin


@pytest.mark.slow
def test_no_label_is_drawn_over_another_or_under_the_toolbar(tmp_path):
    skip_without_chromium()
    import plotly.offline
    from playwright.sync_api import sync_playwright

    drawn = figures()
    page_html = ["<html><head><meta charset='utf-8'><script>", plotly.offline.get_plotlyjs(), "</script></head><body>"]
    for width in (700, 1000):    # a narrow notebook column, and JupyterLab's at 1400 px
        for fig in drawn.values():
            # the toolbar shows while the pointer is on a figure: here always
            page_html.append(f"<div style='width:{width}px'>" + fig.to_html(
                full_html=False, include_plotlyjs=False, config={"displayModeBar": True}) + "</div>")
    path = pathlib.Path(tmp_path) / "figures.html"
    path.write_text("".join(page_html) + "</body></html>")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(path.as_uri())
            page.wait_for_function(f"() => document.querySelectorAll('.js-plotly-plot .main-svg').length >= "
                                   f"{2 * len(drawn)}", timeout=60_000)
            layouts = page.evaluate(READ_LAYOUT)
        finally:
            browser.close()
    names = [f"{name} at {width} px" for width in (700, 1000) for name in drawn]
    problems = [f"{name}: {line}" for name, layout in zip(names, layouts) for line in overlapping_labels(layout)]
    assert not problems, "\n".join(problems)
    sweep_ticks = layouts[list(drawn).index("sweep")]["ticks"]["xtick"]
    assert sweep_ticks and all(float(t.replace(",", "")) >= 100 for t in sweep_ticks), sweep_ticks   # no bare "3 4 5"
    kernel_ticks = layouts[list(drawn).index("kernel benchmark")]["ticks"]["ytick"]
    # 0.12 .. 0.9 ms: 1-2-5 ticks written out (viz.style.log_axis), not plotly's bare "2 3 4 5"
    assert len(kernel_ticks) >= 2 and set(kernel_ticks) <= {"0.1", "0.2", "0.5", "1"}, kernel_ticks
