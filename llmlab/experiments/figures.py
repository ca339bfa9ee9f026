"""Plotly figures of experiment Results: latency CDFs, per-request timelines, what each step
ran over time, several results side by side, and a simulation's error against a real run.
Pure functions, like llmlab/viz: a Result (or several) in, a go.Figure out.

Several results are passed as a dict {name: Result} or a list (named "run 0", "run 1", ...
unless their meta says "label"); `compare` and `sweep` also take `Repeats` (run or simulate
with repeats=k) and draw their 95% intervals as error bars.
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from llmlab.experiments.cost_model import CostModel, swapped_blocks
from llmlab.experiments.repeats import Interval, Repeats
from llmlab.experiments.result import Result, step_durations
from llmlab.experiments.workload import Workload
from llmlab.machine import machine_note
from llmlab.viz.figures import REQUEST_COLORS, STATE_COLORS, log_ticks, title_band

METRIC_TITLES = {"ttft": "TTFT (s)", "tpot": "TPOT (s)", "e2e": "E2E latency (s)", "itl": "inter-token latency (s)"}
SUMMARY_KEYS = ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "e2e_p50", "e2e_p90")


def _named(results) -> dict[str, Result | Repeats]:
    if isinstance(results, (Result, Repeats)):
        return {results.meta.get("label", "run"): results}
    if isinstance(results, dict):
        return dict(results)
    return {r.meta.get("label", f"run {i}"): r for i, r in enumerate(results)}


def _with_notes(fig: go.Figure, results) -> go.Figure:
    """Under the title: which machine measured each real run (and whether it was busy), and
    where a simulation's cost model was recorded."""
    notes = []
    for result in _named(results).values():
        if result.meta.get("kind") == "run" and result.meta.get("machine"):
            notes.append(machine_note(result.meta["machine"]))
        elif result.meta.get("kind") == "simulate":
            recorded_on = result.meta.get("cost_model", {}).get("meta", {}).get("recorded_on", "unknown machine")
            notes.append(f"simulated with a cost model recorded on {recorded_on}")
    return title_band(fig, fig.layout.title.text, notes)


def workload_figure(workload: Workload) -> go.Figure:
    """Each request at its arrival time: prompt length up, output length as the marker size."""
    requests = workload.requests
    outputs = np.array([r.output_len for r in requests], dtype=float)
    fig = go.Figure(go.Scatter(x=[r.arrival_time for r in requests], y=[len(r.prompt_token_ids) for r in requests],
                               mode="markers", text=[f"request {r.request_id}: {r.output_len} output tokens"
                                                     for r in requests],
                               marker=dict(size=6 + 18 * outputs / outputs.max(), color=STATE_COLORS["prefill"],
                                           opacity=0.7, line=dict(width=0))))
    fig.update_layout(xaxis_title="arrival (s)", yaxis_title="prompt tokens", height=300, margin=dict(b=40))
    return title_band(fig, f"Workload: {len(requests)} requests (marker size = output length)")


def step_predictions(trace, cost_model: CostModel) -> go.Figure:
    """Every busy step of a recorded trace: measured wall time against the cost model's
    prediction; on the diagonal the model is exact."""
    points = [(cost_model.step_time(s.scheduled, swapped_blocks(s)) * 1e3, d * 1e3, s.num_prefill_tokens > 0)
              for s, d in zip(trace.steps, step_durations(trace)) if d and s.scheduled]
    fig = go.Figure()
    for mixed, name, color in ((False, "decode-only steps", STATE_COLORS["decode"]),
                               (True, "steps with a prompt chunk", STATE_COLORS["prefill"])):
        chosen = [p for p in points if p[2] == mixed]
        fig.add_trace(go.Scatter(x=[p[0] for p in chosen], y=[p[1] for p in chosen], mode="markers", name=name,
                                 marker=dict(color=color, size=6, opacity=0.7)))
    top = max((max(p[0], p[1]) for p in points), default=1.0)
    fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", name="exact", line=dict(color="#888", dash="dot")))
    fig.update_layout(xaxis_title="predicted (ms)", yaxis_title="measured (ms)", height=360, margin=dict(b=40))
    return title_band(fig, "Step time: measured vs predicted")


