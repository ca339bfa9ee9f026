"""Exercise 05, online softmax: the same as `torch.softmax(x, dim=-1)`."""
import pytest
import torch

from grading import DEVICE, FP32_TOL, randn, randn_view

EXERCISE = "ex05_online_softmax"


@pytest.mark.parametrize("num_cols", [1, 64, 100, 1000])  # one column; one full tile; a ragged tail; many tiles
def test_matches_softmax(ex, num_cols):
    x = randn_view(5, num_cols, gen=torch.Generator().manual_seed(num_cols)) * 5
    torch.testing.assert_close(ex.online_softmax(x), torch.softmax(x, dim=-1), **FP32_TOL)


def test_no_overflow(ex):
    """exp(1000) overflows float32: only a softmax that subtracts the max survives this."""
    x = randn(3, 300, gen=torch.Generator().manual_seed(1), scale=1000.0)
    torch.testing.assert_close(ex.online_softmax(x), torch.softmax(x, dim=-1), **FP32_TOL)


def test_max_in_a_later_tile(ex):
    """Rising rows: every tile raises the running max, so every tile needs the rescale."""
    x = torch.linspace(-50, 50, 500, device=DEVICE).repeat(2, 1)
    x[1] = x[1].flip(0)  # and falling: the max comes first
    torch.testing.assert_close(ex.online_softmax(x), torch.softmax(x, dim=-1), **FP32_TOL)


def test_minus_infinity_entries(ex):
    """Masked scores, as attention has them: a whole first tile of -inf must not give NaN."""
    x = randn(3, 200, gen=torch.Generator().manual_seed(2))
    x[0, :130] = float("-inf")   # the first two tiles entirely masked
    x[1, 1::2] = float("-inf")   # every other entry
    x[2, 1:] = float("-inf")     # a single finite entry: probability 1
    torch.testing.assert_close(ex.online_softmax(x), torch.softmax(x, dim=-1), **FP32_TOL)


def test_leading_dims_and_empty(ex):
    x = randn(2, 3, 70, gen=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ex.online_softmax(x), torch.softmax(x, dim=-1), **FP32_TOL)
    assert ex.online_softmax(x[:0]).shape == (0, 3, 70)
