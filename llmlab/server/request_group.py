"""A handler's end of one API request: the engine requests of its choices (`n` per prompt,
for every prompt of a completion request), read through one queue.

The API side of the engine (async_engine.py) rebuilds each choice's outputs from the deltas
the engine loop sends (`RequestStream.received`) and puts them in its group's queue as
(choice index, RequestOutput or exception); the handler reads them with
`RequestGroup.outputs()`, which merges what piled up for a slow reader, and `close()`
aborts whatever has not finished (a client that hung up, a stream that failed), so every
KV block comes back.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from llmlab.request import RequestOutput
from llmlab.sampling import SamplingParams


@dataclass(eq=False)
class RequestStream:
    """One engine request: one choice of an API request's answer."""
    request_id: str
    index: int                       # the choice's index in the answer
    prompt_token_ids: list[int]
    params: SamplingParams
    queue: asyncio.Queue             # its RequestGroup's: (index, RequestOutput | Exception)
    arrival_time: float = field(default_factory=time.perf_counter)
    # what has arrived so far (the cumulative output), and when the last token did (metrics)
    token_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    last_token_time: float = 0.0

    def received(self, delta) -> RequestOutput:
        """The RequestOutput of a step's `Delta` (engine_loop.py), its cumulative text, token ids
        and logprobs made of every delta so far. O(the delta): like `RequestOutput.of`, the
        cumulative views are a snapshot (a list and a length) joined only when read."""
        self.token_ids += delta.delta_token_ids
        self.pieces.append(delta.delta_text)
        if delta.delta_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += delta.delta_logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        out = RequestOutput.__new__(RequestOutput)
        out.request_id, out.prompt, out.prompt_token_ids = self.request_id, None, self.prompt_token_ids
        out.finished, out.finish_reason = delta.finished, delta.finish_reason
        out.num_cached_prompt_tokens = delta.num_cached_prompt_tokens
        out._all_token_ids, out._num_tokens = self.token_ids, len(self.token_ids)
        out._output_text, out._num_pieces, out._text = self, len(self.pieces), None
        out.delta_text, out.delta_token_ids, out.delta_logprobs = (delta.delta_text, delta.delta_token_ids,
                                                                   delta.delta_logprobs)
        out.prompt_logprobs, out._logprobs = self.prompt_logprobs, self.logprobs
        return out

    def text_of(self, num_pieces: int) -> str:
        """The text of the first `num_pieces` deltas (a RequestOutput's `text`, read when asked)."""
        return "".join(self.pieces[:num_pieces])


class RefusedRequest(ValueError):
    """The engine refused choice `index` of an API request (the client's fault): `error`."""

    def __init__(self, index: int, error: ValueError):
        super().__init__(str(error))
        self.index, self.error = index, error


class RequestGroup:
    """A handler's end of one API request: the engine requests of its choices, read through
    one queue, in the order their outputs come."""

    def __init__(self, abort: Callable[[str], None], streams: list[RequestStream], queue: asyncio.Queue,
                 accepted: asyncio.Future):
        self.abort, self.streams, self.queue = abort, streams, queue     # abort: AsyncEngine.abort
        self.accepted = accepted     # done once the engine took them all, or with the error that refused one
        self.unfinished = {stream.index for stream in streams}    # (as far as the reader knows)

    async def outputs(self) -> AsyncIterator[tuple[RequestStream, RequestOutput]]:
        """(choice, output) until every choice has finished. When a choice has several outputs
        queued (a slow reader) they are merged into one: the newest, carrying all their deltas
        (text, token ids, logprobs). An error (the engine failed, shutdown) is raised."""
        while self.unfinished:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            errors = [item for _, item in items if isinstance(item, BaseException)]
            if errors:
                self.unfinished.clear()    # (an error ends every choice: the engine aborted them)
                raise errors[0]
            by_choice: dict[int, list[RequestOutput]] = {}
            for index, output in items:
                by_choice.setdefault(index, []).append(output)
            for index, outputs in by_choice.items():
                last = merged(outputs)
                if last.finished:
                    self.unfinished.discard(index)
                yield self.streams[index], last

    def close(self) -> None:
        """The reader is done: abort every choice that has not finished (its KV blocks come back)."""
        for index in sorted(self.unfinished):
            self.abort(self.streams[index].request_id)
        self.unfinished.clear()


def merged(outputs: list[RequestOutput]) -> RequestOutput:
    """The newest of one request's outputs, carrying the deltas of all of them."""
    last = outputs[-1]
    if len(outputs) > 1:
        last.delta_text = "".join(o.delta_text for o in outputs)
        last.delta_token_ids = [t for o in outputs for t in o.delta_token_ids]
        if last.delta_logprobs is not None:
            last.delta_logprobs = [entry for o in outputs for entry in o.delta_logprobs]
    return last
