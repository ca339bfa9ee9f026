"""The Triton sampler's top-k path (`sample_passes.py` launches it): the k-th largest value,
top-p, min-p and the seeded race found among a few candidates per row instead of the
radix passes over the whole vocabulary (kernels_explained/sampling.md, "Top-k from candidates").

1. The first pass (`_first_kernel`, which reads every token for the softmax partials
   anyway) stores each of its BLOCK lanes' maximum of x = logit / T (`_store_lane_maxima`).
2. `_threshold_kernel` (a program a row) folds the row's lane maxima into TOPS slots (a
   slot: the max of the lanes that land on it) and takes tau = the k-th largest slot. The
   slots hold the x of TOPS different tokens of the row, so tau <= the row's k-th largest
   x, and every token of the top-k set has x >= tau. On logits in no particular order only
   about k tokens are >= tau (TOPS * -ln(1 - k / TOPS): 51 for k = 50, 1,420 for k = 1024).
3. `_collect_kernel` (the second and last pass over the vocabulary): the tokens with
   x >= tau, appended to the row's candidate buffer (an atomic counter per row; a block
   with none does no atomic and no scan).
4. `_finish_kernel` (a program a row): the candidates hold the top-k set whole, so the k-th
   value, the top-p cut renormalized over the top-k set and the min-p cut found among them
   (each on the values' order keys, bit by bit, as the radix passes find theirs) are those
   of `reference.filter_logits`, ties included; then the Gumbel race over the kept
   candidates with the reference's noise, the lowest token winning a tie of scores.

A row whose k is past the cap (`knobs.sample_top_k_cap`) or whose candidates overflow their
buffer (a long tie at the k-th value, logits sorted by value) is left open, and the radix
passes finish it: every row ends with the reference's token.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .sample_radix import _gumbel, _key, _row_key

LANE_TOPS = 2048        # slots a row folds its lane maxima into (k up to half of it stays tight)
SMALL_CANDIDATES = 256  # a row with at most this many candidates scans this many (the usual k)


def candidates_layout(cap: int):
    """(TOPS: a row's slots of folded lane maxima, CAND: a row's candidate slots), powers of
    two that depend on the cap alone (no kernel variant per batch size)."""
    cand = 2 * triton.next_power_of_2(max(cap, 1))
    return max(LANE_TOPS, cand), cand


@triton.jit
def _on_candidates(t, top_k, V, cap):
    # rows this path takes: sampled, top-k on, k at most the cap
    return (t > 0) & (top_k > 0) & (top_k < V) & (top_k <= cap)


@triton.jit
def _store_lane_maxima(m_lane, lanes_ptr, row, c, P, BLOCK: tl.constexpr):
    # m_lane: [BLOCK] each lane's max of x over chunk c, each the x of one token of the row
    tl.store(lanes_ptr + (row * P + c) * BLOCK + tl.arange(0, BLOCK), m_lane)


@triton.jit
def _largest_key_reaching(key, weight, target):
    # the largest c with sum(weight of keys >= c) >= target, built bit by bit (keys: 32-bit
    # order keys in int64); 0 when even all of them fall short
    prefix = tl.zeros([], dtype=tl.int64)
    one = tl.full([], 1, dtype=tl.int64)
    for i in range(32):
        trial = prefix | (one << (31 - i))
        reached = tl.sum(tl.where(key >= trial, weight, 0.0), axis=0) >= target
        prefix = tl.where(reached, trial, prefix)
    return prefix


@triton.jit(do_not_specialize=["V", "P", "cap"])
def _threshold_kernel(floats_ptr, lanes_ptr, tau_ptr, count_ptr, V, P, cap, TOPS: tl.constexpr,
                      CAND: tl.constexpr, BLOCK: tl.constexpr):
    """tau: the k-th largest of the row's lane maxima folded into TOPS slots (each slot the
    max of a few lanes: still the x of one token, a different token per slot), a lower bound
    on the row's k-th largest x; the row's candidate count starts at 0, or past CAND when
    tau cannot work."""
    row = tl.program_id(0)
    t = tl.load(floats_ptr + row * 4)
    top_k = tl.load(floats_ptr + row * 4 + 3)
    if _on_candidates(t, top_k, V, cap):
        i = tl.arange(0, TOPS)
        tops = tl.full([TOPS], float("-inf"), tl.float32)
        for start in range(0, P * BLOCK, TOPS):
            lane = start + i
            tops = tl.maximum(tops, tl.load(lanes_ptr + row * P * BLOCK + lane, mask=lane < P * BLOCK,
                                            other=float("-inf")))
        valid = tops > float("-inf")
        key = _key(tops, 32)
        kth = _largest_key_reaching(key, tl.where(valid, 1.0, 0.0), top_k)
        tau = tl.max(tl.where(valid & (key == kth), tops, float("-inf")), axis=0)
        tl.store(tau_ptr + row, tau)
        # fewer finite slots than k: every token would be a candidate
        few = tl.sum(valid.to(tl.int32), axis=0) < top_k
        tl.store(count_ptr + row, tl.where(few, CAND + 1, 0))


@triton.jit(do_not_specialize=["V", "CH", "P", "cap"])
def _collect_kernel(logits_ptr, stride_row, floats_ptr, tau_ptr, count_ptr, cand_x_ptr, cand_token_ptr,
                    V, CH, P, cap, CAND: tl.constexpr, BLOCK: tl.constexpr):
    """Chunk c's tokens with x >= tau, appended to the row's candidates (x and token id)."""
    row, c = tl.program_id(0), tl.program_id(1)
    t = tl.load(floats_ptr + row * 4)
    top_k = tl.load(floats_ptr + row * 4 + 3)
    if _on_candidates(t, top_k, V, cap):
        if tl.load(count_ptr + row) <= CAND:        # past it: overflowed, the radix passes finish it
            tau = tl.load(tau_ptr + row)
            logits_ptr += row.to(tl.int64) * stride_row
            for start in range(c * CH, tl.minimum(c * CH + CH, V), BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = tl.load(logits_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * (1.0 / t)
                chosen = ((offs < V) & (x >= tau)).to(tl.int32)
                n = tl.sum(chosen, axis=0)
                if n > 0:                           # most blocks hold none: no atomic, no scan
                    slot = tl.atomic_add(count_ptr + row, n) + tl.cumsum(chosen, axis=0) - 1
                    fits = (chosen > 0) & (slot < CAND)
                    tl.store(cand_x_ptr + row * CAND + slot, x, mask=fits)
                    tl.store(cand_token_ptr + row * CAND + slot, offs, mask=fits)


@triton.jit
def _settle(floats_ptr, ints_ptr, cand_x_ptr, cand_token_ptr, done_ptr, final_ptr, row, n, V, S,
            CAND: tl.constexpr, N: tl.constexpr):
    # reference.filter_logits and the race, over the row's n <= N candidates; each cut is
    # found on the values' 32-bit order keys, bit by bit, as the radix passes do (no sort)
    top_p = tl.load(floats_ptr + row * 4 + 1)
    min_p = tl.load(floats_ptr + row * 4 + 2)
    top_k = tl.load(floats_ptr + row * 4 + 3)
    i = tl.arange(0, N)
    valid = i < n
    x = tl.load(cand_x_ptr + row * CAND + i, mask=valid, other=float("-inf"))
    token = tl.load(cand_token_ptr + row * CAND + i, mask=valid, other=V)
    key = _key(x, 32)
    m = tl.max(x, axis=0)
    # top-k: the k-th largest value, ties kept
    kth_key = _largest_key_reaching(key, tl.where(valid, 1.0, 0.0), top_k)
    in_top_k = valid & (key >= kth_key)
    cut = tl.max(tl.where(in_top_k & (key == kth_key), x, float("-inf")), axis=0)
    if top_p < 1:
        # top-p over the top-k set: the smallest value with the mass strictly above it below
        # top_p, i.e. the largest key whose mass at or above it reaches top_p (none: keep all)
        e = tl.where(in_top_k, tl.exp(x - m), 0.0)
        target = top_p * tl.sum(e, axis=0)
        p_key = _largest_key_reaching(key, e, target)
        p_cut = tl.max(tl.where(in_top_k & (key == p_key), x, float("-inf")), axis=0)
        cut = tl.maximum(cut, p_cut)
    cut = tl.maximum(cut, m + tl.log(min_p))                      # log(0) = -inf: no min-p
    score = tl.where(valid & (x >= cut), x + _gumbel(_row_key(ints_ptr, row, S), token), float("-inf"))
    best = tl.max(score, axis=0)
    tl.store(final_ptr + row, tl.min(tl.where(score == best, token, V), axis=0).to(tl.int64))
    tl.store(done_ptr + row, 1)


@triton.jit(do_not_specialize=["V", "S", "cap"])
def _finish_kernel(floats_ptr, ints_ptr, count_ptr, cand_x_ptr, cand_token_ptr, done_ptr, final_ptr,
                   V, S, cap, CAND: tl.constexpr, SMALL: tl.constexpr):
    """The row's token from its candidates (a scan of SMALL slots for the usual k, of CAND for
    more), unless they overflowed."""
    row = tl.program_id(0)
    t = tl.load(floats_ptr + row * 4)
    top_k = tl.load(floats_ptr + row * 4 + 3)
    if _on_candidates(t, top_k, V, cap):
        n = tl.load(count_ptr + row)
        if n <= SMALL:
            _settle(floats_ptr, ints_ptr, cand_x_ptr, cand_token_ptr, done_ptr, final_ptr, row, n, V, S,
                    CAND, SMALL)
        elif n <= CAND:
            _settle(floats_ptr, ints_ptr, cand_x_ptr, cand_token_ptr, done_ptr, final_ptr, row, n, V, S,
                    CAND, CAND)
