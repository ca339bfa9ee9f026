"""Exercise 01, fused residual RMSNorm: what `llmlab.kernels.reference.rms_norm` computes."""
import pytest
import torch

from diagnose import check_rows
from grading import FP32_TOL, check_end_to_end, randn, randn_view
from llmlab.kernels import reference

EXERCISE = "ex01_rms_norm"


@pytest.mark.parametrize("hidden_size", [576, 64, 1000], ids=["hidden-576-smollm2", "hidden-64", "hidden-1000-ragged"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_matches_reference(ex, hidden_size, with_residual):
    gen = torch.Generator().manual_seed(hidden_size)
    x = randn_view(5, hidden_size, gen=gen)
    weight = randn_view(hidden_size, gen=gen)
    residual = randn_view(5, hidden_size, gen=gen) if with_residual else None
    actual = ex.rms_norm(x, weight, 1e-5, residual)
    expected = reference.rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        assert isinstance(actual, tuple) and len(actual) == 2, "with a residual, return (out, x + residual)"
        check_rows(actual[1], expected[1], case=f"hidden size {hidden_size}, the second output x + residual",
                   tol=FP32_TOL, hint="with a residual the kernel first adds it, returns the sum and "
                   "normalises the sum")
        actual, expected = actual[0], expected[0]
    check_rows(actual, expected, case=f"hidden size {hidden_size}, {'with' if with_residual else 'no'} residual",
               tol=FP32_TOL, hint="one program per row; a hidden size that is not a power of two (576, 1000) "
               "needs the lanes past its end masked, in the load and in the mean of the squares")


def test_large_values_and_other_eps(ex):
    gen = torch.Generator().manual_seed(1)
    x, weight = randn(3, 96, gen=gen, scale=1000.0), randn(96, gen=gen)
    check_rows(ex.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), case="values near 1000, eps 1e-6",
               tol=FP32_TOL, hint="use the eps argument, and accumulate the squares in float32")


def test_leading_dims_and_empty(ex):
    gen = torch.Generator().manual_seed(2)
    x, weight = randn(2, 3, 64, gen=gen), randn(64, gen=gen)
    check_rows(ex.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), case="input [2, 3, 64]",
               tol=FP32_TOL, hint="treat every leading dimension as more rows")
    assert ex.rms_norm(x[:0, 0], weight, 1e-5).shape == (0, 64)


def test_end_to_end(ex, engine_llm, reference_token_ids):
    """The embedded model, every RMSNorm on your kernel: the same greedy text."""
    check_end_to_end(engine_llm, reference_token_ids, "rms_norm", ex.rms_norm)
