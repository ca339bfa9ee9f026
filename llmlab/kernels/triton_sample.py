"""Sampling with Triton: temperature, top-k, top-p, min-p and the Gumbel-max draw for the
whole batch, with no sort (kernels_explained/sampling.md).

Each row is split into P chunks, one program each, so that even one row keeps many SMs
busy (a row is 128k logits; one program streaming it alone waits on memory latency). The
cuts are found by radix select on the logits' bits: a float maps to an integer key whose
order is the float order (16 bits for bf16/fp16 logits, 32 for fp32), and each pass fixes
4 more bits of the cut from a 16-bucket histogram of the tokens that share the bits fixed
so far, weighted by 1 (top-k) or by probability (top-p). A pass is one launch: every
program of a row first sums the P partial histograms of the previous pass and takes the
same decision, so no program waits on another. The last pass adds counter-based Gumbel
noise to the kept tokens; the best of the P chunks wins. Same tokens as `reference.sample`
up to float rounding in the sums.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import GUMBEL_SPAN
from .triton_sample_radix import _level_kernel, _race_kernel, _top_k_mass_kernel

import os

# The [BLOCK, 16] histogram lanes are BLOCK * 16 / (32 * NUM_WARPS) registers a thread: small
# enough that several programs share an SM (occupancy hides memory latency). Tunable for
# measurements (llmlab bench sampler) through the environment.
BLOCK = int(os.environ.get("LLMLAB_SAMPLE_BLOCK", 512))
NUM_WARPS = int(os.environ.get("LLMLAB_SAMPLE_WARPS", 8))
TARGET_PROGRAMS = int(os.environ.get("LLMLAB_SAMPLE_PROGRAMS", 512))   # chunks per row = this / rows
MAX_CHUNKS = 128            # chunk partials a program reads: one fixed size, one compiled variant
_workspace: dict = {}       # device -> a byte buffer the per-call scratch tensors are cut from


def _scratch(device, shapes_dtypes):
    """Views of one cached buffer (no allocations per call), each 256-byte aligned."""
    sizes = [(-(-torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size() // 256)) * 256
             for shape, dtype in shapes_dtypes]
    buffer = _workspace.get(device)
    if buffer is None or buffer.numel() < sum(sizes):
        buffer = _workspace[device] = torch.empty(max(sum(sizes), 1 << 20), dtype=torch.uint8, device=device)
    views, offset = [], 0
    for (shape, dtype), size in zip(shapes_dtypes, sizes):
        count = torch.Size(shape).numel()
        views.append(buffer[offset:offset + size].view(dtype)[:count].view(shape))
        offset += size
    return views


@triton.jit(do_not_specialize=["V", "CH", "P"])
def _stats_kernel(logits_ptr, stride_row, floats_ptr, stats_ptr, V, CH, P, BLOCK: tl.constexpr):
    row, c = tl.program_id(0), tl.program_id(1)
    t = tl.load(floats_ptr + row * 4)
    if t > 0:
        logits_ptr += row.to(tl.int64) * stride_row
        m_lane = tl.full([BLOCK], float("-inf"), tl.float32)
        z_lane = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(c * CH, tl.minimum(c * CH + CH, V), BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(logits_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * (1.0 / t)
            m_new = tl.maximum(m_lane, x)
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            z_lane = z_lane * tl.exp(m_lane - safe) + tl.exp(x - safe)
            m_lane = m_new
        m = tl.max(m_lane, axis=0)
        z = tl.sum(tl.where(m_lane == float("-inf"), 0.0, z_lane * tl.exp(m_lane - m)), axis=0)
        tl.store(stats_ptr + (row * P + c) * 2, m)
        tl.store(stats_ptr + (row * P + c) * 2 + 1, z)


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions):
    """Same contract as reference.sample. The parameter tensors may be on the host (the
    Sampler builds them there): then passes no row needs are not launched at all."""
    S, V = logits.shape
    device = logits.device
    tokens = logits.argmax(dim=-1)
    if S == 0:
        return tokens
    if logits.stride(-1) != 1 or logits.stride(0) % 8 or logits.storage_offset():
        logits = logits.contiguous().clone()   # own aligned storage: no new kernel variant
    k = top_k.float()
    needs_top_k = bool(((k > 0) & (k < V) & (temperature > 0)).any()) if not top_k.is_cuda else True
    needs_top_p = bool(((top_p < 1) & (temperature > 0)).any()) if not top_p.is_cuda else True
    # two small host->device copies: [S, 4] floats (temperature, top_p, min_p, top_k), [2, S] ints
    floats = torch.stack([temperature.float(), top_p.float(), min_p.float(), k.to(temperature.device)], dim=1)
    ints = torch.stack([seeds.long(), positions.long().to(seeds.device)])
    if floats.device != device:
        floats, ints = (t.pin_memory().to(device, non_blocking=True) for t in (floats, ints))
    key_bits = 32 if logits.dtype == torch.float32 else 16
    levels = key_bits // 4
    P = max(1, min(triton.cdiv(V, BLOCK), TARGET_PROGRAMS // S, MAX_CHUNKS))
    CH = triton.cdiv(triton.cdiv(V, P), BLOCK) * BLOCK       # chunk length, a multiple of BLOCK
    P = triton.cdiv(V, CH)
    # sizes vary with the batch, so none of them is a compile-time constant (no recompiles mid-run)
    P_BLOCK = MAX_CHUNKS
    f32, i64 = torch.float32, torch.int64
    stats, hist, state_prefix, state_above, floor, zk, best, best_token = _scratch(device, [
        ((S, P, 2), f32), ((levels, S, P, 16), f32), ((levels, S), i64), ((levels, S), f32),
        ((S,), i64), ((S, P), f32), ((S, P), f32), ((S, P), torch.int32)])
    floor.zero_()
    grid = (S, P)
    meta = dict(BLOCK=BLOCK, num_warps=NUM_WARPS)
    _stats_kernel[grid](logits, logits.stride(0), floats, stats, V, CH, P, **meta)
    for use_mass, needed in ((False, needs_top_k), (True, needs_top_p)):
        if not needed:
            continue
        for level in range(levels):
            _level_kernel[grid](logits, logits.stride(0), floats, stats, hist[max(level - 1, 0)], hist[level],
                                state_prefix, state_above, floor, zk, V, CH, P, S, level,
                                USE_MASS=use_mass, KEY_BITS=key_bits, P_BLOCK=P_BLOCK, **meta)
        if not use_mass:
            _top_k_mass_kernel[grid](logits, logits.stride(0), floats, stats, hist[levels - 1], state_prefix,
                                     state_above, floor, zk, V, CH, P, S, KEY_BITS=key_bits, P_BLOCK=P_BLOCK,
                                     **meta)
    _race_kernel[grid](logits, logits.stride(0), floats, ints, stats, hist[levels - 1], state_prefix,
                       state_above, floor, zk, best, best_token, V, CH, P, S, GUMBEL_SPAN=GUMBEL_SPAN,
                       KEY_BITS=key_bits, P_BLOCK=P_BLOCK, **meta)
    winner = best.argmax(dim=1, keepdim=True)                 # the first chunk on a tie
    sampled = best_token.gather(1, winner)[:, 0].long()
    return torch.where(floats[:, 0] > 0, sampled, tokens)
