"""The CPU's `linear` (kernels/dense/onednn.py: oneDNN with packed weights) computes what F.linear computes."""
import platform

import pytest
import torch
import torch.nn.functional as F

from llmlab.kernels.tuning import knobs
from llmlab.kernels.dense import onednn as dense

# oneDNN sums in another order than MKL: a few float32 ulps of outputs of order 1;
# bfloat16 outputs are rounded once to 8 significant bits (2^-8 relative).
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
             torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 16, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(dtype, rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = (torch.randn(960, 576, generator=gen) / 24).to(dtype)
    bias = torch.randn(960, generator=gen).to(dtype) if with_bias else None
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(dense.linear(x, weight, bias).float(), expected, **TOLERANCE[dtype])


def test_linear_keeps_leading_dims_and_views():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 64, generator=gen)
    x = torch.randn(2, 3, 100, generator=gen)[..., 10:74]     # a strided view
    torch.testing.assert_close(dense.linear(x, weight), F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_packed_copy_follows_in_place_changes():
    """A notebook that edits a weight in place (an ablation) must see its edit take effect."""
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(32, 64, generator=gen), torch.randn(4, 64, generator=gen)
    dense.prepack([weight])
    before = dense.linear(x, weight)
    weight[:8] = 0
    after = dense.linear(x, weight)
    assert torch.equal(after[:, :8], torch.zeros(4, 8))
    torch.testing.assert_close(after[:, 8:], before[:, 8:], atol=1e-5, rtol=1e-5)


def test_onednn_is_used_on_this_cpu():
    """The speed-up is real only if the probe passes on an x86 CPU (where it was measured)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN's packed linear is only relied on for x86 CPUs")
    assert dense.onednn_works()


@pytest.mark.parametrize("library", ["mkl", "onednn"])
def test_one_row_library_is_read_from_the_environment_and_both_agree(monkeypatch, library):
    """LLMLAB_CPU_ONE_ROW decides without timing; either library's one-row product is F.linear's."""
    monkeypatch.setattr(dense, "_one_row", None)
    monkeypatch.setattr(knobs, "cpu_one_row", library)   # LLMLAB_CPU_ONE_ROW
    monkeypatch.setattr(dense, "_time_one_row", lambda: pytest.fail("timed although the environment decides"))
    assert dense.one_row_library() == library
    gen = torch.Generator().manual_seed(2)
    weight, x = torch.randn(960, 576, generator=gen) / 24, torch.randn(1, 576, generator=gen)
    torch.testing.assert_close(dense.linear(x, weight), F.linear(x, weight), **TOLERANCE[torch.float32])
    monkeypatch.setattr(dense, "_one_row", None)   # the next test decides afresh


def test_one_row_library_is_timed_once(monkeypatch):
    monkeypatch.setattr(dense, "_one_row", None)
    monkeypatch.setattr(knobs, "cpu_one_row", None)
    calls = []
    monkeypatch.setattr(dense, "_time_one_row", lambda: calls.append(1) or "onednn")
    assert dense.one_row_library() == "onednn" and dense.one_row_library() == "onednn"
    assert calls == [1]
    monkeypatch.setattr(dense, "_one_row", None)


def test_the_probe_names_a_library():
    if not dense.onednn_works():
        pytest.skip("no oneDNN linear here")
    assert dense._time_one_row() in ("mkl", "onednn")
