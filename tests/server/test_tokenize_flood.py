"""A flood of huge prompts cannot stall a small request (issue #37, row 1): a prompt that
cannot fit is refused before it is tokenized (a bound from its length in characters), and
prompts are tokenized in two lanes, so a short one never queues behind a long one.

How long the small request takes under a flood is a measurement, not a test: `llmlab bench
head-of-line --flood-clients` (BENCHMARKS.md). Here, what decides it is checked exactly:
the refusal names characters (no token was counted), the small request is answered during
the flood, and a short prompt is tokenized while every long-lane thread is held."""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from llmlab.bench.flood import Flood, completion_body, flood_prompt, tiny_request_seconds
from llmlab.model.loader import resolve_model
from llmlab.model.tokenizer import Tokenizer
from llmlab.server import tokenizer_threads
from llmlab.server.tokenizer_threads import LONG_LANE_THREADS, SHORT_PROMPT_CHARS, TokenizerLanes

CLIENTS = 4
# generous: a deadlock detector, not a latency bound (a short prompt encodes in milliseconds)
DEADLOCK_S = 60


@pytest.mark.slow     # a real server under a workload: left out by make test-fast
def test_prompts_that_cannot_fit_are_refused_before_tokenizing(embedded_server):
    body = completion_body(flood_prompt(1_000_000))    # 1,000,031 bytes, as in the issue: ~167k tokens
    with Flood(embedded_server.url, body, CLIENTS) as flood:
        tiny_request_seconds(embedded_server.url)       # a RuntimeError unless answered 200
    assert set(flood.statuses) == {400}
    assert {e["code"] for e in flood.errors} == {"context_length_exceeded"}
    assert "characters" in flood.errors[0]["message"]     # refused by the bound, not by a count


@pytest.mark.slow
def test_prompts_under_the_bound_are_counted_and_refused_while_a_small_one_is_served(embedded_server):
    """Prompts just short of the bound are tokenized whole, then refused by their count."""
    tokenizer = Tokenizer(str(resolve_model(None)))
    max_model_len = httpx.get(f"{embedded_server.url}/v1/models").json()["data"][0]["max_model_len"]
    under_the_bound = (max_model_len - 1) * tokenizer.max_chars_per_token - 10
    with Flood(embedded_server.url, completion_body(flood_prompt(under_the_bound)), CLIENTS) as flood:
        tiny_request_seconds(embedded_server.url)
    assert set(flood.statuses) == {400}
    assert {e["code"] for e in flood.errors} == {"context_length_exceeded"}
    assert "characters" not in flood.errors[0]["message"]   # counted: these were tokenized


class HeldEngine:
    """An engine stand-in whose tokenizer holds every long prompt until `release` is set."""

    def __init__(self):
        self.tokenizer = object()          # no min_num_tokens: every prompt is encoded
        self.release = threading.Event()
        self.long_ones_started = threading.Semaphore(0)

    def tokenize(self, prompt):
        if len(prompt) > SHORT_PROMPT_CHARS:
            self.long_ones_started.release()
            assert self.release.wait(DEADLOCK_S), "never released"
        return [len(prompt)], None


def test_a_short_prompt_is_tokenized_while_every_long_lane_thread_is_held():
    """With one lane (the bug), the short prompt would wait for a long one to finish."""
    engine = HeldEngine()
    lanes = TokenizerLanes(engine)

    async def scenario():
        lanes.start()
        try:
            long_ones = [asyncio.ensure_future(lanes.tokenize("x" * (SHORT_PROMPT_CHARS + 1)))
                         for _ in range(LONG_LANE_THREADS + 2)]
            for _ in range(LONG_LANE_THREADS):     # every long-lane thread is now inside encode
                assert await asyncio.to_thread(engine.long_ones_started.acquire, timeout=DEADLOCK_S)
            short = await asyncio.wait_for(lanes.tokenize("Hi"), DEADLOCK_S)
            assert not any(f.done() for f in long_ones)
            engine.release.set()
            assert [ids for ids in await asyncio.gather(*long_ones)] == [[SHORT_PROMPT_CHARS + 1]] * len(long_ones)
            return short
        finally:
            engine.release.set()
            lanes.stop()

    assert asyncio.run(scenario()) == [2]


def test_the_lane_is_chosen_by_characters():
    assert tokenizer_threads.num_chars("x" * 10, None) == 10
    assert tokenizer_threads.num_chars([1, 2, 3], None) == 0
    assert tokenizer_threads.num_chars(None, [{"role": "user", "content": "abc"}, {"role": "x"}]) == 3


@pytest.mark.parametrize("text", ["", "Hi", "hello world " * 1000, "\n" + " " * 5000, "日本語のテキスト" * 500])
def test_the_bound_never_exceeds_the_count(text):
    """The bound is sound: no text has fewer tokens than it says (else a prompt that fits
    would be refused)."""
    tokenizer = Tokenizer(str(resolve_model(None)))
    assert tokenizer.min_num_tokens(text) <= len(tokenizer.hf.encode(text, add_special_tokens=False))
