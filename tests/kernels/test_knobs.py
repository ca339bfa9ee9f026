"""The fast path's knobs: one table (llmlab/kernels/tuning.py), each field set by its
environment variable, read once."""
import dataclasses

import pytest

import llmlab
from llmlab.kernels import tuning as knobs_module
from llmlab.kernels.tuning import ENVIRONMENT, Knobs


def test_every_knob_has_a_variable_and_a_row_in_the_table():
    fields = [f.name for f in dataclasses.fields(Knobs)]
    assert sorted(ENVIRONMENT) == sorted(fields)
    for name in fields:   # the docstring's table: | field | variable | ...
        assert f"| {name} " in knobs_module.__doc__ and ENVIRONMENT[name] in knobs_module.__doc__, name


def test_variables_set_the_knobs_as_they_always_read():
    assert Knobs.from_environment({}) == Knobs()
    knobs = Knobs.from_environment({"LLMLAB_GEMV": "0", "LLMLAB_SWIGLU_GEMM": "1", "LLMLAB_PREFETCH": "0",
                                    "LLMLAB_Q8_DECODE": "prmt-n128-w4-s2", "LLMLAB_SAMPLE_ROUNDS": "6",
                                    "LLMLAB_PDL": ""})
    assert (knobs.gemv, knobs.swiglu_gemm, knobs.prefetch_kb, knobs.q8_decode, knobs.sample_rounds, knobs.pdl) == (
        False, True, 0, "prmt-n128-w4-s2", 6, True)
    assert Knobs.from_environment({"LLMLAB_SWIGLU_GEMM": "yes"}).swiglu_gemm is False   # only "1" turns it on
    with pytest.raises(ValueError, match="LLMLAB_SAMPLE_BLOCK must be an integer"):
        Knobs.from_environment({"LLMLAB_SAMPLE_BLOCK": "big"})


def test_the_contract_exports_the_one_knobs_object():
    assert llmlab.kernels.knobs is knobs_module.knobs
