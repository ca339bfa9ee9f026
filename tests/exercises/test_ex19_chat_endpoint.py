"""Exercise 19, the streaming chat endpoint: the student's FastAPI app over an AsyncEngine on the
embedded model, served by uvicorn in this process on a free port and called through the
official `openai` client (and raw HTTP where the client hides what is checked: the stream's
[DONE] line). Texts must be LLM.chat's greedy texts; usage, finish reasons, a 400 for a bad
request, and a client that hangs up mid-stream must get its request aborted."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

import llmlab
from llmlab.server.async_engine import AsyncEngine
from diagnose import fail
from helpers.server import running

EXERCISE = "ex19_chat_endpoint"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
LONG = [{"role": "user", "content": "Count from one to one thousand, in words."}]
MODEL = "llmlab-test"
MAX_TOKENS = 8


def expect(ok, case: str, what: str, hint: str) -> None:
    if not ok:
        fail(case, [what, f"-> {hint}"])


class ReadAfterTheEnd(AsyncEngine):
    """An AsyncEngine whose add_requests returns only once the engine has finished every request
    (one request at a time here): all of a request's outputs are queued before the handler
    reads the first, and RequestGroup.outputs() merges them into one, as it does for a slow
    client or a busy event loop. Deterministic, unlike a real slow reader."""

    async def add_requests(self, requests):
        group = await super().add_requests(requests)
        while self.num_unfinished:        # its final output is queued before it leaves the count
            await asyncio.sleep(0.01)
        return group


@contextlib.contextmanager
def serving(ex, llm, engine: llmlab.LLMEngine | None = None, async_engine_class=AsyncEngine):
    """The student's app over an AsyncEngine of `engine` (default: one of its own, sharing
    `llm`'s weights), served by uvicorn; the engine thread starts and stops with the server
    (the grader's lifespan). Yields (base URL, the AsyncEngine)."""
    if engine is None:
        config = llmlab.EngineConfig(device="cpu", dtype="float32", backend="torch", num_gpu_blocks=64,
                                     async_scheduling=False)
        engine = llmlab.LLMEngine(config, model=llm.engine.model, tokenizer=llm.tokenizer)
    async_engine = async_engine_class(engine)
    app = ex.build_app(async_engine, MODEL)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        async_engine.start()
        yield
        async_engine.stop()

    with running(Starlette(routes=[Mount("/", app=app)], lifespan=lifespan)) as url:
        yield url, async_engine


@pytest.fixture(scope="module")
def served(ex, llm):
    with serving(ex, llm) as server:
        yield server


def greedy_answer(llm, **params):
    """LLM.chat's greedy answer to MESSAGES (the default engine)."""
    return llm.chat(MESSAGES, llmlab.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **params))[0]


@pytest.fixture(scope="module")
def expected(llm):
    return greedy_answer(llm)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_not_streamed(served, expected):
    url, _ = served
    case = f"a chat completion, not streamed (max_tokens {MAX_TOKENS}, temperature 0)"
    answer = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                 temperature=0.0)
    choice = answer.choices[0]
    expect(choice.message.content == expected.text, case,
           f"the answer is {choice.message.content!r}, LLM.chat's greedy text {expected.text!r}",
           "choices[0].message.content is the final output's text; params from parse_chat_request(body)")
    expect(choice.message.role == "assistant" and choice.finish_reason == expected.finish_reason, case,
           f"role {choice.message.role!r}, finish_reason {choice.finish_reason!r}; expected 'assistant', "
           f"{expected.finish_reason!r}", "finish_reason is the final output's (\"stop\" or \"length\")")
    usage = answer.usage
    want = (len(expected.prompt_token_ids), len(expected.token_ids))
    expect(usage is not None and (usage.prompt_tokens, usage.completion_tokens) == want
           and usage.total_tokens == sum(want), case,
           f"usage {usage}; expected prompt_tokens {want[0]}, completion_tokens {want[1]}, total_tokens {sum(want)}",
           "prompt_tokens: the ids tokenize(messages=...) returned (the chat template applied); completion_tokens: "
           "the final output's token_ids; total_tokens their sum")
    expect(answer.id and answer.model == MODEL and answer.object == "chat.completion", case,
           f"id {answer.id!r}, model {answer.model!r}, object {answer.object!r}",
           f"the answer names itself: an id, object 'chat.completion', the model name given to build_app ({MODEL!r})")


