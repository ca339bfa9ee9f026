"""A block allocator by hand: allocate, append, fork, free and swap requests and watch the block table.

    playground = viz.BlockPlayground(BlockManager(num_device_blocks=12, num_host_blocks=6, block_size=4))
    playground.allocate("a", 10); playground.fork("a", "b"); playground.figure()

    from exercises.ex09_block_allocator import BlockAllocator       # your exercise 09
    viz.BlockPlayground(BlockAllocator(num_blocks=16, block_size=4))  # the same buttons, your code
    unwritten_methods(BlockAllocator)                                 # ["fork", "free"]: not yet

The engine's `BlockManager` shares full blocks through the prefix cache (a fork recomputes
its partial last block); exercise 09's `BlockAllocator` shares every block and copies on
write. Either way the figure is drawn from the allocator's own tables and counters, so its
header and its grid always describe the same state. Names are never reused silently: an
operation that would overwrite a request is refused. In JupyterLab the playground shows
buttons; an operation that fails prints one line saying why (try allocating until the
blocks run out); without a widget frontend (nbval, nbconvert) it shows its figure.
"""
from __future__ import annotations

from llmlab.hooks import StepRecord
from llmlab.request import Request
from llmlab.sampling import SamplingParams
from llmlab.viz.block_figures import block_manager_state, block_table
from llmlab.viz.widgets import FigureView, has_widget_frontend, run_reporting_errors

NAMES = "abcdefghijklmnopqrstuvwxyz"
EXERCISE_09_METHODS = ("allocate", "append_slot", "fork", "free")   # what the playground calls


def unwritten_methods(allocator_class) -> list[str]:
    """The methods of exercise 09's BlockAllocator that still raise NotImplementedError. Each
    is tried on an allocator of its own whose sequence 0 (3 tokens in block 0) is set up by
    hand, so one unwritten method does not hide another; any other error means it is written."""
    missing = []
    for name in EXERCISE_09_METHODS:
        allocator = allocator_class(num_blocks=4, block_size=4)
        allocator.free_blocks.remove(0)
        allocator.ref_counts[0] = 1
        allocator.block_tables[0], allocator.seq_lens[0] = [0], 3
        args = {"allocate": (1, 5), "append_slot": (0,), "fork": (0, 1), "free": (0,)}[name]
        try:
            getattr(allocator, name)(*args)
        except NotImplementedError:
            missing.append(name)
        except Exception:   # noqa: BLE001 -- written, maybe wrong: the grader says how
            pass
    return missing


