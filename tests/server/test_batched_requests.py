"""Many choices in one request (issues #34 and #40): completions' `prompt` in all of OpenAI's
forms, `n` completions of each, `echo` (with the prompt's logprobs, and `max_tokens: 0`), and
vLLM's `stream_options.continuous_usage_stats`, sent as the clients that use them send them:
lm-evaluation-harness's `local-completions` (batches of token-id prompts; with `echo` and
`logprobs: 1` to score them) and GuideLLM (streams with usage on every chunk).

The reference for every choice is the same request sent alone (or the engine run directly),
so a choice that took another's tokens, index, seed or prompt fails. And nothing is lost: every
KV block comes back, and a request refused for one bad prompt leaves nothing running.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

import llmlab
from llmlab import SamplingParams
from llmlab.server.app import create_app

from helpers.engine import run_all, tiny_prompt
from helpers.server import CharTokenizer, assert_idle, running, tiny_engine

MODEL = "tiny-random"
# lm-eval 0.4.x local-completions: a loglikelihood batch (TemplateAPI with batch_size > 1)
LM_EVAL_SCORE = dict(model=MODEL, temperature=0, max_tokens=1, logprobs=1, seed=1234, echo=True)
# ... and a generate_until batch
LM_EVAL_GENERATE = dict(model=MODEL, max_tokens=12, temperature=0, stop=["\n\n", "Q:"], seed=1234)
ATOL = 1e-5     # the same engine's numbers in another batch: float32 sums in another order


@pytest.fixture(scope="module")
def served():
    app = create_app(tiny_engine())
    with running(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def url(served):
    return served[0]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def completions(url: str, **body) -> dict:
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(url: str, path: str, **body) -> list[dict]:
    """The chunks of a stream (the usage chunk too), parsed."""
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def joined(chunks: list[dict], key: str = "text") -> dict[int, str]:
    """Each choice's streamed text, by index."""
    texts = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            piece = choice[key] if key == "text" else choice["delta"].get("content", "")
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts


def token_prompts(count: int) -> list[list[int]]:
    return [tiny_prompt(5 + 3 * i, seed=i) for i in range(count)]


# ---- prompt forms -------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", ["Once upon a time", ["Once upon", "a time", "there was"],
                                    [5, 6, 7, 8], [[5, 6, 7], [9, 10], [11, 12, 13, 14]]],
                         ids=["string", "strings", "token ids", "token-id lists"])
def test_each_prompt_form_gives_one_choice_per_prompt_equal_to_it_alone(served, client, prompt):
    url, app = served
    prompts = prompt if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else [prompt]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert [c.index for c in response.choices] == list(range(len(prompts)))
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0) for p in prompts]
    assert [c.text for c in response.choices] == [a.choices[0].text for a in alone]
    assert response.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert response.usage.completion_tokens == 5 * len(prompts)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert_idle(app)


def test_a_batch_of_token_id_prompts_as_lm_eval_generates_them(url):
    prompts = token_prompts(8)
    batch = completions(url, prompt=prompts, **LM_EVAL_GENERATE)
    alone = [completions(url, prompt=p, **LM_EVAL_GENERATE)["choices"][0] for p in prompts]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in batch["choices"]] == \
           [(i, a["text"], a["finish_reason"]) for i, a in enumerate(alone)]


def test_the_prompts_of_a_request_start_in_the_same_step():
    """They are added to the engine in one go, so they batch: the first step prefills them all."""
    engine = tiny_engine()
    recorder = llmlab.Recorder()
    engine.hooks.attach(recorder)
    with running(create_app(engine)) as url:
        completions(url, prompt=token_prompts(8), max_tokens=2, temperature=0)
    first = recorder.trace.steps[0]
    assert sorted(item.request_id.rsplit("-", 1)[1] for item in first.scheduled if item.kind == "prefill") == \
           sorted(str(i) for i in range(8))


def test_one_bad_prompt_fails_the_whole_request_and_leaves_nothing_running(served):
    """Prompt 2's token id is out of range: the engine refuses it after it took prompts 0 and 1,
    which are aborted. A 400 naming the prompt; no block held; the server keeps serving."""
    url, app = served
    body = {"prompt": [[1, 2, 3] * 20, [4, 5] * 30, [6, 10**6], [7]], "max_tokens": 50, "n": 2}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and error["message"].startswith("prompt[2]:"), error
    assert_idle(app)
    assert not app.state.async_engine.engine.requests
    assert completions(url, prompt=[[1, 2], [3]], max_tokens=2)["usage"]["completion_tokens"] == 4