def test_usage_counts_tokens_not_outputs(ex, llm, expected):
    """Outputs that piled up while the handler was busy reach it merged into one: usage counts
    the final output's token ids, and the stream's deltas still add up to the text."""
    case = (f"a chat completion whose {len(expected.token_ids)} tokens were all generated before the handler read "
            "its outputs (merged into one, as for a slow reader), not streamed")
    with serving(ex, llm, async_engine_class=ReadAfterTheEnd) as (url, _):
        answer = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                     temperature=0.0)
        chunks = list(client(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                          temperature=0.0, stream=True))
    want = (len(expected.prompt_token_ids), len(expected.token_ids))
    usage = answer.usage
    got = (usage.prompt_tokens, usage.completion_tokens) if usage is not None else None
    expect(got == want and usage.total_tokens == sum(want), case,
           f"usage {usage}; expected prompt_tokens {want[0]}, completion_tokens {want[1]}, total_tokens {sum(want)}",
           ("completion_tokens counted the outputs, not the tokens: one output may carry several tokens (outputs() "
            "merges what piled up for a slow reader): completion_tokens is len(final.token_ids)"
            if got is not None and got[1] != want[1] else
            "prompt_tokens: the ids tokenize(messages=...) returned; completion_tokens: the final output's "
            "token_ids; total_tokens their sum"))
    expect(answer.choices[0].message.content == expected.text, case,
           f"the answer is {answer.choices[0].message.content!r}, LLM.chat's greedy text {expected.text!r}",
           "the answer is the final output's text (output.text: all of it, however many outputs came)")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expect(text == expected.text, case.replace("not streamed", "streamed"),
           f"the deltas add up to {text!r}, LLM.chat's greedy text is {expected.text!r}",
           "each chunk's delta.content is the output's delta_text, which holds every piece merged into it")


def test_streamed(served, expected):
    url, _ = served
    case = f"a chat completion, streamed (max_tokens {MAX_TOKENS}, temperature 0)"
    chunks = list(client(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                      temperature=0.0, stream=True))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    text = "".join(pieces)
    contents = [p for p in pieces if p]
    repeats = len(contents) > 1 and all(expected.text.startswith(p) for p in contents) \
        and all(len(a) < len(b) for a, b in zip(contents, contents[1:]))
    expect(text == expected.text, case,
           f"the deltas add up to {text!r}, LLM.chat's greedy text is {expected.text!r} (the chunks' contents "
           f"were {contents!r})",
           ("a stream that repeats the whole text in each chunk instead of the delta: " if repeats else "") +
           "each chunk's delta.content is only the new text (output.delta_text); a client appends them")
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    expect(finish and finish[-1] == expected.finish_reason and not any(finish[:-1]), case,
           f"the chunks' finish_reason values are {finish}; expected None until the last, then "
           f"{expected.finish_reason!r}", "the last chunk (the final output: finished=True) carries finish_reason")
    roles = [c.choices[0].delta.role for c in chunks if c.choices]
    expect(roles and roles[0] == "assistant", case, f"the first chunk's delta.role is {roles[:1]}",
           "open the stream with a chunk whose delta is {\"role\": \"assistant\", \"content\": \"\"}")


def test_stream_ends_with_done(served):
    url, _ = served
    case = "a streamed chat completion, read as raw server-sent events"
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "temperature": 0.0, "stream": True}
    with httpx.Client(timeout=120) as http:
        response = http.post(f"{url}/v1/chat/completions", json=body)
    expect(response.status_code == 200 and response.headers.get("content-type", "").startswith("text/event-stream"),
           case, f"status {response.status_code}, content-type {response.headers.get('content-type')!r}",
           "stream with StreamingResponse(..., media_type=\"text/event-stream\")")
    events = [line for line in response.text.split("\n") if line.strip()]
    bad = [line for line in events if not line.startswith("data: ")]
    expect(not bad, case, f"lines {bad[:3]!r} are not server-sent events",
           "each event is the line 'data: <json>' followed by a blank line ('\\n\\n')")
    expect(events and events[-1] == "data: [DONE]", case,
           f"the stream's last event is {events[-1] if events else None!r}, not 'data: [DONE]'",
           "an SSE stream without [DONE]: after the last chunk send the line 'data: [DONE]\\n\\n', which tells "
           "OpenAI's clients the stream ended as it should")
    for line in events[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        expect(chunk.get("object") == "chat.completion.chunk", case, f"an event's object is {chunk.get('object')!r}",
               "each streamed chunk has object 'chat.completion.chunk'")


def test_stop_string(served, llm):
    url, _ = served
    free = greedy_answer(llm).text
    stop = free.split()[1] if len(free.split()) > 1 else free[-2:]
    case = f"a chat completion with stop={[stop]!r}"
    want = greedy_answer(llm, stop=[stop])
    answer = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                 temperature=0.0, stop=[stop])
    got = (answer.choices[0].message.content, answer.choices[0].finish_reason)
    expect(got == (want.text, want.finish_reason), case, f"text and finish_reason {got!r}, expected "
                                                         f"{(want.text, want.finish_reason)!r}",
           "pass the body's stop strings on (parse_chat_request does); finish_reason is the output's")


