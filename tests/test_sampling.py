"""Sampling: the batched sampler draws from exactly the distribution `Sampler.probabilities`
defines (a chi-square test that fails on a wrong distribution), the three kernel backends
pick the same tokens, filters behave at their edges, and a seed gives the same text alone,
batched, or in another batch order."""
from __future__ import annotations

import pytest
import torch

from llmlab import SamplingParams, kernels
from llmlab.kernels import reference
from llmlab.sampling import Sampler


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against expected probabilities (cells with
    expected count < 5 merged into one, as the test's approximation requires)."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
        assert counts[small].sum() == 0, "a token of zero probability was drawn"
    stat = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor(len(expected) - 1, dtype=torch.float64)
    return torch.special.gammaincc(df / 2, stat / 2).item()


def draw(logits_row, params, n, backend="torch"):
    """n draws for one row of logits: n requests with seeds 0..n-1 at output position 3."""
    sampler = Sampler(backend=backend)
    logits = logits_row.repeat(n, 1)
    tokens = sampler(logits, [params] * n, list(range(n)), [3] * n)
    return torch.bincount(tokens, minlength=logits.shape[-1])


# Logits of a small vocabulary with a long tail and a near-tie, the shape of a real LM's.
LOGITS = torch.tensor([4.0, 3.9, 3.0, 2.0, 1.5, 1.0, 0.0, -1.0, -2.0, -4.0, -8.0, -30.0])

CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=4),
    SamplingParams(temperature=1.0, top_k=6, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=5.0),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-minp{p.min_p}")
def test_frequencies_match_the_filtered_softmax(params):
    probs = Sampler.probabilities(LOGITS[None], [params])[0]
    counts = draw(LOGITS, params, 20000)
    assert counts[probs == 0].sum() == 0, "drew a token outside the kept set"
    assert chi_square_p_value(counts, probs) > 1e-3


def test_the_chi_square_test_can_fail():
    """The same draws judged against a slightly wrong distribution (temperature 0.9 instead
    of 1.0) are rejected: the test above has the power to see a real mistake."""
    params = SamplingParams(temperature=1.0)
    wrong = Sampler.probabilities(LOGITS[None], [SamplingParams(temperature=0.9)])[0]
    assert chi_square_p_value(draw(LOGITS, params, 20000), wrong) < 1e-6


def test_draws_are_independent_across_positions():
    """One seed, successive output positions: the draws follow the distribution too (the
    counter-based noise does not repeat or correlate from one position to the next)."""
    params = SamplingParams(temperature=1.0)
    n = 20000
    tokens = Sampler()(LOGITS.repeat(n, 1), [params] * n, [7] * n, list(range(n)))
    probs = Sampler.probabilities(LOGITS[None], [params])[0]
    assert chi_square_p_value(torch.bincount(tokens, minlength=len(LOGITS)), probs) > 1e-3
    pairs = tokens[:-1] * len(LOGITS) + tokens[1:]          # consecutive pairs: p(a) p(b)
    joint = torch.outer(probs, probs).flatten()
    assert chi_square_p_value(torch.bincount(pairs, minlength=len(joint)), joint) > 1e-3


