"""Exercise 11, top-p filtering: the nucleus of `llmlab.sampling.Sampler.probabilities`."""
import pytest
import torch

from llmlab import kernels
from llmlab.kernels import reference
from llmlab.sampling import Sampler, SamplingParams

EXERCISE = "ex11_top_p"


def sampler_probabilities(logits, top_p):
    return Sampler.probabilities(logits, [SamplingParams(temperature=1.0, top_p=top_p)] * logits.shape[0])


NUCLEUS = ("the nucleus is the smallest set of the most likely tokens whose probabilities add up to at "
           "least top_p: sort them, most likely first, and keep a token while the mass BEFORE it is < top_p "
           "(the token that crosses top_p stays)")


def test_smallest_set_reaching_top_p(ex):
    """The case that explains the rule, first: probabilities 0.5, 0.3, 0.15, 0.05 (in a shuffled
    order) and top_p 0.7: 0.5 alone is short of 0.7, 0.5 + 0.3 reaches it, so two tokens."""
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()
    kept = (ex.top_p_filter(logits, 0.7) != float("-inf")).tolist()[0]
    if kept != [False, True, False, True]:
        names = [p for p, k in zip(("0.15", "0.5", "0.05", "0.3"), kept) if k]
        hint = NUCLEUS
        if names == ["0.5"]:
            hint = "the token that crosses top_p (0.3: 0.5 + 0.3 = 0.8 >= 0.7) was dropped; " + NUCLEUS
        elif kept[0] and not kept[3]:
            hint = "the cut follows the order the tokens come in, not their probabilities; " + NUCLEUS
        pytest.fail(f"case probabilities 0.15, 0.5, 0.05, 0.3 with top_p 0.7: kept {names or 'nothing'}, "
                    f"expected 0.5 and 0.3\n  -> {hint}", pytrace=False)


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99, 1.0])
def test_matches_the_sampler(ex, top_p):
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 3
    filtered = ex.top_p_filter(logits, top_p)
    assert filtered.shape == logits.shape
    kept = filtered != float("-inf")
    if not torch.equal(filtered[kept], logits[kept]):
        pytest.fail(f"case 4 rows of 1000 random logits, top_p {top_p}: a kept logit changed\n  -> top_p only "
                    f"removes tokens (sets them to -inf); the kept ones keep their logits", pytrace=False)
    expected = sampler_probabilities(logits, top_p)
    counts, wanted = kept.sum(-1).tolist(), (expected > 0).sum(-1).tolist()
    if counts != wanted:
        pytest.fail(f"case 4 rows of 1000 random logits, top_p {top_p}: kept {counts} tokens per row, the "
                    f"Sampler keeps {wanted}\n  -> {NUCLEUS}", pytrace=False)
    torch.testing.assert_close(filtered.softmax(-1), expected, atol=1e-7, rtol=1e-6)


def test_always_keeps_the_most_likely_token(ex):
    logits = torch.tensor([[0.0, 10.0, 1.0, 2.0], [5.0, 5.1, 5.2, 5.3]])
    filtered = ex.top_p_filter(logits, 1e-6)
    assert (filtered != float("-inf")).sum(-1).tolist() == [1, 1]
    assert filtered[0, 1] == 10.0 and filtered[1, 3] == 5.3


def test_one_top_p_per_row(ex):
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1)) * 2
    top_p = torch.tensor([0.2, 0.8, 1.0])
    filtered = ex.top_p_filter(logits, top_p)
    for row, p in enumerate(top_p.tolist()):
        torch.testing.assert_close(filtered[row:row + 1].softmax(-1), sampler_probabilities(logits[row:row + 1], p),
                                   atol=1e-7, rtol=1e-6)


def test_full_vocabulary(ex):
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(2)) * 4  # SmolLM2's vocabulary
    torch.testing.assert_close(ex.top_p_filter(logits, 0.9).softmax(-1), sampler_probabilities(logits, 0.9),
                               atol=1e-7, rtol=1e-6)


def test_top_p_exactly_at_a_mass(ex):
    """top_p equal to the mass before the 4th token: that token goes (kept only if the mass
    before it is < top_p), 3 stay; the Sampler agrees."""
    logits = torch.randn(1, 10, generator=torch.Generator().manual_seed(0)) * 2
    probs = logits.sort(dim=-1, descending=True).values.softmax(-1)
    top_p = (probs.cumsum(-1) - probs)[0, 3].item()
    for given in (top_p, torch.tensor([top_p])):
        assert (ex.top_p_filter(logits, given) != float("-inf")).sum().item() == 3
    assert (sampler_probabilities(logits, top_p) > 0).sum().item() == 3


def test_top_p_one_keeps_every_token(ex):
    """top_p = 1: every token, even where the float32 mass of a large vocabulary reaches 1.0
    before its last tokens."""
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(0)) * 4
    assert (ex.top_p_filter(logits, 1.0) != float("-inf")).all(), "top_p = 1 keeps every token"
    assert (ex.top_p_filter(logits, torch.ones(4)) != float("-inf")).all()


def test_ties_at_the_cut_are_kept(ex):
    """Three equal logits where the cut falls: all three stay (the cut is on the value)."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    kept = (ex.top_p_filter(logits, 0.5) != float("-inf")).tolist()
    assert kept == [[True, True, True, True, False]], kept
    torch.testing.assert_close(ex.top_p_filter(logits, 0.5).softmax(-1), sampler_probabilities(logits, 0.5))


@pytest.mark.slow
def test_end_to_end(ex, llm):
    """The engine's sampler with your filter in place of llmlab's top-p cut: seeded top-p
    sampling generates the same tokens (the noise and the draw are llmlab's own)."""
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.7, seed=1234)
    prompt = "My favourite animal is"
    expected = llm.generate(prompt, params)[0].token_ids

    def sample_with_your_filter(logits, temperature, top_k, top_p, min_p, seeds, positions):
        assert (top_k == -1).all() and (min_p == 0).all()
        x = ex.top_p_filter(logits.float() * (1.0 / temperature)[:, None], top_p)
        token_ids = torch.arange(x.shape[-1])
        noise = reference.gumbel_noise(reference.row_keys(seeds, positions)[:, None], token_ids[None, :])
        return (x + noise).argmax(dim=-1)

    with kernels.override(sample=sample_with_your_filter):
        got = llm.generate(prompt, params)[0].token_ids
    assert got == expected, f"seeded top-p sampling with your filter gave {got}, llmlab's sampler {expected}"