def test_a_prompt_too_long_for_max_tokens_names_itself(url):
    response = httpx.post(f"{url}/v1/completions", json={"prompt": [[1], [2] * 8190], "max_tokens": 10})
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded"
    assert "prompt[1]" in error["message"] and error["param"] == "max_tokens"


# ---- n ----------------------------------------------------------------------------------------------

SEEDED = dict(temperature=1.0, top_p=0.95, seed=42, max_tokens=8)


def test_n_completions_with_a_seed_equal_n_requests_with_seeds_seed_plus_i(served, client):
    url, app = served
    prompts = ["The sea", "A mountain"]
    response = client.completions.create(model=MODEL, prompt=prompts, n=3, **SEEDED)
    assert [c.index for c in response.choices] == list(range(6))      # prompt index * n + i
    for choice in response.choices:
        p, i = divmod(choice.index, 3)
        alone = client.completions.create(model=MODEL, prompt=prompts[p], **{**SEEDED, "seed": 42 + i})
        assert choice.text == alone.choices[0].text, choice.index
    assert len({c.text for c in response.choices[:3]}) > 1, "three seeds, three draws"
    assert response.usage.prompt_tokens == sum(len(CharTokenizer().encode(p)) for p in prompts)   # once per prompt
    assert response.usage.completion_tokens == 6 * 8
    # streamed: the same choices
    assert joined(streamed(url, "/v1/completions", prompt=prompts, n=3, **SEEDED)) == \
           {c.index: c.text for c in response.choices}
    assert_idle(app)


def test_chat_n_with_a_seed_streamed_and_not(served, client):
    url, app = served
    messages = [{"role": "user", "content": "Tell me"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, n=4, **SEEDED)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for choice in response.choices:
        alone = client.chat.completions.create(model=MODEL, messages=messages, **{**SEEDED, "seed": 42 + choice.index})
        assert choice.message.content == alone.choices[0].message.content
    chunks = streamed(url, "/v1/chat/completions", messages=messages, n=4, **SEEDED)
    assert [c["choices"][0]["delta"] for c in chunks[:4]] == [{"role": "assistant", "content": ""}] * 4
    assert joined(chunks, "delta") == {c.index: c.message.content for c in response.choices}
    assert_idle(app)


def test_n_with_stop_strings_streamed_and_not(served, client):
    """Each choice stops at its own stop string, never shown, streamed or not."""
    url, app = served
    body = dict(prompt="Stop me", n=6, temperature=1.0, seed=5, max_tokens=40, stop=["a", "e", "!"])
    whole = completions(url, **body)
    finish = [c["finish_reason"] for c in whole["choices"]]
    assert "stop" in finish
    assert not any(s in c["text"] for c in whole["choices"] for s in body["stop"])
    chunks = streamed(url, "/v1/completions", **body)
    assert joined(chunks) == {c["index"]: c["text"] for c in whole["choices"]}
    ends = {ch["index"]: ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]}
    assert [ends[i] for i in range(6)] == finish
    assert_idle(app)


def test_best_of_equal_to_n_is_every_completion(client):
    response = client.completions.create(model=MODEL, prompt="Hi", n=2, best_of=2, max_tokens=2, seed=1)
    assert len(response.choices) == 2


# ---- echo and the prompt's logprobs --------------------------------------------------------------

