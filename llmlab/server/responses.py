"""How an answer goes back: OpenAI's response objects, sent as a stream of server-sent
events or as one JSON object at the end.

Both ways read a `RequestGroup` (`async_engine.py`: the engine requests of one API request,
one per choice) and turn its outputs into choices with `choices.py`. A stream sends a chunk
per new piece of a choice (one choice per chunk, with its `index`, as OpenAI and vLLM do);
per output it touches only what is new (`delta_text`, `delta_token_ids`, `delta_logprobs`),
never the cumulative text, so a 4,096-token stream costs the same per token at its end as at
its start (`tests/server/test_server_stream_cost.py` counts it).
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
    from llmlab.server.request_group import RequestGroup


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
    logprobs: dict | None = None     # {tokens, token_logprobs, top_logprobs, text_offset} (logprobs.py)
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
    logprobs: dict | None = None     # {"content": [{token, logprob, bytes, top_logprobs}]} (logprobs.py)
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
    logprobs: dict | None = None
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


def event_stream(group: RequestGroup, choices, include_usage: bool, on_error: Callable[[int], None]):
    """Server-sent events: the opening chunks (chat: each choice's role), a chunk per new
    piece of a choice, its finish reason on its last one, usage if asked
    (`stream_options.include_usage`), then [DONE]. An error after the headers went out (the
    engine failed, the server is shutting down) is sent as OpenAI's error object in an event,
    then [DONE]: the client sees why, and the stream still ends properly. A client that
    disconnects cancels this generator (Starlette listens for the disconnect), which aborts
    every choice still running. `choices`: a choices.py `Choices` (its `opening()`,
    `chunk(stream, output)` and `usage_chunk()` build the chunks)."""
    from fastapi.responses import StreamingResponse

    async def events():
        try:
            for chunk in choices.opening():
                yield sse(chunk)
            async for stream, output in group.outputs():   # O(1) per token: only the new text is touched
                chunk = choices.chunk(stream, output)
                if chunk is not None:
                    yield sse(chunk)
        except Exception as err:    # headers are sent: the error goes in the stream
            error = as_api_error(err)
            on_error(error.status)
            yield sse_error(error)
        else:
            if include_usage:
                yield sse(choices.usage_chunk())
        finally:    # also when the client disconnected and this generator was cancelled
            group.close()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def wait_for_all(group: RequestGroup, request: Request) -> dict[int, RequestOutput] | None:
    """Each choice's final output (by index) of a non-streaming request, or None if the client
    hung up first (then every choice is aborted: nobody would read the answer). An error
    ending the request (e.g. the 503 of a shutdown) is raised."""
    async def finals():
        found = {}
        async for stream, output in group.outputs():
            if output.finished:
                found[stream.index] = output
        return found

    async def hang_up():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    result, disconnect = asyncio.ensure_future(finals()), asyncio.ensure_future(hang_up())
    try:
        done, _ = await asyncio.wait({result, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (result, disconnect):
            task.cancel()     # no-op when done
        group.close()
    return result.result() if result in done else None
