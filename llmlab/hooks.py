"""Observing the engine: events, a hook bus, and a Recorder that builds a Trace.

The engine emits three kinds of events: `RequestAdded`, one `StepRecord` per step (what
was scheduled, preempted, swapped, allocated and sampled, the block tables afterwards,
phase timings; built by `step_record`, as the simulator's are) and `RequestFinished`. Hooks
observe; they never steer. With no hook attached the engine does not even build the events.

    rec = llmlab.Recorder(); engine.hooks.attach(rec)
    ...; rec.trace.steps[3].scheduled; rec.trace.save("run.json"); Trace.load("run.json")
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field


@dataclass
class ScheduledRecord:
    request_id: str
    kind: str               # "prefill" | "decode"
    num_tokens: int
    start_position: int


@dataclass
class StepRecord:
    step: int
    scheduled: list[ScheduledRecord] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)       # by recompute
    swapped_out: list[str] = field(default_factory=list)
    swapped_in: list[str] = field(default_factory=list)
    allocated_blocks: dict[str, list[int]] = field(default_factory=dict)
    freed_blocks: list[int] = field(default_factory=list)
    prefix_hit_tokens: dict[str, int] = field(default_factory=dict)
    block_tables: dict[str, list[int]] = field(default_factory=dict)        # running requests
    host_block_tables: dict[str, list[int]] = field(default_factory=dict)   # swapped requests
    shared_blocks: list[int] = field(default_factory=list)                   # ref count > 1
    cached_blocks: list[int] = field(default_factory=list)                   # in the prefix cache
    sampled: dict[str, int] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)                   # id -> finish reason
    waiting: list[str] = field(default_factory=list)
    free_device_blocks: int = 0
    total_device_blocks: int = 0
    free_host_blocks: int = 0
    total_host_blocks: int = 0
    token_budget: int = 0
    timings: dict[str, float] = field(default_factory=dict)          # seconds per phase
    kernel_timings: dict[str, float] = field(default_factory=dict)   # seconds per kernel
    time: float = 0.0       # perf_counter at the end of the step
    # async scheduling: planned while the step before it ran. An engine runs one step at a
    # time while a hook is attached, so a recorded step is overlapped only if it was
    # launched before the hook came (engine/in_flight.py)
    overlapped: bool = False

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.kind == "prefill")

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.kind == "decode")


def step_record(step: int, plan, scheduler, advanced, *, blocks: bool = True, freed_blocks=(), timings=None,
                kernel_timings=(), time: float = 0.0, overlapped: bool = False) -> StepRecord:
    """The StepRecord of a step that ran `plan` (a scheduler Plan), read once its bookkeeping
    is done: `advanced` are the requests that got a token (StepOutcome.advanced; those done
    are finished by now), and `scheduler` (its queues and its block manager) is in its state
    after the step. The engine and the simulator both build their records here.
    `blocks=False` leaves out which blocks (allocated, freed, the block tables but those of
    requests swapped in or out, shared and cached blocks) and the prefix hits, keeping the
    block counts: the simulator's traces hold the schedule only, small for long workloads."""
    bm = scheduler.blocks
    record = StepRecord(
        step=step, overlapped=overlapped,
        scheduled=[ScheduledRecord(i.request.request_id, i.kind, i.num_tokens, i.start_position) for i in plan.items],
        preempted=list(plan.preempted), swapped_out=list(plan.swapped_out), swapped_in=list(plan.swapped_in),
        sampled={r.request_id: r.output_token_ids[-1] for r in advanced},
        finished={r.request_id: r.finish_reason for r in advanced if r.finished},
        waiting=[r.request_id for r in scheduler.waiting],
        free_device_blocks=bm.num_free_blocks, total_device_blocks=bm.num_device_blocks,
        free_host_blocks=bm.num_free_host_blocks, total_host_blocks=bm.num_host_blocks,
        token_budget=scheduler.token_budget, timings=timings if timings is not None else {},
        kernel_timings=dict(kernel_timings), time=time)
    if not blocks:   # the tables of requests swapped in or out only: what a step copied (as Trace.without_blocks)
        swapped_in = set(plan.swapped_in)
        record.block_tables = {r.request_id: list(r.block_table) for r in scheduler.running
                               if r.request_id in swapped_in}
        record.host_block_tables = {k: list(bm.host_tables[k]) for k in plan.swapped_out if k in bm.host_tables}
    else:
        record.allocated_blocks = {k: list(v) for k, v in plan.allocated_blocks.items()}
        record.freed_blocks = list(freed_blocks)
        record.prefix_hit_tokens = dict(plan.prefix_hit_tokens)
        record.block_tables = {r.request_id: list(r.block_table) for r in scheduler.running}
        record.host_block_tables = {k: list(v) for k, v in bm.host_tables.items()}
        record.shared_blocks = [b for b, c in enumerate(bm.ref_counts) if c > 1]
        record.cached_blocks = sorted(bm.cached_blocks.values())
    return record


