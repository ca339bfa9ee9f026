"""`llmlab bench single-forward` refuses a --seq-lens its model cannot hold (issue #34): a
cell runs a prefill of seq_len tokens and then a decode step at context seq_len + 1, so
seq_len must be below the model's context (8,192 for the Llama-3-8B shape). 8192 crashed on
the GPU in the CUDA-graph block-table copy; now it is one line and exit status 2, before
the CUDA check and the minutes it takes to build the random 8B weights."""
from __future__ import annotations

import pytest

from helpers.engine import assert_all_blocks_free, embedded_engine
from llmlab import cli
from llmlab.bench.single_forward import llmlab_cells


@pytest.mark.parametrize("seq_lens, bad", [("8192", "8192"), ("512,9000", "9000"), ("0", "0")])
def test_the_command_refuses_a_length_the_model_cannot_hold(capsys, seq_lens, bad):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "single-forward", "--seq-lens", seq_lens, "--batch-sizes", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"llmlab: error: --seq-lens {bad} "), err
    if bad != "0":
        assert "8191" in err      # the longest it takes


def test_a_cell_is_checked_against_the_engine_before_its_batch_is_built(llm):
    """The engine's own max_model_len binds too (here a small KV cache: 8 blocks, 128 tokens)."""
    engine = embedded_engine(llm, num_gpu_blocks=8)
    assert engine.max_model_len == 128
    with pytest.raises(ValueError, match=r"--seq-lens 128 is too long: .* at most 128 tokens"):
        llmlab_cells(engine, 1, 128, do_prefill=True)
    assert_all_blocks_free(engine)


def test_mixed_steps_time_decodes_with_a_prompt_arriving_each_step_and_leave_nothing_behind(llm):
    """--mixed-prompt-lens: a few whole engine steps of 2 decodes (after 20 prompt tokens) with
    an 8-token prompt arriving before each; every request is gone and every block back after."""
    from llmlab.bench.single_forward import mixed_steps

    engine = embedded_engine(llm, num_gpu_blocks=64)
    for prompt_len in (0, 8):
        assert mixed_steps(engine, 2, 20, prompt_len, steps=3) > 0
        assert not engine.has_unfinished_requests() and not engine.requests
        assert_all_blocks_free(engine)


def test_knob_settings_are_checked_before_anything_is_built(capsys):
    """--knobs: a setting that names no knob (or no value) fails with the knobs' names, before
    the CUDA check and the weights; each value is read as its variable is."""
    from llmlab.kernels import knobs
    from llmlab.kernels.tuning import knobs_set, parse_setting

    for bad in ("fold_norm=1", "fold_norms", "fold_norms="):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["bench", "single-forward", "--batch-sizes", "1", "--knobs", bad])
        assert exit_info.value.code == 2
        assert "use field=value with a field of gemv, fold_norms" in capsys.readouterr().err
    assert parse_setting("fold_norms=1, prefetch_kb=0") == {"fold_norms": True, "prefetch_kb": 0}
    assert parse_setting("gemv=0") == {"gemv": False}
    assert parse_setting("prefill_config=m128-n128-w12-s2-ws") == {"prefill_config": "m128-n128-w12-s2-ws"}
    with pytest.raises(SystemExit) as exit_info:    # a variant's name is checked too, before any weight is built
        cli.main(["bench", "single-forward", "--batch-sizes", "1", "--knobs", "prefill_config=m128-typo"])
    assert exit_info.value.code == 2 and "names no variant" in capsys.readouterr().err
    before = knobs.fold_norms
    with knobs_set({"fold_norms": not before}):
        assert knobs.fold_norms is (not before)
    assert knobs.fold_norms is before
    with pytest.raises(SystemExit):
        cli.main(["bench", "single-forward", "--batch-sizes", "1", "--knobs", "gemv=0", "--tp", "2"])
    assert "tensor parallel" in capsys.readouterr().err
