"""Exercise 16, the sampler on a batch: the filters against the spec (kernels/reference.py),
each rule in a case of its own; greedy rows; the exact tokens of seeded draws against
llmlab's own Sampler; the same tokens in any batch order; the distribution of many seeded
draws against `Sampler.probabilities` by a chi-square test; then the real engine with the
student's Sampler. Every check fails with the case that broke, what differs and what to check."""
import pytest
import torch

import llmlab
from diagnose import fail
from llmlab.kernels import reference
from llmlab.sampling import Sampler, SamplingParams

EXERCISE = "ex16_sampler"
INF = float("inf")


def expect(ok, case: str, what: str, hint: str) -> None:
    if not ok:
        fail(case, [what, f"-> {hint}"])


def kept(x) -> list[list[int]]:
    return [torch.nonzero(row != -INF)[:, 0].tolist() for row in x]


def filter_case(ex, case, logits, top_k, top_p, min_p, hint):
    """ex.filter_logits against the spec on rows of logits, one (top_k, top_p, min_p) per row."""
    S = logits.shape[0]
    args = (torch.tensor(top_k, dtype=torch.int32).expand(S), torch.tensor(top_p).expand(S),
            torch.tensor(min_p).expand(S))
    got = ex.filter_logits(logits.clone(), *args)
    expected = reference.filter_logits(logits, *args)
    expect(isinstance(got, torch.Tensor) and got.shape == logits.shape, case,
           f"filter_logits returned {getattr(got, 'shape', got)!r}", "return the logits [S, V], -inf where cut")
    expect(kept(got) == kept(expected), case, f"kept tokens {kept(got)}, expected {kept(expected)}", hint)
    survivors = expected != -INF
    expect(torch.equal(got[survivors], logits[survivors]), case, "the kept logits were changed",
           "kept logits stay as they are: the cut sets the others to -inf, nothing is renormalised in the logits")


# probabilities 0.4, 0.3, 0.2, 0.1 in a shuffled order, and a row with a tie at the cut
FOUR = torch.tensor([[0.2, 0.4, 0.1, 0.3]]).log()
TIED = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])


def test_top_k(ex):
    hint = ("top-k keeps the tokens at or above the k-th largest logit (tokens tied with it too); top_k <= 0 or "
            ">= the vocabulary keeps every token")
    filter_case(ex, "top_k 2 of probabilities [0.2, 0.4, 0.1, 0.3]", FOUR, 2, 1.0, 0.0, hint)
    filter_case(ex, "top_k 2 with three tokens tied in 2nd place", TIED, 2, 1.0, 0.0, hint)
    filter_case(ex, "top_k -1 (every token)", FOUR, -1, 1.0, 0.0, hint)
    filter_case(ex, "top_k 10 over 4 tokens", FOUR, 10, 1.0, 0.0, hint)


def test_top_p(ex):
    hint = ("top-p keeps, most likely first, each token whose mass strictly before it is < top_p (so the top token "
            "always stays, and top_p = 1 keeps all); tokens tied with the last one kept stay too")
    filter_case(ex, "top_p 0.7 of probabilities [0.2, 0.4, 0.1, 0.3]", FOUR, -1, 0.7, 0.0, hint)
    filter_case(ex, "top_p 0.5 with three tokens tied at the cut", TIED, -1, 0.5, 0.0, hint)
    filter_case(ex, "top_p 1e-6 (the top token only)", FOUR, -1, 1e-6, 0.0, hint)
    logits = torch.randn(3, 4000, generator=torch.Generator().manual_seed(0)) * 3
    filter_case(ex, "top_p 1 over 4000 tokens (float32 mass reaches 1 early)", logits, -1, 1.0, 0.0, hint)


