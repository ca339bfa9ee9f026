"""A request's life: WAITING -> RUNNING <-> (SWAPPED | back to WAITING) -> FINISHED.

The engine owns requests; the scheduler moves them between queues; the block manager
keeps their block tables. Everything the notebooks show about a request is a field here.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from llmlab.sampling import SamplingParams


class ContextLengthError(ValueError):
    """The prompt (plus one new token) does not fit in the model's context."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # queued; no KV in the cache (new, or preempted by recompute)
    RUNNING = "running"      # has KV blocks on the device; prefilling or decoding
    SWAPPED = "swapped"      # preempted by swap: its KV blocks live in host memory
    FINISHED = "finished"


@dataclass(eq=False)   # a request is itself: compare by identity, not field by field
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0     # tokens whose K/V is in the cache
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    generator: torch.Generator | None = None
    detokenizer: object = None       # IncrementalDetokenizer, set by the engine
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0   # prompt tokens found in the prefix cache
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self):
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled:
        the (rest of the) prompt while prefilling, 1 while decoding."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed_tokens > 1 or not self.output_token_ids and self.num_uncomputed_tokens > 0

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""


@dataclass
class RequestOutput:
    """What a request has produced so far (returned by `LLMEngine.step`, `LLM.generate`)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_cached_prompt_tokens: int = 0   # prompt tokens served from the prefix cache

    @classmethod
    def of(cls, request: Request) -> "RequestOutput":
        return cls(request.request_id, request.prompt, request.prompt_token_ids, request.text,
                   list(request.output_token_ids), request.finished, request.finish_reason,
                   request.num_cached_prompt_tokens)
