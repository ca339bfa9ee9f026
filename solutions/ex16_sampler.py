"""Exercise 16 -- the sampler on a batch: temperature, top-k, top-p, min-p and seeded draws
that do not depend on the batch.
Difficulty: ** (no Triton; torch only; about 60 minutes)

Read first: notebooks/10_sampling.ipynb and kernels_explained/sampling.md; exercise 11 (your
top-p grows into `filter_logits` here). Use: `SamplingParams` (its fields and `.greedy`),
llmlab's `Sampler` (llmlab/sampling.py: yours extends it and keeps its other methods) and,
from llmlab/kernels/reference.py, `row_keys` and `gumbel_noise` only: they define llmlab's
random numbers, so your seeded draws can equal llmlab's token for token. (`filter_logits`
and `sample`, just below them in that file, are this exercise's answer: stop reading there.)

Task
    The engine calls its sampler once per step with one row of logits per sequence that
    samples, and each row's SamplingParams, seed and output position (how many tokens its
    request has generated so far). Write:
      filter_logits(x, top_k, top_p, min_p)
                             x: temperature-scaled logits [S, V]; every token outside the kept
                             set goes to -inf, the others stay unchanged. In this order:
                             top-k keeps the tokens at or above the k-th largest logit
                             (top_k <= 0 or >= V: all); top-p then keeps, of those, the
                             smallest most-likely set whose probability -- renormalised over
                             the top-k set -- reaches top_p (sorted most likely first, a token
                             stays if the mass strictly before it is < top_p; top_p = 1: all);
                             min-p keeps tokens whose probability is at least min_p times the
                             top token's. Each rule is a cut on the logit value, so tokens tied
                             with the last one kept stay. top_k int [S], top_p, min_p float [S].
      Sampler.__call__(logits, params, seeds, positions)
                             one token id per row, int64 [S], on the logits' device. A greedy
                             row (params[i].greedy: temperature below GREEDY_BELOW) takes the
                             argmax of its raw logits. Any other row: x = logits * (1 /
                             temperature) (the reciprocal, as every llmlab backend scales),
                             filter_logits, then the Gumbel-max draw
                                 argmax(x + gumbel_noise(row_keys(seeds, positions)[:, None],
                                                         token ids[None, :]))
                             which is a draw from softmax(x): the noise of (row, token) is a
                             hash of the row's seed, its position and the token id.
    With a seed, a request's text is the same alone or in any batch, at any row: nothing of
    a row's draw may depend on another row, on its index, or on a generator shared by the batch.

Shapes
    logits [S, V] (any float dtype: work in float32); params list of S SamplingParams;
    seeds, positions lists of S ints (seeds are 64-bit). Returns int64 [S].

Hints
    - One batch of tensor ops for every row at once, no Python loop over rows doing tensor
      work: build temperature, top_k, top_p, min_p as [S] tensors from the params first.
    - top-k and top-p need the sorted row; a cut found on the sorted values applies to the
      unsorted row as `x < cut` (which also keeps ties).
    - min-p in logits: p >= min_p * p_max  <=>  x >= x_max + log(min_p) (log 0 = -inf: no cut).
    - A greedy row must never be divided by its temperature: 1/0 is inf, and inf - inf NaN.

What you will have built: the engine's sampler; the grader checks its distribution with a
chi-square test, its seeded tokens against llmlab's, and runs the real engine on it
(LLMEngine(config, sampler=Sampler)).

Grade: `make grade EX=ex16`, or `pytest tests/exercises/test_ex16_sampler.py --impl=exercises`.
"""
from __future__ import annotations

import torch

from llmlab import sampling
from llmlab.kernels.reference import gumbel_noise, row_keys
from llmlab.sampling import SamplingParams


def filter_logits(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Scaled logits [S, V] with every token outside top-k, then top-p, then min-p at -inf."""
    V = x.shape[-1]
    sorted_x = x.sort(dim=-1, descending=True).values
    # top-k: the k-th largest logit is the cut (tokens tied with it stay)
    k = torch.where((top_k <= 0) | (top_k > V), V, top_k).long()
    in_top_k = sorted_x >= sorted_x.gather(1, k[:, None] - 1)
    # top-p over the top-k survivors, their probabilities renormalised among themselves
    probs = sorted_x.masked_fill(~in_top_k, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1))
    cut = sorted_x.gather(1, keep.sum(dim=-1, keepdim=True) - 1)   # the last kept value (the top one always stays)
    # min-p: p >= min_p * p_max, in logits
    cut = torch.maximum(cut, sorted_x[:, :1] + torch.log(min_p[:, None]))
    return x.masked_fill(x < cut, float("-inf"))


class Sampler(sampling.Sampler):
    """llmlab's Sampler (new_seed, sample_requests, logprobs, ...) with your draw."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                 positions: list[int]) -> torch.Tensor:
        """logits [S, V]; each row's SamplingParams, seed and output position -> int64 [S]."""
        device = logits.device
        greedy = torch.tensor([p.greedy for p in params], device=device)
        # a greedy row is scaled by 1, not by its temperature (1/0 = inf): its draw is thrown away
        temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        min_p = torch.tensor([p.min_p for p in params], device=device)
        x = filter_logits(logits.float() * (1.0 / temperature)[:, None], top_k, top_p, min_p)
        # Gumbel-max: argmax(x + Gumbel noise) is a draw from softmax(x); the noise of each
        # (row, token) comes from the row's own seed and position, so no row sees another
        keys = row_keys(torch.tensor(seeds, dtype=torch.int64, device=device),
                        torch.tensor(positions, dtype=torch.int64, device=device))
        token_ids = torch.arange(x.shape[-1], device=device)
        drawn = (x + gumbel_noise(keys[:, None], token_ids[None, :])).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), drawn)
