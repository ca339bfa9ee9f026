"""Serve a model over the OpenAI API (FastAPI + uvicorn), so any OpenAI client can use it.

    llmlab serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY]

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="KEY or anything")
    client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[...], stream=True)

Routes: POST /v1/completions and /v1/chat/completions (`stream: true` sends server-sent
events, one `data: {chunk}` per new piece of text, then `data: [DONE]`), GET /v1/models,
GET /health, GET /metrics (Prometheus). With an API key, the /v1 routes need
`Authorization: Bearer KEY`; /health and /metrics stay open for probes and scrapers (as
in vLLM). Every error is OpenAI's JSON error object; the server keeps serving.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.requests import Request    # = fastapi.Request; FastAPI finds it by this name
from llmlab.request import ContextLengthError
from llmlab.server.async_engine import AsyncEngine, RequestStream
from llmlab.server.protocol import (APIError, ChatChoice, ChatChunkChoice, ChatCompletion,
                                    ChatCompletionChunk, ChatCompletionRequest, ChatMessageOut,
                                    Completion, CompletionChoice, CompletionRequest, Delta,
                                    ModelCard, ModelList, Usage, new_id, now, parse)

if TYPE_CHECKING:
    from fastapi import FastAPI

    from llmlab.engine.engine import LLMEngine
    from llmlab.request import RequestOutput

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
MAX_BODY_BYTES = 1 << 20       # 1 MiB: ~250k tokens of text, far more than any context here
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions


def model_name_for(model: str | None) -> str:
    return EMBEDDED_MODEL_NAME if model is None else Path(model).name


def create_app(engine: LLMEngine, model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The app for one engine. The engine thread starts and stops with the app (lifespan);
    `app.state.async_engine` gives tests and notebooks its metrics and KV stats."""
    # imported here, not at the top: `llmlab --help` imports this module for its arguments
    from fastapi import APIRouter, Depends, FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response
    from starlette.exceptions import HTTPException

    model_name = model_name or model_name_for(engine.config.model)
    known_names = {model_name} | ({str(engine.config.model)} if engine.config.model else set())
    async_engine = AsyncEngine(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async_engine.start()
        yield
        async_engine.stop()

    app = FastAPI(title="llmlab", lifespan=lifespan)
    app.state.async_engine = async_engine

    # ---- errors: always OpenAI's {"error": {...}} ------------------------------------
    @app.exception_handler(APIError)
    async def api_error(request, err: APIError):
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(HTTPException)     # unknown route, wrong method
    async def http_error(request, err: HTTPException):
        return JSONResponse(APIError(err.status_code, str(err.detail)).body(),
                            status_code=err.status_code, headers=err.headers)

    @app.exception_handler(RequestValidationError)   # (bodies are parsed by read_json)
    async def validation_error(request, err: RequestValidationError):
        return JSONResponse(APIError(400, str(err)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def server_error(request, err: Exception):
        error = APIError(500, f"internal error: {type(err).__name__}: {err}", type="server_error")
        return JSONResponse(error.body(), status_code=500)

    # ---- open routes -------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not async_engine.is_running:
            raise APIError(503, "the engine loop is not running", type="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(async_engine.metrics.render(async_engine.kv_stats),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- the OpenAI API ------------------------------------------------------------------
    async def check_api_key(request: Request):
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken does not reveal how much of the key was right
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/models")
    async def models():
        card = ModelCard(id=model_name, created=now(), max_model_len=engine.max_model_len)
        return ModelList(data=[card]).model_dump()

    def check_model(name: str | None) -> None:
        if name is not None and name not in known_names:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")

    async def submit(request_id: str, params, **prompt) -> RequestStream:
        param = "messages" if "messages" in prompt else "prompt"
        try:
            return await async_engine.add_request(request_id, params, **prompt)
        except ContextLengthError as err:
            raise APIError(400, str(err), param=param, code="context_length_exceeded") from None
        except ValueError as err:
            raise APIError(400, str(err), param=param) from None

    @v1.post("/completions")
    async def completions(request: Request):
        body = await read_json(request, CompletionRequest, max_body_bytes)
        check_model(body.model)
        params = body.sampling_params(default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS)
        response_id, created = new_id("cmpl"), now()
        stream = await submit(response_id, params, prompt=body.single_prompt())

        def completion(text: str, finish_reason: str | None, usage: Usage | None = None, choices=True):
            return Completion(id=response_id, created=created, model=model_name, usage=usage,
                              choices=[CompletionChoice(text=text, finish_reason=finish_reason)] if choices else [])

        if body.stream:
            return event_stream(stream, completion, body.include_usage, first_chunk=None)
        output = await wait_for_last(stream, request)
        if output is None:
            return Response(status_code=499)    # the client hung up; nobody reads this
        return completion(output.text, output.finish_reason, usage_of(stream, output)).model_dump()

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request, ChatCompletionRequest, max_body_bytes)
        check_model(body.model)
        # no max_tokens: until the context is full (the engine stops there with "length")
        params = body.sampling_params(default_max_tokens=engine.max_model_len)
        response_id, created = new_id("chatcmpl"), now()
        messages = [m.as_template_message() for m in body.messages]
        stream = await submit(response_id, params, messages=messages)

        if body.stream:
            def chunk(text: str | None, finish_reason: str | None, usage: Usage | None = None,
                      choices=True, role=None):
                delta = Delta(role=role, content=text if text or role else None)
                return ChatCompletionChunk(
                    id=response_id, created=created, model=model_name, usage=usage,
                    choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)] if choices else [])
            # the first chunk names the speaker, before any text (as OpenAI does)
            return event_stream(stream, chunk, body.include_usage, first_chunk=chunk("", None, role="assistant"))
        output = await wait_for_last(stream, request)
        if output is None:
            return Response(status_code=499)
        return ChatCompletion(id=response_id, created=created, model=model_name,
                              choices=[ChatChoice(message=ChatMessageOut(content=output.text),
                                                  finish_reason=output.finish_reason)],
                              usage=usage_of(stream, output)).model_dump()

    app.include_router(v1)
    return app


async def read_json(request: Request, model, max_body_bytes: int):
    """The request body as a validated `model`; 413 past `max_body_bytes` (checked from
    Content-Length first, then from the bytes as they arrive, for chunked uploads), 400 for
    non-UTF-8 or malformed JSON."""
    too_large = APIError(413, f"the request body is larger than {max_body_bytes} bytes",
                         code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        raise too_large
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > max_body_bytes:
            raise too_large
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8") from None
    except json.JSONDecodeError as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None
    return parse(model, data)


def usage_of(stream: RequestStream, output: RequestOutput) -> Usage:
    return Usage.of(len(stream.prompt_token_ids), len(output.token_ids), output.num_cached_prompt_tokens)


def event_stream(stream: RequestStream, chunk, include_usage: bool, first_chunk):
    """Server-sent events: a chunk per new piece of text, the finish reason on the last one,
    usage if asked (`stream_options.include_usage`), then [DONE]. `chunk(text, finish_reason,
    usage=None, choices=True)` builds one chunk object. A client that disconnects cancels
    this generator (Starlette listens for the disconnect), which aborts the request."""
    from fastapi.responses import StreamingResponse

    def event(obj) -> str:
        return f"data: {obj.model_dump_json()}\n\n"

    async def events():
        if first_chunk is not None:
            yield event(first_chunk)
        output = None
        try:
            async for output in stream.outputs():   # O(1) per token: only the new text is touched
                if output.delta_text or output.finished:
                    yield event(chunk(output.delta_text, output.finish_reason if output.finished else None))
        except Exception as err:    # headers are sent: the error goes in the stream
            yield f"data: {json.dumps(APIError(500, str(err), type='server_error').body())}\n\n"
        else:
            if include_usage:
                yield event(chunk("", None, usage=usage_of(stream, output), choices=False))
        finally:    # also when the client disconnected and this generator was cancelled
            stream.close()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def wait_for_last(stream: RequestStream, request: Request) -> RequestOutput | None:
    """The final output of a non-streaming request, or None if the client hung up first
    (then the request is aborted: nobody would read its answer)."""
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


# ---- `llmlab serve` ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    import os

    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: loopback only; 0.0.0.0 exposes the server)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("LLMLAB_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $LLMLAB_API_KEY)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model's name in the API (default: the --model file or folder name)")
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    engine = parser.add_argument_group("engine (EngineConfig fields)")
    engine.add_argument("--dtype", default=None)
    engine.add_argument("--device", default=None)
    engine.add_argument("--backend", default=None, choices=["reference", "torch", "triton"])
    engine.add_argument("--block-size", type=int, default=None)
    engine.add_argument("--num-gpu-blocks", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=None)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--preemption-mode", default=None, choices=["swap", "recompute"])
    engine.add_argument("--enable-prefix-caching", action="store_true", default=None)
    engine.add_argument("--tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int, default=None,
                        help="shard the model over this many GPUs (tensor parallelism)")


def main(args) -> None:
    import sys
    import time

    import uvicorn

    from llmlab.config import EngineConfig
    from llmlab.engine.engine import LLMEngine

    fields = ("dtype", "device", "backend", "block_size", "num_gpu_blocks", "max_num_seqs",
              "max_num_batched_tokens", "max_model_len", "preemption_mode", "enable_prefix_caching",
              "tensor_parallel_size")
    config = EngineConfig(model=args.model, **{name: getattr(args, name) for name in fields
                                               if getattr(args, name) is not None})
    start = time.perf_counter()
    print(f"loading {args.model or 'the embedded ' + EMBEDDED_MODEL_NAME} ...", file=sys.stderr, flush=True)
    engine = LLMEngine(config)
    print(f"loaded in {time.perf_counter() - start:.1f}s on {engine.device.type}", file=sys.stderr, flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach this "
              f"port can use the model", file=sys.stderr, flush=True)
    app = create_app(engine, args.served_model_name, args.api_key, args.max_body_bytes)
    # on Ctrl-C, open streams get a few seconds to finish, then the engine thread stops
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
