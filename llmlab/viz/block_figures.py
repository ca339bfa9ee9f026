"""The KV block table as a plotly figure: physical blocks by owner, device and host pools.

`block_table` draws one step of a `Trace`, or any `StepRecord`; live state is drawn the
same way, read into a StepRecord first (`engine_state`, `block_manager_state`). Pure
functions, like figures.py; the playground (playground.py) and the Stepper (widgets.py)
redraw these in place.
"""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from llmlab.hooks import StepRecord, Trace
from llmlab.viz.figures import CACHED, FREE, SHARED, sorted_ids, request_color, step_index
from llmlab.viz.style import TOOLBAR_PX


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
    swapped-out requests (host_block_tables); there is none where there is no host memory.
    """
    if isinstance(source, Trace):
        index = step_index(source, step)
        record = source.steps[index]
        block_size = block_size or source.meta.get("block_size")
        tokens = cached_tokens(source, index) if block_size else {}
        title = title or f"KV block table after step {index}"
    else:
        record, tokens = source, {}
        title = title or "KV block table"
    if num_tokens is not None:
        tokens = num_tokens
    owners = sorted_ids(set(record.block_tables) | set(record.host_block_tables))
    code = {rid: i + 3 for i, rid in enumerate(owners)}         # colour codes 0-2: free, cached, shared
    colors = [FREE, CACHED, SHARED] + [request_color(rid) for rid in owners]
    draw = dict(code=code, colors=colors, tokens=tokens, block_size=block_size, max_blocks=max_blocks)
    device, device_width = _block_panel(record.block_tables, record.total_device_blocks, "device pool",
                                        set(record.cached_blocks), set(record.shared_blocks), **draw)
    # an allocator with no host memory (exercise 09's, an engine with swap_space=0) gets no empty panel
    has_host = bool(record.total_host_blocks or record.host_block_tables)
    panels = [(device, device_width, record.total_device_blocks)]
    if has_host:
        host, host_width = _block_panel(record.host_block_tables, record.total_host_blocks, "host pool", **draw)
        panels.append((host, host_width, record.total_host_blocks))
    row_px, gap_px = 26, 80          # fixed pixels per row, so cells look alike in any figure
    plot_px = row_px * sum(len(heatmap.y) for heatmap, _, _ in panels) + gap_px * (len(panels) - 1)
    # what the numbers in the cells mean, said where they are drawn
    legend_text = (f" · pool: tokens held (of {block_size})" if tokens and block_size else "") + \
        (" · rows: logical block" if record.block_tables else "")
    titles = (f"device: {record.free_device_blocks}/{record.total_device_blocks} blocks free{legend_text}",
              f"host (swap space): {record.free_host_blocks}/{record.total_host_blocks} blocks free")
    fig = make_subplots(rows=len(panels), cols=1, row_heights=[len(heatmap.y) for heatmap, _, _ in panels],
                        vertical_spacing=gap_px / plot_px if has_host else 0, subplot_titles=titles[:len(panels)])
    fig.update_annotations(font_size=13)    # the subplot titles: long enough to wrap at 16 px
    for row, (heatmap, _, _) in enumerate(panels, start=1):
        fig.add_trace(heatmap, row=row, col=1)
    legend = (("free", FREE), ("free, kept in the prefix cache", CACHED), ("shared (ref count > 1)", SHARED))
    for name, color in legend:
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name, showlegend=True,
                                 marker=dict(symbol="square", size=12, color=color)), row=1, col=1)
    for row, (_, width, total) in enumerate(panels, start=1):
        shown = f" (first {width} of {total})" if width < total else ""
        fig.update_xaxes(range=[-0.5, width - 0.5], row=row, col=1, title_text="physical block" + shown,
                         title_standoff=2, dtick=1 if width <= 32 else None)
        fig.update_yaxes(autorange="reversed", row=row, col=1)
    # from the top: the toolbar, the title below it (the house template), the legend, the panels
    height = plot_px + 150 + TOOLBAR_PX
    legend_top_px = TOOLBAR_PX + 34
    fig.update_layout(title=dict(text=title), height=height,
                      margin=dict(l=80, r=20, t=100 + TOOLBAR_PX, b=50), plot_bgcolor="white",
                      legend=dict(orientation="h", x=0, y=1 - legend_top_px / height, yref="container",
                                  yanchor="top"))
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
    rows = sorted_ids(tables)
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