def test_min_p(ex):
    hint = ("min-p keeps the tokens whose probability is at least min_p times the top token's: in logits, "
            "x >= x_max + log(min_p) (min_p 0: no cut)")
    filter_case(ex, "min_p 0.5 of probabilities [0.2, 0.4, 0.1, 0.3]", FOUR, -1, 1.0, 0.5, hint)
    filter_case(ex, "min_p 0.26 of probabilities [0.2, 0.4, 0.1, 0.3]", FOUR, -1, 1.0, 0.26, hint)
    filter_case(ex, "min_p 0 (no cut)", FOUR, -1, 1.0, 0.0, hint)


def test_top_k_then_top_p_over_the_survivors(ex):
    """top_k 2 leaves 0.4 and 0.3, renormalised 0.57 and 0.43: top_p 0.5 then keeps only the
    first. top-p over the whole row first would keep both (0.4 < 0.5)."""
    filter_case(ex, "top_k 2 and top_p 0.5 of probabilities [0.2, 0.4, 0.1, 0.3]", FOUR, 2, 0.5, 0.0,
                "top-k first, then top-p over the top-k survivors with their probabilities renormalised among "
                "themselves (softmax of the top-k row), not over the whole vocabulary")


def test_filters_per_row(ex):
    case = "4 rows of 300 tokens, each with its own top_k, top_p, min_p"
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 2
    top_k, top_p, min_p = torch.tensor([-1, 20, 5, 50]), torch.tensor([0.9, 1.0, 0.5, 0.8]), \
        torch.tensor([0.0, 0.05, 0.0, 0.1])
    got = ex.filter_logits(logits.clone(), top_k, top_p, min_p)
    expected = reference.filter_logits(logits, top_k, top_p, min_p)
    bad = [i for i in range(4) if kept(got[i:i + 1]) != kept(expected[i:i + 1])]
    expect(not bad, case, f"rows {bad} keep other tokens than the spec",
           "each row has its own top_k, top_p and min_p ([S] tensors): broadcast them as [S, 1] against the row")


def logits_with_negatives(seed=2):
    """Rows whose largest logit is not the first positive one, and some negative logits."""
    return torch.randn(6, 50, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows(ex):
    case = "a batch of greedy rows (temperature 0 and 1e-6) among sampled ones"
    logits = logits_with_negatives()
    params = [SamplingParams(temperature=t) for t in (0.0, 0.8, 1e-6, 1.0, 0.0, 1.5)]
    got = ex.Sampler(0)(logits, params, list(range(6)), [0] * 6)
    expect(isinstance(got, torch.Tensor) and got.dtype == torch.int64 and got.shape == (6,), case,
           f"the sampler returned {got!r}", "one int64 token id per row, [S]")
    greedy_rows = [0, 2, 4]
    wrong = [i for i in greedy_rows if got[i] != logits[i].argmax()]
    expect(not wrong, case, f"greedy rows {wrong} took tokens {[got[i].item() for i in wrong]}, expected the "
                            f"argmax {[logits[i].argmax().item() for i in wrong]}",
           "a greedy row (params.greedy: temperature below GREEDY_BELOW) takes the argmax of its raw logits: do not "
           "divide it by its temperature (1/0 is inf, inf - inf NaN) nor draw for it")


def seeded_draw(logits, params, seeds, positions, scale_first=True):
    """llmlab's seeded draw of every row (no greedy row here), or, scale_first=False, a mistake's:
    the filters on the raw logits and the temperature after them."""
    temperature = torch.tensor([p.temperature for p in params])
    args = (torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params]),
            torch.tensor([p.min_p for p in params]))
    if scale_first:
        x = reference.filter_logits(logits.float() * (1.0 / temperature)[:, None], *args)
    else:
        x = reference.filter_logits(logits.float(), *args) * (1.0 / temperature)[:, None]
    keys = reference.row_keys(torch.tensor(seeds, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64))
    return (x + reference.gumbel_noise(keys[:, None], torch.arange(x.shape[-1])[None, :])).argmax(dim=-1)


