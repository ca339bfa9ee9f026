"""The radix-select passes of the Triton sampler (`triton_sample.py`): the cut of top-k
and of top-p found on the logits' bits, with no sort.

A float maps to an integer key whose order is the float order (16 bits for bf16/fp16
logits, 32 for fp32), and each pass fixes 4 more bits of the cut from a 16-bucket
histogram of the tokens that share the bits fixed so far, weighted by 1 (top-k) or by
probability (top-p). A pass is one launch: every program of a row first sums the P
partial histograms of the previous pass and takes the same decision, so no program waits
on another. The last pass (`_race_kernel`) adds counter-based Gumbel noise to the kept
tokens; the best of the P chunks wins.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    # x: uint32; the same two xorshift-multiply rounds as reference.mix32 (wraps mod 2**32)
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _row_key(ints_ptr, row, S):
    # the row's noise key from (seed, output position): reference.row_keys
    seed = tl.load(ints_ptr + row)
    position = tl.load(ints_ptr + S + row)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _mix32(lo ^ _mix32(hi ^ 0x632BE5AB))
    return _mix32(key ^ _mix32((position & 0xFFFFFFFF).to(tl.uint32) ^ 0x85EBCA6B))


@triton.jit
def _gumbel(key, offs):
    # Gumbel noise of tokens offs: reference.gumbel_noise
    h = _mix32(key + offs.to(tl.uint32) * 0x9E3779B1)
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07   # 2**-23
    return -tl.log(-tl.log(u))


@triton.jit
def _key(raw, KEY_BITS: tl.constexpr):
    # a logit (bf16/fp16: 16-bit key, fp32: 32-bit) -> int64 key in the same order
    # 16-bit keys stay in int32: 64-bit integer ops take several instructions each, and the
    # histogram compares every token's digit 16 times
    if KEY_BITS == 16:
        bits = raw.to(tl.uint16, bitcast=True).to(tl.int32)
        return tl.where(bits >= 0x8000, 0xFFFF - bits, bits + 0x8000)
    else:
        bits = raw.to(tl.uint32, bitcast=True).to(tl.int64)
        return tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)


@triton.jit
def _as_key(value, KEY_BITS: tl.constexpr):
    if KEY_BITS == 16:
        return value.to(tl.int32)
    else:
        return value.to(tl.int64)


@triton.jit
def _row_stats(stats_ptr, row, P, P_BLOCK: tl.constexpr):
    # the row's max and softmax normalizer from the P chunks' (max, sum) partials
    c = tl.arange(0, P_BLOCK)
    m_c = tl.load(stats_ptr + (row * P + c) * 2, mask=c < P, other=float("-inf"))
    z_c = tl.load(stats_ptr + (row * P + c) * 2 + 1, mask=c < P, other=0.0)
    m = tl.max(m_c, axis=0)
    return m, tl.sum(tl.where(m_c == float("-inf"), 0.0, z_c * tl.exp(m_c - m)), axis=0)


@triton.jit
def _decide(hist_ptr, row, P, prefix, above, target, shift, P_BLOCK: tl.constexpr):
    # one radix digit: the largest d whose tokens at or above it weigh >= target
    c = tl.arange(0, P_BLOCK)
    digits = tl.arange(0, 16)
    h = tl.load(hist_ptr + (row * P + c[:, None]) * 16 + digits[None, :], mask=c[:, None] < P, other=0.0)
    hist = tl.sum(h, axis=0)
    at_or_above = above + tl.cumsum(hist, axis=0, reverse=True)
    # float sums may leave the whole range a hair short of target: then keep all of it
    reach = tl.minimum(target, tl.max(at_or_above, axis=0))
    chosen = tl.max(tl.where(at_or_above >= reach, digits, 0), axis=0)
    above += tl.sum(tl.where(digits > chosen, hist, 0.0), axis=0)
    return prefix | (chosen.to(prefix.dtype) << shift), above


@triton.jit(do_not_specialize=["V", "CH", "P", "S", "level"])
def _level_kernel(logits_ptr, stride_row, floats_ptr, stats_ptr, hist_prev_ptr, hist_ptr,
                  state_prefix_ptr, state_above_ptr, floor_ptr, zk_ptr, done_ptr, V, CH, P, S, level,
                  USE_MASS: tl.constexpr, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr,
                  P_BLOCK: tl.constexpr):
    """One radix pass of top-k (USE_MASS False) or top-p (True) for chunk c of a row."""
    row, c = tl.program_id(0), tl.program_id(1)
    t = tl.load(floats_ptr + row * 4)
    top_p = tl.load(floats_ptr + row * 4 + 1)
    top_k = tl.load(floats_ptr + row * 4 + 3)
    if USE_MASS:
        active = (t > 0) & (top_p < 1)
    else:
        active = (t > 0) & (top_k > 0) & (top_k < V)
    if active & (tl.load(done_ptr + row) == 0):      # rows the rejection rounds settled are done
        m, z = _row_stats(stats_ptr, row, P, P_BLOCK)
        floor_key = _as_key(tl.zeros([], dtype=tl.int64), KEY_BITS)
        if USE_MASS:
            floor_key = _as_key(tl.load(floor_ptr + row), KEY_BITS)
            if (top_k > 0) & (top_k < V):   # top-p renormalizes over the top-k set
                cs = tl.arange(0, P_BLOCK)
                z = tl.sum(tl.load(zk_ptr + row * P + cs, mask=cs < P, other=0.0), axis=0)
            target = top_p * z
        else:
            target = top_k
        prefix = _as_key(tl.zeros([], dtype=tl.int64), KEY_BITS)
        above = tl.zeros([], dtype=tl.float32)
        if level > 0:
            prefix = _as_key(tl.load(state_prefix_ptr + (level - 1) * S + row), KEY_BITS)
            above = tl.load(state_above_ptr + (level - 1) * S + row)
            prefix, above = _decide(hist_prev_ptr, row, P, prefix, above, target,
                                    KEY_BITS - 4 * level, P_BLOCK)
        if c == 0:
            tl.store(state_prefix_ptr + level * S + row, prefix.to(tl.int64))
            tl.store(state_above_ptr + level * S + row, above)
        shift = KEY_BITS - 4 * (level + 1)
        digits = tl.arange(0, 16)
        lanes = tl.zeros([BLOCK, 16], dtype=tl.float32)
        logits_ptr += row.to(tl.int64) * stride_row
        for start in range(c * CH, tl.minimum(c * CH + CH, V), BLOCK):
            offs = start + tl.arange(0, BLOCK)
            raw = tl.load(logits_ptr + offs, mask=offs < V, other=float("-inf"))
            key = _key(raw, KEY_BITS)
            live = (offs < V) & (key >= floor_key) & ((key >> (shift + 4)) == (prefix >> (shift + 4)))
            if USE_MASS:
                weight = tl.where(live, tl.exp(raw.to(tl.float32) * (1.0 / t) - m), 0.0)
            else:
                weight = tl.where(live, 1.0, 0.0)
            digit = (key >> shift) & 15
            lanes += tl.where(digit[:, None] == digits[None, :], weight[:, None], 0.0)
        tl.store(hist_ptr + (row * P + c) * 16 + digits, tl.sum(lanes, axis=0))


@triton.jit
def _cut_key(hist_ptr, state_prefix_ptr, state_above_ptr, row, P, S, target,
             KEY_BITS: tl.constexpr, P_BLOCK: tl.constexpr):
    # the last radix digit: the key of the cut itself
    last = KEY_BITS // 4 - 1
    prefix = _as_key(tl.load(state_prefix_ptr + last * S + row), KEY_BITS)
    above = tl.load(state_above_ptr + last * S + row)
    key, _ = _decide(hist_ptr, row, P, prefix, above, target, 0, P_BLOCK)
    return key


@triton.jit(do_not_specialize=["V", "CH", "P", "S"])
def _top_k_mass_kernel(logits_ptr, stride_row, floats_ptr, stats_ptr, hist_ptr, state_prefix_ptr,
                       state_above_ptr, floor_ptr, zk_ptr, done_ptr, V, CH, P, S, KEY_BITS: tl.constexpr,
                       BLOCK: tl.constexpr, P_BLOCK: tl.constexpr):
    """After the top-k passes: the top-k cut (kept in floor_ptr) and each chunk's share of
    the top-k set's probability mass (top-p renormalizes over it)."""
    row, c = tl.program_id(0), tl.program_id(1)
    t = tl.load(floats_ptr + row * 4)
    top_k = tl.load(floats_ptr + row * 4 + 3)
    if (t > 0) & (top_k > 0) & (top_k < V) & (tl.load(done_ptr + row) == 0):   # done: the candidates path
        m, z = _row_stats(stats_ptr, row, P, P_BLOCK)
        floor_key = _cut_key(hist_ptr, state_prefix_ptr, state_above_ptr, row, P, S, top_k,
                             KEY_BITS, P_BLOCK)
        if c == 0:
            tl.store(floor_ptr + row, floor_key.to(tl.int64))
        logits_ptr += row.to(tl.int64) * stride_row
        z_lane = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(c * CH, tl.minimum(c * CH + CH, V), BLOCK):
            offs = start + tl.arange(0, BLOCK)
            raw = tl.load(logits_ptr + offs, mask=offs < V, other=float("-inf"))
            keep = (offs < V) & (_key(raw, KEY_BITS) >= floor_key)
            z_lane += tl.where(keep, tl.exp(raw.to(tl.float32) * (1.0 / t) - m), 0.0)
        tl.store(zk_ptr + row * P + c, tl.sum(z_lane, axis=0))


