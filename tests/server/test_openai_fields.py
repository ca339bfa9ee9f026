"""OpenAI request fields this server does not act on (issue #37, row 8). Those that ask for a
different output (a function call, audio, a web search, a predicted output, a tool-call turn)
are a 400 naming the field, like `tools`: a client that asked for audio and got plain text
could not tell. The harmless ones (bookkeeping, hints) are accepted, and the fields a request
set that were not acted on are listed in one warning line in the log, as vLLM does."""
from __future__ import annotations

import logging

import httpx
import pytest

from llmlab.server.app import create_app
from helpers.server import running, tiny_engine

USER = [{"role": "user", "content": "Hi"}]
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.fixture(scope="module")
def url():
    with running(create_app(tiny_engine())) as url:
        yield url


def chat(url: str, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": USER, "max_tokens": 1, **fields}, timeout=30)


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]), ("function_call", "auto"),
    ("function_call", {"name": "f"}), ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"}),
    ("prediction", {"type": "content", "content": "Hello"}), ("web_search_options", {}),
])
def test_fields_that_change_the_output_are_refused(url, field, value):
    response = chat(url, **{field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"] and error["code"] == "unsupported_parameter"


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
    {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
])
def test_an_assistant_tool_call_turn_is_refused(url, message):
    field = next(k for k in message if k not in ("role", "content"))
    response = chat(url, messages=[*USER, message, {"role": "user", "content": "and?"}])
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == f"messages[1].{field}"


def test_their_off_values_are_accepted(url):
    response = chat(url, functions=[], function_call="none", modalities=["text"], audio=None, prediction=None,
                    web_search_options=None,
                    messages=[*USER, {"role": "assistant", "content": "Hello", "tool_calls": []}, *USER])
    assert response.status_code == 200, response.text


def test_harmless_fields_are_accepted_and_listed_in_one_warning(url, caplog):
    harmless = dict(store=True, metadata={"team": "a"}, service_tier="auto", user="u-1", parallel_tool_calls=False,
                    reasoning_effort="low", not_an_openai_field=1)
    with caplog.at_level(logging.WARNING, logger="llmlab.server"):
        response = chat(url, messages=[{"role": "user", "content": "Hi", "name": "ann"}], **harmless)
        completion = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "store": True})
    assert response.status_code == 200 and completion.status_code == 200, response.text
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(lines) == 2, lines     # one line per request
    assert all(name in lines[0] for name in [*harmless, "messages[0].name"]), lines[0]
    assert "store" in lines[1]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmlab.server"):
        assert chat(url).status_code == 200
    assert not [r for r in caplog.records if "ignored" in r.getMessage()]   # nothing to say: no line
