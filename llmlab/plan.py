"""The scheduler's output as plain data. `Scheduler.schedule()` returns a `Plan` (what
runs this step, what moves between device and host); the engine applies it and the runner
turns it into one flat batch. `Scheduler.update` answers with a `StepOutcome` (what the
step's sampled tokens did). Neither holds tensors."""
from __future__ import annotations

from dataclasses import dataclass, field

from llmlab.request import Request


@dataclass
class ScheduledItem:
    request: Request
    kind: str             # "prefill" | "decode"
    num_tokens: int       # new tokens computed this step
    start_position: int   # position of the first of them
    # whether this step computes the request's last uncomputed token, so that it samples
    # (a prefill chunk short of the prompt's end does not). Decided once, when the item is
    # made: the runner's logits rows, the sampler and update() all read this one answer.
    completes_prompt: bool = field(init=False)

    def __post_init__(self):
        self.completes_prompt = self.start_position + self.num_tokens == self.request.num_tokens


@dataclass
class Plan:
    prefills: list[ScheduledItem] = field(default_factory=list)
    decodes: list[ScheduledItem] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)        # back to waiting (recompute)
    swapped_out: list[str] = field(default_factory=list)
    swapped_in: list[str] = field(default_factory=list)
    swap_out_copies: list[tuple[int, int]] = field(default_factory=list)   # (device, host)
    swap_in_copies: list[tuple[int, int]] = field(default_factory=list)    # (host, device)
    allocated_blocks: dict[str, list[int]] = field(default_factory=dict)
    prefix_hit_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def items(self) -> list[ScheduledItem]:
        """Prefill chunks first, then decodes: the order of the flat batch."""
        return self.prefills + self.decodes

    @property
    def sampling_items(self) -> list[ScheduledItem]:
        """The items that sample a token this step, in batch order: one logits row each."""
        return [item for item in self.items if item.completes_prompt]

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)

    @property
    def is_empty(self) -> bool:
        return not self.items

    @property
    def changes_nothing(self) -> bool:
        """No tokens, no swaps, no preemptions: the step leaves every request as it was."""
        return not (self.items or self.swap_out_copies or self.swap_in_copies or self.preempted
                    or self.swapped_out or self.swapped_in)


@dataclass
class StepOutcome:
    """What `Scheduler.update` did with one step's sampled tokens."""
    advanced: list[Request] = field(default_factory=list)   # got a token, in plan.sampling_items order
    finished: list[Request] = field(default_factory=list)   # of those, the ones done (blocks freed)
    freed_blocks: list[int] = field(default_factory=list)   # device blocks the finished gave back
    num_dropped: int = 0     # tokens sampled for requests that had finished meanwhile (async scheduling)
    policy_error: Exception | None = None   # the policy's on_step raised (after the step's bookkeeping)

    def checked(self, result=None):
        """`result` (default: this outcome), or the policy's on_step error, raised once whoever
        finishes the step has done so: nothing is lost (the error carries `result` as `outputs`)."""
        if self.policy_error is not None:
            self.policy_error.outputs = result
            raise self.policy_error
        return self if result is None else result
