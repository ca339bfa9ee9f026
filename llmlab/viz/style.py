"""The look every llmlab figure shares, and the axes a template cannot style alone.

Importing `llmlab.viz` makes "plotly+llmlab" plotly's default template, so figures drawn in a
notebook with plain `go.Figure(...)` get it too. What it changes: the title sits below
plotly's toolbar (the mode bar, about 28 px high at the figure's top right, shown while the
pointer is over the figure), however long the title is, and the top margin grows to fit it.

Two helpers style axes whose ticks depend on the data:

    log_axis(fig)                  # decades: 10⁻⁶, 10⁻⁵, ... instead of plotly's "5, 2, 1µ, 5, 2"
    step_axis(fig, num_steps)      # engine steps are whole numbers: no tick at step 0.2
"""
from __future__ import annotations

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


def log_axis(fig: go.Figure, axis: str = "y", **selector) -> go.Figure:
    """A log-scale axis ticked once per decade and labelled as powers of ten (10⁻⁶), not with
    plotly's default in-between ticks ("5, 2, 1µ, 5, 2") that read like a linear scale.
    `selector` (row=, col=) picks one subplot's axis."""
    update = fig.update_yaxes if axis == "y" else fig.update_xaxes
    update(type="log", dtick=1, exponentformat="power", showexponent="all", **selector)
    return fig


def step_axis(fig: go.Figure, num_steps: int, axis: str = "x", **selector) -> go.Figure:
    """An axis of engine steps ticks whole steps only (plotly puts ticks at 0.2, 0.4, ...
    when only a few steps are drawn)."""
    update = fig.update_xaxes if axis == "x" else fig.update_yaxes
    update(tick0=0, dtick=1 if num_steps <= SMALL_STEP_RANGE else None, tickformat="d", **selector)
    return fig
