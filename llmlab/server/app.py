"""Serve a model over the OpenAI API (FastAPI), so any OpenAI client can use it.

    llmlab serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY]   (serve.py)

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="KEY or anything")
    client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[...], stream=True)

Routes: POST /v1/completions and /v1/chat/completions (`stream: true` sends server-sent
events, one `data: {chunk}` per new piece of a choice's text, then `data: [DONE]`), GET /v1/models
and /v1/models/{id}, GET /health, GET /metrics (Prometheus); every GET route answers HEAD. With an API key, the /v1
routes need `Authorization: Bearer KEY`; /health and /metrics stay open for probes and
scrapers (as in vLLM). POST bodies must be `application/json` (guards.py says why). Every
error is OpenAI's JSON error object, 4xx for what the client sent, and the server keeps
serving. No docs UI: FastAPI's /docs would load its scripts from a CDN; /openapi.json is
there for tools.

A request flows: `protocol.py` parses and checks the body; `submit` tokenizes its prompts
(on tokenizer threads), fits `max_tokens` to each, fans each out into `n` engine requests
and adds them all at once (`async_engine.py`); `choices.py` turns their outputs into the
answer's choices (text, echo, logprobs via `logprobs.py`, usage), and `responses.py` sends
them, streamed or whole.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.requests import ClientDisconnect, Request    # = fastapi.Request; FastAPI finds it by this name
from llmlab.request import ContextLengthError
from llmlab.server.async_engine import AsyncEngine
from llmlab.server.request_group import RefusedRequest, RequestGroup
from llmlab.server.choices import ChatChoices, CompletionChoices
from llmlab.server.guards import api_key_checker, host_checker, require_json
from llmlab.server.logprobs import TokenNames
from llmlab.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                   TokenizeRequest, parse_json,
                                    resolve_max_tokens)
from llmlab.server.responses import ModelCard, ModelList, event_stream, new_id, now, wait_for_all

if TYPE_CHECKING:
    from fastapi import FastAPI

    from llmlab.engine.engine import LLMEngine
    from llmlab.server.engine_process import EngineProcess

logger = logging.getLogger("llmlab.server")

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
MAX_BODY_BYTES = 1 << 20       # 1 MiB: ~250k tokens of text, far more than any context here
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions


def model_name_for(model: str | None) -> str:
    return EMBEDDED_MODEL_NAME if model is None else Path(model).name


def create_app(engine: LLMEngine | EngineProcess, model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, allowed_hosts: list[str] | None = None) -> FastAPI:
    """The app for one engine: an LLMEngine (its loop runs on a thread of this process) or an
    EngineProcess (`llmlab serve`: engine_process.py). The loop starts and stops with the app (lifespan);
    `app.state.async_engine` gives tests and notebooks its metrics and KV stats.
    `allowed_hosts=None` accepts any Host header (`llmlab serve` defaults to the loopback
    names when it listens on loopback); an empty `api_key` is refused (ValueError)."""
    # imported here, not at the top: `llmlab --help` imports the server's modules for its arguments
    from fastapi import APIRouter, Depends, FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException

    model_name = model_name or model_name_for(engine.config.model)
    known_names = {model_name} | ({str(engine.config.model)} if engine.config.model else set())
    check_api_key = api_key_checker(api_key)
    async_engine = AsyncEngine(engine)
    metrics = async_engine.metrics

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async_engine.start()
        yield
        async_engine.stop()

    app = FastAPI(title="llmlab", lifespan=lifespan, docs_url=None, redoc_url=None,
                  dependencies=[Depends(host_checker(allowed_hosts))])
    app.state.async_engine = async_engine

    # ---- errors: always OpenAI's {"error": {...}} ------------------------------------
    def error_response(error: APIError, headers=None) -> JSONResponse:
        metrics.on_error(error.status)
        if error.status == 401:
            headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request, err: APIError):
        return error_response(err)

    @app.exception_handler(HTTPException)     # unknown route, wrong method
    async def http_error(request, err: HTTPException):
        return error_response(APIError(err.status_code, str(err.detail)), err.headers)

    @app.exception_handler(RequestValidationError)   # (bodies are parsed by read_json)
    async def validation_error(request, err: RequestValidationError):
        return error_response(APIError(400, "invalid request"))

    @app.exception_handler(Exception)
    async def server_error(request, err: Exception):
        logger.error("request failed", exc_info=err)   # the details for the log, not the client
        return error_response(APIError(500, "internal server error", type="server_error"))

    def get(router, path: str):
        """A GET route that answers HEAD too (load balancers and uptime checkers probe with
        HEAD; FastAPI, unlike Starlette, does not add it). The HEAD route runs the same
        function (uvicorn drops the body) and stays out of /openapi.json, where two methods
        of one function would share an operation id."""
        def register(endpoint):
            router.head(path, include_in_schema=False)(endpoint)
            return router.get(path)(endpoint)
        return register

    # ---- open routes -------------------------------------------------------------------
    @get(app, "/health")
    async def health():
        if not async_engine.is_running or async_engine.draining:
            raise APIError(503, "the engine loop is not running", type="server_error")
        return {"status": "ok"}

    @get(app, "/metrics")
    async def metrics_page():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ---- the OpenAI API ------------------------------------------------------------------
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    def model_card() -> ModelCard:
        return ModelCard(id=model_name, created=now(), max_model_len=engine.max_model_len)

    @get(v1, "/models")
    async def models():
        return ModelList(data=[model_card()]).model_dump()

    @get(v1, "/models/{name:path}")    # :path: a model name may hold slashes ("org/model")
    async def model(name: str):
        check_model(name)
        return model_card().model_dump()

    def check_model(name: str | None) -> None:
        if name is not None and name not in known_names:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")

    async def submit(response_id: str, body, default_max_tokens: int | None,
                     prompts: list[dict]) -> RequestGroup:
        """Tokenize every prompt (on tokenizer threads, side by side), fit max_tokens to each
        one's context, fan each out into n engine requests, and queue them all at once, so they
        batch. One prompt's error is a 400 for the whole request, and leaves nothing running.
        `prompts`: {"prompt": text or ids} or {"messages": [...]} each."""
        param = "messages" if "messages" in prompts[0] else "prompt"

        def refused(index: int, err: ValueError) -> APIError:
            message = f"prompt[{index}]: {err}" if len(prompts) > 1 else str(err)
            code = "context_length_exceeded" if isinstance(err, ContextLengthError) else None
            return APIError(400, message, param=param, code=code)

        body.sampling_params()     # the cheap checks first, before tokenizing
        tokenized = await asyncio.gather(*(async_engine.tokenize(**prompt) for prompt in prompts),
                                         return_exceptions=True)
        for index, result in enumerate(tokenized):
            if isinstance(result, ValueError):    # (ContextLengthError: refused from its length, unencoded)
                raise refused(index, result)
            if isinstance(result, BaseException):
                raise result
        requested, max_tokens_param = body.requested_max_tokens
        if isinstance(body, CompletionRequest):
            body.check_echo_logprobs([len(token_ids) for token_ids in tokenized])
        requests = []
        for index, token_ids in enumerate(tokenized):
            name = f"prompt[{index}]" if len(prompts) > 1 else "the prompt"
            params = body.sampling_params(resolve_max_tokens(requested, default_max_tokens, len(token_ids),
                                                             engine.max_model_len, max_tokens_param, param, name))
            requests += [(f"{response_id}-{index * body.n + i}", token_ids, one)    # the choice's index
                         for i, one in enumerate(params.fan_out())]
        try:
            return await async_engine.add_requests(requests)
        except RefusedRequest as err:
            raise refused(err.index // body.n, err.error) from None

    names = TokenNames(engine.tokenizer)

    def prompt_text(prompt: str | list[int]) -> str:
        """What echo shows of a prompt: its text, or its token ids decoded (special tokens too)."""
        if isinstance(prompt, str):
            return prompt
        return engine.tokenizer.decode(prompt, skip_special_tokens=False) if engine.tokenizer is not None else ""

    async def answer(request: Request, body, group: RequestGroup, choices):
        """The answer, streamed or whole, from the choices' outputs."""
        if body.stream:
            return event_stream(group, choices, body.include_usage, metrics.on_error)
        outputs = await wait_for_all(group, request)
        if outputs is None:
            return Response(status_code=499)    # the client hung up; nobody reads this
        return choices.whole(outputs).model_dump()

    @v1.post("/completions", dependencies=[Depends(require_json)])
    async def completions(request: Request):
        body = parse_json(CompletionRequest, await read_body(request, max_body_bytes))
        warn_ignored_fields(request, body)
        check_model(body.model)
        response_id, created = new_id("cmpl"), now()
        prompts = body.prompts()
        group = await submit(response_id, body, COMPLETIONS_DEFAULT_MAX_TOKENS, [{"prompt": p} for p in prompts])
        texts = [prompt_text(prompt) for prompt in prompts] if body.echo else []
        choices = CompletionChoices(response_id, created, model_name, body, group, names, prompt_texts=texts)
        return await answer(request, body, group, choices)

    @v1.post("/chat/completions", dependencies=[Depends(require_json)])
    async def chat_completions(request: Request):
        body = parse_json(ChatCompletionRequest, await read_body(request, max_body_bytes))
        warn_ignored_fields(request, body)
        check_model(body.model)
        response_id, created = new_id("chatcmpl"), now()
        messages = [m.as_template_message() for m in body.messages]
        # no max_tokens: until the context is full (the engine stops there with "length")
        group = await submit(response_id, body, None, [{"messages": messages}])
        return await answer(request, body, group, ChatChoices(response_id, created, model_name, body, group, names))

    app.include_router(v1)

    # ---- vLLM's tokenizer routes (at the root, as vLLM serves them; the API key applies) ----
    tokenizer_routes = APIRouter(dependencies=[Depends(check_api_key)])

    @tokenizer_routes.post("/tokenize", dependencies=[Depends(require_json)])
    async def tokenize(request: Request):
        body = parse_json(TokenizeRequest, await read_body(request, max_body_bytes))
        check_model(body.model)
        try:
            if body.messages is not None:
                ids = await async_engine.tokenize(messages=[m.as_template_message() for m in body.messages])
            else:
                ids = await async_engine.tokenize(prompt=body.prompt)
        except ValueError as err:    # (ContextLengthError: certainly longer than the context)
            code = "context_length_exceeded" if isinstance(err, ContextLengthError) else None
            raise APIError(400, str(err), param="messages" if body.messages is not None else "prompt",
                           code=code) from None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": None}

    @tokenizer_routes.post("/detokenize", dependencies=[Depends(require_json)])
    async def detokenize(request: Request):
        body = parse_json(DetokenizeRequest, await read_body(request, max_body_bytes))
        check_model(body.model)
        vocab = engine.model_config.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is not in the vocabulary (0 .. {vocab - 1})", param="tokens")
        return {"prompt": await asyncio.to_thread(prompt_text, body.tokens)}

    app.include_router(tokenizer_routes)
    return app


def warn_ignored_fields(request: Request, body) -> None:
    """One warning line for the fields a request set that were accepted but not acted on (as vLLM)."""
    if body.ignored_fields:
        # the client's names as repr()s, each cut short, 20 at most: a name is no log line of its own
        names = [repr(name[:60]) + ("..." if len(name) > 60 else "") for name in body.ignored_fields[:20]]
        more = len(body.ignored_fields) - len(names)
        logger.warning("%s %s: fields ignored (accepted, not acted on): %s%s", request.method, request.url.path,
                       ", ".join(names), f" and {more} more" if more > 0 else "")


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The raw request body; 413 past `max_body_bytes` (checked from Content-Length first,
    then from the bytes as they arrive, for chunked uploads)."""
    too_large = APIError(413, f"the request body is larger than {max_body_bytes} bytes",
                         code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        raise too_large
    body = bytearray()
    try:
        async for piece in request.stream():
            body += piece
            if len(body) > max_body_bytes:
                raise too_large
    except ClientDisconnect:   # nobody to answer; a client's doing, not a server failure (nginx's 499)
        raise APIError(499, "the client closed the connection before sending the whole body",
                       code="client_closed_request") from None
    return bytes(body)
