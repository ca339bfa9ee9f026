"""A saved Result keeps its trace (without the block lists), so a cost model can be refitted
from the file alone; to_frame needs pandas, which llmlab does not install, and says so."""
import gzip
import json
import sys

import pytest

from llmlab import LLMEngine
from llmlab.experiments import CostModel, Result, Workload, run, simulate

from helpers.engine import TINY, cpu_engine_config, tiny_model

CONFIG = cpu_engine_config(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=32, max_num_seqs=8)


@pytest.fixture(scope="module")
def measured() -> Result:
    workload = Workload.poisson(8, rate=80.0, prompt_len=(3, 20), output_len=(2, 8), seed=5, vocab_size=TINY.vocab_size)
    return run(workload, LLMEngine(CONFIG, model=tiny_model(seed=3)))


@pytest.mark.parametrize("name", ["result.json", "result.json.gz"])
def test_a_saved_run_refits_the_same_cost_model(measured, tmp_path, name):
    measured.save(tmp_path / name)
    if name.endswith(".gz"):
        with gzip.open(tmp_path / name, "rt") as f:
            assert "trace" in json.load(f)
    loaded = Result.load(tmp_path / name)
    assert loaded.trace is not None and len(loaded.trace.steps) == len(measured.trace.steps)
    assert CostModel.fit(loaded.trace).coefficients == CostModel.fit(measured.trace).coefficients
    assert loaded.summary() == measured.summary() and loaded.meta == measured.meta
    # the block lists (most of a trace's size) are not kept; the schedule and timings are
    assert measured.trace.steps[0].allocated_blocks and not loaded.trace.steps[0].allocated_blocks
    assert [s.scheduled for s in loaded.trace.steps] == [s.scheduled for s in measured.trace.steps]
    assert Result.from_trace(loaded.trace).summary()["num_finished"] == 8


def test_save_without_the_trace_and_a_result_that_has_none(measured, tmp_path):
    measured.save(tmp_path / "bare.json", trace=False)
    assert Result.load(tmp_path / "bare.json").trace is None
    simulated = simulate(Workload.offline(3, 8, 4, vocab_size=TINY.vocab_size), CONFIG,
                         CostModel.constant(0.01, {"num_gpu_blocks": 64}))
    simulated.save(tmp_path / "simulated.json")
    assert simulated.trace is None and Result.load(tmp_path / "simulated.json").trace is None


def test_to_frame_without_pandas_says_it_is_optional(measured, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)         # import pandas now fails, installed or not
    with pytest.raises(ImportError, match=r"needs pandas, which is optional.*pip install pandas.*to_rows\(\)"):
        measured.to_frame()
    rows = measured.to_rows()
    assert len(rows) == 8 and rows[0]["ttft"] == measured.requests[0].ttft