class BlockPlayground:
    """Each method is the allocator call the scheduler would make, plus, for a BlockManager,
    the bookkeeping the engine does after a forward (`num_computed_tokens`, `cache_full_blocks`)."""

    def __init__(self, allocator, max_blocks: int = 64):
        self.block_manager = allocator          # BlockManager, or anything with exercise 09's API
        self.is_exercise = hasattr(allocator, "append_slot")
        self.max_blocks = max_blocks
        self.requests: dict[str, Request] = {}  # BlockManager only: the requests it serves
        self.last_copy: tuple[int, int] | None = None   # exercise 09: the last copy-on-write
        self._view = None
        self._next_token = 1000      # made-up token ids: only their equality matters here

    # ---- names -------------------------------------------------------------------------
    def names(self) -> list[str]:
        tables = self.block_manager.block_tables if self.is_exercise else self.requests
        return [str(name) for name in tables]

    def next_free_name(self) -> str:
        used = set(self.names())
        return next((n for n in NAMES if n not in used), f"r{len(used)}")

    def _new(self, name: str) -> None:
        if name in self.names():
            raise ValueError(f"request {name!r} exists already: free it first, or use another name "
                             f"({self.next_free_name()!r} is free)")

    def _known(self, name: str) -> None:
        if name not in self.names():
            raise ValueError(f"no request {name!r} (there are: {', '.join(self.names()) or 'none'})")

    # ---- operations ----------------------------------------------------------------------
    def allocate(self, name: str, num_tokens: int, token_ids: list[int] | None = None):
        """A new request with a prompt of `num_tokens` tokens: blocks for all of them."""
        self._new(name)
        if self.is_exercise:
            table = self.block_manager.allocate(name, num_tokens)
            self.refresh()
            return table
        request = Request(name, None, token_ids or self._tokens(num_tokens), SamplingParams())
        self.block_manager.allocate(request, request.num_tokens)   # raises before changing anything
        self.requests[name] = request
        return self._computed(request)

    def append(self, name: str, num_tokens: int = 1):
        """Decode `num_tokens` more tokens: a new block only when the last one is full (and,
        in exercise 09, a private copy when the last block is shared)."""
        self._known(name)
        try:
            for _ in range(num_tokens):
                if self.is_exercise:
                    _, copy = self.block_manager.append_slot(name)
                    self.last_copy = copy or self.last_copy
                else:
                    request = self.requests[name]
                    self.block_manager.allocate(request, request.num_tokens + 1)   # room first
                    request.output_token_ids += self._tokens(1)
        finally:   # tokens appended before a failure stay: draw them
            if not self.is_exercise:
                self._computed(self.requests[name])
            self.refresh()
        return self.block_manager.block_tables[name] if self.is_exercise else self.requests[name]

    def fork(self, parent: str, child: str):
        """A request with the same tokens as `parent`. BlockManager: its full blocks are shared
        through the prefix cache (ref count 2), the partial last block is recomputed into a
        block of its own. Exercise 09: every block is shared until someone appends."""
        self._known(parent)
        self._new(child)
        if self.is_exercise:
            self.block_manager.fork(parent, child)
            self.refresh()
            return self.block_manager.block_tables[child]
        request = Request(child, None, list(self.requests[parent].all_token_ids), SamplingParams())
        self.block_manager.match_prefix(request)
        try:
            self.block_manager.allocate(request, request.num_tokens)
        except Exception:
            self.block_manager.free(request)   # give the shared blocks back: no leak
            raise
        self.requests[child] = request
        return self._computed(request)

    def free(self, name: str):
        """The request finished: drop its references; returns the blocks that became free."""
        self._known(name)
        if self.is_exercise:
            before = set(self.block_manager.free_blocks)
            self.block_manager.free(name)
            self.refresh()
            return sorted(set(self.block_manager.free_blocks) - before)
        request = self.requests.pop(name)
        if name in self.block_manager.host_tables:
            self.block_manager.free_host(request)
        freed = self.block_manager.free(request)
        self.refresh()
        return freed

    def swap_out(self, name: str) -> list[tuple[int, int]]:
        request = self._swappable(name)
        if not request.block_table:
            raise ValueError(f"request {name!r} is already in host memory")
        if not self.block_manager.can_swap_out(request):
            raise ValueError(f"not enough host blocks for {name!r}: it needs {len(request.block_table)}, "
                             f"{self.block_manager.num_free_host_blocks} free")
        copies = self.block_manager.swap_out(request)
        self.refresh()
        return copies

    def swap_in(self, name: str) -> list[tuple[int, int]]:
        request = self._swappable(name)
        if name not in self.block_manager.host_tables:
            raise ValueError(f"request {name!r} is not swapped out")
        if not self.block_manager.can_swap_in(request):
            raise ValueError(f"not enough free device blocks to bring {name!r} back: it needs "
                             f"{len(self.block_manager.host_tables[name])}, {self.block_manager.num_free_blocks} free")
        copies = self.block_manager.swap_in(request)
        self.refresh()
        return copies

    def _swappable(self, name):
        if self.is_exercise:
            raise ValueError("exercise 09's allocator has no host memory: swapping is the engine's BlockManager")
        self._known(name)
        return self.requests[name]

    def _tokens(self, n):
        self._next_token += n
        return list(range(self._next_token - n, self._next_token))

    def _computed(self, request):
        request.num_computed_tokens = request.num_tokens   # as if the forward wrote their K/V
        self.block_manager.cache_full_blocks(request)
        self.refresh()
        return request

    # ---- drawing -------------------------------------------------------------------------
    def state(self):
        """The allocator's state as a StepRecord (what `figures.block_table` draws) and the
        tokens each request holds."""
        if not self.is_exercise:
            state = block_manager_state(self.block_manager, list(self.requests.values()))
            return state, {name: r.num_computed_tokens for name, r in self.requests.items()}
        allocator = self.block_manager
        state = StepRecord(
            step=0, block_tables={str(k): list(v) for k, v in allocator.block_tables.items()},
            shared_blocks=[b for b, count in enumerate(allocator.ref_counts) if count > 1],
            free_device_blocks=allocator.num_free_blocks, total_device_blocks=allocator.num_blocks)
        return state, {str(k): n for k, n in allocator.seq_lens.items()}

    def figure(self, title: str | None = None):
        state, tokens = self.state()
        if title is None and self.last_copy:
            title = f"KV block table (last copy-on-write: block {self.last_copy[0]} -> {self.last_copy[1]})"
        return block_table(state, block_size=self.block_manager.block_size, num_tokens=tokens,
                                   max_blocks=self.max_blocks, title=title or "KV block table")

    def refresh(self) -> None:
        if self._view is not None:
            self._view.update(self.figure())
            self._other.value = self.next_free_name()

    @property
    def widget(self):
        import ipywidgets as widgets

        if self._view is None:
            self._view = FigureView(self.figure())
            log = widgets.Output()
            name = widgets.Text(value="a", description="request", layout=widgets.Layout(width="180px"))
            self._other = widgets.Text(value=self.next_free_name(), description="fork to",
                                       layout=widgets.Layout(width="180px"))
            tokens = widgets.BoundedIntText(value=6, min=1, max=256, description="tokens",
                                            layout=widgets.Layout(width="150px"))
            buttons = {"allocate": lambda: self.allocate(name.value, tokens.value),
                       "append": lambda: self.append(name.value, tokens.value),
                       "fork": lambda: self.fork(name.value, self._other.value),
                       "free": lambda: self.free(name.value)}
            if not self.is_exercise:
                buttons.update({"swap out": lambda: self.swap_out(name.value),
                                "swap in": lambda: self.swap_in(name.value)})
            row = []
            for label, fn in buttons.items():
                button = widgets.Button(description=label, layout=widgets.Layout(width="90px"))
                button.on_click(lambda _, fn=fn: run_reporting_errors(log, fn))
                row.append(button)
            self._box = widgets.VBox([widgets.HBox([name, tokens, self._other]), widgets.HBox(row),
                                      self._view.widget, log])
        return self._box

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget if has_widget_frontend() else self.figure())
