"""Log-probabilities over the API (issue #34): chat's `logprobs` / `top_logprobs` and
completions' `logprobs: k`, in OpenAI's shapes, read through the official `openai` client.

The numbers are the engine's (tests/engine/test_logprobs.py checks those against HF
transformers); here a fresh engine on the same tiny model, run directly, is the reference for
what the server must send: the same tokens, logprobs and alternatives, named by the tokenizer,
streamed or not."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from llmlab import SamplingParams
from llmlab.server.app import create_app
from llmlab.server.logprobs import LOWEST_LOGPROB

from helpers.engine import cpu_engine, run_all, tiny_model
from helpers.server import LONG_CONTEXT, CharTokenizer, assert_idle, running, tiny_engine

USER = [{"role": "user", "content": "Hello there"}]
# the engine's numbers in another batch (the server's own steps): float32 sums in another order
ATOL = 1e-5


@pytest.fixture(scope="module")
def served():
    app = create_app(tiny_engine())
    with running(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0)


def reference(prompt, **fields):
    """The engine's own output for one prompt (text or ids), on a fresh engine of the same model."""
    return run_all(tiny_engine(), [prompt], SamplingParams(**fields))[0]


def chat_prompt_ids(messages) -> list[int]:
    return CharTokenizer().apply_chat_template(messages)


def name(token_id: int) -> str:
    return CharTokenizer().decode([token_id])


SAMPLED = dict(temperature=0.8, top_p=0.9, seed=7)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), SAMPLED], ids=["greedy", "sampled"])
def test_chat_logprobs_are_the_engines_in_openais_shape(served, client, sampling):
    response = client.chat.completions.create(model="tiny-random", messages=USER, max_tokens=6, logprobs=True,
                                              top_logprobs=3, **sampling)
    expected = reference(chat_prompt_ids(USER), max_tokens=6, logprobs=3, **sampling)
    content = response.choices[0].logprobs.content
    assert [c.token for c in content] == [name(t) for t in expected.token_ids]
    assert "".join(c.token for c in content) == response.choices[0].message.content
    for entry, want in zip(content, expected.logprobs, strict=True):
        assert entry.logprob == pytest.approx(want.logprob, abs=ATOL)
        assert entry.bytes == list(entry.token.encode())
        assert [t.token for t in entry.top_logprobs] == [name(t) for t, _ in want.top]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([lp for _, lp in want.top], abs=ATOL)
    assert_idle(served[1])


def test_chat_without_logprobs_has_none_and_top_logprobs_0_is_the_chosen_token_only(client):
    plain = client.chat.completions.create(model="tiny-random", messages=USER, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    bare = client.chat.completions.create(model="tiny-random", messages=USER, max_tokens=2, temperature=0,
                                          logprobs=True)
    assert [len(c.top_logprobs) for c in bare.choices[0].logprobs.content] == [0, 0]


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), SAMPLED], ids=["greedy", "sampled"])
def test_completion_logprobs_are_the_engines_in_the_legacy_shape(client, sampling):
    prompt = "Once upon"
    response = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=6, logprobs=2, **sampling)
    expected = reference(prompt, max_tokens=6, logprobs=2, **sampling)
    logprobs = response.choices[0].logprobs
    assert logprobs.tokens == [name(t) for t in expected.token_ids]
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=ATOL)
    assert logprobs.text_offset == list(range(6))     # one character per token
    for top, want, token in zip(logprobs.top_logprobs, expected.logprobs, logprobs.tokens, strict=True):
        # the k most likely and the chosen one (OpenAI: "up to logprobs + 1 elements")
        wanted = {name(t): lp for t, lp in want.top} | {token: want.logprob}
        assert top.keys() == wanted.keys()
        assert list(top.values()) == pytest.approx(list(wanted.values()), abs=ATOL)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_logprobs_equal_the_whole_answers(served, endpoint):
    """Each chunk carries the logprobs of its own tokens; together they are the non-streamed ones."""
    url, app = served
    if endpoint == "chat":
        path, body = "/v1/chat/completions", dict(messages=USER, logprobs=True, top_logprobs=4)
    else:
        path, body = "/v1/completions", dict(prompt="Streams of", logprobs=4)
    body.update(max_tokens=24, ignore_eos=True, **SAMPLED)
    whole = httpx.post(url + path, json=body, timeout=60).json()["choices"][0]
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    pieces = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0].get("logprobs")]
    assert len(pieces) > 1
    if endpoint == "chat":
        streamed = [entry for piece in pieces for entry in piece["logprobs"]["content"]]
        assert streamed == whole["logprobs"]["content"]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == whole["message"]["content"]
    else:
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for piece in pieces for x in piece["logprobs"][key]] == whole["logprobs"][key], key
    assert_idle(app)


def test_a_token_the_filters_cut_is_sent_as_minus_9999(client):
    """top_k=2 cuts every other token (-inf): JSON has no -inf, so it is clamped as vLLM does."""
    response = client.chat.completions.create(model="tiny-random", messages=USER, max_tokens=3, temperature=1.0,
                                              seed=3, logprobs=True, top_logprobs=5, extra_body={"top_k": 2})
    for entry in response.choices[0].logprobs.content:
        values = [t.logprob for t in entry.top_logprobs]
        assert values[2:] == [LOWEST_LOGPROB] * 3 and all(v > LOWEST_LOGPROB for v in values[:2])


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/chat/completions", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/v1/chat/completions", dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
    ("/v1/chat/completions", dict(top_logprobs=2), "top_logprobs"),        # without logprobs: true
    ("/v1/chat/completions", dict(logprobs=1), "logprobs"),                # a boolean in chat
    ("/v1/chat/completions", dict(echo=True), "echo"),                     # completions only
    ("/v1/completions", dict(logprobs=21), "logprobs"),
    ("/v1/completions", dict(logprobs=True), "logprobs"),                  # an integer in completions
    ("/v1/completions", dict(prompt_logprobs=1), "prompt_logprobs"),       # vLLM's shape: echo + logprobs instead
])
def test_logprobs_out_of_bounds_are_400s_naming_the_field(served, path, fields, param):
    url, app = served
    body = {"messages": USER} if "chat" in path else {"prompt": "Hi"}
    response = httpx.post(url + path, json={**body, "max_tokens": 2, **fields}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"], error
    assert "SamplingParams" not in error["message"]
    assert_idle(app)


def test_an_engine_without_tokenizer_names_tokens_by_id():
    """Token ids in, token ids out (a bare weights folder): tokens are "token_id:N" (vLLM's
    --return-tokens-as-token-ids), so a client still tells them apart."""
    engine = cpu_engine(tiny_model(seed=0, config=LONG_CONTEXT), None, model="tiny-random", num_gpu_blocks=64)
    with running(create_app(engine)) as url:
        body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "logprobs": 1, "echo": True}
        logprobs = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["choices"][0]["logprobs"]
    assert logprobs["tokens"][:3] == ["token_id:5", "token_id:6", "token_id:7"]
    assert all(token.startswith("token_id:") for top in logprobs["top_logprobs"][1:] for token in top)
    offsets = [sum(map(len, logprobs["tokens"][:i])) for i in range(len(logprobs["tokens"]))]
    assert logprobs["text_offset"] == offsets
