"""Pure functions from what the engine recorded to plotly figures.

Each takes a `Trace` (or one `StepRecord`) and options and returns a `go.Figure`: the KV
block table and the scheduler over time. Nothing here runs a model or changes an engine.
Timings and latencies are in timing_figures.py, figures of tensors and kernels (attention,
tile schedules) in model_figures.py. Live state is drawn the same way: `engine_state` and
`block_manager_state` read it into a StepRecord first.

    trace = llmlab.viz.record(engine, workload)
    block_table(trace, step=5); batch_composition(trace); request_timeline(trace)

Figures keep a fixed set of traces whatever the data (e.g. one bar trace per request
state, even when empty), so a widget can update them in place.
"""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from llmlab.hooks import StepRecord, Trace

FREE, CACHED, SHARED = "#eeeeee", "#d8cfb8", "#444444"   # free, in prefix cache but free, shared
REQUEST_COLORS = ["#1F77B4", "#FF7F0E", "#2CA02C", "#D62728", "#9467BD", "#8C564B", "#E377C2",
                  "#BCBD22", "#17BECF"]
STATE_COLORS = {"waiting": "#c7c7c7", "prefill": "#FF7F0E", "decode": "#1F77B4",
                "preempted": "#D62728", "swapped": "#9467BD", "idle": "#BCBD22"}


def request_color(request_id: str) -> str:
    """A request keeps its colour in every figure (numeric ids index the palette)."""
    key = int(request_id) if str(request_id).isdigit() else sum(map(ord, str(request_id)))
    return REQUEST_COLORS[key % len(REQUEST_COLORS)]


def _by_id(request_ids):
    """Numeric ids in numeric order ("2" before "10"), names after them."""
    return sorted(request_ids, key=lambda r: (len(str(r)), str(r)))


# ---- the KV block table ------------------------------------------------------------------
def cached_tokens(trace: Trace, step: int = -1) -> dict[str, int]:
    """Tokens each request has in the KV cache after `trace.steps[step]` (from what was scheduled)."""
    tokens: dict[str, int] = {}
    for record in trace.steps[: len(trace.steps) + step + 1 if step < 0 else step + 1]:
        for rid in record.preempted:
            tokens[rid] = 0
        for item in record.scheduled:
            tokens[item.request_id] = item.start_position + item.num_tokens
        for rid in record.finished:
            tokens.pop(rid, None)
    return tokens


def block_table(source: Trace | StepRecord, step: int = -1, *, block_size: int | None = None,
                num_tokens: dict[str, int] | None = None, max_blocks: int = 128,
                title: str | None = None) -> go.Figure:
    """The KV cache after one step: physical blocks (x) by owner (y), device and host.

    Top row "pool": every device block, coloured by its owner, dark when shared (ref count > 1),
    grey when free, beige when free but still in the prefix cache; its text is the number of
    tokens the block holds, when known: from a Trace whose meta has "block_size", or from
    `num_tokens` (request id -> tokens in the cache) and `block_size`. One row per
    running request: the cell at physical block b says which logical block of the request it
    is (block_tables[request][logical] == b). The lower panel is host memory: blocks of
    swapped-out requests (host_block_tables).
    """
    if isinstance(source, Trace):
        record = source.steps[step]
        block_size = block_size or source.meta.get("block_size")
        tokens = cached_tokens(source, step) if block_size else {}
    else:
        record, tokens = source, {}
    if num_tokens is not None:
        tokens = num_tokens
    owners = _by_id(set(record.block_tables) | set(record.host_block_tables))
    code = {rid: i + 3 for i, rid in enumerate(owners)}         # colour codes 0-2: free, cached, shared
    colors = [FREE, CACHED, SHARED] + [request_color(rid) for rid in owners]
    draw = dict(code=code, colors=colors, tokens=tokens, block_size=block_size, max_blocks=max_blocks)
    device, device_width = _block_panel(record.block_tables, record.total_device_blocks, "device pool",
                                        set(record.cached_blocks), set(record.shared_blocks), **draw)
    host, host_width = _block_panel(record.host_block_tables, record.total_host_blocks, "host pool", **draw)
    device_rows, host_rows = len(device.y), len(host.y)
    row_px, gap_px = 26, 80          # fixed pixels per row, so cells look alike in any figure
    plot_px = row_px * (device_rows + host_rows) + gap_px
    titles = (f"device: {record.free_device_blocks}/{record.total_device_blocks} blocks free",
              f"host (swap space): {record.free_host_blocks}/{record.total_host_blocks} blocks free")
    fig = make_subplots(rows=2, cols=1, row_heights=[device_rows, host_rows],
                        vertical_spacing=gap_px / plot_px, subplot_titles=titles)
    fig.add_trace(device, row=1, col=1)
    fig.add_trace(host, row=2, col=1)
    legend = (("free", FREE), ("free, kept in the prefix cache", CACHED), ("shared (ref count > 1)", SHARED))
    for name, color in legend:
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name, showlegend=True,
                                 marker=dict(symbol="square", size=12, color=color)), row=1, col=1)
    panels = ((1, device_width, record.total_device_blocks), (2, host_width, record.total_host_blocks))
    for row, width, total in panels:
        shown = f" (first {width} of {total})" if width < total else ""
        fig.update_xaxes(range=[-0.5, width - 0.5], row=row, col=1, title_text="physical block" + shown,
                         title_standoff=2, dtick=1 if width <= 32 else None)
        fig.update_yaxes(autorange="reversed", row=row, col=1)
    height = plot_px + 150
    fig.update_layout(title=dict(text=title or f"KV block table after step {record.step}", y=1 - 12 / height,
                                 yanchor="top"), height=height,
                      margin=dict(l=80, r=20, t=100, b=50), plot_bgcolor="white",
                      legend=dict(orientation="h", x=0, y=1 - 50 / height, yref="container", yanchor="top"))
    return fig