@dataclass
class RequestAdded:
    request_id: str
    num_prompt_tokens: int
    time: float


@dataclass
class RequestFinished:
    request_id: str
    finish_reason: str
    num_output_tokens: int
    time: float


class HookBus:
    def __init__(self):
        self.hooks = []

    def attach(self, hook) -> None:
        """`hook(event)` is called for every event until detached."""
        self.hooks.append(hook)

    def detach(self, hook) -> None:
        self.hooks.remove(hook)

    @property
    def active(self) -> bool:
        return bool(self.hooks)

    @property
    def blocks(self) -> bool:
        """Whether step records carry their blocks (allocated, freed, shared and cached blocks,
        the block tables): some hook wants them. Building them costs a step milliseconds over
        thousands of blocks, so a hook that reads none says so with `hook.blocks = False`."""
        return any(getattr(hook, "blocks", True) for hook in self.hooks)

    def emit(self, event) -> None:
        for hook in self.hooks:
            hook(event)


@dataclass
class Trace:
    steps: list[StepRecord] = field(default_factory=list)
    added: list[RequestAdded] = field(default_factory=list)
    finished: list[RequestFinished] = field(default_factory=list)
    meta: dict = field(default_factory=dict)   # model, device, config: whatever the recorder was told

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Trace":
        steps = []
        for s in data.get("steps", []):
            s = dict(s)
            s["scheduled"] = [ScheduledRecord(**x) for x in s.get("scheduled", [])]
            steps.append(StepRecord(**s))
        return cls(steps=steps,
                   added=[RequestAdded(**x) for x in data.get("added", [])],
                   finished=[RequestFinished(**x) for x in data.get("finished", [])],
                   meta=data.get("meta", {}))

    def without_blocks(self) -> "Trace":
        """A copy without which blocks each step allocated, freed, shared and cached, and
        without block tables except those of requests swapped in or out in the step: what
        the metrics and a cost model read (Result.from_trace, CostModel.fit) is kept, and
        most of a long run's size is not."""
        steps = [dataclasses.replace(
            s, block_tables={r: s.block_tables[r] for r in s.swapped_in if r in s.block_tables},
            host_block_tables={r: s.host_block_tables[r] for r in s.swapped_out if r in s.host_block_tables},
            allocated_blocks={}, freed_blocks=[], shared_blocks=[], cached_blocks=[]) for s in self.steps]
        return dataclasses.replace(self, steps=steps)

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f)

    @classmethod
    def load(cls, path) -> "Trace":
        with open(path) as f:
            return cls.from_dict(json.load(f))


class Recorder:
    """A hook that keeps every event in `self.trace`; with `blocks=False` its step records
    leave out which blocks (as Trace.without_blocks does) and cost the engine less to build."""

    def __init__(self, blocks: bool = True, **meta):
        self.blocks = blocks
        self.trace = Trace(meta=meta)

    def __call__(self, event) -> None:
        if isinstance(event, StepRecord):
            self.trace.steps.append(event)
        elif isinstance(event, RequestAdded):
            self.trace.added.append(event)
        elif isinstance(event, RequestFinished):
            self.trace.finished.append(event)
