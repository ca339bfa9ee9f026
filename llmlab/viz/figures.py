"""Pure functions from what the engine recorded to plotly figures.

Each takes a `Trace` and options and returns a `go.Figure`: the scheduler over time (batch
composition, request timeline, memory in use), and the colours and step numbers every viz
module shares. Nothing here runs a model or changes an engine. The KV block table is in
block_figures.py, timings and latencies in timing_figures.py, figures of tensors and kernels
(attention, tile schedules) in model_figures.py.

    trace = llmlab.viz.record(engine, workload)
    batch_composition(trace); request_timeline(trace); memory_usage(trace)

Steps are numbered from the start of the trace: "step i" is `trace.steps[i]`, on every
axis, title and slider (a StepRecord's own `.step` is the engine's counter, which keeps
running across generate calls; hovers show it as "engine step"). Figures keep a fixed set
of traces whatever the data (e.g. one bar trace per request state, even when empty), so a
widget can update them in place. `title_band` places a title and its notes where neither the
toolbar nor the subplot titles cover them; `log_ticks` labels a log axis in whole numbers.
"""
from __future__ import annotations

import math
import textwrap

import plotly.graph_objects as go

from llmlab.hooks import Trace
from llmlab.viz.style import step_axis

FREE, CACHED, SHARED = "#eeeeee", "#d8cfb8", "#444444"   # free, in prefix cache but free, shared
REQUEST_COLORS = ["#1F77B4", "#FF7F0E", "#2CA02C", "#D62728", "#9467BD", "#8C564B", "#E377C2",
                  "#BCBD22", "#17BECF"]
STATE_COLORS = {"waiting": "#c7c7c7", "prefill": "#FF7F0E", "decode": "#1F77B4",
                "preempted": "#D62728", "swapped": "#9467BD", "idle": "#BCBD22"}


def request_color(request_id: str) -> str:
    """A request keeps its colour in every figure (numeric ids index the palette)."""
    key = int(request_id) if str(request_id).isdigit() else sum(map(ord, str(request_id)))
    return REQUEST_COLORS[key % len(REQUEST_COLORS)]


def sorted_ids(request_ids):
    """Numeric ids in numeric order ("2" before "10"), names after them."""
    return sorted(request_ids, key=lambda r: (len(str(r)), str(r)))


# ---- titles ----------------------------------------------------------------------------------
# plotly's toolbar (the modebar: zoom, pan, download) is drawn over the top right of a figure,
# about 30 px tall, while the pointer is on it; a title in that band hides under it. Titles
# start below it, and the top margin holds them, their notes and the subplot titles below.
TOOLBAR_PX = 34
TITLE_PX = 24             # the title's line (plotly's default 17 px font)
NOTE_PX = 22              # each note line (<sup>) under it: plotly keeps the title's line spacing
SUBPLOT_TITLES_PX = 28    # subplot titles stand just above their plots, inside the top margin
NOTE_CHARS = 95           # a longer note is wrapped: it would run off a figure 700 px wide
# plotly drops the cap shift (0.7 em) of a title's first line when the title has several lines
MULTILINE_SHIFT_PX = 12


def title_band(fig: go.Figure, title: str, notes=(), gap_px: int = 12) -> go.Figure:
    """Give `fig` its title, one smaller line under it per note (the machine that measured,
    where a cost model was recorded, ...; repeats dropped, long ones wrapped), below the
    toolbar's band, and a top margin that holds them and, under them, the subplot titles:
    nothing drawn there covers anything else. A figure of a set height grows by what its
    margin grew, so its plot keeps its size."""
    lines = [line for note in dict.fromkeys(note for note in notes if note)
             for line in textwrap.wrap(note, NOTE_CHARS, break_on_hyphens=False)]
    text = title + "".join(f"<br><sup>{line}</sup>" for line in lines)
    subplot_titles = any(a.yref == "paper" and a.yanchor == "bottom" and a.y is not None and a.y >= 1
                         for a in fig.layout.annotations)
    top = TOOLBAR_PX + TITLE_PX + NOTE_PX * len(lines) + (SUBPLOT_TITLES_PX if subplot_titles else gap_px)
    if fig.layout.height is not None:
        before = fig.layout.margin.t if fig.layout.margin.t is not None else 100   # plotly's default
        fig.update_layout(height=fig.layout.height + max(0, top - before))
    pad = TOOLBAR_PX + (MULTILINE_SHIFT_PX if lines else 0)
    fig.update_layout(title=dict(text=text, y=1, yref="container", yanchor="top", pad=dict(t=pad)),
                      margin=dict(t=top))
    return fig


