"""Exercise 11 -- top-p (nucleus) filtering of logits.  Difficulty: ** (no Triton; torch only)

Read first: notebooks/10_sampling.ipynb (and `Sampler.probabilities` in llmlab/sampling.py).

Task
    Nucleus sampling (Holtzman et al., 2020) samples only from the smallest set of most
    likely tokens whose probability mass reaches top_p. Write `top_p_filter`, which sets
    the logits of every other token to -inf, with llmlab's exact rule:

        sort the tokens by probability, most likely first; keep a token if the mass of
        the tokens strictly before it is < top_p; top_p = 1 keeps every token; tokens
        tied with the last one kept are kept too (the cut is on the logit's value).

    So the most likely token is always kept (the mass before it is 0). top_p = 1 is a rule
    of its own because float32 sums over a large vocabulary reach 1.0 before the last
    tokens do, and ties because a cut between equal logits would depend on the sort's order
    of them. The logits that stay are returned
    unchanged; softmax of the result is then the nucleus distribution that
    `llmlab.sampling.Sampler.probabilities` computes (at temperature 1, no top-k). The
    grader also plugs your function into the engine's sampler and checks that seeded
    sampling generates the same text.

Shapes
    logits [num_seqs, vocab_size] float; top_p a float in (0, 1] for every row, or a
    tensor [num_seqs] of one value per row. Returns a new [num_seqs, vocab_size] tensor.

Hints
    - `logits.sort(dim=-1, descending=True)` gives the sorted values and, for each,
      its original column; `softmax` then `cumsum` on the sorted row gives the mass up to
      and including each token: subtract the token's own probability for the mass before it.
    - Count the kept tokens per row; the smallest kept logit is the sorted row's value at
      (count - 1) (`gather`). Every logit below it goes: `masked_fill(logits < cut, -inf)`,
      which keeps the ties and needs no mapping back from the sorted order.
    - A per-row top_p needs a column to broadcast against [num_seqs, vocab]: top_p[:, None].

Grade: `make grade`, or `pytest tests/exercises/test_ex11_top_p.py --impl=exercises`.
"""
from __future__ import annotations

import torch


def top_p_filter(logits: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """logits with every token outside the top-p nucleus set to -inf."""
    raise NotImplementedError("ex11: write top_p_filter")
