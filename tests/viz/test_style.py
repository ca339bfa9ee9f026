"""llmlab.viz.style: titles below plotly's toolbar in every figure (also one a notebook builds
with plain go.Figure), log axes by decades, step axes by whole steps."""
import plotly.graph_objects as go
import torch

from llmlab import viz
from llmlab.cache.block_manager import BlockManager
from llmlab.hooks import RequestAdded, ScheduledRecord, StepRecord, Trace
from llmlab.viz.style import TOOLBAR_PX


def steps(n: int) -> Trace:
    return Trace(steps=[StepRecord(step=i, total_device_blocks=8, free_device_blocks=7, total_host_blocks=2,
                                   free_host_blocks=2, timings={"forward": 0.01}) for i in range(n)])


def title_below_toolbar(fig: go.Figure) -> bool:
    """What plotly.js draws: the figure's own title settings over its template's."""
    title = fig.layout.title
    template = fig.layout.template.layout.title
    y = title.y if title.y is not None else template.y
    yref = title.yref or template.yref
    yanchor = title.yanchor or template.yanchor
    pad = title.pad.t if title.pad.t is not None else template.pad.t
    return (yref, y, yanchor) == ("container", 1.0, "top") and pad >= TOOLBAR_PX and template.automargin


def test_every_kind_of_figure_puts_its_title_below_the_toolbar():
    playground = viz.BlockPlayground(BlockManager(num_device_blocks=4, num_host_blocks=2, block_size=4))
    playground.allocate("a", 5)
    figures = [go.Figure(go.Bar(y=[1, 2])).update_layout(title="a notebook's own figure, with a long title"),
               viz.batch_composition(steps(3)), viz.memory_usage(steps(3)), viz.phase_timings(steps(3)),
               playground.figure(title="a long title " * 5),
               viz.kernel_benchmark([{"shape": "s", "impl": "a", "ms": 1.0}], "kernels", machine="this machine")]
    assert all(title_below_toolbar(fig) for fig in figures)
    assert all("<br>" not in fig.layout.title.text for fig in figures)      # a second line is a subtitle


def test_block_table_legend_sits_between_the_title_and_the_panels():
    playground = viz.BlockPlayground(BlockManager(num_device_blocks=4, num_host_blocks=2, block_size=4))
    fig = playground.figure()
    legend_top_px = (1 - fig.layout.legend.y) * fig.layout.height
    assert TOOLBAR_PX + 20 <= legend_top_px < fig.layout.margin.t


def test_log_axes_tick_decades_as_powers_of_ten_or_numbers_in_full():
    fig = viz.kernel_benchmark([{"shape": "s", "impl": "a", "ms": 1e-3}, {"shape": "s", "impl": "b", "ms": 2.0}], "t")
    assert (fig.layout.yaxis.type, fig.layout.yaxis.dtick, fig.layout.yaxis.exponentformat) == ("log", 1, "power")
    narrow = viz.kernel_benchmark([{"shape": "s", "impl": "a", "ms": 60.0}, {"shape": "s", "impl": "b", "ms": 750.0}],
                                  "t")
    assert narrow.layout.yaxis.type == "log"          # one decade: 1-2-5 ticks, written out
    assert list(narrow.layout.yaxis.ticktext) == ["50", "100", "200", "500", "1000"]
    tiny = viz.log_axis(go.Figure(go.Bar(y=[2e-6, 3e-5])))
    assert list(tiny.layout.yaxis.ticktext) == ["1·10<sup>-6</sup>", "2·10<sup>-6</sup>", "5·10<sup>-6</sup>",
                                                "1·10<sup>-5</sup>", "2·10<sup>-5</sup>", "5·10<sup>-5</sup>"]
    assert viz.kernel_benchmark([{"shape": "s", "impl": "a", "ms": 1.0}], "t", log_y=False).layout.yaxis.type != "log"
    probs = {"sharp": torch.tensor([0.9, 0.09, 0.01]), "flat": torch.tensor([0.34, 0.33, 0.33])}
    assert viz.token_distribution(probs, top=3, log_y=True).layout.yaxis.type == "log"
    assert viz.token_distribution(probs, top=3).layout.yaxis.type is None


def test_step_axes_tick_whole_steps():
    for figure in (viz.batch_composition, viz.memory_usage, viz.phase_timings, viz.request_timeline):
        few = figure(steps(2))
        assert (few.layout.xaxis.dtick, few.layout.xaxis.tickformat) == (1, "d"), figure.__name__
        many = figure(steps(60))
        assert many.layout.xaxis.dtick is None and many.layout.xaxis.tickformat == "d", figure.__name__


def test_every_axis_has_a_title():
    trace = steps(2)
    trace.steps[0].scheduled = [ScheduledRecord("0", "prefill", 4, 0)]
    trace.added = [RequestAdded("0", 4, 0.0)]
    x = torch.randn(10)
    figures = {"decode_splits": viz.decode_splits([40, 17], 2, 16),
               "kernel_benchmark": viz.kernel_benchmark([{"shape": "s", "impl": "a", "ms": 1.0}], "t"),
               "request_timeline": viz.request_timeline(trace), "prefix_hits": viz.prefix_hits(trace),
               "online_softmax_steps": viz.online_softmax_steps(x, [x[:5].max().item(), x.max().item()],
                                                                [1.0, 2.0], 5),
               "token_distribution": viz.token_distribution({"p": torch.tensor([0.5, 0.3, 0.2])}, top=3)}
    for name, fig in figures.items():
        axes = [fig.layout[key] for key in fig.layout if key.startswith(("xaxis", "yaxis"))]
        untitled = [axis.plotly_name for axis in axes if not (axis.title and axis.title.text)
                    and not (axis.matches or axis.showticklabels is False)]
        if name == "online_softmax_steps":     # shared x: only the lower panel is titled
            untitled = [a for a in untitled if a != "xaxis"]
        assert untitled == [], (name, untitled)
