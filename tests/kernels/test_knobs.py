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


def test_a_variant_name_from_the_environment_is_checked_when_llmlab_is_imported():
    """A typo in LLMLAB_PREFILL_CONFIG or LLMLAB_Q8_DECODE fails on every machine, at import,
    naming the variable and the variants there are (not first on a GPU, mid-run)."""
    import os
    import subprocess
    import sys

    from llmlab.kernels.triton.prefill_configs import PREFILL_CONFIGS
    from llmlab.kernels.triton.q8_configs import Q8_CONFIGS

    knobs_module.check_variant("prefill_config", "m128-n64-w8-s3-dq", PREFILL_CONFIGS)
    knobs_module.check_variant("q8_decode", None, Q8_CONFIGS)
    for field, catalogue in (("prefill_config", PREFILL_CONFIGS), ("q8_decode", Q8_CONFIGS)):
        with pytest.raises(ValueError, match=f"{ENVIRONMENT[field]}='nonsense' names no variant; known: "):
            knobs_module.check_variant(field, "nonsense", catalogue)
    env = dict(os.environ, LLMLAB_PREFILL_CONFIG="m1-n1")
    done = subprocess.run([sys.executable, "-c", "import llmlab"], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "LLMLAB_PREFILL_CONFIG='m1-n1' names no variant" in done.stderr


def test_the_prefill_scratch_is_reserved_only_where_a_config_makes_one(monkeypatch):
    """The runner's memory profile adds kernels.prefill_scratch_bytes: the dequantize-first
    scratch's cap over an 8-bit cache with a -dq config (the default), nothing otherwise."""
    from llmlab import kernels
    from llmlab.kernels.triton.prefill_attention import DEQUANT_SCRATCH_MAX_BYTES

    monkeypatch.setattr(kernels.knobs, "prefill_config", None)
    assert kernels.prefill_scratch_bytes(True) == DEQUANT_SCRATCH_MAX_BYTES
    assert kernels.prefill_scratch_bytes(False) == 0
    monkeypatch.setattr(kernels.knobs, "prefill_config", "m128-n128-w8-s3")   # converts in the kernel
    assert kernels.prefill_scratch_bytes(True) == 0
