"""Sampling with Triton: temperature, top-k, top-p, min-p and the Gumbel-max draw for the
whole batch, with no sort (kernels_explained/sampling.md).

Each row is split into P chunks, one program each, so that even one row keeps many SMs
busy (a row is 128k logits; one program streaming it alone waits on memory latency). A
pass over the logits is one launch; programs of a row never wait on each other: each pass
first reduces the P partials the previous pass left, and every program of the row takes
the same decision from them.

Rows without top-k (the usual chat settings) are drawn by rejection rounds:
1. one pass: the row's softmax partials (max, normalizer) and the Gumbel race over ALL
   tokens, which draws from the unfiltered softmax;
2. the winner w is the answer if it would survive the filters: top-p keeps it iff the mass
   of tokens above it is < top_p (`_mass_above_kernel` sums it), min-p iff its logit is at
   least max + log(min_p). Every kept token lies above a rejected winner, so the race run
   again over the tokens above w, with the same noise, finds the next candidate; the first
   accepted one is the race's winner over the kept set: exactly `reference.sample`'s token.
   A row is accepted at the first check with probability of about the kept mass (0.9 for
   top_p 0.9), so two or three passes settle nearly every row.
Rows with top-k up to `knobs.sample_top_k_cap` take the candidates path of `sample_top_k.py`:
a threshold from the first pass's lane maxima, one more pass that gathers the few tokens
above it, and the cuts and the race over those alone. Rows with a larger k, rows whose
candidates overflow, and rows that the rounds leave unsettled take the radix-select passes
of `sample_radix.py` (cuts found on the logits' bits). Same tokens as `reference.sample`
up to float rounding in the sums.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tuning import knobs
from ..reference import GUMBEL_SPAN
from .sample_radix import (_gumbel, _key, _level_kernel, _race_kernel, _row_key, _row_stats,
                                  _top_k_mass_kernel)
from .sample_top_k import (SMALL_CANDIDATES, _collect_kernel, _finish_kernel, _on_candidates,
                           _store_lane_maxima, _threshold_kernel, candidates_layout)

# Tunable for measurements (llmlab bench sampler): knobs.sample_block, sample_warps,
# sample_programs (chunks per row = this / rows) and sample_rounds (rejection checks before
# the radix fallback). The radix passes' [BLOCK, 16] histogram lanes are
# BLOCK * 16 / (32 * warps) registers a thread.
MAX_CHUNKS = 128            # chunk partials a program reads: one fixed size, one compiled variant
@triton.jit
def _no_top_k(top_k, V):
    return (top_k <= 0) | (top_k >= V)


@triton.jit
def _candidate(best_ptr, token_ptr, row, P, V, P_BLOCK: tl.constexpr):
    # the race's winner over the row's P chunk partials (the first chunk on a tie)
    cs = tl.arange(0, P_BLOCK)
    best = tl.load(best_ptr + row * P + cs, mask=cs < P, other=float("-inf"))
    token = tl.load(token_ptr + row * P + cs, mask=cs < P, other=V)
    return tl.min(tl.where(best == tl.max(best, axis=0), token, V), axis=0)


@triton.jit
def _race_above(logits_ptr, t, key, start_at, stop_at, floor_key, V,
                KEY_BITS: tl.constexpr, BLOCK: tl.constexpr):
    # the Gumbel race over this chunk's tokens whose key is above floor_key: (score, token)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_token = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(start_at, stop_at, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        raw = tl.load(logits_ptr + offs, mask=offs < V, other=float("-inf"))
        above = (offs < V) & (_key(raw, KEY_BITS) > floor_key)
        score = tl.where(above, raw.to(tl.float32) * (1.0 / t) + _gumbel(key, offs), float("-inf"))
        better = score > best       # per lane, so the earlier token wins a tie
        best_token = tl.where(better, offs, best_token)
        best = tl.where(better, score, best)
    top = tl.max(best, axis=0)
    return top, tl.min(tl.where(best == top, best_token, V), axis=0)


@triton.jit(do_not_specialize=["V", "CH", "P", "S", "cap"])
def _first_kernel(logits_ptr, stride_row, floats_ptr, ints_ptr, stats_ptr, best_ptr, token_ptr,
                  lanes_ptr, V, CH, P, S, cap, BLOCK: tl.constexpr):
    """Chunk c's softmax partials (max, sum of exp) and, for rows without top-k, the race
    over all its tokens (the first candidate); for rows with a top-k up to the cap, its
    lanes' maxima (sample_top_k.py)."""
    row, c = tl.program_id(0), tl.program_id(1)
    t = tl.load(floats_ptr + row * 4)
    if t > 0:
        race = _no_top_k(tl.load(floats_ptr + row * 4 + 3), V)
        key = _row_key(ints_ptr, row, S)
        logits_ptr += row.to(tl.int64) * stride_row
        m_lane = tl.full([BLOCK], float("-inf"), tl.float32)
        z_lane = tl.zeros([BLOCK], dtype=tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_token = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(c * CH, tl.minimum(c * CH + CH, V), BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(logits_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * (1.0 / t)
            m_new = tl.maximum(m_lane, x)
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            z_lane = z_lane * tl.exp(m_lane - safe) + tl.exp(x - safe)
            m_lane = m_new
            if race:
                score = x + _gumbel(key, offs)     # -inf past the end of the row
                better = score > best
                best_token = tl.where(better, offs, best_token)
                best = tl.where(better, score, best)
        if _on_candidates(t, tl.load(floats_ptr + row * 4 + 3), V, cap):
            _store_lane_maxima(m_lane, lanes_ptr, row, c, P, BLOCK)
        m = tl.max(m_lane, axis=0)
        z = tl.sum(tl.where(m_lane == float("-inf"), 0.0, z_lane * tl.exp(m_lane - m)), axis=0)
        tl.store(stats_ptr + (row * P + c) * 2, m)
        tl.store(stats_ptr + (row * P + c) * 2 + 1, z)
        if race:
            top = tl.max(best, axis=0)
            tl.store(best_ptr + row * P + c, top)
            tl.store(token_ptr + row * P + c, tl.min(tl.where(best == top, best_token, V), axis=0))


@triton.jit(do_not_specialize=["V", "CH", "P", "S"])
def _mass_above_kernel(logits_ptr, stride_row, floats_ptr, stats_ptr, best_ptr, token_ptr, done_ptr,
                       mass_ptr, V, CH, P, S, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr,
                       P_BLOCK: tl.constexpr):
    """Chunk c's probability mass (unnormalized) of the tokens above the row's candidate."""
    row, c = tl.program_id(0), tl.program_id(1)
    t = tl.load(floats_ptr + row * 4)
    top_p = tl.load(floats_ptr + row * 4 + 1)
    if (t > 0) & (top_p < 1) & _no_top_k(tl.load(floats_ptr + row * 4 + 3), V) & (tl.load(done_ptr + row) == 0):
        m, _ = _row_stats(stats_ptr, row, P, P_BLOCK)
        logits_ptr += row.to(tl.int64) * stride_row
        floor_key = _key(tl.load(logits_ptr + _candidate(best_ptr, token_ptr, row, P, V, P_BLOCK)), KEY_BITS)
        lane = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(c * CH, tl.minimum(c * CH + CH, V), BLOCK):
            offs = start + tl.arange(0, BLOCK)
            raw = tl.load(logits_ptr + offs, mask=offs < V, other=float("-inf"))
            above = (offs < V) & (_key(raw, KEY_BITS) > floor_key)
            lane += tl.where(above, tl.exp(raw.to(tl.float32) * (1.0 / t) - m), 0.0)
        tl.store(mass_ptr + row * P + c, tl.sum(lane, axis=0))


@triton.jit(do_not_specialize=["V", "CH", "P", "S"])
def _accept_kernel(logits_ptr, stride_row, floats_ptr, ints_ptr, stats_ptr, best_ptr, token_ptr,
                   mass_ptr, done_ptr, final_ptr, next_best_ptr, next_token_ptr, V, CH, P, S,
                   RACE: tl.constexpr, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr,
                   P_BLOCK: tl.constexpr):
    """Accept the row's candidate if top-p and min-p keep it; else (RACE) run chunk c's race
    over the tokens above it, for the next candidate."""
    row, c = tl.program_id(0), tl.program_id(1)
    t = tl.load(floats_ptr + row * 4)
    top_p = tl.load(floats_ptr + row * 4 + 1)
    min_p = tl.load(floats_ptr + row * 4 + 2)
    if (t > 0) & _no_top_k(tl.load(floats_ptr + row * 4 + 3), V) & (tl.load(done_ptr + row) == 0):
        m, z = _row_stats(stats_ptr, row, P, P_BLOCK)
        logits_ptr += row.to(tl.int64) * stride_row
        w = _candidate(best_ptr, token_ptr, row, P, V, P_BLOCK)
        raw_w = tl.load(logits_ptr + w)
        kept = raw_w.to(tl.float32) * (1.0 / t) >= m + tl.log(min_p)    # log(0) = -inf: no min-p
        if top_p < 1:
            cs = tl.arange(0, P_BLOCK)
            mass = tl.sum(tl.load(mass_ptr + row * P + cs, mask=cs < P, other=0.0), axis=0)
            kept = kept & (mass < top_p * z)
        if kept:
            if c == 0:
                tl.store(done_ptr + row, 1)
                tl.store(final_ptr + row, w.to(tl.int64))
        elif RACE:
            top, token = _race_above(logits_ptr, t, _row_key(ints_ptr, row, S), c * CH,
                                     tl.minimum(c * CH + CH, V), _key(raw_w, KEY_BITS), V, KEY_BITS, BLOCK)
            tl.store(next_best_ptr + row * P + c, top)
            tl.store(next_token_ptr + row * P + c, token)


def row_flags(temperature, top_k, top_p, min_p, V):
    """Which passes a batch needs, from its parameters on the host: (rows with top-k, rows
    with top-p, rows the first check cannot settle: top-p or min-p without top-k, greedy
    rows). The parameters on the device: all of them (read back, they would cost a sync)."""
    if top_k.is_cuda:
        return True, True, True, True
    t, k, p, mp = (x.numpy() for x in (temperature.float(), top_k, top_p.float(), min_p.float()))
    sampled = t > 0
    k_on = (k > 0) & (k < V)
    return (bool((k_on & sampled).any()), bool(((p < 1) & sampled).any()),
            bool((sampled & ~k_on & ((p < 1) | (mp > 0))).any()), not bool(sampled.all()))


def pack(temperature, top_k, top_p, min_p, seeds, positions, rows=None):
    """The parameters as two small tensors: floats [rows, 4] (temperature, top_p, min_p, top_k),
    ints [2, rows] (seed, position); rows past the batch are greedy padding."""
    S = temperature.shape[0]
    rows = rows or S
    floats = torch.zeros(rows, 4, dtype=torch.float32, device=temperature.device)
    ints = torch.zeros(2, rows, dtype=torch.int64, device=seeds.device)
    floats[:S] = torch.stack([temperature.float(), top_p.float(), min_p.float(),
                              top_k.float().to(temperature.device)], dim=1)
    ints[0, :S] = seeds
    ints[1, :S] = positions.to(seeds.device)
    return floats, ints


def layout(S, V, dtype):
    """(P chunks per row, CH tokens per chunk, radix levels)."""
    levels = (32 if dtype == torch.float32 else 16) // 4
    block = knobs.sample_block
    P = max(1, min(triton.cdiv(V, block), knobs.sample_programs // S, MAX_CHUNKS))
    CH = triton.cdiv(triton.cdiv(V, P), block) * block       # chunk length, a multiple of the block
    return triton.cdiv(V, CH), CH, levels


def scratch_shapes(S, P, levels, rounds):
    f32, i32, i64 = torch.float32, torch.int32, torch.int64
    _, CAND = candidates_layout(knobs.sample_top_k_cap)
    return [((S, P, 2), f32), ((rounds + 1, S, P), f32), ((rounds + 1, S, P), i32), ((S, P), f32), ((3, S), i64),
            ((levels, S, P, 16), f32), ((levels, S), i64), ((levels, S), f32), ((S, P), f32),
            ((S, P), f32), ((S, P), i32),
            ((S, P, knobs.sample_block), f32), ((S,), f32), ((S,), i32), ((S, CAND), f32), ((S, CAND), i32)]


def launch(logits, floats, ints, flags, scratch):
    """Every pass the batch needs, on device tensors (the CUDA graph captures this)."""
    S, V = logits.shape
    with_top_k, any_top_p, rounds_needed, any_greedy = flags
    P, CH, levels = layout(S, V, logits.dtype)
    rounds = max(knobs.sample_rounds, 1) if rounds_needed else 1   # temperature alone: one check accepts
    (stats, cand_best, cand_token, mass, done_final, hist, state_prefix, state_above, zk, best,
     best_token, lanes, tau, count, top_k_x, top_k_token) = scratch
    tokens = logits.argmax(dim=-1) if any_greedy else None     # an argmax reads the whole batch too
    done_final.zero_()
    done, final, floor = done_final[0], done_final[1], done_final[2]
    # sizes vary with the batch, so none of them is a compile-time constant (no recompiles mid-run)
    grid = (S, P)
    meta = dict(BLOCK=knobs.sample_block, num_warps=knobs.sample_warps)
    common = (logits, logits.stride(0), floats)
    radix = dict(KEY_BITS=levels * 4, P_BLOCK=MAX_CHUNKS, **meta)
    cap = knobs.sample_top_k_cap if with_top_k else 0      # 0: no row takes the candidates path
    TOPS, CAND = candidates_layout(knobs.sample_top_k_cap)
    _first_kernel[grid](*common, ints, stats, cand_best[0], cand_token[0], lanes, V, CH, P, S, cap, **meta)
    if cap > 0:     # top-k rows up to the cap: a threshold, one pass gathering candidates, the draw
        _threshold_kernel[(S,)](floats, lanes, tau, count, V, P, cap, TOPS=TOPS, CAND=CAND,
                                BLOCK=knobs.sample_block, num_warps=knobs.sample_warps)
        _collect_kernel[grid](*common, tau, count, top_k_x, top_k_token, V, CH, P, cap, CAND=CAND, **meta)
        _finish_kernel[(S,)](floats, ints, count, top_k_x, top_k_token, done, final, V, S, cap, CAND=CAND,
                             SMALL=min(SMALL_CANDIDATES, CAND), num_warps=knobs.sample_warps)
    for r in range(rounds if knobs.sample_rounds > 0 else 0):
        if any_top_p:
            _mass_above_kernel[grid](*common, stats, cand_best[r], cand_token[r], done, mass, V, CH, P, S, **radix)
        _accept_kernel[grid](*common, ints, stats, cand_best[r], cand_token[r], mass, done, final,
                             cand_best[r + 1], cand_token[r + 1], V, CH, P, S, RACE=r + 1 < rounds, **radix)
    # the radix passes, for rows with top-k and for rows the rounds left unsettled (each pass
    # skips settled rows at once)
    if not (with_top_k or rounds_needed or knobs.sample_rounds <= 0):
        return _with_greedy(floats, final, tokens)
    for use_mass, needed in ((False, with_top_k), (True, any_top_p)):
        if not needed:
            continue
        for level in range(levels):
            _level_kernel[grid](*common, stats, hist[max(level - 1, 0)], hist[level], state_prefix, state_above,
                                floor, zk, done, V, CH, P, S, level, USE_MASS=use_mass, **radix)
        if not use_mass:
            _top_k_mass_kernel[grid](*common, stats, hist[levels - 1], state_prefix, state_above, floor, zk,
                                     done, V, CH, P, S, **radix)
    _race_kernel[grid](*common, ints, stats, hist[levels - 1], state_prefix, state_above, floor, zk, done,
                       best, best_token, V, CH, P, S, GUMBEL_SPAN=GUMBEL_SPAN, **radix)
    winner = best.argmax(dim=1, keepdim=True)                 # the first chunk on a tie
    sampled = torch.where(done.bool(), final, best_token.gather(1, winner)[:, 0].long())
    return _with_greedy(floats, sampled, tokens)


def _with_greedy(floats, sampled, greedy):
    return sampled if greedy is None else torch.where(floats[:, 0] > 0, sampled, greedy)
