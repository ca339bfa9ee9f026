"""The OpenAI-compatible server, started for real on a free loopback port and driven
through the official `openai` client (and raw httpx where a client would refuse to send
the bad input). Greedy outputs must equal `LLM.generate` / `LLM.chat` on the same model."""
from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

import llmlab
from llmlab.server.app import create_app

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
GREEDY = dict(temperature=0.0, max_tokens=12)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served():
    """A real uvicorn server in a background thread, its own engine with the same settings
    as the `llm` fixture (the reference), so greedy text must match token for token.
    Yields (base url, app)."""
    engine = llmlab.LLM(device="cpu", dtype="float32", backend="torch", num_gpu_blocks=512).engine
    app = create_app(engine, api_key=API_KEY)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.1)
    yield url, app
    uv.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(served) -> str:
    return served[0]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def http(server) -> httpx.Client:
    return httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def metrics(server) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    text = httpx.get(f"{server}/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def wait_until_idle(server, timeout=60) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and every device KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if (m["llmlab_num_requests_running"] == m["llmlab_num_requests_waiting"] == 0
                and m['llmlab_kv_blocks_free{location="device"}'] == m['llmlab_kv_blocks_total{location="device"}']):
            return m
        assert time.monotonic() < deadline, f"KV blocks not freed: {m}"
        time.sleep(0.1)


def test_health_models_and_auth(server, client):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY}):
        response = httpx.get(f"{server}/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()


@pytest.mark.slow
def test_completion_matches_generate(server, client, llm):
    prompt = "The capital of France is"
    expected = llm.generate(prompt, llmlab.SamplingParams(**GREEDY))[0]

    response = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)

    # token ids are a prompt too
    response = client.completions.create(model=MODEL, prompt=expected.prompt_token_ids, **GREEDY)
    assert response.choices[0].text == expected.text


@pytest.mark.slow
def test_chat_matches_llm_chat(server, client, llm):
    messages = [{"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": "What is the largest planet?"}]
    expected = llm.chat(messages, llmlab.SamplingParams(**GREEDY))[0]

    response = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.token_ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_stop_strings_and_seeded_sampling_match_generate(server, client, llm):
    prompt = "List three colors:"
    for fields in (dict(temperature=0.0, max_tokens=16, stop=[",", "\n"]),
                   dict(temperature=0.9, top_p=0.9, top_k=40, min_p=0.02, seed=1234, max_tokens=12)):
        expected = llm.generate(prompt, llmlab.SamplingParams(**fields))[0]
        extra = {name: fields.pop(name) for name in ("top_k", "min_p") if name in fields}   # vLLM extensions
        response = client.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **fields)
        assert (response.choices[0].text, response.choices[0].finish_reason) == (expected.text, expected.finish_reason)


@pytest.mark.slow
def test_32_concurrent_streaming_clients(server, llm):
    """All 32 share engine steps; each gets exactly its own greedy text; nothing leaks."""
    prompts = [f"Write a list of {i} things to do in a city called Number{i}:" for i in range(32)]
    params = dict(temperature=0.0, max_tokens=8)
    expected = [out.text for out in llm.generate(prompts, llmlab.SamplingParams(**params))]
    before = metrics(server)

    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, stream=True, **params)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(all_of_them()) == expected
    after = wait_until_idle(server)
    assert after["llmlab_generation_tokens_total"] - before["llmlab_generation_tokens_total"] == 32 * 8
    assert after["llmlab_time_to_first_token_seconds_count"] - before["llmlab_time_to_first_token_seconds_count"] == 32


def body_of(payload) -> bytes:
    return json.dumps(payload).encode()


