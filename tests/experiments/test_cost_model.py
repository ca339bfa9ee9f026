"""The cost model's profiled term: a table of the matrix products' time by rows (DenseProfile),
interpolated, fitted as the `dense` term, saved with the model; models saved before it
predict as they did."""
import json
import pathlib

import numpy as np
import pytest
import torch

from llmlab.experiments import CostModel
from llmlab.experiments.cost_model import FEATURES, step_features
from llmlab.experiments.dense_profile import DENSE_ROWS, DenseProfile, interpolate, profile_rows
from llmlab.hooks import ScheduledRecord, StepRecord, Trace
from llmlab.model.llama import LlamaModel

from helpers.engine import TINY

H200_MODEL = pathlib.Path(__file__).parents[2] / "notebooks" / "data" / "h200_cost_model_llama3_8b.json"

# a CPU-like table: 2 rows cost more than 1 or 3-6 (oneDNN's kernel choice), compute-bound past 8
PROFILE = DenseProfile(rows=[1, 2, 3, 4, 5, 6, 7, 8, 16, 64],
                       layer_seconds=[0.039, 0.050, 0.040, 0.038, 0.034, 0.037, 0.042, 0.047, 0.060, 0.150],
                       head_rows=[1, 2, 3, 4, 8], head_seconds=[0.008, 0.013, 0.008, 0.008, 0.009])


def decodes(n, context=100):
    return [ScheduledRecord(f"d{i}", "decode", 1, context) for i in range(n)]


def test_interpolate_is_exact_on_the_grid_linear_between_and_past_the_end():
    rows, seconds = [1, 2, 4, 8], [1.0, 3.0, 2.0, 6.0]
    assert [interpolate(rows, seconds, r) for r in rows] == seconds
    assert interpolate(rows, seconds, 3) == pytest.approx(2.5)
    assert interpolate(rows, seconds, 6) == pytest.approx(4.0)
    assert interpolate(rows, seconds, 12) == pytest.approx(6.0 + 4 * (6.0 - 2.0) / 4)   # the last two's line
    assert interpolate(rows, seconds, 0) == 0.0


def test_profile_rows_measure_every_decode_batch_then_coarser_up_to_the_budget():
    rows = profile_rows(256)
    assert rows[:DENSE_ROWS] == list(range(1, DENSE_ROWS + 1)) and rows[-1] == 256
    gaps = np.diff(rows[DENSE_ROWS - 1:])
    assert (gaps >= 8).all() and (np.array(rows[DENSE_ROWS:]) <= 1.5 * np.array(rows[DENSE_ROWS - 1:-1]) + 8).all()
    assert profile_rows(5) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError):
        profile_rows(0)


def test_dense_feature_is_the_profile_at_the_steps_tokens_and_sequences():
    # 2 decodes and a 10-token chunk: 12 rows through the layers, 3 sequences' last tokens through the head
    items = decodes(2) + [ScheduledRecord("p", "prefill", 10, 0)]
    dense = step_features(items, profile=PROFILE)[FEATURES.index("dense")]
    assert dense == pytest.approx(0.047 + (0.060 - 0.047) * 4 / 8 + 0.008)
    assert step_features(items)[FEATURES.index("dense")] == 0.0          # no profile, no term
    assert step_features(decodes(2), profile=PROFILE)[FEATURES.index("dense")] == pytest.approx(0.050 + 0.013)


def trace_of(step_time, shapes, noise=0.01, seed=0) -> Trace:
    rng = np.random.default_rng(seed)
    steps, clock = [], 0.0
    for i, items in enumerate(shapes):
        seconds = step_time(items) * (1 + rng.normal(0, noise))
        clock += seconds
        steps.append(StepRecord(step=i, scheduled=items, time=clock, timings={"forward": seconds * 0.95}))
    return Trace(steps=steps, meta={"engine": {"num_gpu_blocks": 99}})


def test_fit_with_a_profile_follows_a_step_time_no_line_fits():
    # the engine's step: its matrix products as profiled, plus 3 ms and 0.2 ms per decode
    def truth(items):
        return step_features(items, profile=PROFILE)[FEATURES.index("dense")] + 0.003 + 0.0002 * len(items)

    # fitted where a calibration workload has its steps (1, 2 and 7-16 sequences) ...
    fit_shapes = [decodes(n, 50 + 7 * i) for i in range(40) for n in (1, 2, 7, 8, 10, 12, 16)]
    trace = trace_of(truth, fit_shapes)
    profiled, linear = CostModel.fit(trace, profile=PROFILE), CostModel.fit(trace)
    assert profiled.coefficients["dense"] == pytest.approx(1.0, rel=0.05)
    assert linear.coefficients["dense"] == 0.0 and linear.profile is None
    # ... and asked about 3-6 sequences, which it never saw: 3 decodes cost less than 2
    linear_errors = []
    for n in (3, 4, 5, 6):
        step = decodes(n, 300)
        assert profiled.step_time(step) == pytest.approx(truth(step), rel=0.03), n
        linear_errors.append(abs(linear.step_time(step) - truth(step)) / truth(step))
    assert max(linear_errors) > 0.15       # a line through 1, 2 and 7-16 overshoots 5 sequences
    assert profiled.step_time(decodes(3)) < profiled.step_time(decodes(2))


