"""Parallelism, drawn: which rank holds which weights, and a pipeline's timeline.

Pure functions of a ModelConfig and the parallel sizes (the placement is computed by the
engine's own functions: model/tensor_parallel.py, engine/parallel/placement.py), or of the
StageSpans an engine recorded:

    tensor_parallel_placement(config, tp=3)        # config: the whole model's ModelConfig
    pipeline_placement(config, tp=1, pp=2)
    engine.executor.record_timeline = True; llm.generate(...)
    pipeline_timeline(engine.executor.timeline)
"""
from __future__ import annotations

import plotly.graph_objects as go

from llmlab.config import ModelConfig
from llmlab.engine.parallel.pipeline import StageSpan
from llmlab.engine.parallel.placement import RankLayout, stage_layers
from llmlab.machine import machine_note
from llmlab.model.tensor_parallel import kv_heads_of_rank, padded_vocab_size
from llmlab.viz.style import title_with_note

RANK_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def _colorscale(num_ranks: int) -> list:
    """Discrete colours: z = rank + 1 gets the rank's colour, z = 0 (not held) white (with
    zmin -0.5 and zmax num_ranks + 0.5 each z sits in the middle of its band)."""
    colors = ["#ffffff"] + [RANK_COLORS[r % len(RANK_COLORS)] for r in range(num_ranks)]
    scale = []
    for i, color in enumerate(colors):
        scale += [[i / len(colors), color], [(i + 1) / len(colors), color]]
    return scale


