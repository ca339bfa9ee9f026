"""Where the time goes, as plotly figures of a recorded `Trace` or a serving benchmark's report:
per-phase and per-kernel step timings, per-request latencies (TTFT, inter-token), latency
against request rate, and prefix-cache hits. Pure functions, like figures.py.
"""
from __future__ import annotations

import math
import statistics

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from llmlab.hooks import Trace
from llmlab.machine import is_busy, machine_note
from llmlab.viz.figures import SHARED, STATE_COLORS, title_band
from llmlab.viz.style import step_axis, title_with_note

PHASES = ("schedule", "swap", "prepare", "forward", "sample")


def phase_timings(trace: Trace | list[Trace]) -> go.Figure:
    """Milliseconds per engine phase (schedule, swap, prepare, forward, sample), stacked per step.
    Given several traces of one workload (repeats), each bar is the median over them and a
    black tick spans the fastest to the slowest whole step; one run's times swing with the
    machine's load. The subtitle says which machine measured them, and warns when it was busy."""
    traces = [trace] if isinstance(trace, Trace) else list(trace)
    num_steps = min((len(t.steps) for t in traces), default=0)
    steps = list(range(num_steps))   # step i = trace.steps[i], as in figures.py
    fig = go.Figure([go.Bar(name=phase, x=steps, y=[statistics.median(t.steps[i].timings.get(phase, 0.0) * 1e3
                                                                      for t in traces) for i in steps])
                     for phase in PHASES])
    spread = None
    if len(traces) > 1:
        totals = [[sum(t.steps[i].timings.values()) * 1e3 for t in traces] for i in steps]
        median_totals = [statistics.median(x) for x in totals]
        fig.add_trace(go.Scatter(name="fastest..slowest run", x=steps, y=median_totals, mode="markers",
                                 marker=dict(color="black", size=3), error_y=dict(
                                     type="data", symmetric=False, array=[max(x) - m for x, m in zip(totals, median_totals)],
                                     arrayminus=[m - min(x) for x, m in zip(totals, median_totals)])))
        spread = max((max(x) / min(x) for x in totals if min(x) > 0), default=None)
    runs = f" (median of {len(traces)} runs)" if len(traces) > 1 else " (one run)"
    fig.update_layout(barmode="stack", title=timing_title("Time per phase" + runs, traces, spread),
                      xaxis_title="engine step", yaxis_title="ms", height=340, margin=dict(t=70, b=40))
    return step_axis(fig, num_steps)


def timing_title(title: str, traces: list[Trace], spread: float | None = None) -> dict:
    """A figure title with, under it, timing_note(traces, spread) as its subtitle."""
    return title_with_note(title, timing_note(traces, spread))


def timing_note(traces: list[Trace], spread: float | None = None) -> str:
    """The machine that measured `traces` (recorded in their meta by viz.record; else this
    machine, now), and a warning when it was busy."""
    recorded = [t.meta["recorded_on"] for t in traces if t.meta.get("recorded_on")]
    if recorded:   # a trace saved elsewhere (notebooks/data) names its machine in words
        return f"recorded on {recorded[0]}"
    info = next((t.meta["machine"] for t in traces if t.meta.get("machine")), None)
    busy_runs = [t.meta["machine"] for t in traces if t.meta.get("machine") and is_busy(t.meta["machine"])]
    return machine_note(busy_runs[0] if busy_runs else info, spread)


def kernel_timings(trace: Trace) -> go.Figure:
    """Total milliseconds per kernel over the trace (needs engine.kernel_timing = True); the rest
    of the forward (matmuls, embedding, glue) is shown as "forward, outside kernels"."""
    totals: dict[str, float] = {}
    for s in trace.steps:
        for name, seconds in s.kernel_timings.items():
            totals[name] = totals.get(name, 0.0) + seconds * 1e3
    forward = sum(s.timings.get("forward", 0.0) for s in trace.steps if s.kernel_timings) * 1e3
    names = sorted(totals, key=totals.get) + ["forward, outside kernels"]
    values = [totals[n] for n in names[:-1]] + [max(0.0, forward - sum(totals.values()))]
    fig = go.Figure(go.Bar(x=values, y=names, orientation="h", marker_color=STATE_COLORS["decode"]))
    fig.update_layout(title=timing_title("Time per kernel, whole trace", [trace]), xaxis_title="ms",
                      height=140 + 30 * len(names), margin=dict(t=70, b=40))
    return fig


def request_latencies(trace: Trace) -> dict[str, dict]:
    """Per request: "ttft" (first token time - arrival, s), "itl" (gaps between its tokens, s),
    "ttft_steps" (steps from the one it was first scheduled in to its first token, inclusive)."""
    arrival = {a.request_id: a.time for a in trace.added}
    token_times: dict[str, list[float]] = {}
    first_step, first_token_step = {}, {}
    for i, s in enumerate(trace.steps):
        for item in s.scheduled:
            first_step.setdefault(item.request_id, i)
        for rid in s.sampled:
            token_times.setdefault(rid, []).append(s.time)
            first_token_step.setdefault(rid, i)
    out = {}
    for rid, times in token_times.items():
        out[rid] = {"ttft": times[0] - arrival[rid] if rid in arrival else math.nan,
                    "itl": [b - a for a, b in zip(times, times[1:])],
                    "ttft_steps": first_token_step[rid] - first_step[rid] + 1}
    return out