def status_and_body(url: str, **body) -> tuple[int, object]:
    """The HTTP status of a chat request through the openai client, and the error's body (None
    when it was answered). Outside the client's `except`, so a failure reports only its case."""
    try:
        client(url).chat.completions.create(**body)
    except openai.APIStatusError as error:
        return error.status_code, error.body
    return 200, None


def expect_a_400(url: str, body: dict, case: str, why: str) -> None:
    status, error = status_and_body(url, **body)
    expect(status != 200, case, "the request was answered", why)
    expect(status == 400, case, f"status {status}, expected 400", why)
    expect(isinstance(error, dict) and error.get("message"), case, f"the 400's body is {error!r}",
           "answer {\"error\": {\"message\": str(error), \"type\": \"invalid_request_error\"}}")


def test_bad_request_is_a_400(served):
    url, async_engine = served
    for body, what in [({"model": MODEL, "messages": []}, "no messages"),
                       ({"model": MODEL, "messages": MESSAGES, "max_tokens": -1}, "max_tokens -1")]:
        expect_a_400(url, body, f"a chat request with {what}",
                     "a ValueError from parse_chat_request is the client's fault: JSONResponse(..., status_code=400)")
    too_long = [{"role": "user", "content": "word " * async_engine.engine.max_model_len}]
    expect_a_400(url, {"model": MODEL, "messages": too_long, "max_tokens": 4},
                 "a chat request whose prompt is longer than the model's context",
                 "tokenize raises ContextLengthError (a ValueError) for a prompt that does not fit, and add_requests "
                 "a ValueError for one the engine refuses: the client's fault too, so the try that answers 400 covers "
                 "parse_chat_request, tokenize and add_requests")
    case = "a body that is not JSON"
    with httpx.Client(timeout=60) as http:
        response = http.post(f"{url}/v1/chat/completions", content=b"{not json",
                             headers={"content-type": "application/json"})
    expect(response.status_code == 400, case, f"status {response.status_code}",
           "json.loads raises a ValueError (JSONDecodeError): answer 400 as for any bad request")


def idle(async_engine) -> bool:
    stats = async_engine.kv_stats     # refreshed by the engine thread after every step
    return async_engine.num_unfinished == 0 and stats["free_device_blocks"] == stats["total_device_blocks"] \
        and stats["num_running"] == stats["num_waiting"] == 0


def check_disconnect_aborts(url: str, async_engine, timeout: float = 20.0) -> None:
    """Read a long stream's first piece of text, hang up, and wait for the engine to be idle."""
    case = "a client that hangs up after the first piece of a long stream (max_tokens 1000, ignore_eos)"
    body = {"model": MODEL, "messages": LONG, "max_tokens": 1000, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content": "' in line.replace('"content":"', '"content": "') \
                    and '"content": ""' not in line.replace('"content":""', '"content": ""'):
                break     # the first piece of text: the request is running
    deadline = time.monotonic() + timeout
    while not idle(async_engine):
        if time.monotonic() > deadline:
            stats = async_engine.kv_stats
            fail(case, [f"{timeout:.0f} s after the client hung up the request still runs: {async_engine.num_unfinished} "
                        f"unfinished, {stats['free_device_blocks']} of {stats['total_device_blocks']} KV blocks free",
                        "-> a disconnect that does not abort: the client's hang-up cancels your stream's generator; "
                        "close the group (group.close(), which aborts the request) in a `finally:` around it"])
        time.sleep(0.05)


def test_disconnect_aborts_the_request(served):
    url, async_engine = served
    check_disconnect_aborts(url, async_engine)
