"""A request's life: WAITING -> RUNNING <-> (SWAPPED | back to WAITING) -> FINISHED.

The engine owns requests; the scheduler moves them between queues; the block manager
keeps their block tables. Everything the notebooks show about a request is a field here.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from llmlab.sampling import SamplingParams, TokenLogprob


class ContextLengthError(ValueError):
    """The prompt (plus one new token) does not fit in the model's context."""


# the value of an output token the host has not read yet (never fed to the model: the
# runner takes that input id from the device, where the sampler left it)
PENDING_TOKEN = -1


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
    block_hashes: list[int] = field(default_factory=list)   # hash chain of its full blocks (prefix caching)
    num_cached_blocks: int = 0       # leading blocks of block_table already in the prefix cache
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    sampling_seed: int = 0           # keys the sampler's noise: params.seed, or one the engine drew
    output_text: object = None       # its OutputText (engine/output.py), set by the output processor
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0   # prompt tokens found in the prefix cache
    first_token_time: float | None = None
    finish_time: float | None = None
    num_reported_tokens: int = 0     # output tokens already handed out in a RequestOutput
    # async scheduling: the newest output token is still on the device (a placeholder in
    # output_token_ids until the host reads it, one step later; see engine/in_flight.py)
    token_pending: bool = False
    output_logprobs: list[TokenLogprob] | None = None   # one per output token, if params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None   # one per prompt token (None for the first)

    def __post_init__(self):
        if getattr(self.params, "logprobs", None) is not None:
            self.output_logprobs = []
        if getattr(self.params, "prompt_logprobs", None) is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

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
        return self.output_text.text if self.output_text is not None else ""

    def drop_pending_token(self) -> None:
        """Forget the newest token if it is still in flight (the request finished meanwhile:
        aborted, or ended by a stop string)."""
        if self.token_pending:
            self.output_token_ids.pop()
            self.token_pending = False


def unused_request_id(request_id, requests: dict, ids) -> str:
    """`request_id` as a string, or for None the next number of `ids` (an itertools.count)
    that no caller has taken; a ValueError if `requests` holds it already."""
    if request_id is None:
        while (request_id := str(next(ids))) in requests:
            pass
    request_id = str(request_id)
    if request_id in requests:
        raise ValueError(f"request id {request_id!r} is already in use")
    return request_id


class RequestOutput:   # a plain class with __slots__: it is built for every request every step
    """What a request has produced so far (returned by `LLMEngine.step`, `LLM.generate`).

    `text` and `token_ids` are cumulative; `delta_text` and `delta_token_ids` are what is
    new since the request's previous output (what a stream sends). Building an output is
    O(1) in the output's length: the cumulative views are a snapshot (a reference and a
    length) materialized only when read, so a long stream does not pay O(length) per step.
    """
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "delta_text", "delta_token_ids",
                 "finished", "finish_reason", "num_cached_prompt_tokens", "prompt_logprobs", "delta_logprobs",
                 "_logprobs",
                 "_all_token_ids", "_num_tokens", "_output_text", "_num_pieces", "_text")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 text: str = "", token_ids: list[int] = (), finished: bool = False,
                 finish_reason: str | None = None, num_cached_prompt_tokens: int = 0,
                 delta_text: str | None = None, delta_token_ids: list[int] | None = None):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.finished, self.finish_reason = finished, finish_reason
        self.num_cached_prompt_tokens = num_cached_prompt_tokens   # prompt tokens served from the prefix cache
        self._all_token_ids, self._num_tokens = list(token_ids), len(token_ids)
        self._output_text, self._num_pieces, self._text = None, 0, text
        self.delta_text = text if delta_text is None else delta_text
        self.delta_token_ids = list(self._all_token_ids) if delta_token_ids is None else delta_token_ids
        self.prompt_logprobs = self._logprobs = self.delta_logprobs = None

    @classmethod
    def of(cls, request: "Request") -> "RequestOutput":
        """A snapshot of `request` now, with what is new since its previous output (so the
        request's delta counters advance: call it once per output handed out)."""
        out = cls.__new__(cls)
        start, request.num_reported_tokens = request.num_reported_tokens, len(request.output_token_ids)
        delta_token_ids = request.output_token_ids[start:]
        delta_text = request.output_text.take_delta() if request.output_text is not None else ""
        out.request_id, out.prompt, out.prompt_token_ids = request.request_id, request.prompt, request.prompt_token_ids
        out.finished, out.finish_reason = request.finished, request.finish_reason
        out.num_cached_prompt_tokens = request.num_cached_prompt_tokens
        out._all_token_ids, out._num_tokens = request.output_token_ids, len(request.output_token_ids)
        output_text = request.output_text
        out._output_text, out._num_pieces = output_text, len(output_text.pieces) if output_text else 0
        out._text = None if output_text else ""
        out.delta_text, out.delta_token_ids = delta_text, delta_token_ids
        out.prompt_logprobs, out._logprobs = request.prompt_logprobs, request.output_logprobs
        out.delta_logprobs = None if out._logprobs is None else out._logprobs[start:]
        return out

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """One TokenLogprob per token of `token_ids` (None unless SamplingParams.logprobs was set);
        `delta_logprobs`: those of `delta_token_ids`. `prompt_logprobs`: one per prompt token,
        None for the first (nothing predicts it), if SamplingParams.prompt_logprobs was set."""
        return None if self._logprobs is None else self._logprobs[:self._num_tokens]

    @property
    def token_ids(self) -> list[int]:
        """Every token generated so far (cumulative)."""
        return self._all_token_ids[:self._num_tokens]

    @property
    def text(self) -> str:
        """The text generated so far (cumulative; a held-back partial stop string excluded)."""
        if self._text is None:
            self._text = self._output_text.text_of(self._num_pieces)
        return self._text

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, text={self.text!r}, "
                f"token_ids={self.token_ids}, finished={self.finished}, finish_reason={self.finish_reason!r})")
