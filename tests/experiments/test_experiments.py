"""llmlab.experiments: workloads, metrics, the cost model, and a simulator that schedules
exactly as the real engine does."""
import json
import math

import numpy as np
import pytest

from llmlab import EngineConfig, LLMEngine, Trace
from llmlab.experiments import CostModel, Result, Workload, engine_meta, read_lengths, run, simulate
from llmlab.experiments.cost_model import FEATURES, step_features
from llmlab.hooks import RequestAdded, RequestFinished, ScheduledRecord, StepRecord

from helpers.engine import TINY, cpu_engine_config, tiny_model

MODEL = tiny_model(seed=3)


def config_with(**overrides) -> EngineConfig:
    config = dict(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=32, max_num_seqs=8, swap_space=0.001)
    config.update(overrides)
    return cpu_engine_config(**config)


def schedule_of(trace: Trace) -> list:
    """Per step: what ran (request, kind, tokens, first position), who was preempted / swapped."""
    return [([(x.request_id, x.kind, x.num_tokens, x.start_position) for x in s.scheduled],
             s.preempted, s.swapped_out, s.swapped_in) for s in trace.steps]


# ---- workloads ---------------------------------------------------------------------------------
def test_poisson_arrivals_have_the_asked_rate_and_exponential_gaps():
    workload = Workload.poisson(4000, rate=5.0, seed=1)
    gaps = np.diff([r.arrival_time for r in workload])
    # the mean gap of 4000 exponential gaps is within 1/sqrt(4000) = 1.6% of 1/rate (1 sigma)
    assert workload.requests[0].arrival_time == 0.0
    assert abs(gaps.mean() * 5.0 - 1) < 0.06
    assert abs(gaps.std() / gaps.mean() - 1) < 0.08          # exponential: cv = 1


def test_gamma_arrivals_are_burstier_at_the_same_rate():
    workload = Workload.gamma(20000, rate=10.0, cv=3.0, seed=2)
    gaps = np.diff([r.arrival_time for r in workload])
    assert abs(gaps.mean() * 10.0 - 1) < 0.08
    assert abs(gaps.std() / gaps.mean() - 3.0) < 0.3


def test_offline_workload_arrives_at_once_and_lengths_follow_their_spec():
    workload = Workload.offline(300, prompt_len=(5, 9), output_len=[3, 30], seed=0, vocab_size=100)
    assert all(r.arrival_time == 0 for r in workload) and math.isinf(workload.rate)
    assert {len(r.prompt_token_ids) for r in workload} == {5, 6, 7, 8, 9}     # inclusive range
    assert {r.output_len for r in workload} == {3, 30}
    assert all(16 <= t < 100 for r in workload for t in r.prompt_token_ids)
    fixed = Workload.offline(3, prompt_len=7, output_len=2)
    assert [len(r.prompt_token_ids) for r in fixed] == [7, 7, 7] and [r.output_len for r in fixed] == [2, 2, 2]


def test_workloads_are_reproducible_from_their_seed():
    a, b = Workload.poisson(50, 3.0, (4, 40), (1, 9), seed=7), Workload.poisson(50, 3.0, (4, 40), (1, 9), seed=7)
    c = Workload.poisson(50, 3.0, (4, 40), (1, 9), seed=8)
    assert a == b and a != c


def test_shared_prefix_groups_share_exactly_their_prefix():
    workload = Workload.shared_prefix(num_groups=3, requests_per_group=4, prefix_len=20, suffix_len=(1, 5), seed=0)
    prefixes = {tuple(r.prompt_token_ids[:20]) for r in workload}
    assert len(workload) == 12 and len(prefixes) == 3
    assert all(sum(tuple(r.prompt_token_ids[:20]) == p for r in workload) == 4 for p in prefixes)


