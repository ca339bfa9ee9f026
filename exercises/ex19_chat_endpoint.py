"""Exercise 19 -- the streaming chat endpoint: OpenAI's POST /v1/chat/completions, streamed
(server-sent events) and not, on FastAPI over llmlab's AsyncEngine.
Difficulty: ** (no Triton; Python and asyncio; about 60 minutes)

Read first: notebooks/11_serving_and_benchmarking.ipynb; exercise 14 (the text a stream
sends). Use: the AsyncEngine you are given (llmlab/server/async_engine.py), through its public
methods only: `await engine.tokenize(messages=messages)` (token ids, the chat template
applied), `await engine.add_requests([(request_id, token_ids, params)])` (returns a
RequestGroup, llmlab/server/request_group.py: `async for _, output in group.outputs()` gives
the request's RequestOutputs -- `delta_text`, `text`, `token_ids`, `finished`,
`finish_reason` -- and `group.close()` aborts it if it has not finished) and
`engine.abort(request_id)`; FastAPI (`Request`, `JSONResponse`, `StreamingResponse`);
`parse_chat_request` below (given). Nothing else of llmlab/ is needed.

Task
    Write build_app(engine, model_name) -> a FastAPI app with one route, POST
    /v1/chat/completions, which any OpenAI client can call (the grader uses the official
    `openai` package). Whoever serves the app starts and stops the engine (the grader does).
      - the body is JSON: parse_chat_request(body) -> (messages, SamplingParams, stream);
        a body that is not JSON, or that it (or tokenize, or add_requests) refuses with a
        ValueError, is answered 400 with OpenAI's error object
        {"error": {"message": str(error), "type": "invalid_request_error"}}.
      - not streamed: one JSON object {"id", "object": "chat.completion", "created" (Unix
        seconds), "model", "choices": [{"index": 0, "message": {"role": "assistant",
        "content": text}, "finish_reason"}], "usage": {"prompt_tokens", "completion_tokens",
        "total_tokens"}}.
      - streamed ("stream": true): a StreamingResponse of media type text/event-stream, one
        event "data: <json>\n\n" per chunk {"id", "object": "chat.completion.chunk",
        "created", "model", "choices": [{"index": 0, "delta": {...}, "finish_reason"}]}:
        first a delta {"role": "assistant", "content": ""}, then one per new piece of text,
        delta {"content": the new text only} (output.delta_text: a client appends the
        deltas), and the last with finish_reason set; then the line "data: [DONE]\n\n".
      - a client that disconnects from a stream cancels your generator: abort the request
        then (close the group in a `finally:`), or it runs on, holding its KV blocks.

Hints
    - One request id per API request (e.g. "chatcmpl-" + a uuid4's hex): add_requests takes
      it, and the response's "id" is the same.
    - finish_reason is "stop" (EOS or a stop string) or "length" (max_tokens); the last
      output of a request has finished=True and carries it.
    - Usage: prompt_tokens is the number of token ids tokenize returned, completion_tokens
      the number of token ids of the final output.

What you will have built: an OpenAI-compatible streaming endpoint over a continuous-batching
engine (what `llmlab serve`, vLLM and SGLang serve); the grader serves your app with uvicorn
and calls it through the `openai` client.

Grade: `make grade EX=ex19`, or `pytest tests/exercises/test_ex19_chat_endpoint.py --impl=exercises`.
"""
from __future__ import annotations

import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from llmlab.sampling import SamplingParams


def parse_chat_request(body) -> tuple[list[dict], SamplingParams, bool]:
    """(messages, sampling params, stream) of a chat completion request's JSON body; a
    ValueError names what is wrong with a bad one. Given. Reads: messages (a non-empty list
    of {"role", "content"} strings), max_tokens (or max_completion_tokens; default 16),
    temperature, top_p, seed, stop, stream, and vLLM's ignore_eos."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} strings")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16))
    params = SamplingParams(max_tokens=max_tokens, temperature=body.get("temperature", 1.0),
                            top_p=body.get("top_p", 1.0), seed=body.get("seed"), stop=body.get("stop") or [],
                            ignore_eos=bool(body.get("ignore_eos", False)))
    params.validate()
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ValueError("'stream' must be true or false")
    return messages, params, stream


def build_app(engine, model_name: str = "llmlab") -> FastAPI:
    """A FastAPI app serving POST /v1/chat/completions over `engine` (an AsyncEngine)."""
    raise NotImplementedError("ex19: write build_app")