def latency_comparison(traces: dict[str, Trace], ttft_requests=None, itl_requests=None) -> go.Figure:
    """Time to first token (mean) and inter-token latency (median and worst) of several runs,
    in ms, over all requests or only the ids in `ttft_requests` / `itl_requests`."""
    labels = list(traces)
    stats = [request_latencies(t) for t in traces.values()]
    ttft = [_mean([r["ttft"] for rid, r in s.items() if ttft_requests is None or rid in ttft_requests]) * 1e3
            for s in stats]
    gaps = [sorted(g for rid, r in s.items() if itl_requests is None or rid in itl_requests for g in r["itl"])
            for s in stats]
    which = lambda ids: "" if ids is None else " of req " + ", ".join(map(str, ids))   # noqa: E731
    fig = make_subplots(rows=1, cols=2, subplot_titles=(f"time to first token{which(ttft_requests)}",
                                                        f"inter-token latency{which(itl_requests)}"))
    fig.add_trace(go.Bar(name="TTFT (mean)", x=labels, y=ttft, marker_color=STATE_COLORS["prefill"]),
                  row=1, col=1)
    fig.add_trace(go.Bar(name="ITL median", x=labels, y=[g[len(g) // 2] * 1e3 if g else 0 for g in gaps],
                         marker_color=STATE_COLORS["decode"]), row=1, col=2)
    fig.add_trace(go.Bar(name="ITL worst", x=labels, y=[g[-1] * 1e3 if g else 0 for g in gaps],
                         marker_color=STATE_COLORS["preempted"]), row=1, col=2)
    fig.update_yaxes(title_text="ms")
    fig.update_layout(barmode="group", height=360, margin=dict(b=40))
    # title_band, not a subtitle: the template's automargin makes room for a title and its
    # subtitle, not for the subplot titles under them, which the subtitle then covered
    return title_band(fig, "Latency", [timing_note(list(traces.values()))])


def _mean(values):
    return sum(values) / len(values) if values else 0.0


SERVING_METRICS = (("ttft_ms", "time to first token"), ("tpot_ms", "time per output token"),
                   ("e2e_ms", "end-to-end latency"))
PERCENTILES = (("p50", "#1F77B4"), ("p90", "#FF7F0E"), ("p99", "#D62728"))


def serving_latency(report: dict, title: str = "Latency vs request rate") -> go.Figure:
    """TTFT, TPOT and E2E percentiles (ms) against the arrival rate, from the report of
    `llmlab.bench.serving.run` (or its "results" list): one panel per metric, one line
    per percentile."""
    results = report["results"] if isinstance(report, dict) else report
    rates = [f"{r['rate']:g} req/s" for r in results]
    fig = make_subplots(rows=1, cols=3, subplot_titles=[name for _, name in SERVING_METRICS])
    for col, (key, _) in enumerate(SERVING_METRICS, start=1):
        for percentile, color in PERCENTILES:
            fig.add_trace(go.Scatter(name=percentile, x=rates, y=[r[key].get(percentile) for r in results],
                                     mode="lines+markers", line_color=color, legendgroup=percentile,
                                     showlegend=col == 1), row=1, col=col)
    fig.update_yaxes(title_text="ms", rangemode="tozero")
    fig.update_xaxes(type="category", title_text="arrival rate (Poisson)")
    fig.update_layout(title=title, height=360, margin=dict(t=80, b=40))
    return fig


def prefix_hits(trace: Trace) -> go.Figure:
    """Each request's prompt tokens: found in the prefix cache vs computed."""
    hits: dict[str, int] = {}
    for s in trace.steps:
        for rid, n in s.prefix_hit_tokens.items():
            hits[rid] = hits.get(rid, 0) + n
    ids = [a.request_id for a in trace.added]
    prompt = {a.request_id: a.num_prompt_tokens for a in trace.added}
    labels = [f"req {r}" for r in ids]
    fig = go.Figure([
        go.Bar(name="from the prefix cache", x=labels, y=[hits.get(r, 0) for r in ids], marker_color=SHARED),
        go.Bar(name="computed", x=labels, y=[prompt[r] - hits.get(r, 0) for r in ids],
               marker_color=STATE_COLORS["prefill"])])
    total = sum(prompt.values())
    rate = sum(hits.values()) / total if total else 0.0
    fig.update_layout(barmode="stack", title=f"Prompt tokens: {rate:.0%} of them found in the prefix cache",
                      xaxis_title="request", yaxis_title="prompt tokens", height=320, margin=dict(t=50, b=40))
    return fig