def random_batch(num_rows, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    temperature = torch.rand(num_rows, generator=gen) * 1.5
    temperature[::5] = 0.0                                   # some greedy rows
    top_k = torch.randint(-1, vocab + 20, (num_rows,), generator=gen, dtype=torch.int32)
    top_k[::3] = -1
    top_p = torch.rand(num_rows, generator=gen).clamp(min=0.05)
    top_p[::4] = 1.0
    min_p = torch.where(torch.rand(num_rows, generator=gen) < 0.3, torch.rand(num_rows, generator=gen) * 0.2, 0.0)
    seeds = torch.randint(-2**62, 2**62, (num_rows,), generator=gen)
    positions = torch.randint(0, 5000, (num_rows,), generator=gen)
    return logits, temperature, top_k, top_p, min_p, seeds, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("vocab", [50, 3000])
def test_backends_pick_the_reference_tokens(backend, vocab, dtype):
    """Same noise, same cuts: every backend picks the reference's token on every row (the
    torch backend's candidate search and the Triton radix select, over 32-bit keys for fp32
    logits and 16-bit keys for fp16, in chunks of a row, find the same cut as a full sort)."""
    args = random_batch(24, vocab, seed=vocab)
    args = (args[0].to(dtype),) + args[1:]
    expected = reference.sample(*args)
    assert torch.equal(kernels.sample(*args, backend=backend), expected)


def rejection_batch(seed, num_rows=16, vocab=2000):
    """Rows without top-k, flat and peaked, with small and usual top-p and some min-p: the
    rows the Triton sampler draws by rejection rounds (a flat row with top_p 0.2 rejects its
    first candidates often)."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.tensor([0.3, 3.0])[torch.arange(num_rows) % 2]
    logits = torch.randn(num_rows, vocab, generator=gen) * spread[:, None]
    temperature = torch.rand(num_rows, generator=gen) + 0.3
    top_k = torch.full((num_rows,), -1, dtype=torch.int32)
    top_p = torch.tensor([0.2, 0.9, 0.5, 1.0])[torch.arange(num_rows) % 4]
    min_p = torch.where(torch.arange(num_rows) % 3 == 0, 0.05, 0.0)
    seeds = torch.randint(0, 2**62, (num_rows,), generator=gen)
    positions = torch.randint(0, 5000, (num_rows,), generator=gen)
    return logits, temperature, top_k, top_p, min_p, seeds, positions


def triton_sample_module():
    """The Triton sampler's passes (the radix kernels)."""
    kernels.get_kernel("sample", "triton")      # imports it the way the engine does (interpreter on a CPU)
    import llmlab.kernels.triton.sample_passes
    return llmlab.kernels.triton.sample_passes


@pytest.mark.parametrize("rounds", [0, 1, 3, 6])
@pytest.mark.slow
def test_triton_rejection_rounds_and_the_radix_fallback_agree(rounds, monkeypatch):
    """However many rejection checks run before the radix passes take over (0: radix only),
    every row gets the reference's token."""
    triton_sample = triton_sample_module()
    monkeypatch.setattr(kernels.knobs, "sample_rounds", rounds)
    args = rejection_batch(seed=rounds)
    assert torch.equal(kernels.sample(*args, backend="triton"), reference.sample(*args))


@pytest.mark.slow
def test_triton_rejection_rounds_settle_rows_on_their_own(monkeypatch):
    """With the radix passes broken, rows settled by the rounds still get the reference's
    token: the rounds do the work (the radix passes are only the fallback)."""
    triton_sample = triton_sample_module()

    class Broken:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(kernels.knobs, "sample_rounds", 12)
    for name in ("_level_kernel", "_top_k_mass_kernel", "_race_kernel"):
        monkeypatch.setattr(triton_sample, name, Broken())
    logits, temperature, top_k, top_p, min_p, seeds, positions = rejection_batch(seed=9)
    top_p = top_p.clamp(min=0.5)        # rows a dozen checks settle for sure
    args = (logits, temperature, top_k, top_p, min_p, seeds, positions)
    assert torch.equal(kernels.sample(*args, backend="triton"), reference.sample(*args))


def test_flat_rows_and_a_deep_top_k():
    """Rows whose cut lies deep in the vocabulary (flat logits, top_k in the thousands) take
    the torch backend's wider candidate sets and its full-sort fallback."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 20000, generator=gen) * 0.3
    temperature = torch.ones(6)
    top_k = torch.tensor([-1, 3000, 15000, 100, -1, 9000], dtype=torch.int32)
    top_p = torch.tensor([0.95, 1.0, 0.99, 0.5, 1.0, 0.9])
    min_p = torch.zeros(6)
    seeds, positions = torch.arange(6), torch.zeros(6, dtype=torch.int64)
    args = (logits, temperature, top_k, top_p, min_p, seeds, positions)
    assert torch.equal(kernels.sample(*args, backend="torch"), reference.sample(*args))


@pytest.mark.parametrize("case", ["random", "rejection", "deep", "ties"])
def test_torch_filter_keeps_the_references_set(case):
    """kernels.filter_logits on the torch backend (the processed logprobs' filter) finds the
    cut among candidates, not by sorting every row: it must keep exactly the spec's tokens."""
    if case == "random":
        logits, temperature, top_k, top_p, min_p = random_batch(24, 3000, seed=11)[:5]
    elif case == "rejection":
        logits, temperature, top_k, top_p, min_p = rejection_batch(4)[:5]
    elif case == "deep":     # cuts deep in a flat vocabulary: wider candidate sets, then a full sort
        logits = torch.randn(6, 20000, generator=torch.Generator().manual_seed(5)) * 0.3
        temperature = torch.ones(6)
        top_k = torch.tensor([-1, 3000, 15000, 100, -1, 9000], dtype=torch.int32)
        top_p, min_p = torch.tensor([0.95, 1.0, 0.99, 0.5, 1.0, 0.9]), torch.tensor([0.0, 0.1, 0, 0, 0.5, 0])
    else:                    # ties at every cut
        logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0, -1.0]] * 4)
        temperature = torch.ones(4)
        top_k = torch.tensor([2, -1, 1, 5], dtype=torch.int32)
        top_p, min_p = torch.tensor([1.0, 0.5, 1.0, 0.7]), torch.tensor([0.0, 0.0, 0.0, 0.3])
    x = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]   # (greedy rows: T = 1)
    expected = reference.filter_logits(x, top_k, top_p, min_p)
    assert torch.equal(kernels.filter_logits(x, top_k, top_p, min_p, backend="torch"), expected)
    assert torch.equal(kernels.filter_logits(x, top_k, top_p, min_p, backend="reference"), expected)