BAD_INPUTS = {
    # name: (path, raw body, status, param, code)
    "malformed JSON": ("/v1/completions", b'{"model": "x", "prompt": ', 400, None, None),
    "not UTF-8": ("/v1/completions", b'{"prompt": "caf\xe9"}', 400, None, None),
    "not an object": ("/v1/completions", b"[1, 2, 3]", 400, None, None),
    "no prompt": ("/v1/completions", body_of({"max_tokens": 4}), 400, "prompt", None),
    "max_tokens wrong type": ("/v1/completions", body_of({"prompt": "hi", "max_tokens": "ten"}), 400, "max_tokens", None),
    "temperature wrong type": ("/v1/completions", body_of({"prompt": "hi", "temperature": "hot"}), 400, "temperature", None),
    "stop wrong type": ("/v1/completions", body_of({"prompt": "hi", "stop": 7}), 400, "stop", None),
    "max_tokens < 1": ("/v1/completions", body_of({"prompt": "hi", "max_tokens": 0}), 400, "max_tokens", None),
    "temperature < 0": ("/v1/completions", body_of({"prompt": "hi", "temperature": -0.5}), 400, "temperature", None),
    "top_p > 1": ("/v1/chat/completions", body_of({"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}), 400, "top_p", None),
    "min_p > 1": ("/v1/completions", body_of({"prompt": "hi", "min_p": 1.5}), 400, "min_p", None),
    "n < 1": ("/v1/completions", body_of({"prompt": "hi", "n": 0}), 400, "n", None),
    "n > 128": ("/v1/chat/completions", body_of({"messages": [{"role": "user", "content": "hi"}], "n": 129}), 400, "n", None),
    "prompts x n > 1024": ("/v1/completions", body_of({"prompt": ["hi"] * 9, "n": 128}), 400, "prompt", None),
    "unsupported field": ("/v1/completions", body_of({"prompt": "hi", "suffix": "!"}), 400, "suffix", "unsupported_parameter"),
    "logprobs > 20": ("/v1/completions", body_of({"prompt": "hi", "logprobs": 21}), 400, "logprobs", None),
    "max_tokens 0 without echo": ("/v1/completions", body_of({"prompt": "hi", "max_tokens": 0, "logprobs": 1}), 400,
                                  "max_tokens", None),
    "one bad prompt of several": ("/v1/completions", body_of({"prompt": [[1, 2], [3, 10**9], [4]]}), 400, "prompt", None),
    "an empty prompt of several": ("/v1/completions", body_of({"prompt": ["hi", ""]}), 400, "prompt", None),
    "empty prompt": ("/v1/completions", body_of({"prompt": ""}), 400, "prompt", None),
    "token id out of range": ("/v1/completions", body_of({"prompt": [1, 10**9]}), 400, "prompt", None),
    "prompt longer than the context": ("/v1/completions", body_of({"prompt": "hello " * 9000}), 400, "prompt", "context_length_exceeded"),
    "chat longer than the context": ("/v1/chat/completions", body_of({"messages": [{"role": "user", "content": "hello " * 9000}]}), 400, "messages", "context_length_exceeded"),
    "bad role": ("/v1/chat/completions", body_of({"messages": [{"role": "robot", "content": "hi"}]}), 400, "messages[0].role", None),
    "no messages": ("/v1/chat/completions", body_of({"messages": []}), 400, "messages", None),
    "unknown model": ("/v1/completions", body_of({"model": "gpt-9", "prompt": "hi"}), 404, "model", "model_not_found"),
    "oversized body": ("/v1/completions", body_of({"prompt": "a" * (2 << 20)}), 413, None, "request_too_large"),
    # bodies Python's json module accepts and that crashed later (issue 18): a 400, not a 500
    "lone surrogate in a prompt": ("/v1/completions", b'{"prompt": "abc\\ud800"}', 400, None, None),
    "lone surrogate in a message": ("/v1/chat/completions",
                                    b'{"messages": [{"role": "user", "content": "\\udc00 hi"}]}', 400, None, None),
    "JSON nested 5k deep": ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None, None),
    "JSON nested 100k deep, in an ignored field": (
        "/v1/completions", b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, None),
    "a 5,000-digit integer": ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400, None, None),
    "temperature Infinity": ("/v1/completions", b'{"prompt": "hi", "temperature": Infinity}', 400, "temperature", None),
    "temperature 1e999": ("/v1/completions", b'{"prompt": "hi", "temperature": 1e999}', 400, "temperature", None),
    "top_p NaN": ("/v1/completions", b'{"prompt": "hi", "top_p": NaN}', 400, "top_p", None),
    "stream_options with an unknown field": ("/v1/completions", body_of(
        {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True, "bogus": 1}}), 400, "stream_options.bogus", None),
    "stream_options wrong type": ("/v1/completions", body_of(
        {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}), 400, "stream_options.include_usage", None),
    "stream_options without stream": ("/v1/completions", body_of(
        {"prompt": "hi", "stream_options": {"include_usage": True}}), 400, "stream_options", None),
    "max_tokens beyond the context": ("/v1/completions", body_of({"prompt": "hi", "max_tokens": 100_000}),
                                      400, "max_tokens", "context_length_exceeded"),
    "max_completion_tokens beyond the context": ("/v1/chat/completions", body_of(
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100_000}),
        400, "max_completion_tokens", "context_length_exceeded"),
    "max_completion_tokens < 1": ("/v1/chat/completions", body_of(
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}), 400, "max_completion_tokens", None),
    "best_of true (not best_of 1)": ("/v1/completions", body_of({"prompt": "hi", "best_of": True}), 400, "best_of",
                                     "unsupported_parameter"),
    "best_of other than n": ("/v1/completions", body_of({"prompt": "hi", "best_of": 3, "n": 2}), 400, "best_of",
                             "unsupported_parameter"),
    "presence_penalty false": ("/v1/completions", body_of({"prompt": "hi", "presence_penalty": False}), 400,
                               "presence_penalty", "unsupported_parameter"),
    "stop an empty string": ("/v1/completions", body_of({"prompt": "hi", "stop": ""}), 400, "stop", None),
    "top_k -5": ("/v1/completions", b'{"prompt": "hi", "top_k": -5}', 400, "top_k", None),
    "user message without content": ("/v1/chat/completions", body_of(
        {"messages": [{"role": "user", "content": None}]}), 400, "messages[0]", None),
    # what a hostile client and vLLM users sent (#37, #34)
    "an image part": ("/v1/chat/completions", body_of({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}), 400, "messages[0].content[0].type", None),
    "a text part without text": ("/v1/chat/completions", body_of({"messages": [{"role": "user", "content": [
        {"type": "text"}]}]}), 400, "messages[0].content[0].text", None),
    "n 10000": ("/v1/completions", body_of({"prompt": "hi", "n": 10000}), 400, "n", None),
    "temperature 1e39": ("/v1/completions", body_of({"prompt": "hi", "temperature": 1e39}), 400, "temperature", None),
    "65 stop strings": ("/v1/completions", body_of({"prompt": "hi", "stop": [f"s{i}" for i in range(65)]}), 400, "stop", None),
    "a stop string of 1025 characters": ("/v1/completions", body_of({"prompt": "hi", "stop": ["x" * 1025]}), 400, "stop", None),
    "stop_token_ids not ids": ("/v1/completions", body_of({"prompt": "hi", "stop_token_ids": [-1]}), 400, "stop_token_ids", None),
    "repetition_penalty": ("/v1/completions", body_of({"prompt": "hi", "repetition_penalty": 1.2}), 400, "repetition_penalty", "unsupported_parameter"),
    "min_tokens": ("/v1/completions", body_of({"prompt": "hi", "min_tokens": 5}), 400, "min_tokens", "unsupported_parameter"),
    "guided_json": ("/v1/completions", body_of({"prompt": "hi", "guided_json": {"type": "object"}}), 400, "guided_json", "unsupported_parameter"),
    "structured_outputs": ("/v1/chat/completions", body_of({"messages": [{"role": "user", "content": "hi"}],
                                                            "structured_outputs": {"choice": ["a", "b"]}}), 400, "structured_outputs", "unsupported_parameter"),
    "skip_special_tokens false": ("/v1/completions", body_of({"prompt": "hi", "skip_special_tokens": False}), 400, "skip_special_tokens", "unsupported_parameter"),
    "include_stop_str_in_output": ("/v1/completions", body_of({"prompt": "hi", "include_stop_str_in_output": True}), 400, "include_stop_str_in_output", "unsupported_parameter"),
    "chat_template": ("/v1/chat/completions", body_of({"messages": [{"role": "user", "content": "hi"}],
                                                       "chat_template": "{{ messages }}"}), 400, "chat_template", "unsupported_parameter"),
    "echo logprobs past the bound": ("/v1/completions", body_of({"prompt": [[1] * 4000] * 4, "n": 16, "echo": True,
                                                                 "logprobs": 5, "max_tokens": 0}), 400, "echo", None),
}

