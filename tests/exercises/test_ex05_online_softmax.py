"""Exercise 05, online softmax: the same as `torch.softmax(x, dim=-1)`."""
import pytest
import torch

from diagnose import check_rows
from grading import DEVICE, FP32_TOL, randn, randn_view

TILE = 64  # exercises/ex05's BLOCK: columns per tile

EXERCISE = "ex05_online_softmax"


@pytest.mark.parametrize("num_cols", [1, 64, 100, 1000],
                         ids=["1-column", "64-one-full-tile", "100-ragged-tail", "1000-many-tiles"])
def test_matches_softmax(ex, num_cols):
    x = randn_view(5, num_cols, gen=torch.Generator().manual_seed(num_cols)) * 5
    check_rows(ex.online_softmax(x), torch.softmax(x, dim=-1), case=f"rows of {num_cols} columns", tol=FP32_TOL,
               tile=TILE, hint="the last tile of a row is partial unless the row length is a multiple of the "
               "tile: its padding lanes load -inf, not 0")


def test_no_overflow(ex):
    """exp(1000) overflows float32: only a softmax that subtracts the max survives this."""
    x = randn(3, 300, gen=torch.Generator().manual_seed(1), scale=1000.0)
    check_rows(ex.online_softmax(x), torch.softmax(x, dim=-1), case="values near +-1000", tol=FP32_TOL,
               tile=TILE, hint="subtract the running max before exp, or exp(1000) = inf")


def test_max_in_a_later_tile(ex):
    """Rising rows: every tile raises the running max, so every tile needs the rescale."""
    x = torch.linspace(-50, 50, 500, device=DEVICE).repeat(2, 1)
    x[1] = x[1].flip(0)  # and falling: the max comes first
    check_rows(ex.online_softmax(x), torch.softmax(x, dim=-1), case="a rising and a falling row", tol=FP32_TOL,
               tile=TILE, hint="when a tile raises the max, rescale the running sum by exp(old max - new max)")


def test_minus_infinity_entries(ex):
    """Masked scores, as attention has them: a whole first tile of -inf must not give NaN."""
    x = randn(3, 200, gen=torch.Generator().manual_seed(2))
    x[0, :130] = float("-inf")   # the first two tiles entirely masked
    x[1, 1::2] = float("-inf")   # every other entry
    x[2, 1:] = float("-inf")     # a single finite entry: probability 1
    check_rows(ex.online_softmax(x), torch.softmax(x, dim=-1), case="rows with -inf entries", tol=FP32_TOL,
               tile=TILE, hint="start the running max at a finite -1e30: exp(-inf - (-inf)) is NaN")


def test_leading_dims_and_empty(ex):
    x = randn(2, 3, 70, gen=torch.Generator().manual_seed(3))
    check_rows(ex.online_softmax(x), torch.softmax(x, dim=-1), case="input [2, 3, 70]", tol=FP32_TOL,
               tile=TILE, hint="treat every leading dimension as more rows")
    assert ex.online_softmax(x[:0]).shape == (0, 3, 70)
