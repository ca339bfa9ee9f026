"""A SamplingParams changed after it was built is checked again when its request is added
(issue #37, row 6): LLMEngine.add_request and LLM.generate refuse a bad value with the
ValueError the constructor gives (one `SamplingParams.validate`), the engine keeps running
and no KV block is held; a bare string `stop` is one stop string, as OpenAI reads it."""
from __future__ import annotations

import math

import pytest

from helpers.engine import assert_all_blocks_free, embedded_engine, run_all
from llmlab import SamplingParams

BAD = [("temperature", -1), ("temperature", math.nan), ("top_p", 5), ("top_k", 0), ("min_p", 2),
       ("stop_token_ids", [-1]), ("max_tokens", -3), ("max_tokens", 0), ("max_tokens", "8"), ("seed", 2**70),
       ("stop", [""]), ("stop", 5), ("ignore_eos", "yes"), ("n", 0), ("logprobs", 21), ("prompt_logprobs", -1)]


def changed(field: str, value) -> SamplingParams:
    params = SamplingParams(max_tokens=4, temperature=0.5)    # sampled: the seed reaches the sampler
    setattr(params, field, value)
    return params


@pytest.fixture(scope="module")
def engine(llm):
    return embedded_engine(llm, num_gpu_blocks=64)


@pytest.mark.parametrize("field, value", BAD, ids=[f"{field}={value!r}" for field, value in BAD])
def test_add_request_refuses_what_the_constructor_refuses(engine, field, value):
    with pytest.raises(ValueError) as built:
        SamplingParams(**{field: value})
    with pytest.raises(ValueError) as added:
        engine.add_request("Hello", changed(field, value))
    assert str(added.value) == str(built.value) and str(added.value).startswith(f"SamplingParams.{field} must be")
    assert_all_blocks_free(engine)
    assert run_all(engine, ["Hi"], SamplingParams(max_tokens=2))[0].finished     # still serving


@pytest.mark.parametrize("field, value", [("temperature", -1), ("max_tokens", "8"), ("seed", 2**70), ("n", "3"),
                                          ("logprobs", -1)])
def test_generate_refuses_it_and_rolls_back_the_batch(llm, field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be"):
        llm.generate(["a fine prompt", "Hello"], [SamplingParams(max_tokens=2), changed(field, value)])
    assert_all_blocks_free(llm.engine)


def test_a_bare_stop_string_is_one_stop_string(engine):
    """Set to "ab" after construction, `stop` stops at "ab", not at "a" or at "b" (a string
    iterated character by character), as SamplingParams(stop="ab") and OpenAI's API do."""
    prompt, greedy = "Write a haiku about the sea.", dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    text = run_all(engine, [prompt], SamplingParams(**greedy))[0].text
    # a two-character piece of the text whose first character shows up earlier on its own
    stop = next(text[k:k + 2] for k in range(1, len(text) - 1)
                if text.find(text[k:k + 2]) == k and text.find(text[k]) < k and text[k:k + 2].strip())
    params = SamplingParams(**greedy)
    params.stop = stop
    out = run_all(engine, [prompt], params)[0]
    assert params.stop == [stop]
    assert out.text == text[:text.find(stop)] and out.finish_reason == "stop"
    assert out.text == run_all(engine, [prompt], SamplingParams(**greedy, stop=stop))[0].text
    assert_all_blocks_free(engine)
