"""Write each new token's K and V rows into the paged cache, in Triton: one program per
token copies all of its kv heads to the slot the block manager assigned it. Into a
quantized cache (int8 or fp8) it writes each row's codes and, beside them, its scale."""
from __future__ import annotations

import torch

from ..interpreter import enable_interpreter_if_no_cuda
from ..reference import QUANT_EPS, QUANT_MAX, check_scales

# Triton decides when it is imported whether kernels run compiled or interpreted: on a
# machine without CUDA, switch the interpreter on first (also when imported directly).
enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _quantize_rows(x, QMAX: tl.constexpr, ROUND: tl.constexpr, QUANT_EPS: tl.constexpr):
    """reference.quantize of each row of x [BLOCK_H, HEAD_DIM]: (codes as fp32, scales [BLOCK_H])."""
    x = x.to(tl.float32)
    absmax = tl.maximum(tl.max(tl.abs(x), axis=1), QUANT_EPS)
    y = x * (QMAX / absmax)[:, None]   # the row's largest value lands on +-QMAX
    if ROUND:                          # int8: round half up; fp8 rounds in the cast
        y = tl.floor(y + 0.5)
    return tl.minimum(tl.maximum(y, -QMAX), QMAX), absmax / QMAX


@triton.jit
def _write_slot(x, cache_ptr, scales_ptr, block, offset,
                stride_cache_block, stride_cache_slot, stride_cache_head,
                stride_scale_block, stride_scale_slot, num_kv_heads,
                BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                QUANTIZED: tl.constexpr, QMAX: tl.constexpr, ROUND: tl.constexpr, QUANT_EPS: tl.constexpr):
    """Write one token's rows x [BLOCK_H, HEAD_DIM] (one per kv head; rows past num_kv_heads
    are masked) at (block, offset) of a cache: for an int8/fp8 cache, their codes, and
    each row's scale at the same (block, offset) of the scales [num_blocks, block_size, Hkv].
    Shared with the fused rope + store kernel (triton/rope_store_kv.py)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    head_ok = offs_h < num_kv_heads
    if QUANTIZED:
        x, scale = _quantize_rows(x, QMAX, ROUND, QUANT_EPS)
        tl.store(scales_ptr + block * stride_scale_block + offset * stride_scale_slot + offs_h, scale, mask=head_ok)
    dst = cache_ptr + block * stride_cache_block + offset * stride_cache_slot
    tl.store(dst + offs_h[:, None] * stride_cache_head + offs_d[None, :],
             x.to(cache_ptr.dtype.element_ty), mask=head_ok[:, None])


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scales_ptr, v_scales_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_scale_block, stride_scale_slot,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    QUANTIZED: tl.constexpr, QMAX: tl.constexpr, ROUND: tl.constexpr, QUANT_EPS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # a padding token: nothing to write
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < num_kv_heads)[:, None]
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    _write_slot(k, k_cache_ptr, k_scales_ptr, block, offset, stride_kc_block, stride_kc_slot, stride_kc_head,
                stride_scale_block, stride_scale_slot, num_kv_heads, BLOCK_H, HEAD_DIM,
                QUANTIZED, QMAX, ROUND, QUANT_EPS)
    _write_slot(v, v_cache_ptr, v_scales_ptr, block, offset, stride_vc_block, stride_vc_slot, stride_vc_head,
                stride_scale_block, stride_scale_slot, num_kv_heads, BLOCK_H, HEAD_DIM,
                QUANTIZED, QMAX, ROUND, QUANT_EPS)


def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scales=None, v_scales=None):
    """k_cache/v_cache[slot // block_size, slot % block_size] = k/v[t] for slot =
    slot_mapping[t] >= 0 (quantized, with the row's scale beside it, for an int8/fp8
    cache); in place, returns None. See kernels_explained/store_kv.md and kv_quantization.md."""
    # k, v:             [num_tokens, num_kv_heads, head_dim]
    # k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    # slot_mapping:     [num_tokens] integer, -1 for padding tokens
    # k/v_scales:       [num_blocks, block_size, num_kv_heads] float32, quantized caches only
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape, f"v {tuple(v.shape)} != k {tuple(k.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim), \
        f"k_cache {tuple(k_cache.shape)} does not hold [*, *, {num_kv_heads}, {head_dim}] rows"
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
    assert slot_mapping.shape == (num_tokens,) and not slot_mapping.is_floating_point()
    assert (head_dim & (head_dim - 1)) == 0, f"head_dim {head_dim} must be a power of two"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches must be contiguous in head_dim"
    quantized = check_scales(k_cache, v_cache, k_scales, v_scales)
    if quantized:
        assert k_scales.stride() == v_scales.stride() and k_scales.stride(-1) == 1
    else:
        k_scales = v_scales = k_cache  # not read: QUANTIZED=False compiles the plain copy
    if num_tokens == 0:
        return None
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping.contiguous(), k_scales, v_scales,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scales.stride(0) if quantized else 0, k_scales.stride(1) if quantized else 0,
        num_kv_heads,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_H=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, QUANTIZED=quantized, QMAX=QUANT_MAX.get(k_cache.dtype, 0.0),
        ROUND=k_cache.dtype == torch.int8, QUANT_EPS=QUANT_EPS, num_warps=4,
    )
    return None
