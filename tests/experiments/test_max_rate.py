"""max_rate: the highest arrival rate at which a policy keeps a target fraction of requests
within an SLO, by bracketing then bisection, on the simulator or on the engine."""
import pytest

from llmlab import EngineConfig, LLMEngine
from llmlab.experiments import CostModel, RateSearch, Workload, max_rate

from helpers.engine import TINY, cpu_engine_config, tiny_model

# One request at a time (max_num_seqs 1), every step 10 ms: a request of 10 output tokens
# holds the engine for one prefill step and 9 decode steps, S = 0.1 s: 10 requests/s.
STEP = 0.01
SERVICE = 10 * STEP
CONFIG = EngineConfig(device="cpu", block_size=4, num_gpu_blocks=64, max_num_batched_tokens=64, max_num_seqs=1)
COST = CostModel.constant(STEP, {"num_gpu_blocks": 64, "max_model_len": 256})
# 20 requests arriving evenly (gamma gaps with cv 1e-6: a clock, not a Poisson process)
EVEN = dict(num_requests=20, prompt_len=8, output_len=10, cv=1e-6, seed=0, vocab_size=128)


def test_max_rate_brackets_the_rate_a_queue_can_serve():
    # Arrivals every g = 1/rate seconds. With g >= S every request finds the engine idle: TTFT = one
    # step. With g < S request i starts when i - 1 ends, at i*S: TTFT = i*(S - g) + STEP. The SLO
    # allows DELTA more than one step, so request i meets it while i*(S - g) <= DELTA, and 90% of 20
    # (requests 0-17) meet it while 17*(S - g) <= DELTA: rate <= 1 / (S - DELTA / 17).
    delta = 0.005
    known = 1 / (SERVICE - delta / 17)                   # 10.03 requests/s
    search = max_rate(EVEN, "fcfs", {"ttft": STEP + delta}, target=0.9, config=CONFIG, cost_model=COST,
                      start_rate=1.0, rel_tol=0.01)
    assert isinstance(search, RateSearch) and search.rate == search.low
    assert search.low <= known <= search.high and search.high / search.low - 1 <= 0.01
    for point in search.points:                          # every rate tried says which side it is on
        assert (point["slo_attainment"] >= 0.9) == (point["rate"] <= known)
    assert search.points[0]["rate"] == 1.0 and [p["rate"] for p in search.points[:5]] == [1, 2, 4, 8, 16]


def test_max_rate_halves_down_from_a_rate_too_high_and_takes_a_workload_function():
    delta = 0.005
    known = 1 / (SERVICE - delta / 17)

    def evenly(rate):
        return Workload.gamma(rate=rate, **EVEN)

    search = max_rate(evenly, "fcfs", {"ttft": STEP + delta}, config=CONFIG, cost_model=COST, start_rate=100.0,
                      rel_tol=0.05)
    assert [p["rate"] for p in search.points[:4]] == [100, 50, 25, 12.5]
    assert search.low <= known <= search.high and search.high / search.low - 1 <= 0.05


def test_an_slo_no_rate_meets_gives_zero_and_one_every_rate_meets_gives_inf():
    never = max_rate(EVEN, "fcfs", {"ttft": STEP / 2}, config=CONFIG, cost_model=COST, max_evaluations=8)
    assert never.rate == 0.0 and never.low == 0.0 and not never.bracketed
    always = max_rate(dict(EVEN, num_requests=2), "fcfs", {"e2e": 100.0}, config=CONFIG, cost_model=COST,
                      max_evaluations=8)
    assert always.high == float("inf") and not always.bracketed and always.rate == always.points[-1]["rate"]


def test_bad_arguments_are_refused():
    slo = {"ttft": 1.0}
    with pytest.raises(ValueError, match="target"):
        max_rate(EVEN, "fcfs", slo, target=1.5, config=CONFIG, cost_model=COST)
    with pytest.raises(ValueError, match="cost_model .* or an engine"):
        max_rate(EVEN, "fcfs", slo, config=CONFIG)
    with pytest.raises(ValueError, match="cost_model .* or an engine"):
        max_rate(EVEN, "fcfs", slo, config=CONFIG, cost_model=COST, engine=object())
    with pytest.raises(ValueError, match="rate"):
        max_rate(dict(EVEN, rate=3.0), "fcfs", slo, config=CONFIG, cost_model=COST)
    with pytest.raises(ValueError, match="unknown SLO key"):
        max_rate(EVEN, "fcfs", {"latency": 1.0}, config=CONFIG, cost_model=COST)


@pytest.mark.slow
def test_max_rate_on_the_real_engine():
    engine = LLMEngine(cpu_engine_config(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=32, max_num_seqs=4),
                       model=tiny_model(seed=3))
    params = dict(num_requests=6, prompt_len=(4, 12), output_len=4, seed=1, vocab_size=TINY.vocab_size)
    search = max_rate(params, "fcfs", {"e2e": 0.5}, engine=engine, start_rate=20.0, rel_tol=0.5, max_evaluations=6)
    assert all(p["summary"]["num_finished"] == 6 and p["kind"] == "run" for p in search.points)
    met = [p["rate"] for p in search.points if p["slo_attainment"] >= 0.9]
    assert search.low == max(met, default=0.0)
    assert all(p["rate"] >= search.high for p in search.points if p["slo_attainment"] < 0.9)


def test_the_rate_search_figure_draws_every_rate_tried():
    from llmlab.experiments import rate_search

    search = max_rate(EVEN, "fcfs", {"ttft": STEP + 0.005}, config=CONFIG, cost_model=COST, rel_tol=0.05)
    fig = rate_search({"fcfs": search})
    line = fig.data[0]
    assert list(line.x) == sorted(p["rate"] for p in search.points)
    assert list(line.y) == [p["slo_attainment"] for p in sorted(search.points, key=lambda p: p["rate"])]
    assert fig.layout.shapes[0].x0 == search.rate and fig.layout.shapes[1].y0 == 0.9