@triton.jit(do_not_specialize=["V", "CH", "P", "S"])
def _race_kernel(logits_ptr, stride_row, floats_ptr, ints_ptr, stats_ptr, hist_ptr,
                 state_prefix_ptr, state_above_ptr, floor_ptr, zk_ptr, done_ptr, best_ptr, token_ptr,
                 V, CH, P, S, GUMBEL_SPAN: tl.constexpr, KEY_BITS: tl.constexpr,
                 BLOCK: tl.constexpr, P_BLOCK: tl.constexpr):
    """The Gumbel-max race over the kept tokens of chunk c; noise keyed on (seed, position, token)."""
    row, c = tl.program_id(0), tl.program_id(1)
    t = tl.load(floats_ptr + row * 4)
    if (t > 0) & (tl.load(done_ptr + row) == 0):
        top_p = tl.load(floats_ptr + row * 4 + 1)
        min_p = tl.load(floats_ptr + row * 4 + 2)
        top_k = tl.load(floats_ptr + row * 4 + 3)
        m, z = _row_stats(stats_ptr, row, P, P_BLOCK)
        floor_key = _as_key(tl.load(floor_ptr + row), KEY_BITS)
        if top_p < 1:
            if (top_k > 0) & (top_k < V):
                cs = tl.arange(0, P_BLOCK)
                z = tl.sum(tl.load(zk_ptr + row * P + cs, mask=cs < P, other=0.0), axis=0)
            floor_key = _cut_key(hist_ptr, state_prefix_ptr, state_above_ptr, row, P, S, top_p * z,
                                 KEY_BITS, P_BLOCK)
        cut = tl.maximum(m - GUMBEL_SPAN, m + tl.log(min_p))   # log(0) = -inf: no min-p
        key = _row_key(ints_ptr, row, S)
        logits_ptr += row.to(tl.int64) * stride_row
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_token = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(c * CH, tl.minimum(c * CH + CH, V), BLOCK):
            offs = start + tl.arange(0, BLOCK)
            raw = tl.load(logits_ptr + offs, mask=offs < V, other=float("-inf"))
            x = raw.to(tl.float32) * (1.0 / t)
            kept = (offs < V) & (_key(raw, KEY_BITS) >= floor_key) & (x >= cut)
            score = tl.where(kept, x + _gumbel(key, offs), float("-inf"))
            better = score > best       # per lane, so the earlier token wins a tie
            best_token = tl.where(better, offs, best_token)
            best = tl.where(better, score, best)
        top = tl.max(best, axis=0)
        tl.store(best_ptr + row * P + c, top)
        tl.store(token_ptr + row * P + c, tl.min(tl.where(best == top, best_token, V), axis=0))
