"""The Triton GEMV (kernels/triton_gemv.py) against F.linear: one row times a weight, shapes
whose N and K are not multiples of the tiles, every variant; on a GPU, dense.linear sends
one-row products to it and the model's outputs do not change."""
import pytest
import torch
import torch.nn.functional as F

from llmlab.kernels.triton_gemv import GEMV_CONFIGS, config_for, gemv


@pytest.mark.parametrize("n,k", [(40, 96), (33, 2048), (16, 1024), (7, 1500)])
def test_gemv_matches_f_linear(n, k):
    gen = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=gen)
    x = torch.randn(1, k, generator=gen)
    for config in (config_for(n, k), GEMV_CONFIGS["n4-k1024-w4-s1"], GEMV_CONFIGS["n32-k256-w4-s3"]):
        got = gemv(x, weight, config)
        assert got.shape == (1, n) and got.dtype == x.dtype
        torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_gemv_reads_only_its_weight_rows():
    """A weight that is a row slice of a bigger matrix (strided rows): the rows around it,
    NaN, must not leak into the result, and rows past N are never written."""
    gen = torch.Generator().manual_seed(0)
    big = torch.full((50, 300), float("nan"))
    big[10:30, :256] = torch.randn(20, 256, generator=gen)
    weight = big[10:30, :256]
    x = torch.randn(1, 256, generator=gen)
    got = gemv(x, weight, GEMV_CONFIGS["n16-k256-w4-s3"])
    torch.testing.assert_close(got, F.linear(x, weight.contiguous()), rtol=1e-5, atol=1e-4)


def test_gemv_rejects_more_than_one_row():
    with pytest.raises(AssertionError, match="one row"):
        gemv(torch.zeros(2, 8), torch.zeros(4, 8))


@pytest.mark.gpu
def test_gpu_one_row_linear_is_the_gemv_and_matches_cublas(monkeypatch):
    from llmlab.model import dense

    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((6144, 4096), (4096, 14336), (1000, 333)):
        weight = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).bfloat16()
        x = torch.randn(1, k, generator=gen, device="cuda").bfloat16()
        calls = []
        monkeypatch.setattr("llmlab.kernels.triton_gemv.gemv", lambda *a, _g=gemv: calls.append(1) or _g(*a))
        got = dense.linear(x, weight)
        assert calls, "one row on a GPU should take the GEMV"
        torch.testing.assert_close(got.float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-3)
