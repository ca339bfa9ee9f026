"""The Triton sampler's top-k candidates path (triton/sample_top_k.py) against the spec,
`reference.sample`: the exact token for every k (1, 2, 50, the cap, one past it, the whole
vocabulary and past it, 0 and -1 for off), ties at the k-th value, top-p / min-p /
temperature on top, greedy rows in the batch, the same token in any batch order, and rows
whose candidates overflow falling back to the radix passes."""
from __future__ import annotations

import pytest
import torch

from llmlab import kernels
from llmlab.kernels import reference


def sampler_modules():
    """(sample.py, sample_passes.py, sample_top_k.py), imported the way the engine does
    (the interpreter on a CPU)."""
    kernels.get_kernel("sample", "triton")
    from llmlab.kernels.triton import sample, sample_passes, sample_top_k
    return sample, sample_passes, sample_top_k


def top_k_batch(ks, vocab, seed, ties=False):
    """One row per k, each with its own temperature, top-p and min-p (some off), a greedy row
    every fifth; `ties` rounds the logits to halves, so many tokens share the k-th value."""
    gen = torch.Generator().manual_seed(seed)
    S = len(ks)
    logits = torch.randn(S, vocab, generator=gen) * 2
    if ties:
        logits = (logits * 2).round() / 2
    temperature = torch.rand(S, generator=gen) + 0.3
    temperature[::5] = 0.0
    top_k = torch.tensor(ks, dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.95])[torch.arange(S) % 4]
    min_p = torch.where(torch.arange(S) % 3 == 1, 0.05, 0.0)
    seeds = torch.randint(-2**62, 2**62, (S,), generator=gen)
    positions = torch.randint(0, 5000, (S,), generator=gen)
    return logits, temperature, top_k, top_p, min_p, seeds, positions


def in_nan_padding(logits):
    """The same logits as a view of a wider NaN-filled buffer (a row stride the kernels take
    as it is, no copy): a read past a row's end picks up NaN and changes the token."""
    S, V = logits.shape
    wide = torch.full((S, V + 8), float("nan"), dtype=logits.dtype)
    wide[:, :V] = logits
    return wide[:, :V]


def poison_workspace(sample):
    """Every scratch tensor of the next call starts as NaN / -1 bytes: a kernel that reads a
    slot no pass wrote picks that up."""
    for buffer in sample._workspace.values():
        buffer.fill_(0xFF)


def check(args, sample):
    poison_workspace(sample)
    expected = reference.sample(*args)
    got = kernels.sample(*args, backend="triton")
    assert torch.equal(got, expected), (got != expected).nonzero().flatten().tolist()


@pytest.mark.slow      # Triton's interpreter on a CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_k_gives_the_reference_token(dtype, monkeypatch):
    sample, _, _ = sampler_modules()
    monkeypatch.setattr(kernels.knobs, "sample_top_k_cap", 64)
    V = 3000
    ks = [1, 2, 50, 64, 65, V - 1, V, V + 7, 0, -1, 3, 50, 17, 64, 1]
    args = top_k_batch(ks, V, seed=1)
    check((in_nan_padding(args[0].to(dtype)),) + args[1:], sample)


@pytest.mark.slow      # Triton's interpreter on a CPU
def test_ties_at_the_kth_value_are_kept(monkeypatch):
    """Logits rounded to halves: the k-th value is shared by many tokens, and every one of
    them stays (the reference's cut is on the value)."""
    sample, _, _ = sampler_modules()
    monkeypatch.setattr(kernels.knobs, "sample_top_k_cap", 64)
    ks = [1, 2, 3, 5, 8, 13, 21, 34, 50, 64, 2, 5]
    check(top_k_batch(ks, 2000, seed=2, ties=True), sample)


@pytest.mark.slow      # Triton's interpreter on a CPU
def test_hundreds_of_candidates_at_the_default_cap():
    """k in the hundreds (the default cap, 1024): more candidates than the small scan holds,
    so the row takes the full candidate buffer's scan."""
    sample, _, _ = sampler_modules()
    assert kernels.knobs.sample_top_k_cap == 1024
    check(top_k_batch([300, 700, 1024, 1025, 257], 3000, seed=8), sample)