def test_greedy_rows_are_the_exact_argmax():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 1000, generator=gen)
    params = [SamplingParams(temperature=0.0)] * 4 + [SamplingParams(temperature=0.8, top_p=0.9)] * 4
    tokens = Sampler()(logits, params, list(range(8)), [0] * 8)
    assert torch.equal(tokens[:4], logits[:4].argmax(dim=-1))


def test_filter_edges():
    x = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0, -1.0]])
    one = torch.ones(1)

    def kept(top_k=-1, top_p=1.0, min_p=0.0):
        out = reference.filter_logits(x, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
        return (out > float("-inf"))[0].tolist()

    assert kept() == [True] * 6                               # top_p = 1, top_k off: all
    assert kept(top_k=1) == [True] + [False] * 5              # top_k = 1: the argmax
    assert kept(top_k=2) == [True, True, True, True, False, False]   # ties at the cut stay
    assert kept(top_p=1e-6) == [True] + [False] * 5           # the top token always stays
    assert kept(top_k=100) == [True] * 6                      # top_k beyond the vocabulary: off
    assert kept(min_p=0.3) == [True, True, True, True, False, False]  # e^-1 = 0.37 >= 0.3
    assert kept(top_k=5, min_p=1.0) == [True] + [False] * 5
    del one


@pytest.mark.parametrize("temperature", [1e-4, 1e4])
def test_extreme_temperatures(temperature):
    """Tiny temperature: the argmax; huge: close to uniform."""
    params = SamplingParams(temperature=temperature)
    counts = draw(LOGITS, params, 6000)
    if temperature < 1:
        assert counts[0] == 6000
    else:
        uniform = torch.full((len(LOGITS),), 1 / len(LOGITS))
        assert chi_square_p_value(counts, uniform) > 1e-3


def test_bad_values_are_rejected():
    for bad in (dict(temperature=float("inf")), dict(temperature=float("nan")), dict(min_p=1.5),
                dict(min_p=-0.1), dict(top_p=0.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


@pytest.mark.slow
def test_a_seed_gives_the_same_text_alone_batched_and_reordered(llm):
    """The noise is keyed on (seed, position, token), so nothing about the batch matters."""
    seeded = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=1234)
    others = SamplingParams(max_tokens=16, temperature=1.0)
    prompt = "Write a haiku about the sea."
    alone = llm.generate(prompt, seeded)[0].token_ids
    batched = llm.generate(["Tell me a joke.", prompt, "List three colours."], [others, seeded, others])
    reordered = llm.generate([prompt, "List three colours.", "Hi"], [seeded, seeded, others])
    assert batched[1].token_ids == alone
    assert reordered[0].token_ids == alone
    other_seed = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=99))
    assert other_seed[0].token_ids != alone