def latency_cdf(results, metrics=("ttft", "tpot", "e2e")) -> go.Figure:
    """Empirical CDF of each metric (one panel each), one line per result: where the tail is."""
    named = _named(results)
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=[METRIC_TITLES[m] for m in metrics])
    for i, (name, result) in enumerate(named.items()):
        color = REQUEST_COLORS[i % len(REQUEST_COLORS)]
        for col, metric in enumerate(metrics, 1):
            values = np.sort([v for v in (getattr(r, metric) for r in result.requests) if v is not None])
            fig.add_trace(go.Scatter(x=values, y=np.arange(1, len(values) + 1) / max(len(values), 1),
                                     mode="lines", name=name, legendgroup=name, showlegend=col == 1,
                                     line=dict(color=color, shape="hv")), row=1, col=col)
    fig.update_yaxes(title_text="fraction of requests", row=1, col=1)
    fig.update_layout(title="Latency CDFs", height=340, margin=dict(t=60, b=40))
    return _with_notes(fig, named)


def request_timeline(result: Result, max_requests: int = 60) -> go.Figure:
    """One row per request (the first `max_requests` by arrival): waiting (arrival -> first
    scheduled), prefill (-> first token), decode (-> finish); x marks preemptions."""
    requests = sorted(result.requests, key=lambda r: r.arrival)[:max_requests]
    ids = [r.request_id for r in requests]
    phases = {"waiting": [], "prefill": [], "decode": []}
    for r in requests:
        scheduled = r.first_scheduled if r.first_scheduled is not None else r.first_token
        bounds = [r.arrival, scheduled, r.first_token, r.finish]
        for (phase, values), start, end in zip(phases.items(), bounds, bounds[1:]):
            ok = start is not None and end is not None
            values.append((start if ok else 0.0, (end - start) if ok else 0.0))
    fig = go.Figure([go.Bar(name=phase, y=ids, x=[d for _, d in values], base=[s for s, _ in values],
                            orientation="h", marker_color=STATE_COLORS[phase])
                     for phase, values in phases.items()])
    preempted = [r for r in requests if r.num_preemptions]
    fig.add_trace(go.Scatter(name="preempted (count)", y=[r.request_id for r in preempted],
                             x=[r.finish for r in preempted], mode="markers+text",
                             text=[str(r.num_preemptions) for r in preempted], textposition="middle right",
                             marker=dict(symbol="x", color=STATE_COLORS["preempted"], size=9)))
    fig.update_layout(barmode="overlay", title=f"Requests over time ({result.meta.get('kind', 'run')})",
                      xaxis_title="seconds", yaxis=dict(title="request", autorange="reversed", type="category"),
                      height=160 + 14 * len(ids), margin=dict(t=50, b=40))
    return _with_notes(fig, result)


def step_timeline(result: Result) -> go.Figure:
    """Per step, against time: prefill and decode tokens in the batch, and the waiting queue."""
    steps = result.steps
    time = [s.time for s in steps]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.65, 0.35],
                        subplot_titles=["tokens per step", "waiting requests"])
    fig.add_trace(go.Scatter(x=time, y=[s.num_prefill_tokens for s in steps], name="prefill tokens",
                             mode="lines", line=dict(color=STATE_COLORS["prefill"], shape="hv")), row=1, col=1)
    fig.add_trace(go.Scatter(x=time, y=[s.num_decode_tokens for s in steps], name="decode tokens",
                             mode="lines", line=dict(color=STATE_COLORS["decode"], shape="hv")), row=1, col=1)
    fig.add_trace(go.Scatter(x=time, y=[s.num_waiting for s in steps], name="waiting", mode="lines",
                             line=dict(color=STATE_COLORS["waiting"], shape="hv"), fill="tozeroy"), row=2, col=1)
    fig.update_xaxes(title_text="seconds", row=2, col=1)
    fig.update_layout(title="What the engine ran", height=420, margin=dict(t=60, b=40))
    return _with_notes(fig, result)


def compare(results, keys=SUMMARY_KEYS, slo: dict | None = None) -> go.Figure:
    """Summary percentiles of several results side by side (grouped bars, seconds). A
    `Repeats` is drawn as the mean of its repeats with its 95% t interval as an error bar."""
    named = _named(results)
    fig = go.Figure()
    for i, (name, result) in enumerate(named.items()):
        summary = result.summary(slo)
        text = f" (SLO met {_mean(summary['slo_attainment']):.0%})" if slo else ""
        fig.add_trace(go.Bar(name=name + text, x=list(keys), y=[_mean(summary[k]) for k in keys],
                             error_y=_error_bars([summary[k] for k in keys]),
                             marker_color=REQUEST_COLORS[i % len(REQUEST_COLORS)]))
    fig.update_layout(barmode="group", title="Latency percentiles" + _repeats_note(named), yaxis_title="seconds",
                      height=340, margin=dict(t=50, b=40))
    return _with_notes(fig, named)