def log_ticks(low: float, high: float) -> dict:
    """tickvals and ticktext for a log axis from `low` to `high`, in whole numbers: the decades
    (1, 10, 100, ...), and 2 and 5 times them where the axis spans two decades or less, else
    the two ends. (plotly labels a short log axis with bare digits: "3 4 5 6 7 8 9 1000 2".)
    `fig.update_xaxes(type="log", **log_ticks(low, high))`."""
    if not 0 < low <= high:
        raise ValueError(f"a log axis needs 0 < low <= high, got {low}, {high}")
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    steps = (1, 2, 5) if last - first <= 2 else (1,)
    ticks = [m * 10.0 ** e for e in range(first, last + 1) for m in steps
             if low / 1.001 <= m * 10.0 ** e <= high * 1.001]
    if len(ticks) < 2:
        ticks = sorted({low, high})
    return dict(tickvals=ticks, ticktext=[f"{t:,.0f}" if t >= 1 else f"{t:g}" for t in ticks])


def step_index(trace: Trace, step: int) -> int:
    """The step number figures show for trace.steps[step] (negative indexes count from the end)."""
    index = step + len(trace.steps) if step < 0 else step
    if not 0 <= index < len(trace.steps):
        raise IndexError(f"step {step}: the trace has {len(trace.steps)} steps (0..{len(trace.steps) - 1})")
    return index


# ---- the scheduler over time ---------------------------------------------------------------
def batch_composition(trace: Trace, *, current_step: int | None = None) -> go.Figure:
    """Tokens in each step's flat batch: prefill-chunk tokens stacked on decode tokens,
    against the token budget (max_num_batched_tokens)."""
    steps = list(range(len(trace.steps)))
    detail = [f"(engine step {s.step})<br>" + ("<br>".join(f"req {i.request_id}: {i.kind} {i.num_tokens} "
                                                          f"@ {i.start_position}" for i in s.scheduled) or "idle")
              for s in trace.steps]
    fig = go.Figure()
    for kind, color in (("decode", STATE_COLORS["decode"]), ("prefill", STATE_COLORS["prefill"])):
        counts = [s.num_decode_tokens if kind == "decode" else s.num_prefill_tokens for s in trace.steps]
        fig.add_trace(go.Bar(name=f"{kind} tokens", x=steps, y=counts, marker_color=color,
                             customdata=detail, hovertemplate="step %{x}<br>%{customdata}<extra></extra>"))
    budgets = [s.token_budget for s in trace.steps]
    most = max((s.num_prefill_tokens + s.num_decode_tokens for s in trace.steps), default=1)
    off_chart = bool(budgets) and max(budgets) > 2 * most
    fig.add_trace(go.Scatter(name="token budget" + (f" ({max(budgets)}, off the chart)" if off_chart else ""),
                             x=steps, y=budgets, mode="lines",
                             line=dict(color="black", dash="dash", shape="hvh"),
                             visible="legendonly" if off_chart else True))
    fig.update_layout(barmode="stack", title="Batch composition per step", xaxis_title="engine step",
                      yaxis_title="tokens in the batch", height=320, margin=dict(t=50, b=40),
                      shapes=_step_marker(current_step))
    if off_chart:
        fig.update_yaxes(range=[0, most * 1.15])
    return step_axis(fig, len(trace.steps))


def _step_marker(step):
    if step is None:
        return []
    return [dict(type="line", x0=step, x1=step, y0=0, y1=1, yref="paper", line=dict(color="black", width=2))]


