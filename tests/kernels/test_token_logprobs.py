"""kernels.token_logprobs: the Triton kernel (one read of the logits: per-chunk max, sum and top
candidates, then one program per row) against `reference.token_logprobs` (logsumexp, gather,
topk on a float32 copy). Rows in a NaN-filled wider buffer: a read past a row's end changes
the answer. On a CPU through Triton's interpreter; on a GPU also bf16 at the Llama-3 vocabulary."""
from __future__ import annotations

import pytest
import torch

from llmlab.kernels import reference
from llmlab.kernels.triton.logprobs import token_logprobs


def in_nan_padding(logits: torch.Tensor) -> torch.Tensor:
    R, V = logits.shape
    wide = torch.full((R, V + 8), float("nan"), dtype=logits.dtype, device=logits.device)
    wide[:, :V] = logits
    return wide[:, :V]


def check(logits, token_ids, num_top, scale=None):
    chosen, top_ids, top = token_logprobs(in_nan_padding(logits), token_ids, num_top, scale)
    want_chosen, want_ids, want_top = reference.token_logprobs(logits, token_ids, num_top, scale)
    torch.testing.assert_close(chosen, want_chosen, atol=2e-5, rtol=0)
    torch.testing.assert_close(top, want_top, atol=2e-5, rtol=0)
    # the ids: where the top values are distinct, the same tokens; every id scores its value
    x = logits.float() * (1 if scale is None else scale.to(logits.device)[:, None])
    log_z = x.logsumexp(dim=-1, keepdim=True)
    finite = top > float("-inf")
    torch.testing.assert_close(torch.where(finite, x.gather(1, top_ids) - log_z, top), top, atol=2e-5, rtol=0)
    distinct = torch.ones_like(finite)
    distinct[:, 1:] &= want_top[:, 1:] != want_top[:, :-1]
    distinct[:, :-1] &= want_top[:, :-1] != want_top[:, 1:]
    assert torch.equal(top_ids[distinct & finite], want_ids[distinct & finite])


@pytest.mark.slow      # Triton's interpreter on a CPU
@pytest.mark.parametrize("vocab", [5, 130, 4097, 9000])       # one chunk, one partial, several
@pytest.mark.parametrize("num_top", [0, 1, 5, 20])
def test_kernel_matches_the_reference(vocab, num_top):
    g = torch.Generator().manual_seed(vocab * 31 + num_top)
    logits = torch.randn(3, vocab, generator=g) * 4
    token_ids = torch.randint(0, vocab, (3,), generator=g)
    check(logits, token_ids, min(num_top, vocab))
    check(logits, token_ids, min(num_top, vocab), scale=torch.tensor([1.0, 1 / 0.7, 1 / 1.3]))


@pytest.mark.slow      # Triton's interpreter on a CPU
def test_cut_tokens_ties_and_a_whole_chunk_cut():
    """Processed logits: -inf where a filter cut a token (here a whole 4096-token chunk and all
    but three tokens of a row), ties between top values (ids then in either order)."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 9000, generator=g)
    logits[0, :4096] = float("-inf")                 # a chunk with nothing left
    logits[1, 3:] = float("-inf")                    # fewer tokens left than asked for
    logits[2, 100:110] = 5.0                         # ten tied at the top
    logits[2, 8999] = 5.0
    token_ids = torch.tensor([5000, 1, 8999])
    chosen, top_ids, top = token_logprobs(in_nan_padding(logits), token_ids, 5)
    check(logits, token_ids, 5)
    assert top[1, 3:].eq(float("-inf")).all() and set(top_ids[1, :3].tolist()) == {0, 1, 2}
    assert set(top_ids[2].tolist()) <= set(range(100, 110)) | {8999}
    assert torch.allclose(top[2], torch.full((5,), top[2, 0].item()))


@pytest.mark.slow      # Triton's interpreter on a CPU
def test_the_sampler_takes_the_kernel_for_unfiltered_rows_and_the_spec_for_filtered_ones(monkeypatch):
    """Sampler.logprobs with the Triton backend: greedy and temperature-only rows through the
    kernel (scaled as they are sampled), a top-p row through the processed logits; each equals
    log_softmax of the processed logits at the sampled token."""
    from llmlab import SamplingParams
    from llmlab.sampling import Sampler

    calls = []
    real = reference.token_logprobs
    monkeypatch.setattr(reference, "token_logprobs", lambda *a: calls.append("spec") or real(*a))
    sampler = Sampler(backend="triton")
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 700, generator=g) * 3
    sampled = torch.tensor([4, 9, 600])
    unfiltered = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0.5, logprobs=3),
                  SamplingParams(temperature=1.0, logprobs=0)]
    entries = sampler.logprobs(logits, unfiltered, sampled).entries()
    assert calls == []
    scaled = logits * torch.tensor([1.0, 2.0, 1.0])[:, None]
    want = scaled.log_softmax(dim=-1)
    for row, entry in enumerate(entries):
        assert entry.token_id == sampled[row].item()
        assert entry.logprob == pytest.approx(want[row, sampled[row]].item(), abs=2e-5)
        assert [lp for _, lp in entry.top] == pytest.approx(want[row].topk(unfiltered[row].logprobs).values.tolist(),
                                                            abs=2e-5)
    filtered = [SamplingParams(temperature=0.8, top_p=0.5, logprobs=2)]
    entry = sampler.logprobs(logits[:1], filtered, sampled[:1]).entries()[0]
    processed = reference.filter_logits(logits[:1] / 0.8, torch.tensor([-1]), torch.tensor([0.5]),
                                        torch.tensor([0.0]))
    assert entry.logprob == pytest.approx(processed.log_softmax(dim=-1)[0, 4].item(), abs=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 256])
def test_gpu_kernel_matches_the_reference_at_the_llama3_vocabulary(dtype, rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = (torch.randn(rows, 128256, generator=g, device="cuda") * 3).to(dtype)
    token_ids = torch.randint(0, 128256, (rows,), generator=g, device="cuda")
    for num_top in (0, 5, 20):
        check(logits, token_ids, num_top)
        check(logits, token_ids, num_top, scale=torch.rand(rows, generator=g, device="cuda") + 0.5)
