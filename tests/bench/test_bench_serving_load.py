"""`llmlab bench serving` with vLLM's load knobs: --burstiness (gamma arrivals), --max-concurrency
(at most that many requests in flight), goodput under --slo / --goodput, and vLLM's printout."""
import argparse
import math

import numpy as np
import pytest

from llmlab.bench import serving


def test_burstiness_gives_gamma_gaps_with_vllms_shape():
    # vLLM: gaps ~ gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate, cv 1/sqrt(burstiness)
    for burstiness in (0.25, 1.0, 4.0):
        arrivals = serving.arrival_times(20000, rate=10.0, burstiness=burstiness, seed=1)
        gaps = np.diff(arrivals)
        assert arrivals[0] == 0.0
        assert gaps.mean() == pytest.approx(0.1, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05), burstiness
    # burstiness 1 is the Poisson process the benchmark always used, from the same seed
    assert serving.arrival_times(20, 4.0, 1.0, seed=3) == serving.poisson_arrivals(20, 4.0, seed=3)
    assert serving.arrival_times(5, math.inf, 0.5) == [0.0] * 5
    with pytest.raises(ValueError, match="burstiness"):
        serving.arrival_times(5, 1.0, 0.0)


def test_slo_pairs_in_vllms_two_spellings():
    assert serving.parse_slo(["ttft:300", "tpot:50"]) == {"ttft": 300.0, "tpot": 50.0}      # --goodput ttft:300 tpot:50
    assert serving.parse_slo(["ttft:300,tpot:50,e2el:2000"]) == {"ttft": 300.0, "tpot": 50.0, "e2el": 2000.0}
    for bad, message in ((["latency:3"], "ttft, tpot, e2el"), (["ttft=3"], "KEY:MILLISECONDS"),
                         (["ttft:-1"], "non-negative")):
        with pytest.raises(ValueError, match=message):
            serving.parse_slo(bad)
    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    args = parser.parse_args(["--request-rate", "2", "--burstiness", "0.5", "--max-concurrency", "3",
                              "--goodput", "ttft:300", "tpot:50"])
    assert (args.rate, args.burstiness, args.max_concurrency, args.slo) == (["2"], 0.5, 3, ["ttft:300", "tpot:50"])
    assert parser.parse_args(["--slo", "ttft:300,tpot:50"]).slo == ["ttft:300,tpot:50"]


def hand_results():
    # four requests over 2 s: TTFT 100/400/200 ms and one failure; TPOT (latency - ttft) / (tokens - 1)
    return [serving.RequestResult(0.0, 5, prompt_tokens=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
            serving.RequestResult(0.1, 3, prompt_tokens=20, output_tokens=3, ttft=0.4, latency=0.6, itl=[0.1, 0.1]),
            serving.RequestResult(0.2, 1, prompt_tokens=30, output_tokens=1, ttft=0.2, latency=0.2),
            serving.RequestResult(0.3, 4, error="HTTP 500: boom")]


def test_goodput_counts_the_requests_within_every_limit():
    # TPOTs 100, 100 ms and none (one token: no limit, as vLLM counts it 0): with ttft <= 300 ms and
    # tpot <= 100 ms requests 0 and 2 are good (1's TTFT is 400 ms); the failed one never is
    summary = serving.summarize(hand_results(), 2.0, slo_ms={"ttft": 300, "tpot": 100})
    assert summary["request_goodput"] == pytest.approx(2 / 2.0)
    assert summary["slo_attainment"] == pytest.approx(2 / 4)
    assert summary["completed"] == 3 and summary["failed"] == 1
    assert summary["ttft_ms"]["mean"] == pytest.approx(700 / 3) and summary["ttft_ms"]["p50"] == pytest.approx(200)
    assert "request_goodput" not in serving.summarize(hand_results(), 2.0)


def test_the_printout_is_vllms():
    summary = serving.summarize(hand_results(), 2.0, slo_ms={"ttft": 300, "tpot": 100}, percentiles=(90, 99))
    result = {"rate": 4.0, "burstiness": 1.0, "max_concurrency": 2, **summary}
    text = serving.format_result(result, ("ttft", "tpot", "itl", "e2el"), (90, 99))
    lines = text.splitlines()
    assert lines[0] == "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")
    assert "{:<40} {:<10}".format("Successful requests:", 3) in lines
    assert "{:<40} {:<10}".format("Maximum request concurrency:", 2) in lines
    assert "{:<40} {:<10.2f}".format("Request goodput (req/s):", 1.0) in lines
    assert "{s:{c}^{n}}".format(s="Time to First Token", n=50, c="-") in lines
    assert "{:<40} {:<10.2f}".format("Median TTFT (ms):", 200.0) in lines
    assert "{:<40} {:<10.2f}".format("P99 TTFT (ms):", np.percentile([100, 400, 200], 99)) in lines
    assert "{:<40} {:<10.2f}".format("P90 E2EL (ms):", np.percentile([500, 600, 200], 90)) in lines
    assert lines[-1] == "=" * 50


@pytest.mark.slow
def test_max_concurrency_holds_on_a_server():
    from llmlab.server.app import create_app

    from helpers.server import running, tiny_engine

    class InFlight:
        """An ASGI wrapper counting completions requests the server is handling at once."""
        def __init__(self, app):
            self.app, self.now, self.peak = app, 0, 0

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http" or scope["path"] != "/v1/completions":
                return await self.app(scope, receive, send)
            self.now += 1
            self.peak = max(self.peak, self.now)
            try:
                await self.app(scope, receive, send)
            finally:
                self.now -= 1

    prompts = serving.synthetic_prompts(8, seed=0, mean_input_len=8, max_input_len=16, mean_output_len=48,
                                        max_output_len=64)
    for limit in (2, None):
        app = InFlight(create_app(tiny_engine()))
        with running(app) as url:
            report = serving.run(url, [math.inf], prompts, progress=False, max_concurrency=limit)
        result = report["results"][0]
        assert result["completed"] == 8 and report["max_concurrency"] == limit
        if limit:
            assert app.peak == result["max_concurrent_requests"] == 2
            assert max(r["queued"] for r in result["requests"]) > 0      # some waited for a slot
        else:
            assert app.peak > 2                              # the counter sees more when nothing limits them


@pytest.mark.slow
def test_given_arrival_times_are_the_times_sent():
    """`arrivals` (bench guidellm replays GuideLLM's Poisson schedule with it) replaces the
    rate's drawn times: one per prompt, with one rate."""
    from llmlab.server.app import create_app

    from helpers.server import running, tiny_engine

    prompts = serving.synthetic_prompts(3, seed=0, mean_input_len=8, max_input_len=16, mean_output_len=4,
                                        max_output_len=8)
    arrivals = [0.0, 0.05, 0.4]
    with running(create_app(tiny_engine())) as url:
        report = serving.run(url, [2.0], prompts, progress=False, arrivals=arrivals)
        result = report["results"][0]
        assert result["completed"] == 3
        assert sorted(r["arrival"] for r in result["requests"]) == arrivals
        assert result["duration_s"] >= 0.4
        with pytest.raises(ValueError, match="one rate"):
            serving.run(url, [2.0, 4.0], prompts, progress=False, arrivals=arrivals)
        with pytest.raises(ValueError, match="2 arrival times for 3 prompts"):
            serving.run(url, [2.0], prompts, progress=False, arrivals=arrivals[:2])
