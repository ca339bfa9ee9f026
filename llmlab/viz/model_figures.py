"""Inside the model: what attention and the kernels compute, and how the kernels divide the work.

Pure functions, like figures.py, but their inputs are tensors and kernel launch settings
rather than a Trace:

    attention_heatmap(attention_probs(q, k, positions, config)[head], tokens)
    with record_launches(triton_rms_norm) as launches: kernels.rms_norm(x, w, eps, backend="triton")
    program_map(owner)                               # which program computes which element
    prefill_tiles(num_queries, seq_len, block_m, block_n)    # FlashAttention's causal tile schedule
    decode_splits(seq_lens, num_splits, block_n, block_tables, block_size)   # flash-decoding

`prefill_tile_schedule` and `decode_split_ranges` restate, in plain Python, the loop bounds
of `_prefill_attention_kernel` and `_decode_attention_kernel` (see the kernels'
`kernels_explained/` docs); a notebook checks them against the causal mask and the context.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from llmlab.viz.figures import REQUEST_COLORS
from llmlab.viz.style import log_axis, title_with_note


# ---- attention and sampling ----------------------------------------------------------------
def attention_probs(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, config) -> torch.Tensor:
    """Causal attention weights of one sequence from the "layers.{i}.q" / "layers.{i}.k" hook
    points (taken before rope): q [T, H, D], k [T, Hkv, D] -> [H, T, T], rows sum to 1."""
    from llmlab import kernels

    q, k = kernels.rope(q.float(), k.float(), positions, config.rope_theta, config.rope_scaling,
                        backend="torch")
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)    # grouped-query: H // Hkv heads per kv head
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
    future = positions[None, :] > positions[:, None]
    return scores.masked_fill(future, float("-inf")).softmax(dim=-1)


def attention_heatmap(weights: torch.Tensor, tokens: list[str],
                      title: str = "attention weights") -> go.Figure:
    """weights [T_query, T_key] as a heatmap, queries down, keys across."""
    labels = [f"{i}:{t}" for i, t in enumerate(tokens)]
    fig = go.Figure(go.Heatmap(z=weights.tolist(), x=labels, y=labels, colorscale="Blues", zmin=0,
                               hovertemplate="query %{y}<br>key %{x}<br>weight %{z:.3f}<extra></extra>"))
    fig.update_layout(title=title, xaxis_title="key", yaxis_title="query", height=520,
                      yaxis_autorange="reversed", margin=dict(t=50))
    return fig


def token_distribution(probs: dict[str, torch.Tensor], tokenizer=None, top: int = 15, *,
                       log_y: bool = False) -> go.Figure:
    """Next-token probabilities [vocab] under several settings, over the `top` most likely
    tokens of the first one; the first setting's order is kept. `log_y`: a log axis, for
    settings whose probabilities differ by orders of magnitude (a flat distribution's bars
    would be invisible next to a sharp one's)."""
    first = next(iter(probs.values()))
    ids = first.topk(top).indices.tolist()
    labels = [repr(tokenizer.decode([i])) if tokenizer is not None else str(i) for i in ids]
    fig = go.Figure([go.Bar(name=name, x=labels, y=p[ids].tolist()) for name, p in probs.items()])
    fig.update_layout(barmode="group", title="Next-token probabilities",
                      yaxis_title="probability" + (" (log scale)" if log_y else ""), xaxis_title="token",
                      height=360, margin=dict(t=50, b=40))
    return log_axis(fig) if log_y else fig


# ---- what a kernel computes ----------------------------------------------------------------
def rope_rotation(rotated: torch.Tensor, pairs: list[int]) -> go.Figure:
    """One head vector rotated to positions 0..P-1, rotated [P, D]: for each pair index i in
    `pairs`, the point (x[i], x[i + D/2]) at every position (markers, labelled by position; trace
    2n) on the circle of its length (dotted; trace 2n + 1). Each pair turns at its own speed."""
    half = rotated.shape[-1] // 2
    fig = go.Figure()
    circle = torch.linspace(0, 2 * math.pi, 121)
    for n, i in enumerate(pairs):
        color = REQUEST_COLORS[n % len(REQUEST_COLORS)]
        fig.add_trace(go.Scatter(x=rotated[:, i].tolist(), y=rotated[:, i + half].tolist(), mode="markers+text",
                                 name=f"pair ({i}, {i + half})", text=[str(p) for p in range(len(rotated))],
                                 textposition="top center", marker=dict(color=color, size=8), legendgroup=str(i),
                                 hovertemplate="position %{text}: (%{x:.3f}, %{y:.3f})<extra></extra>"))
        radius = rotated[0, i].hypot(rotated[0, i + half]).item()
        fig.add_trace(go.Scatter(x=(radius * circle.cos()).tolist(), y=(radius * circle.sin()).tolist(), mode="lines",
                                 line=dict(color=color, width=1, dash="dot"), legendgroup=str(i), showlegend=False,
                                 hoverinfo="skip"))
    fig.update_layout(title="RoPE: each pair of a head vector rotates as the position grows (labels: position)",
                      xaxis_title="x[i]", yaxis_title="x[i + D/2]", height=460, margin=dict(t=50, b=40))
    fig.update_yaxes(scaleanchor="x", scaleratio=1)
    return fig


def online_softmax_steps(x: torch.Tensor, running_max: list[float], running_sum: list[float],
                         block: int) -> go.Figure:
    """A row x [N] read in tiles of `block`: after tile k, the running max m_k and sum l_k
    (of exp(x - m_k) over the tiles seen) give the estimate exp(x_j - m_k) / l_k for the
    keys seen so far. Top: the row by tile and the running max. Bottom: the estimates after
    each tile, converging to softmax(x) (black markers) at the last tile."""
    n, num_tiles = len(x), len(running_max)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("the row, tile by tile, and the running max m",
                                        "estimated softmax after each tile: exp(x - m) / l"))
    for k in range(num_tiles):
        cols = list(range(k * block, min(n, (k + 1) * block)))
        fig.add_trace(go.Bar(x=cols, y=x[cols].tolist(), name=f"tile {k}", legendgroup=f"tile {k}",
                             marker_color=REQUEST_COLORS[k % len(REQUEST_COLORS)]), row=1, col=1)
    maxes = [running_max[min(j // block, num_tiles - 1)] for j in range(n)]
    fig.add_trace(go.Scatter(x=list(range(n)), y=maxes, name="running max m", mode="lines",
                             line=dict(color="black", shape="hv")), row=1, col=1)
    for k in range(num_tiles):
        seen = min(n, (k + 1) * block)
        estimate = torch.exp(x[:seen] - running_max[k]) / running_sum[k]
        fig.add_trace(go.Scatter(x=list(range(seen)), y=estimate.tolist(), mode="lines", name=f"after tile {k}",
                                 legendgroup=f"tile {k}", line=dict(color=REQUEST_COLORS[k % len(REQUEST_COLORS)],
                                                                    width=3 if k == num_tiles - 1 else 1)),
                      row=2, col=1)
    fig.add_trace(go.Scatter(x=list(range(n)), y=x.softmax(-1).tolist(), mode="markers", name="torch.softmax(x)",
                             marker=dict(color="black", size=5)), row=2, col=1)
    fig.update_xaxes(title_text="column j", row=2, col=1)
    fig.update_yaxes(title_text="score x", row=1, col=1).update_yaxes(title_text="probability", row=2, col=1)
    fig.update_layout(title="Online softmax", height=560, barmode="overlay", margin=dict(t=70, b=40))
    return fig


# ---- how a kernel divides the work -------------------------------------------------------------
@dataclass
class Launch:
    """One Triton kernel launch: the kernel's name, its grid, its compile-time constants."""
    kernel: str
    grid: tuple[int, ...]
    constants: dict = field(default_factory=dict)

    @property
    def num_programs(self) -> int:
        return math.prod(self.grid)


@contextlib.contextmanager
def record_launches(*modules):
    """Inside the block, every launch of a `*_kernel` of the given modules (kernel files such
    as `llmlab.kernels.triton.rms_norm`) is appended to the yielded list as a Launch, then run
    as usual: the grid and block sizes the launcher really chose."""
    launches: list[Launch] = []
    kernels = {(module, name): fn for module in modules for name, fn in vars(module).items()
               if name.endswith("_kernel") and hasattr(type(fn), "__getitem__") and hasattr(fn, "run")}

    class Recording:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                constants = {k: v for k, v in kwargs.items() if k.isupper()}
                launches.append(Launch(self.name.strip("_").removesuffix("_kernel"), tuple(grid), constants))
                return self.fn[grid](*args, **kwargs)
            return launch

    try:
        for (module, name), fn in kernels.items():
            setattr(module, name, Recording(name, fn))
        yield launches
    finally:
        for (module, name), fn in kernels.items():
            setattr(module, name, fn)


def program_map(owner: torch.Tensor, labels: list[str] | None = None, *, title: str = "Which program computes what",
                x_title: str = "column", y_title: str = "row") -> go.Figure:
    """owner [rows, cols]: the (flat) id of the program that computes each element, -1 for
    none (drawn blank). Each program gets a colour; `labels[id]` names it in the hover (e.g. "(row 2, block 1)")."""
    rows, cols = owner.shape
    names = labels or [f"program {i}" for i in range(int(owner.max()) + 1)]
    colors = [REQUEST_COLORS[i % len(REQUEST_COLORS)] for i in range(len(names))]
    hover = [[names[p] if p >= 0 else "no program" for p in row] for row in owner.tolist()]
    show_text = rows * cols <= 400
    z = [[p if p >= 0 else None for p in row] for row in owner.tolist()]     # None: drawn blank
    fig = go.Figure(go.Heatmap(z=z, x=list(range(cols)), y=list(range(rows)),
                               customdata=hover, hovertemplate="%{y}, %{x}: %{customdata}<extra></extra>",
                               text=z if show_text else None,
                               texttemplate="%{text}" if show_text else None,
                               colorscale=_discrete_scale(colors), zmin=-0.5, zmax=len(names) - 0.5,
                               showscale=False, xgap=1 if cols <= 64 else 0, ygap=1))
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title, height=120 + min(30 * rows, 420),
                      yaxis_autorange="reversed", margin=dict(t=50, b=40))
    return fig


def _discrete_scale(colors):
    n = len(colors)
    return [[c, color] for i, color in enumerate(colors) for c in (i / n, (i + 1) / n)]


def prefill_tile_schedule(num_queries: int, seq_len: int, block_m: int, block_n: int) -> list[dict]:
    """The key tiles each query tile of one sequence visits in `_prefill_attention_kernel`.
    Its queries are the last `num_queries` of `seq_len` tokens. Per query tile: "rows"
    (first, last + 1), "unmasked" (key tile starts below the tile's first query: all
    visible), "masked" (the causal diagonal: masked per element), "skipped" (past the tile's
    last query: never loaded)."""
    context_len = seq_len - num_queries
    schedule = []
    for m_block in range(math.ceil(num_queries / block_m)):
        first_pos = context_len + m_block * block_m
        unmasked_end = (first_pos // block_n) * block_n
        kv_end = min(seq_len, first_pos + block_m)
        starts = range(0, seq_len, block_n)
        schedule.append({"rows": (m_block * block_m, min(num_queries, (m_block + 1) * block_m)),
                         "unmasked": [s for s in starts if s < unmasked_end],
                         "masked": [s for s in starts if unmasked_end <= s < kv_end],
                         "skipped": [s for s in starts if s >= kv_end]})
    return schedule


TILE_STATES = {0: ("skipped: never loaded", "#f4f4f4"), 1: ("run, no mask needed", "#1F77B4"),
               2: ("run with the mask: visible", "#9ecae1"), 3: ("run with the mask: hidden", "#fdd0a2")}


def prefill_tiles(num_queries: int, seq_len: int, block_m: int, block_n: int,
                  block_size: int | None = None) -> go.Figure:
    """Every (query, key) pair of one sequence's causal prefill chunk, coloured by what the
    kernel does with it: the tile holding it is skipped, run without a mask, or run with
    the mask (the pair visible or hidden). Lines mark the tiles; with `block_size`, the x
    axis also marks the KV cache blocks the keys are gathered from."""
    context_len = seq_len - num_queries
    z = [[0] * seq_len for _ in range(num_queries)]
    for tile in prefill_tile_schedule(num_queries, seq_len, block_m, block_n):
        for state, starts in ((1, tile["unmasked"]), (2, tile["masked"])):
            for start in starts:
                for row in range(*tile["rows"]):
                    for key in range(start, min(seq_len, start + block_n)):
                        visible = key <= context_len + row
                        z[row][key] = state if state == 1 or visible else 3
    colors = [color for _, color in TILE_STATES.values()]
    fig = go.Figure(go.Heatmap(z=z, x=list(range(seq_len)), y=[context_len + r for r in range(num_queries)],
                               colorscale=_discrete_scale(colors), zmin=-0.5, zmax=3.5, showscale=False,
                               customdata=[[TILE_STATES[s][0] for s in row] for row in z],
                               hovertemplate="query at %{y}, key %{x}: %{customdata}<extra></extra>"))
    for name, color in TILE_STATES.values():
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                 marker=dict(symbol="square", size=12, color=color)))
    lines = [dict(type="line", x0=s - 0.5, x1=s - 0.5, y0=context_len - 0.5, y1=seq_len - 0.5,
                  line=dict(color="black", width=1)) for s in range(block_n, seq_len, block_n)]
    lines += [dict(type="line", x0=-0.5, x1=seq_len - 0.5, y0=context_len + r - 0.5, y1=context_len + r - 0.5,
                   line=dict(color="black", width=1)) for r in range(block_m, num_queries, block_m)]
    if context_len:     # keys of earlier chunks (or a cached prefix), read back from the cache
        lines.append(dict(type="line", x0=context_len - 0.5, x1=context_len - 0.5, y0=context_len - 0.5,
                          y1=seq_len - 0.5, line=dict(color="#D62728", width=3, dash="dot")))
        fig.add_annotation(x=context_len / 2, y=context_len - 0.5, yanchor="bottom", showarrow=False,
                           text="context: keys of earlier chunks, already in the cache", font_color="#D62728")
    fig.update_layout(shapes=lines, title=f"Causal prefill of queries {context_len}..{seq_len - 1} over "
                      f"{seq_len} keys: BLOCK_M={block_m} query rows x BLOCK_N={block_n} keys per tile",
                      xaxis_title="key position" + (f" (cache blocks of {block_size}: ticks)" if block_size else ""),
                      yaxis_title="query position", yaxis_autorange="reversed", height=220 + 3 * num_queries,
                      margin=dict(t=60, b=40), legend=dict(orientation="h", y=-0.15), plot_bgcolor="white")
    if block_size:
        fig.update_xaxes(tickmode="array", tickvals=list(range(0, seq_len, block_size)))
    return fig


def decode_split_ranges(seq_len: int, num_splits: int, block_n: int) -> list[tuple[int, int]]:
    """The key range [start, end) each split of one sequence reads in `_decode_attention_kernel`:
    whole tiles of block_n keys, the same number of tiles per split; late splits of a short
    sequence can be empty (start >= end)."""
    tiles_per_split = math.ceil(math.ceil(seq_len / block_n) / num_splits)
    ranges = []
    for split in range(num_splits):
        start = split * tiles_per_split * block_n
        ranges.append((start, min(start + tiles_per_split * block_n, seq_len)))
    return ranges


def decode_splits(seq_lens: list[int], num_splits: int, block_n: int, block_tables: list[list[int]] | None = None,
                  block_size: int = 16) -> go.Figure:
    """Flash-decoding's work division: one row per sequence, one cell per KV cache block
    (its logical index across), coloured by the split (program) that reads it; the cell's
    text is the physical block from `block_tables`. num_splits = 1 is PagedAttention v1."""
    width = max(math.ceil(n / block_size) for n in seq_lens)
    z, text = [], []
    for i, seq_len in enumerate(seq_lens):
        owner = [None] * width
        for split, (start, end) in enumerate(decode_split_ranges(seq_len, num_splits, block_n)):
            for block in range(start // block_size, math.ceil(end / block_size) if end > start else 0):
                if owner[block] is None:     # a block shared by two splits shows the first
                    owner[block] = split
        z.append(owner)
        text.append([str(block_tables[i][b]) if block_tables and owner[b] is not None else "" for b in range(width)])
    colors = [REQUEST_COLORS[s % len(REQUEST_COLORS)] for s in range(num_splits)]
    fig = go.Figure(go.Heatmap(z=z, x=list(range(width)), y=[f"seq {i} ({n} tokens)" for i, n in enumerate(seq_lens)],
                               text=text, texttemplate="%{text}" if width <= 48 else None,
                               colorscale=_discrete_scale(colors), zmin=-0.5, zmax=num_splits - 0.5, showscale=False,
                               xgap=1 if width <= 64 else 0, ygap=2,
                               hovertemplate="%{y}, logical block %{x}: split %{z}<extra></extra>"))
    kind = "PagedAttention v1" if num_splits == 1 else f"flash-decoding, {num_splits} splits"
    fig.update_layout(title=f"{kind}: which program reads which KV block (colour = split; text = physical block)",
                      xaxis_title=f"logical KV block ({block_size} tokens each)", yaxis_title="sequence",
                      yaxis_autorange="reversed",
                      height=140 + 40 * len(seq_lens), margin=dict(t=50, b=40))
    return fig


# ---- speed --------------------------------------------------------------------------------------
def kernel_benchmark(rows: list[dict], title: str, *, log_y: bool = True, machine: str | None = None) -> go.Figure:
    """Milliseconds per call, grouped by shape: rows of {"shape", "impl", "ms"} (the format
    `llmlab bench kernels --out` writes). One bar trace per impl, in order of appearance.
    `machine`: a line under the title saying what measured them (viz.machine_note())."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    ms = {(r["shape"], r["impl"]): r["ms"] for r in rows if "ms" in r}
    fig = go.Figure([go.Bar(name=impl, x=shapes, y=[ms.get((s, impl)) for s in shapes],
                            hovertemplate="%{x}<br>" + impl + ": %{y:.4g} ms<extra></extra>") for impl in impls])
    fig.update_layout(barmode="group", title=title_with_note(title, machine),
                      xaxis_title="shape", yaxis_title="ms per call" + (" (log scale)" if log_y else ""), height=380,
                      margin=dict(t=60, b=40))
    return log_axis(fig) if log_y else fig
