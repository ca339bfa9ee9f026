"""An honest simulator: a fitted cost model records the range of step shapes it saw, and
simulate() warns (once) and reports the fraction of its steps outside that range."""
import json
import math
import pathlib
import warnings

import pytest

from llmlab import EngineConfig
from llmlab.experiments import CostModel, Workload, simulate
from llmlab.experiments.cost_model import step_features
from llmlab.experiments.fitted_range import ExtrapolationWarning, step_shape
from llmlab.hooks import ScheduledRecord, StepRecord, Trace

H200_MODEL = pathlib.Path(__file__).parents[2] / "notebooks" / "data" / "h200_cost_model_llama3_8b.json"
CONFIG = EngineConfig(device="cpu", block_size=4, num_gpu_blocks=512, max_num_batched_tokens=32, max_num_seqs=8)
# a step time the fit can recover exactly: no outliers, every timed step kept
TRUTH = CostModel({"intercept": 0.004, "prefill_tokens": 2e-4, "decode_tokens": 1e-3, "decode_context": 2e-6,
                   "num_prefills": 5e-4}, {"num_gpu_blocks": 512, "max_model_len": 1024})


def fitting_workload(prompt_len=(4, 30), output_len=(2, 12)) -> Workload:
    return Workload.offline(16, prompt_len=prompt_len, output_len=output_len, seed=3, vocab_size=128)


def fitted_on(workload) -> CostModel:
    """A model fitted on the simulated trace of `workload` (the truth's step times)."""
    trace = simulate(workload, CONFIG, TRUTH, record_trace=True).trace
    return CostModel.fit(trace)


def test_a_fit_records_the_range_of_the_steps_it_kept():
    def step(i, items):
        return StepRecord(step=i, scheduled=items, time=0.01 * (i + 1), timings={"forward": 0.009})

    shapes = [[ScheduledRecord("p", "prefill", 12, 0)],
              [ScheduledRecord("p", "prefill", 20, 12), ScheduledRecord("a", "decode", 1, 40)],
              [ScheduledRecord("a", "decode", 1, 41), ScheduledRecord("b", "decode", 1, 99),
               ScheduledRecord("c", "decode", 1, 7)]]
    steps = [step(0, shapes[0])] + [step(i + 1, items) for i, items in enumerate(shapes)]   # the first step has no gap
    model = CostModel.fit(Trace(steps=steps))
    # by hand: tokens 12 / 21 / 3; sequences 1 / 2 / 3; decode context 0 / 41 / 42 + 100 + 8;
    # prefill attention (thousands of pairs) 12 * 6.5 / 1000, 20 * (12 + 10.5) / 1000, 0
    assert model.fitted_range == {"num_tokens": [3, 21], "num_seqs": [1, 3], "decode_context": [0, 150],
                                  "prefill_attention": [0, pytest.approx(0.45)]}
    for items in shapes:
        assert step_shape(step_features(items))[0] == sum(i.num_tokens for i in items)
    saved = CostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert saved.fitted_range == model.fitted_range


def test_simulate_warns_once_past_the_fitted_range_and_not_on_the_fitting_workload():
    workload = fitting_workload()
    model = fitted_on(workload)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExtrapolationWarning)      # any warning fails the test
        inside = simulate(workload, CONFIG, model)
    assert inside.summary()["outside_fitted_range"] == 0.0
    # the same engine, prompts and outputs three times longer: decodes read far more context
    longer = fitting_workload(prompt_len=(60, 90), output_len=(30, 40))
    with pytest.warns(ExtrapolationWarning) as caught:
        outside = simulate(longer, CONFIG, model, record_trace=True)
    assert len(caught) == 1
    message = str(caught[0].message)
    high = model.fitted_range["decode_context"][1]
    highest = max(step_shape(step_features(s.scheduled))[2] for s in outside.trace.steps)
    assert "decode_context up to" in message and f"{highest / high:.2g}x the fitted maximum" in message
    fraction = outside.summary()["outside_fitted_range"]
    report = outside.meta["fitted_range"]
    assert 0 < fraction <= 1 and fraction == report["num_outside"] / len(outside.steps)
    assert report["dimensions"]["decode_context"]["highest"] == highest


def test_a_model_without_a_fit_has_no_range_and_says_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExtrapolationWarning)
        result = simulate(fitting_workload(prompt_len=(60, 90)), CONFIG, TRUTH)
    assert TRUTH.fitted_range is None and math.isnan(result.summary()["outside_fitted_range"])


def test_the_committed_h200_model_gets_the_range_its_fit_recorded():
    model = CostModel.load(H200_MODEL)
    meta = json.loads(H200_MODEL.read_text())["meta"]
    saved = meta["fit"]
    assert "fitted_range" not in meta                            # saved before ranges were recorded
    # its fit kept the maxima of its terms: two of them are dimensions of the range; the rest is unknown
    assert model.fitted_range == {"num_tokens": None, "num_seqs": None,
                                  "decode_context": [None, saved["max"]["decode_context"]],
                                  "prefill_attention": [None, saved["max"]["prefill_attention"]]}
    bytes_per_block = 2 * 32 * 8 * 128 * 16 * 2
    config = EngineConfig(max_num_batched_tokens=2048, max_num_seqs=256, num_gpu_blocks=60 * 2**30 // bytes_per_block)
    short = Workload.poisson(40, 2.0, prompt_len=(32, 256), output_len=(16, 64), seed=0, vocab_size=128000)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExtrapolationWarning)
        assert simulate(short, config, model).summary()["outside_fitted_range"] == 0.0
    # long prompts and outputs at a high rate: hundreds of decodes over thousands of tokens each
    long = Workload.poisson(300, 20.0, prompt_len=(2000, 4000), output_len=(400, 600), seed=0, vocab_size=128000)
    with pytest.warns(ExtrapolationWarning, match="decode_context up to .* the fitted maximum of 93,918") as caught:
        result = simulate(long, config, model)
    assert len(caught) == 1 and "num_tokens, num_seqs: not recorded" in str(caught[0].message)
    assert result.summary()["outside_fitted_range"] > 0.2


@pytest.mark.parametrize("preset", ["h200", "cpu", "tiny"])
def test_each_calibration_preset_fits_long_decode_contexts(preset):
    # The bursty part alone grows decode context with the number of decodes (the H200 fit of
    # 2026-12-01 left decode_context at 0); its long requests read several times the context
    # with few sequences. Checked on the schedule (a toy clock), not on timings.
    import argparse

    from llmlab.bench import calibrate

    options = calibrate._options(argparse.Namespace(preset=preset))
    config = EngineConfig(max_num_seqs=options["max_num_seqs"], max_num_batched_tokens=options["max_num_batched_tokens"],
                          num_gpu_blocks=20000)
    toy = CostModel.constant(0.01)

    def decode_shapes(options):
        workload = calibrate.fit_workload(options, seed=0, vocab_size=256)
        steps = simulate(workload, config, toy, record_trace=True).trace.steps
        shapes = [step_shape(toy.features(s.scheduled)) for s in steps]
        return [(context, seqs) for _, seqs, context, _ in shapes if context]

    bursty, full = decode_shapes(dict(options, fit_long_requests=0)), decode_shapes(options)
    assert max(c for c, _ in full) >= 2 * max(c for c, _ in bursty)                         # the range reaches further
    assert max(c / n for c, n in full) >= 3 * max(c / n for c, n in bursty)                 # with fewer sequences
    limit = 512 if preset == "tiny" else 8192           # and every request fits the model's context
    assert all(len(r.prompt_token_ids) + r.output_len <= limit for r in calibrate.fit_workload(options, 0, 256))
