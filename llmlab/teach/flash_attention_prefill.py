"""Notebook 03, FlashAttention for prefill: the causal tile schedule of a later chunk, the running
max, and the rescale."""
from __future__ import annotations

import math

import torch

from llmlab.teach.check import close, fraction, integer, number, right, wrong
from llmlab.viz import prefill_tile_schedule


def skipped_fraction(num_queries: int, seq_len: int, block: int = 128) -> float:
    schedule = prefill_tile_schedule(num_queries, seq_len, block, block)
    counts = {kind: sum(len(tile[kind]) for tile in schedule) for kind in ("unmasked", "masked", "skipped")}
    return counts["skipped"] / sum(counts.values())


def q1(answer):
    """A 4096-token prompt prefilled in 4 chunks of 1024, GPU tiles of 128 x 128: what fraction of the
    last chunk's (query tile, key tile) pairs is skipped?"""
    value = fraction(answer)
    if close(value, skipped_fraction(1024, 4096), 0.005):
        return right("its queries sit at positions 3072-4095 and see every earlier key, so only the tiles "
                     "past each query tile's diagonal are skipped: far fewer than in one whole-prompt chunk.")
    if close(value, skipped_fraction(4096, 4096), 0.01) or close(value, 0.5, 0.02):
        return wrong("that is for the whole prompt in one chunk; the last chunk's queries also see all the "
                     "keys of the first three chunks.")
    return wrong("draw viz.prefill_tile_schedule(1024, 4096, 128, 128) (the last 1024 queries of 4096 keys) "
                 "and count the skipped key tiles against all of them.")


def running_max_changes(first_tile_max: bool) -> int:
    """The notebook's row (seed 0), its largest score 3.5 in tile 0 or tile 2: how often the
    running max rises after tile 0."""
    x = torch.randn(20, generator=torch.Generator().manual_seed(0))
    x[2 if first_tile_max else 12] = 3.5
    maxima = [x[:end].max().item() for end in range(5, 21, 5)]
    return sum(later > earlier for earlier, later in zip(maxima, maxima[1:]))


def q2(answer):
    """Put the largest score in the first tile (x[2] = 3.5 instead of x[12] = 3.5): after tile 0, how
    many times does the running max change?"""
    changes = integer(answer)
    if changes == running_max_changes(first_tile_max=True):
        return right("tile 0 already holds the largest score, so no later tile raises m and nothing summed "
                     "so far is ever rescaled (every exp(m_old - m_new) is 1).")
    if changes == running_max_changes(first_tile_max=True) + 1:
        return wrong("tile 0 sets m for the first time (from -inf); count only the changes after it.")
    if changes == running_max_changes(first_tile_max=False):
        return wrong("that is the notebook's row, with the largest score in tile 2; move it to tile 0 and "
                     "rerun the loop.")
    return wrong("rerun the first loop with x[2] = 3.5 and watch the printed m after each tile.")


MAXIMA = (1.0, 2.5, 2.5, 3.0)    # the running max after tiles 0..3 in q3


def q3(answer):
    """The running max after tiles 0, 1, 2, 3 of a row is 1.0, 2.5, 2.5, 3.0. When tile 3 arrives, by
    what factor is the running sum l multiplied before tile 3's terms are added?"""
    factor = number(answer)
    expected = math.exp(MAXIMA[2] - MAXIMA[3])
    if close(factor, expected, 0.005):
        return right("exp(m_old - m_new): every term summed so far was exp(x - 2.5) and must become "
                     "exp(x - 3.0).")
    if close(factor, 1 / expected, 0.01):
        return wrong("the factor shrinks the old terms (the new max is larger): exp(m_old - m_new), not the "
                     "other way round.")
    if close(factor, 1.0, 0.001):
        return wrong("tile 3 raises the max, so the old terms were taken against a max that is now too small.")
    return wrong("the old terms are exp(x - m_old); what turns them into exp(x - m_new)?")


QUESTIONS = {"q1": q1, "q2": q2, "q3": q3}
