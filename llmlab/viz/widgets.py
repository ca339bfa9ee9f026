"""Watching an engine from Jupyter: `record` a whole run, or drive one step by step.

`Stepper(engine, workload)` is Step / Run N / Reset buttons, add-request controls, a slider
that scrubs through the recorded steps, and figures that update in place.
It also works from code (`stepper.step(3)`, `stepper.figures[...]`), and without a widget
frontend (nbval, nbconvert, a terminal) it shows static figures, so a notebook runs
headless unchanged. `FigureView` (a figure redrawn in place) is shared with playground.py,
the same for a bare BlockManager.
"""
from __future__ import annotations

import html
import os
import time
from dataclasses import dataclass

from llmlab.hooks import Recorder, Trace
from llmlab.machine import machine_info
from llmlab.sampling import SamplingParams
from llmlab.viz import block_figures, figures


def has_widget_frontend() -> bool:
    """Whether this code runs in a kernel whose frontend draws widgets. Conservative: True only
    when the running cell came from JupyterLab / Notebook 7 (they send the cell's id with each
    execute request; nbval and nbclient do not). LLMLAB_WIDGETS=1 or 0 overrides."""
    forced = os.environ.get("LLMLAB_WIDGETS")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        from IPython import get_ipython
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None or not hasattr(kernel, "get_parent"):
        return False
    return "cellId" in (kernel.get_parent() or {}).get("metadata", {})


def run_reporting_errors(log, fn) -> None:
    """Run a button's action. An error prints as one line in `log` (the widget's Output):
    "ValueError: out of KV blocks: need 3, 2 free", not a traceback inside the widget."""
    from IPython.display import clear_output

    with log:
        clear_output()
        try:
            fn()
        except Exception as error:   # noqa: BLE001 -- any failure of the student's action is shown, not raised
            print(f"{type(error).__name__}: {error}")


def _show(*figs):
    from IPython.display import display

    for fig in figs:
        display(fig)


# ---- recording a run -----------------------------------------------------------------------
@dataclass
class Arrival:
    """A request of a workload, added to the engine just before step `step` of the run."""
    prompt: str | list[int]
    params: SamplingParams
    step: int = 0


def fresh_ids(engine):
    """Request ids "0", "1", ... in the order a run adds them, skipping ids the engine still
    holds: a trace's request ids then read the same in every run of a workload, however
    many requests the engine served before."""
    n = 0
    while True:
        if str(n) not in engine.requests:
            yield str(n)
        n += 1


def record(engine, workload: list[Arrival], max_steps: int = 10_000, use_tqdm: bool | str = False,
           **meta) -> Trace:
    """Run `workload` on `engine` to completion with a Recorder attached; returns its Trace
    (meta holds the engine's block size and scheduling knobs, plus `meta`). Requests get ids
    "0", "1", ... in arrival order. `use_tqdm` shows a progress bar of finished requests (a
    string: its label), for a run long enough to look stuck."""
    from tqdm.auto import tqdm

    recorder = Recorder(**_engine_meta(engine), **meta)
    engine.hooks.attach(recorder)
    pending = sorted(workload, key=lambda a: a.step)
    step, ids = 0, fresh_ids(engine)
    bar = tqdm(total=len(workload), desc=use_tqdm if isinstance(use_tqdm, str) else "requests", unit="req",
               disable=not use_tqdm)
    try:
        while (pending or engine.has_unfinished_requests()) and step < max_steps:
            if not engine.has_unfinished_requests():
                step = max(step, pending[0].step)   # nothing to do until the next arrival
            while pending and pending[0].step <= step:
                arrival = pending.pop(0)
                engine.add_request(arrival.prompt, arrival.params, request_id=next(ids))
            bar.update(sum(out.finished for out in engine.step()))
            step += 1
            bar.set_postfix_str(f"step {step}", refresh=False)
    finally:
        bar.close()
        engine.hooks.detach(recorder)
    recorder.trace.meta["machine"] = machine_info()   # after the run: its load is the run's
    return recorder.trace


def _engine_meta(engine) -> dict:
    c = engine.config
    return {"block_size": c.block_size, "max_num_batched_tokens": c.max_num_batched_tokens,
            "enable_chunked_prefill": c.enable_chunked_prefill,
            "enable_prefix_caching": c.enable_prefix_caching, "preemption_mode": c.preemption_mode,
            "num_gpu_blocks": engine.block_manager.num_device_blocks, "machine": machine_info()}


# ---- figures that update in place ------------------------------------------------------------
class FigureView:
    """A figure shown once and redrawn in place: an Output widget in which each update that
    changes the figure displays it anew, through the plotly renderer JupyterLab loaded with the
    page. An update that changes nothing sends nothing.

    Not plotly's FigureWidget, which drew blank axes for good on a loaded machine: it is an
    anywidget whose 5 MB module is sent and evaluated once per figure, and anywidget drops
    every message of a model whose module took over 2 s to load, the figure's data (sent just
    after the widget opens) and every later update among them."""

    def __init__(self, fig):
        import ipywidgets as widgets

        self.widget = widgets.Output()
        self.figure, self._shown = None, None     # what the front end has, and its JSON
        self.update(fig)

    def update(self, fig) -> None:
        from IPython.display import clear_output

        shown = _plotly_json(fig)
        if shown == self._shown:
            return
        with self.widget:
            clear_output(wait=True)    # the old figure stays until the new one is drawn: no flicker
            _show(fig)
        self.figure, self._shown = fig, shown