def _grid(rows: list[list[int | None]], columns: list[str], ranks: list[str], title: str,
          hover: list[list[str]]) -> go.Figure:
    """rows[r][c] = the rank holding column c in row r, or None."""
    z = [[0 if held is None else held + 1 for held in row] for row in rows]
    fig = go.Figure(go.Heatmap(z=z, x=columns, y=ranks, zmin=-0.5, zmax=len(rows) + 0.5, showscale=False,
                               colorscale=_colorscale(len(rows)), xgap=1, ygap=3, text=hover,
                               hovertemplate="%{y}: %{text}<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=title, height=120 + 45 * len(rows), margin=dict(t=60, l=70))
    return fig


def tensor_parallel_placement(config: ModelConfig, tp: int, mlp_columns: int = 12,
                              vocab_columns: int = 12) -> go.Figure:
    """Rank x (query heads | kv heads | MLP width | vocabulary | norms) of every layer: a
    cell is coloured by the rank that holds that part (shard_weight's cuts). The MLP width
    and the vocabulary are drawn in `mlp_columns` / `vocab_columns` equal slices."""
    heads, kv_heads = config.num_heads, config.num_kv_heads
    columns = ([f"q head {h}" for h in range(heads)] + [f"kv head {h}" for h in range(kv_heads)]
               + [f"MLP {i + 1}/{mlp_columns}" for i in range(mlp_columns)]
               + [f"vocab {i + 1}/{vocab_columns}" for i in range(vocab_columns)] + ["norms"])
    vocab_rows = padded_vocab_size(config.vocab_size, tp) // tp
    rows, hover = [], []
    for rank in range(tp):
        q = range(rank * heads // tp, (rank + 1) * heads // tp)
        kv = kv_heads_of_rank(config, rank, tp)
        mlp = range(rank * config.intermediate_size // tp, (rank + 1) * config.intermediate_size // tp)
        vocab = range(rank * vocab_rows, (rank + 1) * vocab_rows)
        held = ([h in q for h in range(heads)] + [h in kv for h in range(kv_heads)]
                + [mlp.start <= (i + 0.5) * config.intermediate_size / mlp_columns < mlp.stop
                   for i in range(mlp_columns)]
                + [vocab.start <= (i + 0.5) * config.vocab_size / vocab_columns < vocab.stop
                   for i in range(vocab_columns)]
                + [True])
        rows.append([rank if h else None for h in held])
        hover.append([f"{column} ({'held' if h else 'not held'}: q heads {q.start}-{q.stop - 1}, kv heads "
                      f"{kv.start}-{kv.stop - 1}, MLP columns {mlp.start}-{mlp.stop - 1}, vocab rows "
                      f"{vocab.start}-{min(vocab.stop, config.vocab_size) - 1})" for column, h in zip(columns, held)])
    return _grid(rows, columns, [f"rank {r}" for r in range(tp)],
                 f"Tensor parallelism over {tp} ranks: what each rank holds of every layer", hover)


def pipeline_placement(config: ModelConfig, tp: int, pp: int) -> go.Figure:
    """Rank x (embedding | layer 0 .. L-1 | final norm | lm_head): the stage of each rank
    holds its layers (1/tp of each with tensor parallelism), the first stage the
    embedding, the last the norm and the lm_head (the embedding table again when tied)."""
    layers = stage_layers(config.num_layers, pp)
    columns = ["embedding"] + [f"layer {i}" for i in range(config.num_layers)] + ["final norm", "lm_head"]
    rows, hover, names = [], [], []
    for rank in range(tp * pp):
        layout = RankLayout(rank, tp, pp, config.num_layers)
        stage = layers[layout.stage]
        held = ([layout.is_first_stage] + [i in stage for i in range(config.num_layers)]
                + [layout.is_last_stage, layout.is_last_stage])
        share = "" if tp == 1 else f", tensor-parallel shard {layout.tp_rank} of {tp}"
        rows.append([rank if h else None for h in held])
        hover.append([f"{column}{share}" if h else f"{column}: not held" for column, h in zip(columns, held)])
        names.append(f"rank {rank} (stage {layout.stage})")
    return _grid(rows, columns, names, f"Pipeline parallelism: {pp} stages of {tp} rank(s), "
                 f"layers {', '.join(f'{r.start}-{r.stop - 1}' for r in layers)}", hover)


def pipeline_timeline(spans: list[StageSpan], note: str | None = None) -> go.Figure:
    """A Gantt chart of recorded micro-batches: one row per rank, a bar from when a
    micro-batch's input was in hand to when its output was ready, coloured by micro-batch;
    the gaps are where a stage waited (the bubbles). Times in ms from the first start."""
    if not spans:
        raise ValueError("no spans: set engine.executor.record_timeline = True before generating")
    t0 = min(s.start for s in spans)
    ranks = sorted({(s.rank, s.stage) for s in spans})
    labels = {(rank, stage): f"rank {rank} (stage {stage})" for rank, stage in ranks}
    fig = go.Figure()
    for m in sorted({s.micro_batch for s in spans}):
        mine = [s for s in spans if s.micro_batch == m]
        fig.add_trace(go.Bar(
            name=f"micro-batch {m}", orientation="h", y=[labels[s.rank, s.stage] for s in mine],
            base=[(s.start - t0) * 1e3 for s in mine], x=[(s.end - s.start) * 1e3 for s in mine],
            marker_color=RANK_COLORS[m % len(RANK_COLORS)], text=[f"s{s.step}·m{m}" for s in mine],
            textposition="inside", customdata=[[s.step, s.num_tokens] for s in mine],
            hovertemplate="step %{customdata[0]}, micro-batch " + str(m) +
                          ", %{customdata[1]} tokens<br>%{base:.1f} - %{x:.1f} ms long<extra></extra>"))
    fig.update_yaxes(categoryorder="array", categoryarray=[labels[k] for k in reversed(ranks)])
    fig.update_layout(barmode="overlay", xaxis_title="ms since the first micro-batch started",
                      height=160 + 50 * len(ranks), margin=dict(t=80),
                      title=title_with_note(f"Pipeline timeline: the ranks are busy {busy_fraction(spans):.0%} of "
                                            f"the time; the gaps are bubbles", note or machine_note()))
    return fig


def busy_fraction(spans: list[StageSpan]) -> float:
    """Share of the ranks' time (first start to last end, every rank) spent on micro-batches."""
    t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
    return sum(s.end - s.start for s in spans) / ((t1 - t0) * len({s.rank for s in spans}))
