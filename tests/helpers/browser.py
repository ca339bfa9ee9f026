"""Debian's chromium through Playwright's Python package (Playwright's own browser download
cannot work offline; .ci/run installs chromium), and plotly figures measured where a browser
drew them."""
from __future__ import annotations

import importlib.util
import os

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def skip_without_chromium() -> None:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium; .ci/run installs it)")
    pytest.importorskip("playwright.sync_api", reason="the playwright Python package is missing")


def can_run_jupyterlab() -> bool:
    """Whether the browser tests of JupyterLab will run here rather than skip (chromium, the
    playwright package and jupyterlab): tests/notebooks/conftest.py asks before it leaves
    nbval's run of a notebook to them."""
    return (os.access(CHROMIUM, os.X_OK) and importlib.util.find_spec("playwright") is not None
            and importlib.util.find_spec("jupyterlab") is not None)


# Every plotly figure under `root`: its title, whether plotly drew it (its SVG is there) and
# how many marks it drew (heatmap images, bars, lines, markers, table cells: empty axes have
# none), whether it lives in a widget, and its data (to see a click change it).
READ_FIGURES = """(root) => [...(root || document).querySelectorAll('.js-plotly-plot')].map(gd => {
    const title = gd.layout && gd.layout.title;
    return {title: String((title && (title.text !== undefined ? title.text : title)) || ''),
            drawn: !!gd.querySelector('svg.main-svg'),
            marks: gd.querySelectorAll('.heatmaplayer image, .barlayer .point, .scatterlayer .js-line, '
                                       + '.scatterlayer .point, .table .cell-rect').length,
            traces: (gd.data || []).length,
            in_widget: !!gd.closest('.widget-vbox'),
            data: JSON.stringify((gd.data || []).map(t => [t.name, t.x, t.y, t.z, t.text])),
            shapes: JSON.stringify(((gd.layout || {}).shapes || []).map(s => s.x0))};
})"""


# The boxes (page pixels) of what plotly drew above and around each figure's plot area: the
# title and its subtitle, every annotation (subplot titles among them), the legend and the
# toolbar (modebar), and the text of every tick label. `root` is an element that holds the
# figures (or the page).
READ_LAYOUT = """(root) => [...(root || document).querySelectorAll('.js-plotly-plot')].map(gd => {
    const box = el => { const r = el.getBoundingClientRect();
                        return {left: r.left, right: r.right, top: r.top, bottom: r.bottom}; };
    const text = gd.querySelector('.g-gtitle text.gtitle');
    const subtitle = gd.querySelector('.g-gtitle text.gtitle-subtitle');
    const labels = [];
    if (text && text.textContent) labels.push({what: 'title', text: text.textContent, ...box(text)});
    if (subtitle && subtitle.textContent) labels.push({what: 'subtitle', text: subtitle.textContent, ...box(subtitle)});
    gd.querySelectorAll('.annotation').forEach(a => {
        const t = a.querySelector('.annotation-text');
        if (t && t.textContent) labels.push({what: 'annotation', text: t.textContent, ...box(t)});
    });
    const table = gd.querySelector('.table');
    if (table) labels.push({what: 'table', text: 'table', ...box(table)});
    const legend = gd.querySelector('.legend .bg');
    if (legend) labels.push({what: 'legend', text: 'legend', ...box(legend)});
    const modebar = gd.querySelector('.modebar');
    if (modebar) labels.push({what: 'toolbar', text: 'toolbar', ...box(modebar)});
    const ticks = {};
    gd.querySelectorAll('.xtick text, .ytick text').forEach(t => {
        const axis = t.closest('[class*="tick"]').className.baseVal;
        (ticks[axis] = ticks[axis] || []).push(t.textContent);
    });
    const title = gd.layout && gd.layout.title;
    return {title: String((title && (title.text !== undefined ? title.text : title)) || ''), labels, ticks};
})"""


def overlaps(a: dict, b: dict, slack: float = 1.0) -> bool:
    """Whether two boxes share more than `slack` pixels each way."""
    return (min(a["right"], b["right"]) - max(a["left"], b["left"]) > slack
            and min(a["bottom"], b["bottom"]) - max(a["top"], b["top"]) > slack)


def overlapping_labels(figure: dict) -> list[str]:
    """Pairs of a figure's labels (READ_LAYOUT) drawn over each other, as readable lines."""
    labels = figure["labels"]
    return [f"{a['what']} {a['text'][:60]!r} overlaps {b['what']} {b['text'][:60]!r}"
            for i, a in enumerate(labels) for b in labels[i + 1:] if overlaps(a, b)]
