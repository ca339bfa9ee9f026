"""Repeats: the same experiment k times, every summary metric as a mean and a 95% Student's t
interval over the k repeats; one repeat has no interval. The comparison figures draw the
intervals as error bars."""
import math

import numpy as np
import pytest

from llmlab import LLMEngine
from llmlab.experiments import CostModel, Interval, Repeats, Result, Workload, run, simulate
from llmlab.experiments.repeats import interval, t_quantile

from helpers.engine import TINY, cpu_engine_config, tiny_model

MODEL = tiny_model(seed=3)
CONFIG = cpu_engine_config(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=32, max_num_seqs=8)
COST = CostModel.constant(0.01, {"num_gpu_blocks": 64, "max_model_len": 256})


def test_t_quantiles_are_a_statistics_tables():
    # the 97.5% quantiles of Student's t (any table, three decimals)
    table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 9: 2.262, 29: 2.045, 100: 1.984}
    for df, value in table.items():
        assert t_quantile(0.975, df) == pytest.approx(value, abs=6e-4), df


def test_interval_is_the_hand_calculated_t_interval():
    # [1, 2, 4]: mean 7/3, sample variance ((4/3)^2 + (1/3)^2 + (5/3)^2) / 2 = 7/3,
    # half width t(0.975, 2) * s / sqrt(3) = 4.303 * sqrt(7/3) / sqrt(3) = 3.795
    estimate = interval([1.0, 2.0, 4.0])
    assert estimate.mean == pytest.approx(7 / 3)
    assert estimate.high - estimate.mean == pytest.approx(3.795, abs=1e-3)
    assert estimate.mean - estimate.low == pytest.approx(3.795, abs=1e-3)
    assert estimate.n == 3
    # NaN values (a metric a repeat could not measure) are left out, and said so by n
    assert interval([1.0, float("nan"), 2.0, 4.0]) == estimate


def test_one_value_has_no_interval_not_a_zero_wide_one():
    single = interval([0.7])
    assert single.mean == 0.7 and single.low is None and single.high is None and single.n == 1
    assert str(single) == "0.7 (one repeat: no interval)"
    assert interval([float("nan")]).n == 0 and math.isnan(interval([float("nan")]).mean)


def test_repeats_summary_gives_every_metric_an_interval():
    workload = Workload.poisson(6, 40.0, prompt_len=(3, 20), output_len=(2, 6), seed=1, vocab_size=TINY.vocab_size)
    results = [simulate(workload, CONFIG, CostModel.constant(seconds, COST.meta)) for seconds in (0.01, 0.02, 0.04)]
    repeats = Repeats(results)
    summary = repeats.summary(slo={"ttft": 0.05})
    assert set(summary) == set(results[0].summary(slo={"ttft": 0.05}))
    for key, estimate in summary.items():
        assert isinstance(estimate, Interval)
        values = [r.summary(slo={"ttft": 0.05})[key] for r in results]
        assert repr(estimate) == repr(interval(values)), key         # repr: NaN == NaN
    assert summary["ttft_p50"].low < summary["ttft_p50"].mean < summary["ttft_p50"].high
    one = Repeats(results[:1]).summary()
    assert one["ttft_p50"].mean == results[0].summary()["ttft_p50"] and one["ttft_p50"].low is None
    rows = repeats.to_rows()
    assert len(rows) == 18 and [row["repeat"] for row in rows[:7]] == [0] * 6 + [1]


def test_run_repeats_the_same_workload_on_the_engine():
    engine = LLMEngine(CONFIG, model=MODEL)
    workload = Workload.poisson(4, 100.0, prompt_len=(3, 20), output_len=(1, 4), seed=5, vocab_size=TINY.vocab_size)
    repeats = run(workload, engine, repeats=3)
    assert isinstance(repeats, Repeats) and len(repeats.results) == 3
    assert all(r.summary()["num_finished"] == 4 for r in repeats.results)
    assert repeats.summary()["num_finished"] == Interval(4.0, 4.0, 4.0, 3)
    assert isinstance(run(workload, engine), Result)                 # no repeats asked: one Result, as before
    # a function of the repeat's index: each repeat gets its own arrivals
    varied = run(lambda seed: Workload.poisson(3, 100.0, (3, 9), 2, seed=seed, vocab_size=TINY.vocab_size),
                 engine, repeats=2)
    assert varied.results[0].requests[1].arrival != varied.results[1].requests[1].arrival


def test_simulate_repeats_draw_new_arrivals():
    def workload(seed):
        return Workload.poisson(20, 30.0, prompt_len=(3, 20), output_len=(2, 8), seed=seed, vocab_size=TINY.vocab_size)

    repeats = simulate(workload, CONFIG, COST, repeats=4)
    assert [r.requests[5].arrival for r in repeats.results] == [workload(seed).requests[5].arrival_time
                                                                 for seed in range(4)]
    assert repeats.summary()["ttft_p90"].n == 4
    with pytest.raises(ValueError, match="the same every time"):
        simulate(workload(0), CONFIG, COST, repeats=3)
    with pytest.raises(ValueError, match="repeats"):
        simulate(workload, CONFIG, COST, repeats=0)


def test_compare_draws_the_intervals_as_error_bars():
    from llmlab.experiments import compare, sweep

    workload = Workload.poisson(6, 40.0, prompt_len=(3, 20), output_len=(2, 6), seed=1, vocab_size=TINY.vocab_size)
    results = [simulate(workload, CONFIG, CostModel.constant(s, COST.meta)) for s in (0.01, 0.02, 0.04)]
    repeats = Repeats(results)
    fig = compare({"three": repeats, "one": results[0]}, keys=("ttft_p50", "e2e_p90"))
    bars, single = fig.data
    summary = repeats.summary()
    assert list(bars.y) == [summary["ttft_p50"].mean, summary["e2e_p90"].mean]
    assert list(bars.error_y.array) == pytest.approx([summary[k].high - summary[k].mean for k in ("ttft_p50", "e2e_p90")])
    assert list(bars.error_y.arrayminus) == pytest.approx([summary[k].mean - summary[k].low
                                                           for k in ("ttft_p50", "e2e_p90")])
    assert single.error_y.array is None                          # one run: no bar
    assert "95%" in fig.layout.title.text
    lines = sweep({1: repeats, 2: repeats}, keys=("ttft_p50",)).data
    assert list(lines[0].error_y.array) == pytest.approx([summary["ttft_p50"].high - summary["ttft_p50"].mean] * 2)
    assert np.isfinite(list(lines[0].y)).all()
