"""Sampling in one Triton program per row: temperature, top-k, top-p, min-p and the
Gumbel-max draw, with no sort and no host round trip (kernels_explained/sampling.md).

The cuts are found by radix select on the logits' bits: a float maps to a 32-bit key whose
unsigned order is the float order, and 8 passes over the row each fix 4 more bits of the
cut, by a 16-bucket histogram of the tokens that share the bits fixed so far (counts for
top-k, probability mass for top-p). The last pass adds counter-based Gumbel noise to the
tokens above the cut and takes the argmax. Rows with temperature 0 are left to the caller's
argmax. Same tokens as `reference.sample` up to float rounding in the sums.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import GUMBEL_SPAN

BLOCK = 1024


@triton.jit
def _mix32(x):
    # x: uint32; the same two xorshift-multiply rounds as reference.mix32 (wraps mod 2**32)
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _sortable(x):
    # float32 -> int64 holding a uint32 key with the same order as the floats
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) == 1, ~bits, bits | 0x80000000)
    return key.to(tl.int64) & 0xFFFFFFFF


@triton.jit
def _scaled(logits_ptr, offs, V, inv_t):
    x = tl.load(logits_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    return x * inv_t


@triton.jit
def _radix_select(logits_ptr, V, inv_t, m, floor_key, target, USE_MASS: tl.constexpr,
                  BLOCK: tl.constexpr):
    """The key c of the largest logit such that the tokens with key >= c (and >= floor_key)
    weigh >= target: weight 1 per token (top-k) or exp(x - m) (top-p)."""
    digits = tl.arange(0, 16)
    prefix = tl.zeros([], dtype=tl.int64)
    above = tl.zeros([], dtype=tl.float32)      # weight of tokens above the prefix's range
    for level in tl.static_range(8):
        shift = 28 - 4 * level
        hist = tl.zeros([16], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = _scaled(logits_ptr, offs, V, inv_t)
            key = _sortable(x)
            live = (offs < V) & (key >= floor_key) & ((key >> (shift + 4)) == (prefix >> (shift + 4)))
            if USE_MASS:
                weight = tl.where(live, tl.exp(x - m), 0.0)
            else:
                weight = tl.where(live, 1.0, 0.0)
            digit = (key >> shift) & 15
            hist += tl.sum(tl.where(digit[:, None] == digits[None, :], weight[:, None], 0.0), axis=0)
        at_or_above = above + tl.cumsum(hist, axis=0, reverse=True)   # weight of digits >= d
        # float sums may leave the whole range a hair short of target: then keep all of it
        reach = tl.minimum(target, tl.max(at_or_above, axis=0))
        chosen = tl.max(tl.where(at_or_above >= reach, digits, 0), axis=0)
        above += tl.sum(tl.where(digits > chosen, hist, 0.0), axis=0)
        prefix = prefix | (chosen.to(tl.int64) << shift)
    return prefix


@triton.jit
def _sample_kernel(logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                   seeds_ptr, positions_ptr, out_ptr, V, GUMBEL_SPAN: tl.constexpr,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0)
    logits_ptr += row.to(tl.int64) * stride_row
    t = tl.load(temperature_ptr + row)
    if t > 0:
        inv_t = 1.0 / t
        # pass 1: the row's maximum and softmax normalizer (online, as in flash attention)
        m = tl.full([], float("-inf"), tl.float32)
        z = tl.zeros([], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            x = _scaled(logits_ptr, start + tl.arange(0, BLOCK), V, inv_t)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            z = z * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        min_p = tl.load(min_p_ptr + row)
        cut = tl.maximum(m - GUMBEL_SPAN, m + tl.log(min_p))   # log(0) = -inf: no min-p
        cut_key = _sortable(cut)
        top_k = tl.load(top_k_ptr + row)
        floor_key = tl.zeros([], dtype=tl.int64)
        if (top_k > 0) & (top_k < V):
            floor_key = _radix_select(logits_ptr, V, inv_t, m, floor_key, top_k.to(tl.float32),
                                      False, BLOCK)
            z = tl.zeros([], dtype=tl.float32)   # the top-k set's own normalizer
            for start in range(0, V, BLOCK):
                x = _scaled(logits_ptr, start + tl.arange(0, BLOCK), V, inv_t)
                z += tl.sum(tl.where(_sortable(x) >= floor_key, tl.exp(x - m), 0.0), axis=0)
        top_p = tl.load(top_p_ptr + row)
        if top_p < 1:
            floor_key = _radix_select(logits_ptr, V, inv_t, m, floor_key, top_p * z, True, BLOCK)
        cut_key = tl.maximum(cut_key, floor_key)
        # last pass: Gumbel-max over the kept tokens, noise keyed on (seed, position, token)
        seed = tl.load(seeds_ptr + row)
        position = tl.load(positions_ptr + row)
        lo = (seed & 0xFFFFFFFF).to(tl.uint32)
        hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        key = _mix32(lo ^ _mix32(hi ^ 0x632BE5AB))
        key = _mix32(key ^ _mix32((position & 0xFFFFFFFF).to(tl.uint32) ^ 0x85EBCA6B))
        best = tl.full([], float("-inf"), tl.float32)
        best_token = tl.zeros([], dtype=tl.int64)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = _scaled(logits_ptr, offs, V, inv_t)
            h = _mix32(key + offs.to(tl.uint32) * 0x9E3779B1)
            u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07   # 2**-23
            score = tl.where((offs < V) & (_sortable(x) >= cut_key), x - tl.log(-tl.log(u)), float("-inf"))
            block_best = tl.max(score, axis=0)
            block_token = (start + tl.argmax(score, axis=0)).to(tl.int64)
            better = block_best > best
            best_token = tl.where(better, block_token, best_token)
            best = tl.where(better, block_best, best)
        tl.store(out_ptr + row, best_token)


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions):
    """Same contract as reference.sample."""
    S, V = logits.shape
    assert logits.stride(-1) == 1, "logits rows must be contiguous"
    tokens = logits.argmax(dim=-1)
    sampled = torch.empty(S, dtype=torch.int64, device=logits.device)
    if S:
        _sample_kernel[(S,)](
            logits, logits.stride(0),        # [S, V]
            temperature.float().contiguous(),   # [S]
            top_k.to(torch.int32).contiguous(),  # [S]
            top_p.float().contiguous(),      # [S]
            min_p.float().contiguous(),      # [S]
            seeds.to(torch.int64).contiguous(),  # [S]
            positions.to(torch.int64).contiguous(),  # [S]
            sampled, V, GUMBEL_SPAN=GUMBEL_SPAN, BLOCK=BLOCK, num_warps=8)
    return torch.where(temperature > 0, sampled, tokens)