def test_jsonl_round_trip_and_other_line_formats(tmp_path):
    workload = Workload.gamma(20, 2.0, 2.0, (3, 30), (1, 9), seed=3).with_priorities([i % 3 for i in range(20)])
    workload.save_jsonl(tmp_path / "w.jsonl")
    assert Workload.from_jsonl(tmp_path / "w.jsonl") == workload

    class Chars:   # a tokenizer: one token per character
        def encode(self, text):
            return [ord(c) for c in text]

    lines = [{"prompt": "hi there", "output_len": 3, "arrival_time": 1.5},
             {"prompt_len": 12, "output_len": 2}]
    (tmp_path / "text.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    loaded = Workload.from_jsonl(tmp_path / "text.jsonl", tokenizer=Chars())
    assert [r.arrival_time for r in loaded] == [0.0, 1.5]                   # sorted by arrival
    assert loaded.requests[1].prompt_token_ids == Chars().encode("hi there")
    assert len(loaded.requests[0].prompt_token_ids) == 12
    with pytest.raises(ValueError, match="tokenizer"):
        Workload.from_jsonl(tmp_path / "text.jsonl")
    # a length distribution read from a dump: every drawn length is one of the file's
    assert read_lengths(tmp_path / "text.jsonl") == [3, 2]
    drawn = Workload.offline(50, output_len=read_lengths(tmp_path / "text.jsonl"), seed=1)
    assert {r.output_len for r in drawn} == {2, 3}


# ---- metrics on a trace built by hand ---------------------------------------------------------------
def hand_built_trace() -> Trace:
    """Three requests: "a" at t=100.0 (3 tokens at 100.5, 100.7, 100.9), "b" at 100.2 (2 tokens at
    100.7, 101.3, preempted once at 100.9), "c" at 100.4 (1 token at 101.3)."""
    def step(i, time, scheduled, sampled, finished=(), preempted=()):
        return StepRecord(step=i, time=time, timings={"forward": 0.1},
                          scheduled=[ScheduledRecord(rid, kind, n, 0) for rid, kind, n in scheduled],
                          sampled={rid: 1 for rid in sampled}, finished={rid: "length" for rid in finished},
                          preempted=list(preempted))
    steps = [step(0, 100.5, [("a", "prefill", 8)], ["a"]),
             step(1, 100.7, [("b", "prefill", 4), ("a", "decode", 1)], ["b", "a"]),
             step(2, 100.9, [("a", "decode", 1)], ["a"], finished=["a"], preempted=["b"]),
             step(3, 101.3, [("b", "prefill", 5), ("c", "prefill", 6)], ["b", "c"], finished=["b", "c"])]
    added = [RequestAdded("a", 8, 100.0), RequestAdded("b", 4, 100.2), RequestAdded("c", 6, 100.4)]
    finished = [RequestFinished("a", "length", 3, 100.9), RequestFinished("b", "length", 2, 101.3),
                RequestFinished("c", "length", 1, 101.3)]
    return Trace(steps=steps, added=added, finished=finished)


def test_metrics_of_a_hand_built_trace():
    result = Result.from_trace(hand_built_trace())
    a, b, c = result.requests
    assert [r.request_id for r in result.requests] == ["a", "b", "c"]
    assert a.ttft == pytest.approx(0.5) and b.ttft == pytest.approx(0.5) and c.ttft == pytest.approx(0.9)
    assert a.tpot == pytest.approx(0.2) and b.tpot == pytest.approx(0.6) and c.tpot is None   # one token: no TPOT
    assert a.e2e == pytest.approx(0.9) and b.e2e == pytest.approx(1.1) and c.e2e == pytest.approx(0.9)
    assert [r.num_preemptions for r in (a, b, c)] == [0, 1, 0]
    assert a.first_scheduled == pytest.approx(0.4) and b.first_scheduled == pytest.approx(0.6)   # end - 0.1 s
    summary = result.summary(slo={"ttft": 0.6, "tpot": 0.3})
    assert summary["ttft_p50"] == pytest.approx(0.5) and summary["ttft_p90"] == pytest.approx(0.82)   # 0.5 + 0.8 * 0.4
    assert summary["tpot_p50"] == pytest.approx(0.4) and summary["tpot_p90"] == pytest.approx(0.56)   # of 0.2 and 0.6
    assert summary["e2e_p50"] == pytest.approx(0.9) and summary["e2e_p90"] == pytest.approx(1.06)
    assert summary["itl_p50"] == pytest.approx(0.2) and summary["itl_p90"] == pytest.approx(0.52)   # 0.2, 0.2, 0.6
    assert summary["duration_s"] == pytest.approx(1.3)
    assert summary["output_tok_s"] == pytest.approx(6 / 1.3)
    assert summary["slo_attainment"] == pytest.approx(1 / 3)       # b's TPOT and c's TTFT miss
    assert summary["goodput_req_s"] == pytest.approx(1 / 1.3)
    assert summary["num_preemptions"] == 1
    # arrivals given on the trace's clock win over when requests were added
    later = Result.from_trace(hand_built_trace(), arrivals={"a": 99.5}, origin=99.0)
    assert later.requests[0].ttft == pytest.approx(1.0) and later.requests[0].arrival == pytest.approx(0.5)


def test_result_json_round_trip(tmp_path):
    result = Result.from_trace(hand_built_trace(), meta={"kind": "run"})
    result.save(tmp_path / "r.json")
    loaded = Result.load(tmp_path / "r.json")
    assert loaded.summary() == result.summary() and loaded.meta == {"kind": "run"}
    assert [row["tpot"] for row in loaded.to_rows()] == [r.tpot for r in result.requests]


# ---- the cost model --------------------------------------------------------------------------------
def test_cost_model_fit_recovers_a_known_linear_step_time(tmp_path):
    truth = {"intercept": 0.004, "mixed": 0.002, "prefill_tokens": 2e-5, "decode_tokens": 1e-4,
             "decode_context": 1e-7, "num_prefills": 0.001}
    rng = np.random.default_rng(0)
    steps, clock = [], 0.0
    for i in range(300):
        scheduled = [ScheduledRecord(str(j), "decode", 1, int(rng.integers(10, 2000)))
                     for j in range(rng.integers(1, 64))]
        for j in range(i % 3):    # 0, 1 or 2 prompt chunks: "mixed" and "num_prefills" part ways
            scheduled.insert(0, ScheduledRecord(f"p{j}", "prefill", int(rng.integers(16, 512)), 0))
        seconds = float(np.dot([truth.get(f, 0.0) for f in FEATURES], step_features(scheduled)))
        seconds *= 1 + rng.normal(0, 0.01)           # 1% timing noise
        clock += seconds
        steps.append(StepRecord(step=i, scheduled=scheduled, time=clock, timings={"forward": seconds * 0.95}))
    steps[50].time += 0.5                            # an idle gap: not a step's time
    for later in steps[51:]:
        later.time += 0.5
    model = CostModel.fit(Trace(steps=steps, meta={"engine": {"num_gpu_blocks": 99}}))
    for name, value in truth.items():
        assert model.coefficients[name] == pytest.approx(value, rel=0.1), name
    assert model.meta["num_gpu_blocks"] == 99 and model.meta["fit"]["median_relative_error"] < 0.02
    model.save(tmp_path / "cost.json")
    loaded = CostModel.load(tmp_path / "cost.json")
    assert loaded.coefficients == model.coefficients and loaded.step_time(steps[3].scheduled) == model.step_time(steps[3].scheduled)


# ---- simulate schedules as the engine does ---------------------------------------------------------------
@pytest.mark.parametrize("overrides", [dict(), dict(preemption_mode="swap"),
                                       dict(enable_chunked_prefill=False, max_num_batched_tokens=64),
                                       dict(enable_prefix_caching=False)])   # on by default
def test_simulate_with_a_constant_cost_gives_the_engines_schedule(overrides):
    # 24 KV blocks of 4 tokens for 10 requests of up to 40 + 24 tokens: preemptions happen
    config = config_with(num_gpu_blocks=24, **overrides)
    engine = LLMEngine(config, model=MODEL)
    workload = Workload.shared_prefix(5, 2, prefix_len=12, suffix_len=(1, 28), output_len=(4, 24), seed=4,
                                      vocab_size=TINY.vocab_size)
    measured = run(workload, engine)       # its warm-up request leaves nothing in the prefix cache
    simulated = simulate(workload, config, CostModel.constant(0.01, engine_meta(engine)), record_trace=True)
    assert sum(len(s.preempted) + len(s.swapped_out) for s in measured.trace.steps) > 0
    assert schedule_of(simulated.trace) == schedule_of(measured.trace)
    assert [r.num_output_tokens for r in simulated.requests] == [r.output_len for r in workload]
    assert [r.num_preemptions for r in simulated.requests] == [r.num_preemptions for r in measured.requests]
    stats = engine.kv_stats()
    assert stats["free_device_blocks"] == stats["total_device_blocks"] and not engine.requests


def test_run_measures_every_request_on_the_wall_clock():
    engine = LLMEngine(config_with(), model=MODEL)
    workload = Workload.poisson(8, rate=100.0, prompt_len=(3, 20), output_len=(1, 6), seed=5,
                                vocab_size=TINY.vocab_size)
    result = run(workload, engine)
    assert [r.num_output_tokens for r in result.requests] == [r.output_len for r in workload]
    for r, w in zip(result.requests, workload):
        assert r.arrival == pytest.approx(w.arrival_time)
        assert r.arrival <= r.first_scheduled <= r.first_token <= r.finish
        assert list(r.token_times) == sorted(r.token_times)
    summary = result.summary()
    assert summary["num_finished"] == 8 and summary["output_tok_s"] > 0
    assert result.trace.meta["engine"]["num_gpu_blocks"] == 64 and not engine.has_unfinished_requests()
    assert result.trace.meta["machine"] == result.meta["machine"]    # a cost model fitted on it says where


def test_each_run_starts_from_a_cold_prefix_cache():
    # prefix caching is on by default: without a reset, a second run of the same workload on
    # the same engine would find every prompt computed, and compare as a faster policy
    engine = LLMEngine(config_with(), model=MODEL)
    workload = Workload.offline(4, prompt_len=(9, 20), output_len=2, seed=8, vocab_size=TINY.vocab_size)
    first, second = run(workload, engine), run(workload, engine)
    assert engine.block_manager.cached_blocks                # a run leaves its prompts cached
    assert not any(s.prefix_hit_tokens for s in second.trace.steps)
    assert schedule_of(second.trace) == schedule_of(first.trace)


# ---- policies ---------------------------------------------------------------------------------------
def finish_order(result: Result) -> list[str]:
    return [r.request_id for r in sorted(result.requests, key=lambda r: r.finish)]


def test_policies_change_who_goes_first():
    # one sequence at a time: the policy alone decides the order requests are served in
    config = config_with(max_num_seqs=1, max_num_batched_tokens=64)
    cost = CostModel.constant(0.01, {"num_gpu_blocks": 64, "max_model_len": 256})
    workload = Workload.offline(6, prompt_len=(2, 40), output_len=(1, 12), seed=6)
    prompt_lens = {r.request_id: len(r.prompt_token_ids) for r in workload}
    output_lens = {r.request_id: r.output_len for r in workload}
    assert finish_order(simulate(workload, config, cost, "fcfs")) == [r.request_id for r in workload]
    assert finish_order(simulate(workload, config, cost, "shortest_prompt_first")) == sorted(
        prompt_lens, key=lambda rid: (prompt_lens[rid], int(rid)))
    assert finish_order(simulate(workload, config, cost, "shortest_output_first")) == sorted(
        output_lens, key=lambda rid: (output_lens[rid], int(rid)))
    ranked = workload.with_priorities([2, 0, 1, 0, 2, 1])
    assert finish_order(simulate(ranked, config, cost, "priority")) == ["1", "3", "2", "5", "0", "4"]
    # the real engine takes the same policy
    engine = LLMEngine(config, model=MODEL)
    small = Workload.offline(4, prompt_len=(2, 40), output_len=2, seed=6, vocab_size=TINY.vocab_size)
    lens = {r.request_id: len(r.prompt_token_ids) for r in small}
    assert finish_order(run(small, engine, "shortest_prompt_first")) == sorted(lens, key=lambda r: (lens[r], int(r)))
    assert engine.scheduler.policy.__name__ == "fcfs"     # run() puts the engine's own policy back


def test_priority_preempts_the_less_important_requests():
    # 8 requests grow to 8 blocks each; 40 blocks hold the 4 important ones, not all 8
    config = config_with(num_gpu_blocks=40, max_num_batched_tokens=64)
    cost = CostModel.constant(0.01, {"num_gpu_blocks": 40, "max_model_len": 256})
    workload = Workload.offline(8, prompt_len=8, output_len=24, seed=7).with_priorities([1, 0] * 4)
    ranked = simulate(workload, config, cost, "priority")
    victims = {r.request_id for r in ranked.requests if r.num_preemptions}
    assert victims and all(int(rid) % 2 == 0 for rid in victims)       # priority 1 only
    fcfs = simulate(workload, config, cost, "fcfs")                    # the newest go, whatever their priority
    assert any(int(r.request_id) % 2 == 1 for r in fcfs.requests if r.num_preemptions)
    important = [r.e2e for r in ranked.requests if r.priority == 0]
    others = [r.e2e for r in ranked.requests if r.priority == 1]
    assert max(important) <= min(others) and np.mean(important) < np.mean(others)


# ---- bad input ------------------------------------------------------------------------------------
def test_bad_input_raises_a_clear_error():
    cost = CostModel.constant(0.01, {"num_gpu_blocks": 64})
    for rate in (-1.0, 0.0, float("nan")):
        with pytest.raises(ValueError, match="rate must be positive"):
            Workload.poisson(10, rate)
    with pytest.raises(ValueError, match="empty workload"):
        Workload.poisson(0, 1.0)
    with pytest.raises(ValueError, match="workload is empty"):
        simulate(Workload([]), config_with(), cost)
    with pytest.raises(ValueError, match="workload is empty"):
        run(Workload([]), LLMEngine(config_with(), model=MODEL))
    with pytest.raises(ValueError, match="unknown policy 'lifo'"):
        simulate(Workload.offline(2), config_with(), cost, policy="lifo")
    with pytest.raises(ValueError, match="prompt_len must be"):
        Workload.offline(2, prompt_len=0)
    with pytest.raises(ValueError, match="low > high"):
        Workload.offline(2, output_len=(9, 3))
    with pytest.raises(ValueError, match="unknown SLO key"):
        Result.from_trace(hand_built_trace()).summary(slo={"latency": 1.0})
    with pytest.raises(ValueError, match="max_model_len"):
        simulate(Workload.offline(1, prompt_len=300), config_with(max_model_len=256), cost)
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        simulate(Workload.offline(1), EngineConfig(), CostModel.constant(0.01))
    with pytest.raises(ValueError, match="unknown cost-model term"):
        CostModel({"flops": 1.0})


# ---- the calibration command and the figures ----------------------------------------------------------------
@pytest.mark.slow
def test_bench_calibrate_writes_a_cost_model_and_a_report(tmp_path):
    import argparse

    from llmlab.bench import calibrate
    from llmlab.cli import BENCHMARKS

    assert BENCHMARKS["calibrate"] == "llmlab.bench.calibrate"     # `llmlab bench calibrate ...`
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    calibrate.main(parser.parse_args(["--preset", "tiny", "--fit-requests", "12", "--fit-long-requests", "2",
                                      "--predict-requests", "8", "--out", str(tmp_path),
                                      "--policy", "shortest_prompt_first"]))
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["policy"] == "shortest_prompt_first"     # both runs and the simulation ran it
    assert Result.load(tmp_path / "predict_simulated.json").meta["policy"] == "shortest_prompt_first"
    assert set(report["relative_error"]) >= {"ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"}
    errors = report["predict_step_error"]
    assert set(errors) == {"median", "p90", "bias"} and abs(errors["bias"]) <= errors["p90"]
    cost = CostModel.load(tmp_path / "cost_model.json")
    assert cost.meta["num_gpu_blocks"] == 512 and cost.meta["fit"]["num_steps"] > 0
    assert Result.load(tmp_path / "predict_simulated.json").summary()["num_finished"] == 8
    trace = calibrate.load_trace(tmp_path / "fit_trace.json.gz")
    # the tiny preset profiles its matrix products: the model keeps the profile, and refits the same from it
    assert cost.profile is not None and cost.profile.rows[-1] == report["options"]["max_num_batched_tokens"]
    assert len(trace.added) == 14 and CostModel.fit(trace, profile=cost.profile).coefficients == cost.coefficients
    assert {a.request_id for a in trace.added} >= {"long-0", "long-1"}       # the long requests, after the bursty ones
    assert cost.fitted_range["decode_context"][1] > 0
    assert 0 <= report["simulated"]["outside_fitted_range"] <= 1       # the report says how much it extrapolated
    assert report["without_profile"]["cost_model"]["coefficients"] == CostModel.fit(trace).coefficients


def test_figures_draw_what_the_results_hold():
    from llmlab.experiments import compare, latency_cdf, prediction_error, request_timeline, step_timeline

    result = Result.from_trace(hand_built_trace())
    other = Result.from_trace(hand_built_trace(), arrivals={"a": 99.9})
    fig = latency_cdf({"one": result, "two": other}, metrics=("ttft",))
    assert [list(t.x) for t in fig.data] == [sorted(r.ttft for r in res.requests) for res in (result, other)]
    assert all(t.y[-1] == 1.0 for t in fig.data)
    bars = {t.name: t for t in request_timeline(result).data}
    assert list(bars["decode"].base) == [r.first_token for r in result.requests]
    assert list(bars["preempted (count)"].y) == ["b"]
    assert list(step_timeline(result).data[1].y) == [0, 1, 1, 0]         # decode tokens per step
    assert list(compare([result, other]).data[1].y)[0] == other.summary()["ttft_p50"]
    assert list(prediction_error(result, result).data[0].y) == [0.0] * 6
    # a measured run says which machine measured it, and that it was busy
    busy = Result.from_trace(hand_built_trace(), meta={"kind": "run", "machine": {
        "device": "Some CPU", "cores": 2, "torch_threads": 1, "load": 7.5, "gpu": False}})
    note = latency_cdf(busy).layout.title.text          # under the title, above the subplot titles
    assert "Some CPU" in note and "BUSY" in note