def test_unseeded_requests_follow_the_engine_seed():
    """Requests without a seed draw theirs from the engine's generator (EngineConfig.seed)."""
    first, second = Sampler(seed=3), Sampler(seed=3)
    assert [first.new_seed() for _ in range(4)] == [second.new_seed() for _ in range(4)]
    assert Sampler(seed=4).new_seed() != Sampler(seed=3).new_seed()


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [12, 5000, 128256])
def test_gpu_triton_sampler_matches_the_reference(vocab):
    """On the GPU: the compiled radix-select kernel picks the reference's tokens on bf16 logits
    of Llama-3's vocabulary (rows where two scores tie within rounding may differ: at most 1)."""
    args = [a.cuda() for a in random_batch(64, vocab, seed=vocab)]
    args[0] = args[0].bfloat16()
    got, expected = kernels.sample(*args, backend="triton"), reference.sample(*args)
    assert (got != expected).sum() <= 1


@pytest.mark.gpu
def test_gpu_frequencies_match_the_filtered_softmax():
    for params in CASES:
        probs = Sampler.probabilities(LOGITS[None], [params])[0]
        counts = draw(LOGITS.cuda(), params, 20000, backend="triton").cpu()
        assert counts[probs == 0].sum() == 0
        assert chi_square_p_value(counts, probs) > 1e-3, params


@pytest.mark.gpu
def test_gpu_graphed_sampler_matches_its_launches(monkeypatch):
    """On the GPU the sampler's launches replay as CUDA graphs per padded batch size: the
    same tokens as launching them one by one, across batch sizes that share a bucket, grow
    the static logits buffer, and change the passes (top-k rows or none)."""
    triton_sample_module()
    cases = [(1, 0), (3, 1), (4, 2), (17, 3), (64, 4), (300, 5), (20, 6), (64, 7)]
    for num_rows, seed in cases:
        logits, *params = random_batch(num_rows, 128256, seed=seed)
        if seed % 2:
            params[1][:] = -1                      # no top-k rows: rejection rounds only
        logits = logits.cuda().bfloat16()
        monkeypatch.setattr(kernels.knobs, "sample_graphs", True)
        graphed = kernels.sample(logits, *params, backend="triton")
        monkeypatch.setattr(kernels.knobs, "sample_graphs", False)
        assert torch.equal(graphed, kernels.sample(logits, *params, backend="triton")), num_rows


def test_tiny_temperatures_and_a_huge_top_k_in_a_mixed_batch():
    """A positive temperature whose reciprocal overflows float32 samples greedily (below
    GREEDY_BELOW, as vLLM's _SAMPLING_EPS), and a top_k past the vocabulary (past int64 even)
    keeps every token, next to ordinary rows: neither breaks the step nor yields token 0."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 1000, generator=gen)
    logits[3] = logits[2]
    params = [SamplingParams(temperature=1e-38), SamplingParams(temperature=1e-45),
              SamplingParams(temperature=0.8, top_k=10**400), SamplingParams(temperature=0.8)]
    assert params[0].greedy and not SamplingParams(temperature=1e-4).greedy
    tokens = Sampler()(logits, params, [1, 2, 3, 3], [0] * 4)
    assert torch.equal(tokens[:2], logits[:2].argmax(dim=-1))
    assert tokens[2] == tokens[3]                # same row, seed and position: top_k changed nothing
    probs = Sampler.probabilities(logits, params)
    assert torch.equal(probs[0], torch.nn.functional.one_hot(logits[0].argmax(), 1000).float())
    assert torch.allclose(probs[2], probs[3])
