"""The Triton sampler's top-k path (`sample_passes.py` launches it): the k-th largest value,
top-p, min-p and the seeded race found among a few candidates per row instead of the
radix passes over the whole vocabulary (kernels_explained/sampling.md, "Top-k from candidates").

1. The first pass (`_first_kernel`, which reads every token for the softmax partials
   anyway) keeps each of its BLOCK lanes' maximum of x = logit / T; each chunk stores its
   largest `per_chunk` lane maxima (`_store_lane_tops`).
2. `_threshold_kernel` (a program a row): tau = the k-th largest of the row's stored lane
   maxima. They are k values *of the row*, so tau <= the row's k-th largest x, and every
   token of the top-k set has x >= tau. On logits in no particular order, about k + a few
   tokens are >= tau.
3. `_collect_kernel` (the second and last pass over the vocabulary): the tokens with
   x >= tau, appended to the row's candidate buffer (an atomic counter per row).
4. `_finish_kernel` (a program a row): sorts the candidates' x, which holds the top-k set
   whole, so the k-th value, the top-p cut renormalized over the top-k set and the min-p cut
   are those of `reference.filter_logits`, ties included; then the Gumbel race over the kept
   candidates, with the reference's noise, the lowest token winning a tie of scores.

A row whose k is past the cap (`knobs.sample_top_k_cap`) or whose candidates overflow their
buffer (a long tie at the k-th value, a row sorted by value) is left open, and the radix
passes finish it: every row ends with the reference's token.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .sample_radix import _gumbel, _key, _row_key

LANE_TOPS = 4096        # group maxima a row keeps (its chunks share them)
SMALL_CANDIDATES = 256  # a row with at most this many candidates scans this many (the usual k)


def candidates_layout(P: int, block: int, cap: int):
    """(GROUPS: group maxima each of the P chunks keeps, a power of two; TOPS: a row's slots
    for them; CAND: a row's candidate slots), both powers of two."""
    cap = max(cap, 1)
    width = max(LANE_TOPS, triton.next_power_of_2(cap))
    groups = min(block, 1 << ((width // P).bit_length() - 1))
    return groups, triton.next_power_of_2(P * groups), triton.next_power_of_2(2 * cap)


@triton.jit
def _on_candidates(t, top_k, V, cap):
    # rows this path takes: sampled, top-k on, k at most the cap
    return (t > 0) & (top_k > 0) & (top_k < V) & (top_k <= cap)


@triton.jit
def _store_group_maxima(m_lane, tops_ptr, row, c, TOPS: tl.constexpr, GROUPS: tl.constexpr,
                        BLOCK: tl.constexpr):
    # m_lane: [BLOCK] each lane's max of x over chunk c; the max of each of GROUPS groups of
    # lanes is still the x of one token of the row
    groups = tl.max(tl.reshape(m_lane, [GROUPS, BLOCK // GROUPS]), axis=1)
    tl.store(tops_ptr + row * TOPS + c * GROUPS + tl.arange(0, GROUPS), groups)


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
def _threshold_kernel(floats_ptr, tops_ptr, tau_ptr, count_ptr, V, P, cap,
                      TOPS: tl.constexpr, GROUPS: tl.constexpr, CAND: tl.constexpr):
    """tau: the k-th largest of the row's group maxima (a lower bound on its k-th largest x);
    the row's candidate count starts at 0, or past CAND when tau cannot work."""
    row = tl.program_id(0)
    t = tl.load(floats_ptr + row * 4)
    top_k = tl.load(floats_ptr + row * 4 + 3)
    if _on_candidates(t, top_k, V, cap):
        i = tl.arange(0, TOPS)
        n = P * GROUPS
        tops = tl.load(tops_ptr + row * TOPS + i, mask=i < n, other=float("-inf"))
        valid = (i < n) & (tops > float("-inf"))
        key = _key(tops, 32)
        kth = _largest_key_reaching(key, tl.where(valid, 1.0, 0.0), top_k)
        tau = tl.max(tl.where(valid & (key == kth), tops, float("-inf")), axis=0)
        tl.store(tau_ptr + row, tau)
        # fewer finite group maxima than k: every token would be a candidate
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
    t = tl.load(floats_ptr + row * 4)
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
    """The row's token from its candidates (a small sort for the usual k), unless they overflowed."""
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