def test_a_profiled_model_saves_and_loads_with_its_profile(tmp_path):
    trace = trace_of(lambda items: 0.01 + step_features(items, profile=PROFILE)[FEATURES.index("dense")],
                     [decodes(n) for n in range(1, 17)] * 3)
    model = CostModel.fit(trace, profile=PROFILE)
    model.save(tmp_path / "cost.json")
    assert json.loads((tmp_path / "cost.json").read_text())["dense_profile"]["rows"] == PROFILE.rows
    loaded = CostModel.load(tmp_path / "cost.json")
    assert loaded.profile == PROFILE and loaded.coefficients == model.coefficients
    for n in (1, 2, 3, 9, 40):
        assert loaded.step_time(decodes(n)) == model.step_time(decodes(n))
    with pytest.raises(ValueError, match="no DenseProfile"):
        CostModel({"intercept": 0.01, "dense": 1.0})


def test_the_h200_model_saved_before_the_dense_term_predicts_as_it_did():
    data = json.loads(H200_MODEL.read_text())
    assert "dense" not in data["coefficients"] and "dense_profile" not in data
    model = CostModel.load(H200_MODEL)
    assert model.profile is None and model.coefficients["dense"] == 0.0
    c = data["coefficients"]
    for items in (decodes(64, 1000), [ScheduledRecord("p", "prefill", 512, 256)] + decodes(8, 40)):
        # the terms it was saved with, by hand
        prefills = [i for i in items if i.kind == "prefill"]
        expected = (c["intercept"] + c["mixed"] * bool(prefills)
                    + c["prefill_tokens"] * sum(i.num_tokens for i in prefills)
                    + c["decode_tokens"] * (len(items) - len(prefills))
                    + c["decode_context"] * sum(i.start_position + 1 for i in items if i.kind == "decode")
                    + c["prefill_attention"] * sum(i.num_tokens * (i.start_position + (i.num_tokens + 1) / 2) / 1000
                                                   for i in prefills)
                    + c["num_prefills"] * len(prefills))
        assert model.step_time(items) == pytest.approx(expected, rel=1e-12)


def test_measure_times_every_row_count_of_a_real_model():
    config = TINY
    model = LlamaModel.random(config, torch.float32, "cpu", seed=0)
    profile = DenseProfile.measure(model, max_tokens=40, max_sequences=6, repeats=2)
    assert profile.rows == profile_rows(40) and profile.head_rows == [1, 2, 3, 4, 5, 6]
    assert len(profile.layer_seconds) == len(profile.rows) and len(profile.head_seconds) == 6
    assert all(s > 0 for s in profile.layer_seconds + profile.head_seconds)
    assert DenseProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


def test_simulate_times_its_steps_as_the_profiled_model_times_a_recorded_trace():
    # the simulator reads plan items, a fit reads trace records: the same step must get the same time
    from llmlab import EngineConfig
    from llmlab.experiments import Workload, simulate

    model = CostModel({"intercept": 0.002, "decode_context": 1e-6, "prefill_tokens": 1e-5, "dense": 1.0},
                      {"num_gpu_blocks": 64, "max_model_len": 256}, PROFILE)
    config = EngineConfig(device="cpu", block_size=4, num_gpu_blocks=64, max_num_batched_tokens=32, max_num_seqs=8)
    workload = Workload.poisson(12, rate=50.0, prompt_len=(3, 40), output_len=(2, 12), seed=1, vocab_size=128)
    result = simulate(workload, config, model, record_trace=True)
    steps = [s for s in result.trace.steps if s.scheduled]
    assert len({len(s.scheduled) for s in steps}) > 3          # batches of several sizes
    for step in steps:
        assert step.timings["forward"] == pytest.approx(model.step_time(step.scheduled), rel=1e-12)


def test_a_fitted_model_says_where_its_traces_were_recorded():
    # a figure of a simulation names where its cost model was recorded ("unknown machine" was
    # all a model fitted seconds earlier could say)
    from llmlab.machine import recorded_on

    shapes = [decodes(n) for n in range(1, 9)] * 3
    trace = trace_of(lambda items: 0.01 + 0.001 * len(items), shapes)        # a Recorder's trace: no machine
    assert CostModel.fit(trace).meta["recorded_on"] == recorded_on("cpu")    # this process recorded it
    trace.meta["machine"] = {"device": "Some CPU", "cores": 64, "torch_threads": 8, "torch": "9.9", "gpu": False}
    assert CostModel.fit(trace).meta["recorded_on"] == "CPU (64 cores), torch 9.9, 8 threads"   # run()'s record
    trace.meta["recorded_on"] = "NVIDIA H200, torch 9.9, Triton 9.9"                           # a saved trace's
    assert CostModel.fit(trace).meta["recorded_on"] == "NVIDIA H200, torch 9.9, Triton 9.9"