# a Python exception's name in a message means internal text leaked to the client
EXCEPTION_NAME = re.compile(r"\b[A-Z]\w*(Error|Exception)\b")


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_gets_an_openai_error(server, name):
    path, body, status, param, code = BAD_INPUTS[name]
    with http(server) as h:
        response = h.post(path, content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert "SamplingParams" not in error["message"], "the message names the request's field, not a class"
        assert error["message"] and error["type"] == "invalid_request_error"
        assert not EXCEPTION_NAME.search(error["message"]), error["message"]
        assert (error["param"], error["code"]) == (param, code)
        assert h.get("/health").status_code == 200
        assert h.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}).status_code == 200


def test_a_huge_top_k_fails_nobody(server):
    """top_k past the vocabulary (past int64 even) means every token: the request and one
    sampling beside it in the same batch both finish (it used to fail the whole step)."""
    huge = {"prompt": "Hi", "max_tokens": 4, "temperature": 1.0, "top_k": 10**30}
    plain = {"prompt": "Hello there", "max_tokens": 4, "temperature": 1.0}

    async def both():
        async with httpx.AsyncClient(base_url=server, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as h:
            return await asyncio.gather(h.post("/v1/completions", json=huge), h.post("/v1/completions", json=plain))

    for response in asyncio.run(both()):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_more_errors(server, client):
    with http(server) as h:
        # an oversized body sent in chunks (no Content-Length) is cut off while it arrives
        chunks = (b'{"prompt": "' + b"a" * 65536 for _ in range(32))
        assert h.post("/v1/completions", content=chunks, headers={"Content-Type": "application/json"}).status_code == 413
        assert h.get("/v1/nothing-here").json()["error"]["message"] == "Not Found"
        assert h.get("/v1/completions").status_code == 405
        assert h.get("/health").status_code == 200
    # the official client raises its own exception types for our errors
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    # the server still works afterwards
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_engine_failure_fails_its_requests_and_the_server_keeps_serving(served, client):
    server, app = served
    engine = app.state.async_engine.engine

    def broken_step():
        del engine.step     # fail once, then the real step again
        raise RuntimeError("simulated bug in a step")

    engine.step = broken_step
    failed = 'llmlab_requests_failed_total{status="500"}'
    before = metrics(server).get(failed, 0)
    with pytest.raises(openai.InternalServerError) as raised:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
    error = raised.value.body
    assert error["type"] == "server_error" and "simulated" not in error["message"]   # the log has it
    assert metrics(server)[failed] == before + 1
    wait_until_idle(server)
    assert httpx.get(f"{server}/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_disconnect_mid_stream_frees_blocks(server):
    before = metrics(server)
    payload = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 2000,
               "ignore_eos": True, "stream": True}
    with http(server) as h, h.stream("POST", "/v1/completions", json=payload) as response:
        assert response.status_code == 200
        events = response.iter_lines()
        for _ in range(3):      # a few tokens in: the request holds KV blocks now
            while not next(events).startswith("data:"):
                pass
        assert metrics(server)["llmlab_num_requests_running"] == 1
    # the connection is closed: the engine stops generating and gives the blocks back
    after = wait_until_idle(server)
    aborted = 'llmlab_requests_finished_total{finish_reason="abort"}'
    assert after[aborted] == before.get(aborted, 0) + 1
    assert after["llmlab_generation_tokens_total"] - before["llmlab_generation_tokens_total"] < 2000


def test_disconnect_while_waiting_for_a_whole_answer_aborts(server):
    before = metrics(server)
    payload = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True}
    with http(server) as h, pytest.raises(httpx.ReadTimeout):
        h.post("/v1/completions", json=payload, timeout=httpx.Timeout(60, read=1.0))
    after = wait_until_idle(server)
    aborted = 'llmlab_requests_finished_total{finish_reason="abort"}'
    assert after[aborted] == before.get(aborted, 0) + 1