def test_seeded_tokens_are_llmlabs(ex):
    """The noise is llmlab's (row_keys, gumbel_noise), so every seeded draw equals llmlab's own
    Sampler's token for token: random rows, params, seeds and positions."""
    gen = torch.Generator().manual_seed(3)
    S, V = 16, 1000
    logits = torch.randn(S, V, generator=gen) * 2
    params = [SamplingParams(temperature=[0.5, 1.0, 1.3][i % 3], top_k=[-1, 40, 200, 5][i % 4],
                             top_p=[1.0, 0.9, 0.7][i % 3], min_p=[0.0, 0.0, 0.05][i % 3]) for i in range(S)]
    seeds = torch.randint(-2**62, 2**62, (S,), generator=gen).tolist()
    positions = torch.randint(0, 500, (S,), generator=gen).tolist()
    got = ex.Sampler(0)(logits, params, seeds, positions)
    # what a draw keyed on something else than (seed, output position) would give: a known mistake
    mistakes = [
        (seeded_draw(logits, params, seeds, list(range(S))),
         "your draws are keyed on the row index, not the output position: row_keys(seeds, positions) takes each "
         "row's own position (how many tokens its request has generated), so a request's draw is the same at any row"),
        (seeded_draw(logits, params, seeds, [0] * S),
         "your draws ignore the output position: row_keys(seeds, positions) keys each row on its seed and its "
         "position, or every step of a request draws with the same noise"),
        (seeded_draw(logits, params, seeds, positions, scale_first=False),
         "temperature applied after filtering: scale first (x = logits * (1 / temperature)), then filter_logits, so "
         "top-p and min-p cut on the probabilities the draw follows"),
    ]
    for backend in ("reference", "torch"):
        expected = Sampler(0, backend)(logits, params, seeds, positions)
        wrong = [i for i in range(S) if got[i] != expected[i]]
        case = f"{S} seeded rows of {V} tokens, llmlab's {backend} Sampler"
        named = [hint for draws, hint in mistakes
                 if isinstance(got, torch.Tensor) and got.shape == draws.shape and torch.equal(got, draws)
                 and not torch.equal(draws, expected)]
        expect(not wrong, case, f"rows {wrong} drew other tokens than llmlab's",
               named[0] if named else
               "llmlab defines the draw: x = logits * (1 / temperature), filter_logits, then argmax(x + "
               "gumbel_noise(row_keys(seeds, positions)[:, None], token ids[None, :])); seeds and positions as int64 "
               "tensors")


def test_a_seeded_draw_does_not_depend_on_the_batch(ex):
    case = "6 seeded rows drawn in one batch, in reverse order, and each alone"
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 200, generator=gen)
    params = [SamplingParams(temperature=1.0, top_p=0.95) for _ in range(6)]
    seeds, positions = [11, 22, 33, 44, 55, 66], [0, 3, 3, 7, 1, 0]
    sampler = ex.Sampler(0)
    batch = sampler(logits, params, seeds, positions).tolist()
    reverse = sampler(logits.flip(0), params[::-1], seeds[::-1], positions[::-1]).tolist()[::-1]
    alone = [sampler(logits[i:i + 1], params[i:i + 1], seeds[i:i + 1], positions[i:i + 1]).item() for i in range(6)]
    expect(batch == reverse == alone, case,
           f"tokens in the batch {batch}, in reverse order {reverse}, alone {alone}",
           "a seeded draw depends on the batch: the noise of each row must come from its own seed and position "
           "(row_keys(seeds, positions)), never from its row index or a generator shared by the batch")


