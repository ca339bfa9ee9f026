"""How an answer goes back: OpenAI's response objects, sent as a stream of server-sent
events or as one JSON object at the end.

Both ways read a `RequestStream` (`async_engine.py`). Per output they touch only what is new
(`delta_text`), never the cumulative text, so a 4,096-token stream costs the same per
token at its end as at its start (`tests/test_server_stream_cost.py` counts it).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import TYPE_CHECKING, Callable, Literal

from pydantic import BaseModel, model_serializer
from starlette.requests import Request

from llmlab.server.protocol import APIError

if TYPE_CHECKING:
    from llmlab.request import RequestOutput
    from llmlab.server.async_engine import RequestStream


# ---- response bodies (field names and shapes as in the OpenAI API reference) ----------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0      # served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> "Usage":
        return cls(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                   total_tokens=num_prompt_tokens + num_completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens))


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """Both the whole response and, with stream=true, each chunk (same object name)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def without_nulls(self) -> dict:   # OpenAI sends {"content": "..."}, and {} at the end
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]   # empty in the final usage chunk
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llmlab"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---- sending them -------------------------------------------------------------------------
def usage_of(stream: RequestStream, output: RequestOutput) -> Usage:
    # num_tokens_seen (the engine thread's count of delivered tokens), not len(output.token_ids),
    # which would copy the whole output
    return Usage.of(len(stream.prompt_token_ids), stream.num_tokens_seen, output.num_cached_prompt_tokens)


def sse(obj) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


def sse_error(error: APIError) -> str:
    return f"data: {json.dumps(error.body())}\n\n"


def as_api_error(err: Exception) -> APIError:
    """What the client sees of an exception: our own errors as they are, anything else as
    a 500 without its text (that goes to the log)."""
    if isinstance(err, APIError):
        return err
    return APIError(500, "internal server error", type="server_error")


def event_stream(stream: RequestStream, chunk: Callable, include_usage: bool, first_chunk,
                 on_error: Callable[[int], None]):
    """Server-sent events: a chunk per new piece of text, the finish reason on the last one,
    usage if asked (`stream_options.include_usage`), then [DONE]. `chunk(text, finish_reason,
    usage=None, choices=True)` builds one chunk object. An error after the headers went out
    (the engine failed, the server is shutting down) is sent as OpenAI's error object in
    an event, then [DONE]: the client sees why, and the stream still ends properly. A client
    that disconnects cancels this generator (Starlette listens for the disconnect), which
    aborts the request."""
    from fastapi.responses import StreamingResponse

    async def events():
        if first_chunk is not None:
            yield sse(first_chunk)
        output = None
        try:
            async for output in stream.outputs():   # O(1) per token: only the new text is touched
                if output.delta_text or output.finished:
                    yield sse(chunk(output.delta_text, output.finish_reason if output.finished else None))
        except Exception as err:    # headers are sent: the error goes in the stream
            error = as_api_error(err)
            on_error(error.status)
            yield sse_error(error)
        else:
            if include_usage:
                yield sse(chunk("", None, usage=usage_of(stream, output), choices=False))
        finally:    # also when the client disconnected and this generator was cancelled
            stream.close()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def wait_for_last(stream: RequestStream, request: Request) -> RequestOutput | None:
    """The final output of a non-streaming request, or None if the client hung up first
    (then the request is aborted: nobody would read its answer). An error ending the
    request (e.g. the 503 of a shutdown) is raised."""
    async def last():
        output = None
        async for output in stream.outputs():
            pass
        return output

    async def hang_up():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    result, disconnect = asyncio.ensure_future(last()), asyncio.ensure_future(hang_up())
    try:
        done, _ = await asyncio.wait({result, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (result, disconnect):
            task.cancel()     # no-op when done
        stream.close()
    return result.result() if result in done else None