def test_serving_benchmark_runs_inside_an_event_loop(server):
    """`llmlab.bench.serving.run` from a notebook cell, where an event loop is already running."""
    from llmlab.bench import serving

    prompts = serving.synthetic_prompts(3, seed=0, mean_input_len=12, mean_output_len=3, max_output_len=4)

    async def notebook_cell():
        return serving.run(server, [math.inf], prompts, api_key=API_KEY, progress=False)

    (result,) = asyncio.run(notebook_cell())["results"]
    assert result["completed"] == 3 and result["failed"] == 0
    assert result["mean_output_tokens"] == sum(p.output_len for p in prompts) / 3


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_body_not_declared_as_json_gets_415(server, content_type):
    """What a web page may send cross-site without a CORS preflight is refused."""
    headers = {"Content-Type": content_type} if content_type else {}
    before = metrics(server).get('llmlab_requests_rejected_total{status="415"}', 0)
    with http(server) as h:
        response = h.post("/v1/completions", content=body_of({"prompt": "hi", "max_tokens": 1}), headers=headers)
        assert response.status_code == 415
        assert response.json()["error"]["code"] == "unsupported_media_type"
        ok = h.post("/v1/completions", content=body_of({"prompt": "hi", "max_tokens": 1}),
                    headers={"Content-Type": "application/json; charset=utf-8"})
        assert ok.status_code == 200
    assert metrics(server)['llmlab_requests_rejected_total{status="415"}'] == before + 1