def test_echo_puts_the_prompt_before_the_completion(url):
    for prompt in ("Echo this", [40, 41, 42]):
        echoed = completions(url, prompt=prompt, echo=True, max_tokens=4, temperature=0)["choices"][0]["text"]
        plain = completions(url, prompt=prompt, max_tokens=4, temperature=0)["choices"][0]["text"]
        prompt_text = prompt if isinstance(prompt, str) else CharTokenizer().decode(prompt)
        assert echoed == prompt_text + plain


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_scores_of_a_batch_of_token_id_prompts_as_lm_eval_asks(served, max_tokens):
    """lm-eval's loglikelihood request: echo, logprobs 1, temperature 0, max_tokens 1 (vLLM's
    max_tokens 0: the prompt alone). It reads token_logprobs[ctxlen:-1] and calls the
    continuation greedy when each token's logprob is the largest of its top_logprobs."""
    url, app = served
    prompts = token_prompts(8)
    body = {**LM_EVAL_SCORE, "prompt": prompts, "max_tokens": max_tokens}
    response = completions(url, **body)
    expected = run_all(tiny_engine(), prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=1,
                                                              prompt_logprobs=1))
    for choice, prompt, want in zip(response["choices"], prompts, expected, strict=True):
        logprobs, tokens = choice["logprobs"], prompt + want.token_ids[:max_tokens]
        assert logprobs["tokens"] == [CharTokenizer().decode([t]) for t in tokens]
        assert choice["text"] == CharTokenizer().decode(tokens)
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        entries = want.prompt_logprobs[1:] + want.logprobs[:max_tokens]
        assert logprobs["token_logprobs"][1:] == pytest.approx([e.logprob for e in entries], abs=ATOL)
        for top, entry in zip(logprobs["top_logprobs"][1:], entries, strict=True):
            greedy = entry.top[0][0] == entry.token_id
            assert (max(top.values()) == pytest.approx(entry.logprob, abs=ATOL)) == greedy
        assert logprobs["text_offset"] == list(range(len(tokens)))
        assert choice["finish_reason"] == "length"
    assert response["usage"]["completion_tokens"] == max_tokens * len(prompts)
    assert response["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert_idle(app)


@pytest.mark.parametrize("max_tokens", [6, 0])
def test_echo_streamed_equals_echo_whole(url, max_tokens):
    body = dict(prompt=["Echo", "these"], echo=True, logprobs=2, max_tokens=max_tokens, n=2, temperature=0.9, seed=3)
    whole = completions(url, **body)["choices"]
    chunks = streamed(url, "/v1/completions", **body)
    assert joined(chunks) == {c["index"]: c["text"] for c in whole}
    for choice in whole:
        pieces = [ch["logprobs"] for c in chunks for ch in c["choices"] if ch["index"] == choice["index"]]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for piece in pieces for x in piece[key]] == choice["logprobs"][key], key


# ---- usage on every chunk (GuideLLM) --------------------------------------------------------------

GUIDELLM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_usage_on_every_chunk(served, path):
    """GuideLLM's request: ignore_eos, stop null, usage on every chunk and at the end."""
    url, app = served
    body = {"prompt": "Count the tokens"} if "chat" not in path else {"messages": [{"role": "user", "content": "Go"}]}
    chunks = streamed(url, path, **body, model=MODEL, max_tokens=20, ignore_eos=True, stop=None,
                      stream_options=GUIDELLM_OPTIONS)
    *pieces, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 20
    prompt_tokens = last["usage"]["prompt_tokens"]
    seen = 0
    for chunk in pieces:
        usage, choice = chunk["usage"], chunk["choices"][0]
        seen += len(choice["text"] if "text" in choice else choice["delta"].get("content", ""))   # a character a token
        assert usage == {"prompt_tokens": prompt_tokens, "completion_tokens": seen,
                         "total_tokens": prompt_tokens + seen, "prompt_tokens_details": usage["prompt_tokens_details"]}
    assert seen == 20
    assert_idle(app)


def test_continuous_usage_stats_without_include_usage_and_unknown_stream_options(url):
    chunks = streamed(url, "/v1/completions", prompt="Hi", max_tokens=3, ignore_eos=True,
                      stream_options={"continuous_usage_stats": True})
    assert all(c["usage"] for c in chunks) and chunks[-1]["choices"]     # no final usage-only chunk
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "stream": True,
                                                         "stream_options": {**GUIDELLM_OPTIONS, "bogus": 1}})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "stream_options.bogus"
    assert "stream_options.bogus" in error["message"], error


def test_a_client_that_hangs_up_aborts_every_choice(served):
    url, app = served
    body = {"prompt": [[1, 2, 3], [4, 5, 6]], "n": 3, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(12):
            while not next(lines).startswith("data:"):
                pass
        assert app.state.async_engine.kv_stats["num_running"] + app.state.async_engine.kv_stats["num_waiting"] > 0
    assert_idle(app)