@pytest.mark.slow      # Triton's interpreter on a CPU
def test_the_candidates_path_settles_the_rows_on_its_own(monkeypatch):
    """With the radix passes broken, rows with k up to the cap still get the reference's token:
    the candidates path does the work, the radix passes are only its fallback."""
    sample, passes, _ = sampler_modules()

    class Broken:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(kernels.knobs, "sample_top_k_cap", 64)
    for name in ("_level_kernel", "_top_k_mass_kernel", "_race_kernel"):
        monkeypatch.setattr(passes, name, Broken())
    ks = [1, 2, 50, 64, 7, 33, 50, 20]
    logits, temperature, *rest = top_k_batch(ks, 2500, seed=3)
    temperature = temperature.clamp(min=0.3)                  # no greedy rows (their argmax is fine anyway)
    check((logits, temperature, *rest), sample)


@pytest.mark.slow      # Triton's interpreter on a CPU
def test_overflowing_candidates_fall_back_to_the_radix_passes(monkeypatch):
    """A row of one repeated value puts every token among the candidates (more than the
    buffer holds), as do rows whose k is past the cap: the radix passes finish them exactly."""
    sample, _, _ = sampler_modules()
    monkeypatch.setattr(kernels.knobs, "sample_top_k_cap", 64)
    logits, *params = top_k_batch([50, 50, 65, 3, 64, 2], 1500, seed=4)
    logits[0] = 0.25
    logits[4, 700:] = logits[4, 0]                             # a long tie at the top
    params[0] = params[0].clamp(min=0.3)
    check((logits, *params), sample)


@pytest.mark.slow      # Triton's interpreter on a CPU
def test_radix_only_when_the_cap_is_zero(monkeypatch):
    sample, _, _ = sampler_modules()
    monkeypatch.setattr(kernels.knobs, "sample_top_k_cap", 0)
    check(top_k_batch([1, 2, 50, 9], 1200, seed=5), sample)


@pytest.mark.slow      # Triton's interpreter on a CPU
def test_a_seed_gives_the_same_token_in_any_batch_order(monkeypatch):
    sample, _, _ = sampler_modules()
    monkeypatch.setattr(kernels.knobs, "sample_top_k_cap", 64)
    args = top_k_batch([1, 2, 50, 64, 7, 12, 40, 3], 1800, seed=6)
    tokens = kernels.sample(*args, backend="triton")
    order = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    shuffled = kernels.sample(*(a[order] for a in args), backend="triton")
    assert torch.equal(shuffled, tokens[order])
    alone = torch.stack([kernels.sample(*(a[i:i + 1] for a in args), backend="triton")[0] for i in (2, 5)])
    assert torch.equal(alone, tokens[[2, 5]])


@pytest.mark.slow      # Triton's interpreter on a CPU
def test_llama3_vocabulary(monkeypatch):
    """Two rows of Llama-3's 128,256 tokens, top_k 50 and the default cap (many chunks a row)."""
    sample, _, _ = sampler_modules()
    args = top_k_batch([50, 1024, 1025], 128256, seed=7)
    check(args, sample)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [3000, 128256])
def test_gpu_top_k_rows_match_the_reference(vocab):
    """Compiled, bf16 logits: every k against the reference (rows where two scores tie within
    rounding may differ: at most 1), eager and as a CUDA graph."""
    cap = kernels.knobs.sample_top_k_cap
    ks = [1, 2, 50, cap, cap + 1, vocab, vocab + 3, 0, -1, 40, 50, 50] * 8
    args = list(top_k_batch(ks, vocab, seed=vocab))
    args[0] = args[0].cuda().bfloat16()         # the parameters stay on the host, as the Sampler's
    expected = reference.sample(*args)
    for graphs in (False, True):
        kernels.knobs.sample_graphs = graphs
        try:
            got = kernels.sample(*args, backend="triton")
        finally:
            kernels.knobs.sample_graphs = True
        assert (got != expected).sum() <= 1, graphs
