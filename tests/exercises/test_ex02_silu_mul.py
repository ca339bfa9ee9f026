"""Exercise 02, SwiGLU's silu(gate) * up: what `llmlab.kernels.reference.silu_mul` computes."""
import pytest
import torch

from diagnose import check_rows
from grading import DEVICE, FP32_TOL, check_end_to_end, randn, randn_view
from llmlab.kernels import reference

EXERCISE = "ex02_silu_mul"


@pytest.mark.parametrize("n", [8, 300, 2 * 1024 + 5],
                         ids=["n-8-tiny", "n-300-one-partial-block", "n-2053-ragged-tail"])
def test_matches_reference(ex, n):
    gen = torch.Generator().manual_seed(n)
    x = randn_view(4, 2 * n, gen=gen) * 4  # gates well into silu's curved part, and very negative ones
    check_rows(ex.silu_mul(x), reference.silu_mul(x), case=f"n = {n} outputs per row", tol=FP32_TOL,
               hint="gate = x[..., :n], up = x[..., n:]; the last tile of a row is partial unless n is a "
               "multiple of the block")


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(100) = inf in fp32: fine
def test_extreme_gates(ex):
    x = torch.tensor([[-100.0, -5.0, 0.0, 5.0, 100.0, 2.0, 2.0, 2.0, 2.0, 2.0]], device=DEVICE)  # gates | ups
    check_rows(ex.silu_mul(x), reference.silu_mul(x), case="gates -100 .. 100", tol=FP32_TOL,
               hint="silu(g) = g * sigmoid(g) = g / (1 + exp(-g)): exp(100) is inf in float32, and g / inf "
               "is the right 0; compute in float32")


def test_leading_dims_and_empty(ex):
    x = randn(2, 3, 40, gen=torch.Generator().manual_seed(5))
    check_rows(ex.silu_mul(x), reference.silu_mul(x), case="input [2, 3, 40]", tol=FP32_TOL,
               hint="treat every leading dimension as more rows")
    assert ex.silu_mul(x[:0]).shape == (0, 3, 20)


def test_end_to_end(ex, engine_llm, reference_token_ids):
    """The embedded model, every MLP activation on your kernel: the same greedy text."""
    check_end_to_end(engine_llm, reference_token_ids, "silu_mul", ex.silu_mul)
