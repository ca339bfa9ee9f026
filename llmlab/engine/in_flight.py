"""The step in flight: async scheduling (vLLM's name; SGLang calls it the overlap scheduler).

Run one step at a time and the device waits while the host schedules, prepares the batch,
reads the sampled tokens, detokenizes and checks stops: ~4-10 ms per step at 256 sequences.
With `EngineConfig.async_scheduling`, `LLMEngine.step()` launches step N+1 before it reads
step N's tokens, so that host work runs while the device computes:

    host:    schedule N+1, prepare N+1, launch N+1 | read N's tokens, bookkeeping, outputs of N
    device:  ... step N ...........................| step N+1 ..................................

Planning step N+1 without step N's tokens: each request that sampled in step N holds a
placeholder for its token (`request.token_pending`, scheduler.py), so it is scheduled to
decode it, and the runner takes its input id on the device from step N's sampled tensor
(`batch.prepare`'s `previous`). The host reads the tokens a step late, through a pinned copy
and an event (it waits for step N only, not for N+1 behind it), so stop checks,
detokenization and outputs lag one step. A request that step N's token ends (EOS, a stop
token or string) has decoded one token too many in step N+1: that token is dropped and its
blocks freed. A request that step N's token ends by length is not scheduled again.

With a hook attached (a Recorder, the Stepper) the engine runs steps one at a time, so a
StepRecord shows one whole step; each record's `overlapped` says how the step ran.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmlab.request import Request
from llmlab.plan import Plan


@dataclass(eq=False)
class InFlightStep:
    """A launched step whose sampled tokens the host has not read yet."""
    plan: Plan
    requests: list[Request]       # the plan's sampling requests: row i of `sampled` is requests[i]'s
    sampled: torch.Tensor         # [len(requests)] int64, on the device
    timings: dict = field(default_factory=dict)
    kernel_timings: dict = field(default_factory=dict)
    index: int = 0                # the engine's step counter when it was launched
    overlapped: bool = False      # launched before the step ahead of it was read
    # log-probabilities asked for (sampling.TokenLogprobs, on the device): of the sampled tokens
    # (rows: indices into `requests`) and of prompt tokens (rows: (request, prompt position))
    logprobs: object = None
    prompt_logprobs: object = None
    host: list[torch.Tensor] | None = None    # pinned copies of the tensors above (CUDA), valid once `ready`
    ready: torch.cuda.Event | None = None

    def __post_init__(self):
        if self.sampled.is_cuda:   # start the copies now: they run when the step is done
            self.host = [pinned_copy(t) for t in self._device_tensors()]
            self.ready = torch.cuda.Event()
            self.ready.record()

    def _device_tensors(self) -> list[torch.Tensor]:
        return [self.sampled] + [t for lp in (self.logprobs, self.prompt_logprobs) if lp is not None
                                 for t in lp.tensors]

    def _read(self) -> list[torch.Tensor]:
        """The step's tensors on the host (waits for this step only)."""
        if self.ready is not None:
            self.ready.synchronize()
            return self.host
        return self._device_tensors()

    @property
    def previous(self) -> tuple[dict[Request, int], torch.Tensor]:
        """(rows, tokens) for the next step's batch.prepare: request -> its row of `sampled`."""
        return {request: row for row, request in enumerate(self.requests)}, self.sampled

    def tokens(self) -> list[int]:
        """The sampled token ids, in the order of `requests` (waits for this step only)."""
        return self._read()[0].tolist()

    def logprob_entries(self) -> tuple[list, list]:
        """([(row, TokenLogprob)] of the sampled tokens, [((request, position), TokenLogprob)]
        of the prompt tokens): what the output processor attaches to the requests."""
        tensors, found = self._read()[1:], []
        for lp in (self.logprobs, self.prompt_logprobs):
            if lp is None:
                found.append([])
                continue
            found.append(list(zip(lp.rows, lp.entries(tensors[:4]))))
            tensors = tensors[4:]
        return found[0], found[1]


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
