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


# ---- vLLM's extensions (#34): those that change the output are refused unless off; stop_token_ids works

@pytest.mark.parametrize("field, value", [
    ("repetition_penalty", 1.1), ("min_tokens", 3), ("use_beam_search", True), ("length_penalty", 0.5),
    ("bad_words", ["x"]), ("allowed_token_ids", [1, 2]), ("truncate_prompt_tokens", 5),
    ("include_stop_str_in_output", True), ("skip_special_tokens", False), ("guided_json", {"type": "object"}),
    ("guided_regex", "a+"), ("guided_choice", ["a", "b"]), ("guided_grammar", "root ::= 'a'"),
    ("structured_outputs", {"choice": ["a"]}), ("add_generation_prompt", False), ("continue_final_message", True),
    ("chat_template", "{{ messages }}"), ("chat_template_kwargs", {"enable_thinking": False}),
])
def test_vllm_fields_that_change_the_output_are_refused(url, field, value):
    response = chat(url, **{field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["code"] == "unsupported_parameter"


def test_vllm_fields_at_their_off_values_are_accepted(url):
    off = dict(repetition_penalty=1.0, min_tokens=0, use_beam_search=False, length_penalty=1, bad_words=[],
               include_stop_str_in_output=False, skip_special_tokens=True, add_generation_prompt=True,
               continue_final_message=False, chat_template_kwargs={}, guided_json=None)
    assert chat(url, **off).status_code == 200


def completion(url: str, **fields) -> dict:
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello there", "temperature": 0, **fields},
                          timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_stop_token_ids_end_the_completion_at_that_token(url):
    """As in vLLM: the completion ends with the first token of stop_token_ids, which is part of
    its text (a special token's would not be). The tiny engine's tokenizer writes token t as
    the character chr(32 + t % 95)."""
    free = completion(url, max_tokens=12, ignore_eos=True)["text"]
    stop_at = next(i for i in range(1, len(free)) if free[i] not in free[:i])   # a character's first appearance
    ids = [t for t in range(128) if chr(32 + t % 95) == free[stop_at]]
    stopped = completion(url, max_tokens=12, ignore_eos=True, stop_token_ids=ids)
    assert stopped["finish_reason"] == "stop" and stopped["text"] == free[:stop_at + 1], (free, stopped)


def test_null_is_a_fields_default(url):
    nulls = dict(temperature=None, top_p=None, n=None, stream=None, top_k=None, min_p=None, ignore_eos=None,
                 seed=None, stop=None, stop_token_ids=None)
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "echo": None, **nulls},
                      timeout=30).status_code == 200
    assert chat(url, logprobs=None, top_logprobs=None, **nulls).status_code == 200


def test_max_completion_tokens_wins_over_max_tokens(url):
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER, "max_tokens": 7,
                                                              "max_completion_tokens": 3, "ignore_eos": True},
                          timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


def test_an_ignored_fields_name_cannot_forge_a_log_line(url, caplog):
    forged = "x\nERROR:     forged\x1b[31m"
    with caplog.at_level(logging.WARNING, logger="llmlab.server"):
        assert chat(url, **{forged: 1, "y" * 5000: 1}).status_code == 200
    line = next(r.getMessage() for r in caplog.records if "ignored" in r.getMessage())
    assert "\n" not in line and "\x1b" not in line and len(line) < 500, line


def test_a_requests_priority_reaches_the_policy():
    """vLLM's `priority` request field: SamplingParams.priority, which `--policy priority` orders by."""
    from llmlab.server.protocol import CompletionRequest, parse_json

    body = parse_json(CompletionRequest, b'{"prompt": "Hi", "priority": -3, "n": 2}')
    assert {p.priority for p in body.sampling_params(max_tokens=2).fan_out()} == {-3}
    assert parse_json(CompletionRequest, b'{"prompt": "Hi", "priority": null}').sampling_params().priority == 0
