"""Notebook 11, serving and benchmarking: the benchmark's arrivals and metrics, computed by
`llmlab.bench.serving` itself."""
from __future__ import annotations

import math

from llmlab.bench.serving import RequestResult, poisson_arrivals
from llmlab.teach.check import choice, close, number, right, wrong

NUM_PROMPTS = 12


def q1(answer):
    """With the benchmark's seed (0) but 4 requests per second, how many seconds after the first request
    does the twelfth one arrive?"""
    seconds = number(answer)
    arrivals = poisson_arrivals(NUM_PROMPTS, 4.0, seed=0)
    if close(seconds, arrivals[-1], 0.05):
        return right("a seeded Poisson process draws the same exponential gaps at every rate, scaled by "
                     "1/rate: the arrivals at 4 req/s are those at 1 req/s, four times closer together.")
    if close(seconds, poisson_arrivals(NUM_PROMPTS, 1.0, seed=0)[-1], 0.05):
        return wrong("that is at 1 request per second.")
    if close(seconds, (NUM_PROMPTS - 1) / 4, 0.05) or close(seconds, NUM_PROMPTS / 4, 0.05):
        return wrong("that is what the gaps give on average; these are random draws (seeded): look at what "
                     "the same seed gave at 1 req/s.")
    return wrong("llmlab.bench.serving.poisson_arrivals(12, 4.0, seed=0) gives every arrival time; or scale "
                 "the printed arrivals at 1 req/s.")


def q2(answer):
    """A request's first token came 400 ms after it was sent, its last (the 4th) after 1300 ms. What is its
    TPOT, in milliseconds?"""
    value = number(answer)
    tpot_ms = RequestResult(arrival=0.0, output_len=4, output_tokens=4, ttft=0.4, latency=1.3).tpot * 1e3
    if close(value, tpot_ms, 0.5):
        return right("(E2E - TTFT) / (output tokens - 1): the time per token after the first, which TTFT "
                     "already counts.")
    if close(value, 1300 / 4, 0.5):
        return wrong("E2E / tokens mixes in the prefill and queueing that TTFT measures; TPOT starts after the "
                     "first token.")
    if close(value, (1300 - 400) / 4, 0.5):
        return wrong("after the first token, how many more tokens came?")
    return wrong("TPOT = (E2E - TTFT) / (output tokens - 1).")


REASONS = {
    "a": "the server failed some requests",
    "b": "a short run's req/s is completed requests / the time from the first arrival to the last answer",
    "c": "the client sent the requests at 3.4 per second, not 8",
}


def q3(answer):
    """At rate 8 the table shows about 3.4 req/s (your numbers vary). Why is it below 8?
    (a) the server failed some requests  (b) req/s divides the 12 completed requests by the time from the
    first arrival to the last answer, which includes the arrivals' spread and the last request's own
    latency  (c) the client sent them at 3.4 per second"""
    letter = choice(answer, "abc")
    if letter == "b":
        return right("with 12 requests the last one's latency is a large part of the run: req/s reaches the "
                     "rate only on long runs of a server that keeps up. A server that does not keep up shows "
                     "it as TTFT growing with the rate (the queue).")
    if letter == "a":
        return wrong("the cell asserts that none failed (result['failed'] == 0).")
    return wrong("arrivals are drawn at the requested rate (poisson_arrivals); look at what req/s divides by "
                 "(llmlab/bench/serving.py, summarize).")


def q4(answer):
    """Try this: run the benchmark at a third rate, float("inf") (every request at once), and put that
    rate's result dict here."""
    if not isinstance(answer, dict) or "rate" not in answer or "ttft_ms" not in answer:
        return wrong("put the dict serving.run_rate returns (one entry of results), with its 'rate' and "
                     "'ttft_ms'.")
    if not math.isinf(answer["rate"]):
        return wrong(f"that is the result of rate {answer['rate']:g}; run one with float('inf').")
    if answer.get("completed") != NUM_PROMPTS or answer.get("failed"):
        return wrong(f"{answer.get('completed')} of {NUM_PROMPTS} completed; run all 12 prompts.")
    ttft = answer["ttft_ms"]
    return right(f"all 12 at once: TTFT p50 {ttft['p50']:.0f} ms and p99 {ttft['p99']:.0f} ms on this machine. The "
                 f"queue now forms inside the server: the last prompts wait for the first ones' prefill.")


QUESTIONS = {"q1": q1, "q2": q2, "q3": q3, "q4": q4}