def test_temperature_scales_before_the_filters(ex):
    """Top-p cuts on the probabilities of the scaled logits: at temperature 3 the top 0.7 of
    [2, 1, 0, -1] holds three tokens, at temperature 1 only two."""
    case = "2000 seeded draws of logits [2, 1, 0, -1] at temperature 3, top_p 0.7"
    n = 2000
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(n, -1)
    params = SamplingParams(temperature=3.0, top_p=0.7)
    draws = ex.Sampler(0)(logits, [params] * n, list(range(n)), [0] * n)
    support = (Sampler.probabilities(logits[:1], [params])[0] > 0).nonzero().flatten().tolist()
    drawn = sorted(set(draws.tolist()))
    expect(drawn == support, case, f"tokens drawn {drawn}, expected {support} (the top-p set at temperature 3)",
           "temperature applied after filtering: scale first (x = logits * (1 / temperature)), then filter_logits, "
           "so top-p and min-p cut on the probabilities the draw follows")


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The probability of a chi-square statistic at least this large if the draws follow
    `probs` (its upper tail: the regularized upper incomplete gamma function)."""
    expected = probs * counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = probs.numel() - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic.double() / 2).item()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=1.3, top_k=6, top_p=0.9, min_p=0.03)],
                         ids=["temperature 0.7", "temperature 1.3, top_k 6, top_p 0.9, min_p 0.03"])
def test_the_draws_follow_the_distribution(ex, params):
    """20,000 seeded draws from one row of 10 tokens against Sampler.probabilities, the exact
    distribution: a chi-square test. The seeds are fixed, so the test is deterministic; a
    correct sampler's p-value here is far above the 1e-6 threshold."""
    case = f"20000 draws at {params.temperature=}, {params.top_k=}, {params.top_p=}, {params.min_p=}"
    n = 20000
    logits = torch.tensor([[1.0, 2.5, 0.3, -1.0, 2.0, 1.7, 0.0, -0.5, 1.2, 2.2]]).expand(n, -1)
    draws = ex.Sampler(0)(logits, [params] * n, list(range(n)), [0] * n)
    probs = Sampler.probabilities(logits[:1], [params])[0].double()
    counts = torch.bincount(draws, minlength=10).double()
    outside = [t for t in range(10) if probs[t] == 0 and counts[t] > 0]
    expect(not outside, case, f"tokens {outside} were drawn, but the filters cut them",
           "draw from the filtered logits: filter_logits sets the cut tokens to -inf before the noise is added")
    kept_tokens = probs > 0
    p_value = chi_square_p_value(counts[kept_tokens], probs[kept_tokens])
    observed = (counts / n).tolist()
    expect(p_value > 1e-6, case,
           f"the draws' frequencies {[round(f, 3) for f in observed]} are not the distribution "
           f"{[round(p, 3) for p in probs.tolist()]} (chi-square p-value {p_value:.2g})",
           "the draw must follow softmax(filtered logits * (1 / temperature)): scale by the temperature before "
           "filtering, and take argmax(x + Gumbel noise), not argmax of the noise nor of probabilities + noise")


@pytest.mark.slow   # the 30-layer model, two engines
def test_end_to_end(ex, llm):
    """The engine on your Sampler: the default engine's texts, greedy and seeded, in one batch."""
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "My favourite colour is"]
    params = [SamplingParams(max_tokens=6, temperature=0.0),
              SamplingParams(max_tokens=6, temperature=0.9, top_k=40, seed=7),
              SamplingParams(max_tokens=6, temperature=0.7, top_p=0.8, min_p=0.05, seed=8),
              SamplingParams(max_tokens=6, temperature=1.2, seed=9)]

    def run(**plugged):
        config = llmlab.EngineConfig(device="cpu", dtype="float32", backend="torch", num_gpu_blocks=64)
        engine = llmlab.LLMEngine(config, model=llm.engine.model, tokenizer=llm.tokenizer, **plugged)
        return [o.text for o in llmlab.LLM.from_engine(engine).generate(prompts, params)]

    expected, actual = run(), run(sampler=ex.Sampler)
    expect(actual == expected, "the engine with your Sampler (a greedy row and three seeded ones)",
           f"texts {actual!r}, expected {expected!r}",
           "the cases above name the part; every row's draw is llmlab's when the filters and the noise are")
