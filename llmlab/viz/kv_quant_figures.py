"""KV-cache quantization, drawn: where the error of an 8-bit cache sits (by layer, kv head
and token position), how the scale granularities compare, what a memory budget holds and
how many requests it holds at once.

Pure functions of tensors and of `llmlab.bench.kv_quant`'s result rows:

    keys, values = kv_quant.capture_kv(model, token_ids)          # [L, T, Hkv, D] each
    error_heatmaps(kv_quant.relative_error(keys, kv_quant.per_token_head), ...)
    granularity_errors(kv_quant.round_trip_rows(keys, values))
    accuracy_table(kv_quant.accuracy(model, token_ids))
    requests_in_cache({"float32": trace, "int8": int8_trace}, num_requests=5)   # viz.record's traces
"""
from __future__ import annotations

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from llmlab.viz.figures import TOOLBAR_PX, title_band


def error_heatmaps(errors: torch.Tensor, name: str = "K", position_bucket: int = 16) -> go.Figure:
    """Relative round-trip error [L, T, Hkv] (one value per cached row) as two heatmaps:
    layer x kv head (mean over tokens) and layer x token position (mean over heads, in
    buckets of `position_bucket` tokens)."""
    layers, tokens, heads = errors.shape
    usable = tokens // position_bucket * position_bucket
    by_head = errors.mean(dim=1)                                                    # [L, Hkv]
    by_position = errors[:, :usable].mean(dim=2).view(layers, -1, position_bucket).mean(-1)  # [L, T / bucket]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.25, 0.75], horizontal_spacing=0.08,
                        subplot_titles=[f"{name}: by layer and kv head", f"{name}: by layer and position"])
    zmax = max(by_head.max().item(), by_position.max().item())
    common = dict(colorscale="Viridis", zmin=0, zmax=zmax)
    fig.add_trace(go.Heatmap(z=by_head.tolist(), x=[f"head {h}" for h in range(heads)], showscale=False,
                             hovertemplate="layer %{y}, %{x}<br>relative error %{z:.4f}<extra></extra>", **common),
                  1, 1)
    starts = list(range(0, usable, position_bucket))
    fig.add_trace(go.Heatmap(z=by_position.tolist(), x=starts, colorbar=dict(title="rel. error"),
                             hovertemplate="layer %{y}, tokens %{x}+<br>relative error %{z:.4f}<extra></extra>",
                             **common), 1, 2)
    fig.update_yaxes(title_text="layer", autorange="reversed")
    fig.update_xaxes(title_text="token position", row=1, col=2)
    fig.update_layout(height=420, margin=dict(t=60))
    return title_band(fig, f"int8 round trip of {name}: ||x - dequantize(quantize(x))|| / ||x|| per row")


def granularity_errors(rows: list[dict]) -> go.Figure:
    """Mean relative round-trip error of K and of V for each scheme (round_trip_rows' rows)."""
    schemes = [r["scheme"] for r in rows]
    fig = go.Figure([go.Bar(name=label, x=schemes, y=[r[f"{key}_rel_err_mean"] for r in rows])
                     for label, key in (("K", "k"), ("V", "v"))])
    fig.update_layout(barmode="group", yaxis_title="mean relative error per row", height=400, margin=dict(t=50))
    return title_band(fig, "Scale granularity: what one 8-bit row loses")


def accuracy_table(rows: list[dict]) -> go.Figure:
    """accuracy()'s rows as a table: perplexity, its change, mean KL, top-1 agreement."""
    columns = [("cache", "cache"), ("bytes / token / layer", "bytes_per_token_per_layer"),
               ("perplexity", "perplexity"), ("change %", "ppl_change_pct"), ("mean KL", "mean_kl"),
               ("top-1 agreement %", "top1_agreement_pct")]
    cells = [[r[key] for r in rows] for _, key in columns]
    fig = go.Figure(go.Table(header=dict(values=[title for title, _ in columns], align="left"),
                             cells=dict(values=cells, align="left"), columnwidth=[3, 1, 1, 1, 1, 1]))
    # no title: the header row starts below the toolbar's band, which would hide its right end
    fig.update_layout(height=70 + TOOLBAR_PX + 30 * len(rows), margin=dict(t=TOOLBAR_PX, b=10, l=10, r=10))
    return fig


def blocks_per_budget(blocks: dict[str, int], budget_gib: float) -> go.Figure:
    """How many KV blocks each cache dtype gets from the same memory budget."""
    fig = go.Figure(go.Bar(x=list(blocks), y=list(blocks.values()), text=list(blocks.values()),
                           textposition="outside"))
    fig.update_layout(yaxis_title="blocks", height=360, margin=dict(t=50))
    return title_band(fig, f"KV blocks in {budget_gib:g} GiB")


def requests_in_cache(traces: dict, num_requests: int) -> go.Figure:
    """Per step, how many requests hold blocks in each cache (the running ones), one line per
    cache (name -> Trace of the same workload), against the workload's size: a cache too
    small for everyone takes them in turns."""
    fig = go.Figure()
    for name, trace in traces.items():
        fig.add_trace(go.Scatter(x=list(range(len(trace.steps))), y=[len(s.block_tables) for s in trace.steps],
                                 name=name, mode="lines+markers", line_shape="hv",
                                 hovertemplate="step %{x}: %{y} requests in the cache<extra>" + name + "</extra>"))
    fig.add_hline(y=num_requests, line_dash="dash", line_color="#888",
                  annotation_text=f"all {num_requests} requests", annotation_position="top left")
    fig.update_layout(xaxis_title="engine step", height=320, margin=dict(t=50, b=40),
                      yaxis=dict(title="requests in the cache", range=[0, num_requests + 1], dtick=1))
    return title_band(fig, "Requests holding KV blocks, same memory budget")