def request_states(trace: Trace) -> dict[str, list[str | None]]:
    """Each request's state in each recorded step: "prefill" | "decode" (scheduled),
    "waiting", "preempted" (recomputed: waiting again after losing its KV), "swapped",
    "idle" (running but not scheduled), or None (not yet added, or finished)."""
    ids = [a.request_id for a in trace.added]
    for s in trace.steps:
        scheduled = [i.request_id for i in s.scheduled]
        for rid in scheduled + s.waiting + list(s.block_tables) + list(s.host_block_tables):
            if rid not in ids:
                ids.append(rid)
    states = {rid: [] for rid in ids}
    lost_kv, done = set(), set()
    for s in trace.steps:
        kinds = {i.request_id: i.kind for i in s.scheduled}
        lost_kv |= set(s.preempted)
        for rid in ids:
            state = None
            if rid in done:
                pass
            elif rid in kinds:
                state = kinds[rid]
                lost_kv.discard(rid)
            elif rid in s.swapped_out or rid in s.host_block_tables:
                state = "swapped"
            elif rid in lost_kv:
                state = "preempted"
            elif rid in s.waiting:
                state = "waiting"
            elif rid in s.block_tables:
                state = "idle"
            states[rid].append(state)
        done |= set(s.finished)
    return states


def request_timeline(trace: Trace, *, x: str = "step", current_step: int | None = None) -> go.Figure:
    """Gantt chart of every request: waiting, prefill, decode, preempted, swapped, per step.
    x="step" spaces steps evenly; x="time" uses each step's wall time (ms since the first arrival)."""
    states = request_states(trace)
    if x == "time":
        first_step_start = [s.time - sum(s.timings.values()) for s in trace.steps[:1]]
        origin = min([a.time for a in trace.added] + first_step_start, default=0.0)
        ends = [(s.time - origin) * 1e3 for s in trace.steps]
        spans = list(zip([0.0] + ends[:-1], ends))
    elif x == "step":
        spans = [(i - 0.5, i + 0.5) for i in range(len(trace.steps))]
    else:
        raise ValueError(f"x must be 'step' or 'time', got {x!r}")
    runs = {state: ([], [], []) for state in STATE_COLORS}    # y, base, length
    for rid, per_step in states.items():
        start = 0
        for i in range(1, len(per_step) + 1):
            if i == len(per_step) or per_step[i] != per_step[start]:
                if per_step[start] is not None:
                    y, base, length = runs[per_step[start]]
                    y.append(f"req {rid}")
                    base.append(spans[start][0])
                    length.append(spans[i - 1][1] - spans[start][0])
                start = i
    fig = go.Figure()
    for state, (y, base, length) in runs.items():
        fig.add_trace(go.Bar(name=state, y=y, base=base, x=length, orientation="h",
                             marker_color=STATE_COLORS[state],
                             hovertemplate="%{y}: " + state + " from %{base} for %{x}<extra></extra>"))
    fig.update_layout(barmode="overlay", title="Request timeline", height=140 + 28 * len(states), yaxis_title="request",
                      xaxis_title="engine step" if x == "step" else "time since first arrival (ms)",
                      shapes=_step_marker(current_step), margin=dict(t=50, b=40))
    fig.update_yaxes(categoryorder="array", categoryarray=[f"req {r}" for r in states], autorange="reversed")
    return step_axis(fig, len(trace.steps)) if x == "step" else fig


def memory_usage(trace: Trace) -> go.Figure:
    """Used device and host KV blocks after each step."""
    steps = list(range(len(trace.steps)))
    fig = go.Figure()
    for name, used, total in (
            ("device blocks used", [s.total_device_blocks - s.free_device_blocks for s in trace.steps],
             [s.total_device_blocks for s in trace.steps]),
            ("host blocks used", [s.total_host_blocks - s.free_host_blocks for s in trace.steps],
             [s.total_host_blocks for s in trace.steps])):
        fig.add_trace(go.Scatter(name=name, x=steps, y=used, mode="lines+markers", line_shape="hv",
                                 customdata=total,
                                 hovertemplate="step %{x}: %{y}/%{customdata}<extra></extra>"))
    if trace.steps:
        fig.add_hline(y=trace.steps[0].total_device_blocks, line_dash="dash",
                      annotation_text="device capacity", annotation_position="top left")
    fig.update_layout(title="KV cache blocks in use", xaxis_title="engine step", yaxis_title="blocks",
                      height=300, margin=dict(t=50, b=40))
    return step_axis(fig, len(trace.steps))
