"""Exercise 11 -- top-p (nucleus) filtering of logits.  Difficulty: ** (no Triton; torch only)

Read first: notebooks/10_sampling.ipynb (and `Sampler.probabilities` in llmlab/sampling.py).

Task
    Nucleus sampling (Holtzman et al., 2020) samples only from the smallest set of most
    likely tokens whose probability mass reaches top_p. Write `top_p_filter`, which sets
    the logits of every other token to -inf, with llmlab's exact rule:

        sort the tokens by probability, most likely first; keep a token if the mass of
        the tokens strictly before it is < top_p.

    So the most likely token is always kept (the mass before it is 0), and top_p = 1
    keeps every token of nonzero probability. The logits that stay are returned
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
    - Map the keep/drop decision back to the original order with `scatter` (or index with
      the sort order), then `masked_fill(drop, float("-inf"))`.
    - A per-row top_p needs a column to broadcast against [num_seqs, vocab]: top_p[:, None].

Grade: `make grade`, or `pytest tests/exercises/test_ex11_top_p.py --impl=exercises`.
"""
from __future__ import annotations

import torch


def top_p_filter(logits: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """logits with every token outside the top-p nucleus set to -inf."""
    # logits: [num_seqs, vocab_size]; top_p: float or [num_seqs]
    if isinstance(top_p, torch.Tensor):
        top_p = top_p.to(logits.device)[:, None]  # [num_seqs, 1]: one threshold per row
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.float().softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
    drop_sorted = mass_before >= top_p  # never the first token: its mass_before is 0
    # drop_sorted[r, j] is about token order[r, j]: put each decision back in its column
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