def rate_search(searches: dict) -> go.Figure:
    """SLO attainment at every rate `max_rate` tried ({name: RateSearch}), one line each, with
    the target and each search's answer marked: where a policy stops meeting its SLO."""
    fig = go.Figure()
    for i, (name, search) in enumerate(searches.items()):
        color = REQUEST_COLORS[i % len(REQUEST_COLORS)]
        points = sorted(search.points, key=lambda p: p["rate"])
        fig.add_trace(go.Scatter(x=[p["rate"] for p in points], y=[p["slo_attainment"] for p in points],
                                 mode="lines+markers", name=f"{name}: {search.rate:.3g} req/s", line=dict(color=color)))
        if search.rate > 0:
            fig.add_vline(x=search.rate, line=dict(color=color, dash="dot", width=1))
    targets = {search.target for search in searches.values()}
    for target in targets:
        fig.add_hline(y=target, line=dict(color="#888", dash="dash", width=1))
    fig.update_layout(title="SLO attainment against the arrival rate (max_rate's bisection)",
                      xaxis_title="requests/s", yaxis_title="fraction of requests within the SLO",
                      yaxis_range=[0, 1.02], height=340, margin=dict(t=50, b=40))
    return fig


def _mean(value) -> float:
    """A summary value: a number (one Result) or an Interval (Repeats), whose mean is drawn."""
    return value.mean if isinstance(value, Interval) else value


def _error_bars(values) -> dict | None:
    """Plotly error bars for the 95% intervals of Repeats; None for plain numbers or one repeat."""
    if not all(isinstance(v, Interval) and v.low is not None for v in values):
        return None
    return dict(type="data", symmetric=False, array=[v.high - v.mean for v in values],
                arrayminus=[v.mean - v.low for v in values], thickness=1.5)


def _repeats_note(results: dict) -> str:
    counts = sorted({len(r.results) for r in results.values() if isinstance(r, Repeats)})
    if not counts:
        return ""
    return f" (mean of {'/'.join(map(str, counts))} repeats, error bars: 95% t interval)"


def prediction_error(measured: Result, predicted: Result,
                     keys=("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "e2e_p50", "e2e_p90")) -> go.Figure:
    """(predicted - measured) / measured per summary metric, with the +-15% band the
    simulator aims for."""
    a, b = measured.summary(), predicted.summary()
    errors = [(b[k] - a[k]) / a[k] * 100 for k in keys]
    fig = go.Figure(go.Bar(x=list(keys), y=errors, text=[f"{e:+.0f}%" for e in errors],
                           marker_color=[STATE_COLORS["decode"] if abs(e) <= 15 else STATE_COLORS["preempted"]
                                         for e in errors]))
    fig.add_hrect(y0=-15, y1=15, fillcolor=STATE_COLORS["waiting"], opacity=0.25, line_width=0)
    fig.update_layout(title="Simulated vs measured", yaxis_title="error (%)", height=320, margin=dict(t=50, b=40))
    return _with_notes(fig, [measured, predicted])


def sweep(results: dict, keys=("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"), parameter: str = "parameter",
          slo: dict | None = None) -> go.Figure:
    """Summary metrics against a swept parameter ({value: Result or Repeats}): one panel per
    metric kind (TTFT, TPOT, ...), one line per percentile; Repeats with 95% error bars."""
    values = list(results)
    summaries = [results[v].summary(slo) for v in values]
    kinds = list(dict.fromkeys(k.split("_")[0] for k in keys))
    fig = make_subplots(rows=1, cols=len(kinds), subplot_titles=[METRIC_TITLES.get(k, k) for k in kinds])
    for i, key in enumerate(keys):
        fig.add_trace(go.Scatter(x=values, y=[_mean(s[key]) for s in summaries], name=key, mode="lines+markers",
                                 error_y=_error_bars([s[key] for s in summaries]),
                                 line=dict(color=REQUEST_COLORS[i % len(REQUEST_COLORS)])),
                      row=1, col=kinds.index(key.split("_")[0]) + 1)
    if all(isinstance(v, (int, float)) and v > 0 for v in values):
        fig.update_xaxes(title_text=parameter, type="log", **log_ticks(min(values), max(values)))
    else:
        fig.update_xaxes(title_text=parameter)
    fig.update_layout(title=f"Latency against {parameter}" + _repeats_note(results), height=340,
                      margin=dict(t=60, b=40))
    return _with_notes(fig, list(results.values()))
