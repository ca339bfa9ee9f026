"""vLLM's /tokenize and /detokenize (#34: what vLLM users reach for, e.g. to count a prompt's
tokens before sending it): the token ids a completion or a chat request would use (so `count`
is the request's usage.prompt_tokens), and back; bad input is a 400 naming the field."""
from __future__ import annotations

import httpx
import pytest

from llmlab.server.app import create_app
from helpers.server import CharTokenizer, running, tiny_engine

USER = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def url():
    with running(create_app(tiny_engine(), api_key="k")) as url:
        yield url


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers={"Authorization": "Bearer k"}, timeout=30)


def test_tokenize_counts_what_a_request_would_use(url):
    answer = post(url, "/tokenize", {"prompt": "Hello world"}).json()
    assert answer["tokens"] == CharTokenizer().encode("Hello world") and answer["count"] == 11
    assert answer["max_model_len"] == httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k"}
                                                ).json()["data"][0]["max_model_len"]
    usage = post(url, "/v1/completions", {"prompt": "Hello world", "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == answer["count"]
    chat = post(url, "/tokenize", {"messages": USER}).json()
    assert chat["tokens"] == CharTokenizer().apply_chat_template(USER)
    usage = post(url, "/v1/chat/completions", {"messages": USER, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == chat["count"]


def test_detokenize_gives_the_text_back(url):
    tokens = post(url, "/tokenize", {"prompt": "round trip"}).json()["tokens"]
    assert post(url, "/detokenize", {"tokens": tokens}).json() == {"prompt": "round trip"}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": USER}, "messages"),
    ("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"prompt": "a", "add_generation_prompt": False},
                                             "add_generation_prompt"),
    ("/tokenize", {"prompt": "a", "model": "gpt-9"}, "model"),
    ("/detokenize", {"tokens": [1, 128]}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]"), ("/detokenize", {}, "tokens"),
])
def test_bad_input_is_a_400_naming_the_field(url, path, body, param):
    response = post(url, path, body)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param


def test_the_api_key_guards_them(url):
    assert httpx.post(f"{url}/tokenize", json={"prompt": "a"}, timeout=30).status_code == 401
    assert httpx.post(f"{url}/detokenize", json={"tokens": [1]}, timeout=30).status_code == 401
