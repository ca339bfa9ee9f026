"""A BlockManager by hand: allocate, append, fork, free and swap requests and watch the block table.

    playground = viz.BlockPlayground(BlockManager(num_device_blocks=12, num_host_blocks=6, block_size=4))
    playground.allocate("a", 10); playground.fork("a", "b"); playground.figure()

In JupyterLab `playground` shows buttons for each operation; without a widget frontend
(nbval, nbconvert) it shows its figure, like the Stepper in widgets.py.
"""
from __future__ import annotations

from llmlab.request import Request
from llmlab.sampling import SamplingParams
from llmlab.viz import figures
from llmlab.viz.widgets import FigureView, has_widget_frontend


class BlockPlayground:
    """Allocate, append, fork, free and swap requests on a BlockManager and watch its block
    table. Each method is the BlockManager call the scheduler would make, plus the
    bookkeeping the engine does after a forward (`num_computed_tokens`, `cache_full_blocks`)."""

    def __init__(self, block_manager, max_blocks: int = 64):
        self.block_manager, self.max_blocks = block_manager, max_blocks
        self.requests: dict[str, Request] = {}
        self._view = None
        self._next_token = 1000      # made-up token ids: only their equality matters here

    def _tokens(self, n):
        self._next_token += n
        return list(range(self._next_token - n, self._next_token))

    def _computed(self, request):
        request.num_computed_tokens = request.num_tokens   # as if the forward wrote their K/V
        self.block_manager.cache_full_blocks(request)
        self.refresh()
        return request

    def allocate(self, name: str, num_tokens: int, token_ids: list[int] | None = None) -> Request:
        """A new request with a prompt of `num_tokens` tokens: blocks for all of them."""
        request = Request(name, None, token_ids or self._tokens(num_tokens), SamplingParams())
        self.block_manager.allocate(request, request.num_tokens)
        self.requests[name] = request
        return self._computed(request)

    def append(self, name: str, num_tokens: int = 1) -> Request:
        """Decode `num_tokens` more tokens: a new block only when the last one is full."""
        request = self.requests[name]
        for token in self._tokens(num_tokens):
            request.output_token_ids.append(token)
            self.block_manager.allocate(request, request.num_tokens)
        return self._computed(request)

    def fork(self, parent: str, child: str) -> Request:
        """A request with the same tokens as `parent`: its full blocks are shared through the
        prefix cache (ref count 2); the last, partial block is recomputed into a block of its own."""
        request = Request(child, None, list(self.requests[parent].all_token_ids), SamplingParams())
        self.block_manager.match_prefix(request)
        self.block_manager.allocate(request, request.num_tokens)
        self.requests[child] = request
        return self._computed(request)

    def free(self, name: str) -> list[int]:
        """The request finished: drop its references; returns the blocks that became free."""
        freed = self.block_manager.free(self.requests.pop(name))
        self.refresh()
        return freed

    def swap_out(self, name: str) -> list[tuple[int, int]]:
        copies = self.block_manager.swap_out(self.requests[name])
        self.refresh()
        return copies

    def swap_in(self, name: str) -> list[tuple[int, int]]:
        copies = self.block_manager.swap_in(self.requests[name])
        self.refresh()
        return copies

    def figure(self, title: str | None = None):
        state = figures.block_manager_state(self.block_manager, list(self.requests.values()))
        tokens = {name: request.num_computed_tokens for name, request in self.requests.items()}
        return figures.block_table(state, block_size=self.block_manager.block_size, num_tokens=tokens,
                                   max_blocks=self.max_blocks, title=title or "KV block table")

    def refresh(self) -> None:
        if self._view is not None:
            self._view.update(self.figure())

    @property
    def widget(self):
        import ipywidgets as widgets

        if self._view is None:
            self._view = FigureView(self.figure())
            log = widgets.Output()
            name = widgets.Text(value="a", description="request", layout=widgets.Layout(width="180px"))
            other = widgets.Text(value="b", description="fork to", layout=widgets.Layout(width="180px"))
            tokens = widgets.BoundedIntText(value=6, min=1, max=256, description="tokens",
                                            layout=widgets.Layout(width="150px"))
            buttons = {"allocate": lambda: self.allocate(name.value, tokens.value),
                       "append": lambda: self.append(name.value, tokens.value),
                       "fork": lambda: self.fork(name.value, other.value),
                       "free": lambda: self.free(name.value),
                       "swap out": lambda: self.swap_out(name.value),
                       "swap in": lambda: self.swap_in(name.value)}
            row = []
            for label, fn in buttons.items():
                button = widgets.Button(description=label, layout=widgets.Layout(width="90px"))
                button.on_click(lambda _, fn=fn: _run_in(log, fn))
                row.append(button)
            self._box = widgets.VBox([widgets.HBox([name, tokens, other]), widgets.HBox(row),
                                      self._view.widget, log])
        return self._box

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget if has_widget_frontend() else self.figure())


def _run_in(log, fn):
    with log:
        fn()