def _plotly_json(fig) -> str:
    """The figure as JSON text, to tell whether an update changes anything."""
    import json

    from plotly.utils import PlotlyJSONEncoder

    return json.dumps(fig.to_plotly_json(), cls=PlotlyJSONEncoder, sort_keys=True)


# ---- the engine stepper --------------------------------------------------------------------
class Stepper:
    """Drive `engine` one step at a time and watch it: block table, batch composition and
    request timeline, redrawn after each Step and at the end of a Run N; the slider shows any
    recorded step again, its figures, status line and texts as that step left them.
    `workload` (Arrivals) is queued on Reset; each Arrival is added before the step whose
    index (counted from the reset) is its `step`.
    Steps are numbered from the reset, 0 first, in the figures, the slider and the status, and
    requests "0", "1", ... in the order they are added.
    chat=True sends text prompts (the Add box, `add(text)`) as a user message through the
    model's chat template: an instruct model then answers instead of continuing the text."""

    FIGURES = ("block_table", "batch_composition", "request_timeline")
    REDRAW_EVERY_S = 0.5     # a Run N redraws at most this often, and once at the end

    def __init__(self, engine, workload: list[Arrival] = (), figures: tuple = FIGURES, max_blocks: int = 64,
                 chat: bool = False):
        self.engine, self.workload, self.names, self.max_blocks = engine, list(workload), figures, max_blocks
        self.chat = chat
        self.recorder: Recorder | None = None
        self.figures: dict = {}
        self.outputs: dict = {}           # request id -> latest RequestOutput
        self.history: list[dict] = []     # self.outputs after each recorded step: the texts the slider shows
        self._widget = None
        self.reset()

    @property
    def trace(self) -> Trace:
        return self.recorder.trace

    # ---- driving -----------------------------------------------------------------------
    def reset(self) -> None:
        """Abort every request, start a new trace, queue the workload again (blocks in the
        engine's prefix cache stay cached, as they would in a server)."""
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
        if self.recorder is not None:
            self.engine.hooks.detach(self.recorder)
        self.recorder = Recorder(**_engine_meta(self.engine))
        self.engine.hooks.attach(self.recorder)
        self.pending = sorted(self.workload, key=lambda a: a.step)
        self.num_steps, self.position, self.outputs, self.history = 0, None, {}, []
        self._ids = fresh_ids(self.engine)   # after a Reset, the same requests get the same ids
        self.refresh()

    def add(self, prompt, params: SamplingParams | None = None) -> str:
        """Add a request now; it is scheduled from the next step on."""
        if self.chat and isinstance(prompt, str):
            prompt = self.engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        rid = self.engine.add_request(prompt, params or SamplingParams(max_tokens=16, temperature=0.0),
                                      request_id=next(self._ids))
        self.refresh()
        return rid

    @property
    def done(self) -> bool:
        return not self.pending and not self.engine.has_unfinished_requests()

    def step(self, n: int = 1) -> None:
        """Run up to `n` engine steps (fewer when everything has finished). The widget is
        redrawn once at the end, and during a long Run N at most every REDRAW_EVERY_S seconds
        (drawing every step would cost more than the steps of a small model)."""
        drawn = time.perf_counter()
        for i in range(n):
            if self.done:
                break
            while self.pending and self.pending[0].step <= self.num_steps:
                arrival = self.pending.pop(0)
                self.engine.add_request(arrival.prompt, arrival.params, request_id=next(self._ids))
            for out in self.engine.step():
                self.outputs[out.request_id] = out
            self.history.append(dict(self.outputs))   # outputs are snapshots: they keep this step's text
            self.num_steps += 1
            self.position = None          # follow the newest step
            if self._widget is not None and i < n - 1 and time.perf_counter() - drawn >= self.REDRAW_EVERY_S:
                self.refresh()
                drawn = time.perf_counter()
        self.refresh()

    def run(self, max_steps: int = 1000) -> None:
        """Step until every request (and every pending arrival) has finished."""
        self.step(max_steps)

    def show_step(self, index: int | None) -> None:
        """Draw the figures as they were after recorded step `index` (None = the newest)."""
        self.position = index
        self.refresh()

    # ---- drawing -----------------------------------------------------------------------
    def draw(self) -> dict:
        trace, index = self.trace, self.position
        if index is None and trace.steps:
            index = len(trace.steps) - 1
        current = index if trace.steps else None     # step i = trace.steps[i]
        out = {}
        if "block_table" in self.names:
            if trace.steps:
                out["block_table"] = block_figures.block_table(trace, index, max_blocks=self.max_blocks)
            else:
                out["block_table"] = block_figures.block_table(block_figures.engine_state(self.engine),
                                                         max_blocks=self.max_blocks,
                                                         title="KV block table (no step yet)")
        if "batch_composition" in self.names:
            out["batch_composition"] = figures.batch_composition(trace, current_step=current)
        if "request_timeline" in self.names:
            out["request_timeline"] = figures.request_timeline(trace, current_step=current)
        if "memory_usage" in self.names:
            out["memory_usage"] = figures.memory_usage(trace)
        return out

    def refresh(self) -> None:
        """Draw the step shown (the newest, or the slider's): its figures, and, with the widget,
        its status line and its texts."""
        self.figures = self.draw()
        if self._widget is None:
            return
        for name, view in self._views.items():
            view.update(self.figures[name])
        last = max(len(self.trace.steps) - 1, 0)
        self._syncing = True
        self._slider.max = last
        self._slider.value = last if self.position is None else self.position
        self._syncing = False
        ran = len(self.trace.steps)
        shown = ("no step yet" if not ran else
                 f"showing step {last if self.position is None else self.position} of 0..{last}")
        if self.position is None:      # the engine now (a request added since the last step counts)
            stats = self.engine.kv_stats()
            counts = (stats["num_running"], stats["num_waiting"], stats["num_swapped"], len(self.pending),
                      stats["free_device_blocks"], stats["total_device_blocks"])
            outputs = self.outputs
        else:                          # as the step shown left it
            record = self.trace.steps[self.position]
            counts = (len(record.block_tables), len(record.waiting), len(record.host_block_tables),
                      sum(arrival.step > self.position for arrival in self.workload),
                      record.free_device_blocks, record.total_device_blocks)
            outputs = self.history[self.position]
        self._status.value = (
            f"<b>{ran} step{'s' if ran != 1 else ''} run</b> ({shown}) &middot; {counts[0]} running, "
            f"{counts[1]} waiting, {counts[2]} swapped, {counts[3]} still to arrive &middot; device blocks free "
            f"{counts[4]}/{counts[5]}" + (" &middot; <b>all done</b>" if self.done and self.position is None else ""))
        rows = "".join(f"<tr><td>req {rid}</td><td>{out.finish_reason or ''}</td>"
                       f"<td>{html.escape(out.text)}</td></tr>" for rid, out in outputs.items())
        header = "<tr><th>request</th><th>finished</th><th>text so far</th></tr>"
        self._texts.value = f"<table>{header}{rows}</table>"

    @property
    def widget(self):
        """The ipywidgets UI (built on first use)."""
        if self._widget is None:
            self._widget = self._build()
            self.refresh()
        return self._widget

    def _build(self):
        import ipywidgets as widgets

        self._log = widgets.Output()
        self._views = {name: FigureView(fig) for name, fig in self.figures.items()}

        def action(fn):
            return lambda _: run_reporting_errors(self._log, fn)

        step = widgets.Button(description="Step", button_style="primary", tooltip="run one engine step")
        run_n = widgets.Button(description="Run N", tooltip="run N engine steps")
        n = widgets.BoundedIntText(value=5, min=1, max=1000, description="N",
                                   layout=widgets.Layout(width="130px"))
        reset = widgets.Button(description="Reset", button_style="warning",
                               tooltip="abort everything, queue the workload again")
        step.on_click(action(lambda: self.step(1)))
        run_n.on_click(action(lambda: self.step(n.value)))
        reset.on_click(action(self.reset))
        prompt = widgets.Text(placeholder="a new prompt", layout=widgets.Layout(width="320px"))
        max_tokens = widgets.BoundedIntText(value=16, min=1, max=512, description="max_tokens",
                                            layout=widgets.Layout(width="180px"))
        add = widgets.Button(description="Add request", tooltip="add the prompt (greedy) to the engine")
        add.on_click(action(lambda: prompt.value and self.add(prompt.value, SamplingParams(
            max_tokens=max_tokens.value, temperature=0.0))))
        self._slider = widgets.IntSlider(min=0, max=0, description="step", continuous_update=False,
                                         style={"description_width": "initial"},
                                         layout=widgets.Layout(width="500px"))
        self._syncing = False

        def scrub(change):
            if not self._syncing:
                last = len(self.trace.steps) - 1
                run_reporting_errors(self._log, lambda: self.show_step(None if change["new"] >= last else change["new"]))
        self._slider.observe(scrub, names="value")
        self._status, self._texts = widgets.HTML(), widgets.HTML()
        return widgets.VBox([widgets.HBox([step, run_n, n, reset]), widgets.HBox([prompt, max_tokens, add]),
                             self._status, self._slider, *[v.widget for v in self._views.values()],
                             self._texts, self._log])

    def _ipython_display_(self):
        if has_widget_frontend():
            _show(self.widget)
        else:
            _show(*self.figures.values())
