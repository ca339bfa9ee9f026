"""The look every llmlab figure shares, and the axes a template cannot style alone.

Importing `llmlab.viz` makes "plotly+llmlab" plotly's default template, so figures drawn in a
notebook with plain `go.Figure(...)` get it too. What it changes: the title sits below
plotly's toolbar (the mode bar, about 28 px high at the figure's top right, shown while the
pointer is over the figure), however long the title is, and the top margin grows to fit it.

Two helpers style axes whose ticks depend on the data:

    log_axis(fig)                  # decades: 10⁻⁶, 10⁻⁵, ... instead of plotly's "5, 2, 1µ, 5, 2"
    step_axis(fig, num_steps)      # engine steps are whole numbers: no tick at step 0.2

and `title_with_note(title, note)` puts a second, smaller line under a title.
"""
from __future__ import annotations

import math

import plotly.graph_objects as go
import plotly.io as pio

TOOLBAR_PX = 32     # the mode bar's height plus a little air: the title starts below it

TEMPLATE = go.layout.Template(layout=dict(
    # yref "container": y is measured on the whole figure; automargin: the plot area moves
    # down rather than the title running into it
    title=dict(yref="container", y=1.0, yanchor="top", pad=dict(t=TOOLBAR_PX), automargin=True)))
pio.templates["llmlab"] = TEMPLATE
pio.templates.default = "plotly+llmlab"

SMALL_STEP_RANGE = 20   # up to this many steps, tick every step; past it plotly's own ticks are whole


def title_with_note(title: str, note: str | None = None) -> dict:
    """A figure's title with a smaller line under it (which machine measured it, say), as
    plotly's subtitle: a "<br>" inside the title text would be drawn upwards from its first
    line, into the toolbar."""
    return dict(text=title, subtitle=dict(text=note)) if note else dict(text=title)


def log_axis(fig: go.Figure, axis: str = "y", **selector) -> go.Figure:
    """A log-scale axis whose ticks read as numbers: once per decade, as powers of ten (10⁻⁶),
    when the data spans two decades or more; else at 1, 2 and 5 times the powers of ten, every
    label in full (50, 100, 200), where decades alone would leave one tick. Not plotly's default
    of in-between ticks ("5, 2, 1µ, 5, 2") that read like a linear scale. `selector` (row=,
    col=) picks one subplot's axis; the ticks are chosen from every trace's values."""
    update = fig.update_yaxes if axis == "y" else fig.update_xaxes
    values = [v for trace in fig.data for v in (getattr(trace, axis, None) or ())
              if isinstance(v, (int, float)) and v > 0]
    if not values or max(values) >= 100 * min(values):
        update(type="log", dtick=1, exponentformat="power", showexponent="all", **selector)
        return fig
    low, high = min(values), max(values)
    ticks = [m * 10.0 ** k for k in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1)
             for m in (1, 2, 5)]
    ticks = [t for t in ticks if low / 2 <= t <= high * 2]
    update(type="log", tickvals=ticks, ticktext=[_number(t) for t in ticks], **selector)
    return fig


def _number(value: float) -> str:
    """A tick label: 0.05, 200, or 5·10⁻⁶ for the very small and very large."""
    exponent = math.floor(math.log10(value) + 1e-9)
    if -3 <= exponent <= 4:
        return f"{value:.{max(0, -exponent)}f}"
    return f"{value / 10 ** exponent:.0f}·10<sup>{exponent}</sup>"


def step_axis(fig: go.Figure, num_steps: int, axis: str = "x", **selector) -> go.Figure:
    """An axis of engine steps ticks whole steps only (plotly puts ticks at 0.2, 0.4, ...
    when only a few steps are drawn)."""
    update = fig.update_xaxes if axis == "x" else fig.update_yaxes
    update(tick0=0, dtick=1 if num_steps <= SMALL_STEP_RANGE else None, tickformat="d", **selector)
    return fig