def test_assistant_turn_with_null_content_is_an_empty_turn(client, llm):
    """OpenAI allows `content: null` on an assistant message (a tool-call turn)."""
    def conversation(content):
        return [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": content},
                {"role": "user", "content": "What is 2 + 2?"}]
    expected = llm.chat(conversation(""), llmlab.SamplingParams(**GREEDY))[0]
    response = client.chat.completions.create(model=MODEL, messages=conversation(None), **GREEDY)
    assert response.choices[0].message.content == expected.text


def test_model_lookup_and_no_docs_ui(server, client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    # FastAPI's /docs and /redoc pages load their scripts from a CDN: not served
    assert httpx.get(f"{server}/docs").status_code == httpx.get(f"{server}/redoc").status_code == 404
    assert "/v1/completions" in httpx.get(f"{server}/openapi.json").json()["paths"]


def test_client_errors_are_counted_and_the_rest_keeps_working(server, client):
    rejected = 'llmlab_requests_rejected_total{status="400"}'
    before = metrics(server).get(rejected, 0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert metrics(server)[rejected] == before + 1


def test_a_body_cut_off_by_the_client_is_a_499_not_a_server_error():
    """A client that hangs up halfway through its upload gets nothing counted as a 500."""
    from starlette.requests import Request

    from llmlab.server.app import read_body
    from llmlab.server.protocol import APIError

    messages = iter([{"type": "http.request", "body": b'{"prompt": "Hel', "more_body": True},
                     {"type": "http.disconnect"}])

    async def receive():
        return next(messages)

    request = Request({"type": "http", "method": "POST", "headers": [(b"content-length", b"1000")]}, receive)
    with pytest.raises(APIError) as err:
        asyncio.run(read_body(request, 1 << 20))
    assert err.value.status == 499 and err.value.code == "client_closed_request"