def _block_panel(tables, total, pool_label, cached=(), shared=(), *,
                 code, colors, tokens, block_size, max_blocks):
    """One heatmap: a pool row (state of every block) above one row per request."""
    used = [b for table in tables.values() for b in table]
    width = max(total if total <= max_blocks else max(max(used, default=0) + 1, max_blocks), 1)
    holders: dict[int, list[tuple[str, int]]] = {}     # physical block -> [(request, logical block)]
    for rid, table in tables.items():
        for logical, b in enumerate(table):
            holders.setdefault(b, []).append((rid, logical))
    pool_z, pool_text, pool_hover = [], [], []
    for b in range(width):
        held = holders.get(b, [])
        fills = [_fill(tokens.get(rid), logical, block_size) for rid, logical in held]
        fill = max((f for f in fills if f is not None), default=None)
        if len(held) > 1 or b in shared:
            z, hover = 2.5, f"block {b}: shared by " + ", ".join(f"req {r}" for r, _ in held)
        elif held:
            z, hover = code[held[0][0]] + 0.5, f"block {b}: req {held[0][0]}, logical block {held[0][1]}"
        elif b >= total:
            z, hover = None, ""
        elif b in cached:
            z, hover = 1.5, f"block {b}: free, cached prefix (evictable)"
        else:
            z, hover = 0.5, f"block {b}: free"
        pool_z.append(z)
        pool_text.append("" if fill is None else str(fill))
        pool_hover.append(hover + ("" if fill is None else f", {fill}/{block_size} tokens"))
    z, text, hover = [pool_z], [pool_text], [pool_hover]
    rows = _by_id(tables)
    for rid in rows:
        where = {b: logical for logical, b in enumerate(tables[rid])}
        z.append([code[rid] + 0.5 if b in where else None for b in range(width)])
        text.append([str(where[b]) if b in where else "" for b in range(width)])
        hover.append([f"req {rid}: logical block {where[b]} -> physical block {b}" if b in where else ""
                      for b in range(width)])
    heatmap = go.Heatmap(z=z, x=list(range(width)), y=[pool_label] + [f"req {r}" for r in rows],
                         text=text, texttemplate="%{text}", customdata=hover,
                         hovertemplate="%{customdata}<extra></extra>", colorscale=_discrete(colors),
                         zmin=0, zmax=len(colors), showscale=False, xgap=1, ygap=1)
    return heatmap, width


def _fill(num_tokens, logical, block_size):
    if num_tokens is None or not block_size:
        return None
    return max(0, min(block_size, num_tokens - logical * block_size))


def _discrete(colors):
    n = len(colors)
    scale = []
    for i, c in enumerate(colors):
        scale += [[i / n, c], [(i + 1) / n, c]]
    return scale


# ---- the scheduler over time ---------------------------------------------------------------
def batch_composition(trace: Trace, *, current_step: int | None = None) -> go.Figure:
    """Tokens in each step's flat batch: prefill-chunk tokens stacked on decode tokens,
    against the token budget (max_num_batched_tokens)."""
    steps = [s.step for s in trace.steps]
    detail = ["<br>".join(f"req {i.request_id}: {i.kind} {i.num_tokens} @ {i.start_position}"
                          for i in s.scheduled) or "idle" for s in trace.steps]
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
    return fig


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
        spans = [(s.step - 0.5, s.step + 0.5) for s in trace.steps]
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
    fig.update_layout(barmode="overlay", title="Request timeline", height=140 + 28 * len(states),
                      xaxis_title="engine step" if x == "step" else "time since first arrival (ms)",
                      shapes=_step_marker(current_step), margin=dict(t=50, b=40))
    fig.update_yaxes(categoryorder="array", categoryarray=[f"req {r}" for r in states], autorange="reversed")
    return fig


def memory_usage(trace: Trace) -> go.Figure:
    """Used device and host KV blocks after each step."""
    steps = [s.step for s in trace.steps]
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
    return fig


# ---- live state as a StepRecord ------------------------------------------------------------
def block_manager_state(block_manager, requests, step: int = 0) -> StepRecord:
    """What `block_table` needs, read from a live BlockManager and the requests it serves."""
    bm = block_manager
    return StepRecord(
        step=step,
        block_tables={r.request_id: list(r.block_table) for r in requests if r.block_table},
        host_block_tables={k: list(v) for k, v in bm.host_tables.items()},
        shared_blocks=[b for b, count in enumerate(bm.ref_counts) if count > 1],
        cached_blocks=sorted(bm.cached_blocks.values()),
        free_device_blocks=bm.num_free_blocks, total_device_blocks=bm.num_device_blocks,
        free_host_blocks=bm.num_free_host_blocks, total_host_blocks=bm.num_host_blocks)


def engine_state(engine) -> StepRecord:
    """The engine's block tables now (running requests, and swapped ones on the host)."""
    record = block_manager_state(engine.block_manager, engine.scheduler.running, engine.step_index)
    record.waiting = [r.request_id for r in engine.scheduler.waiting]
    return record
