"""RoPE and the KV-cache store as one Triton kernel: one program per token rotates its
query heads (written out for attention) and its key heads, and writes the rotated keys
and the values straight into the token's cache slot (codes and scales for an int8/fp8
cache). The rotated keys never go through memory, and a layer launches one kernel where
rope + store_kv launched two (kernels_explained/rope_store_kv.md)."""
from __future__ import annotations

import torch

from .. import reference
from ..interpreter import enable_interpreter_if_no_cuda
from ..reference import QUANT_EPS, QUANT_MAX, check_scales

# Triton decides when it is imported whether kernels run compiled or interpreted: on a
# machine without CUDA, switch the interpreter on first (also when imported directly).
enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .store_kv import _write_slot  # noqa: E402
from .pdl import launch_options, wait_for_previous_grid  # noqa: E402


@triton.jit
def _rotated_rows(ptr, row_offset, stride_h, num_heads, cos, signed_sin,
                  BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """All heads of one token, rotated: fp32 [BLOCK_H, 2 HALF], rounded to the input dtype
    as rope's output is (rows past num_heads are masked and hold garbage)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, 2 * HALF)
    rows = ptr + row_offset + offs_h[:, None] * stride_h
    mask = (offs_h < num_heads)[:, None]
    x = tl.load(rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    # rotate_half(x)[d] is -x[d + D/2] in the first half and x[d - D/2] in the second:
    # the partner element times [-sin | sin]
    partner = tl.load(rows + ((offs_d + HALF) % (2 * HALF))[None, :], mask=mask, other=0.0).to(tl.float32)
    return (x * cos + partner * signed_sin).to(ptr.dtype.element_ty)


@triton.jit
def _rope_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, positions_ptr, inv_freq_ptr,
    k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scales_ptr, v_scales_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_scale_block, stride_scale_slot,
    num_heads, num_kv_heads,
    BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    QUANTIZED: tl.constexpr, QMAX: tl.constexpr, ROUND: tl.constexpr, QUANT_EPS: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    wait_for_previous_grid(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, 2 * HALF)
    # pair i turns by position * inv_freq[i]; both elements of the pair (d and d + D/2) see it
    angle = tl.load(positions_ptr + token).to(tl.float32) * tl.load(inv_freq_ptr + offs_d % HALF)
    # the reference rounds cos/sin to the input dtype before using them (as HF does)
    cos = tl.cos(angle).to(q_ptr.dtype.element_ty).to(tl.float32)[None, :]
    sin = tl.sin(angle).to(q_ptr.dtype.element_ty).to(tl.float32)
    signed_sin = tl.where(offs_d < HALF, -sin, sin)[None, :]

    # every token's queries rotate, padding tokens' too: attention reads them all
    q = _rotated_rows(q_ptr, token * stride_qt, stride_qh, num_heads, cos, signed_sin, BLOCK_H, HALF)
    offs_h = tl.arange(0, BLOCK_H)
    tl.store(q_out_ptr + token * stride_qot + offs_h[:, None] * stride_qoh + offs_d[None, :], q,
             mask=(offs_h < num_heads)[:, None])

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # a padding token: nothing to store
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    k = _rotated_rows(k_ptr, token * stride_kt, stride_kh, num_kv_heads, cos, signed_sin, BLOCK_HKV, HALF)
    offs_hkv = tl.arange(0, BLOCK_HKV)
    v = tl.load(v_ptr + token * stride_vt + offs_hkv[:, None] * stride_vh + offs_d[None, :],
                mask=(offs_hkv < num_kv_heads)[:, None])
    _write_slot(k, k_cache_ptr, k_scales_ptr, block, offset, stride_kc_block, stride_kc_slot, stride_kc_head,
                stride_scale_block, stride_scale_slot, num_kv_heads, BLOCK_HKV, 2 * HALF,
                QUANTIZED, QMAX, ROUND, QUANT_EPS)
    _write_slot(v, v_cache_ptr, v_scales_ptr, block, offset, stride_vc_block, stride_vc_slot, stride_vc_head,
                stride_scale_block, stride_scale_slot, num_kv_heads, BLOCK_HKV, 2 * HALF,
                QUANTIZED, QMAX, ROUND, QUANT_EPS)


def rope_store_kv(q, k, v, positions, theta, scaling, k_cache, v_cache, slot_mapping,
                  k_scales=None, v_scales=None):
    """rope(q, k), then store_kv(rotated k, v), in one launch; returns q rotated.
    See kernels_explained/rope_store_kv.md."""
    # q:                [num_tokens, num_heads, head_dim]      (token and head strides are free:
    # k, v:             [num_tokens, num_kv_heads, head_dim]    views of the fused qkv output)
    # positions:        [num_tokens] integer
    # k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    # slot_mapping:     [num_tokens] integer, -1 for padding tokens (their q still rotates)
    # k/v_scales:       [num_blocks, block_size, num_kv_heads] float32, quantized caches only
    # returns q rotated: [num_tokens, num_heads, head_dim], contiguous
    assert q.dim() == 3 and k.dim() == 3, "q and k must be [num_tokens, heads, head_dim]"
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim), f"k {tuple(k.shape)} vs q {tuple(q.shape)}"
    assert v.shape == k.shape, f"v {tuple(v.shape)} != k {tuple(k.shape)}"
    assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
    assert positions.shape == (num_tokens,) and not positions.is_floating_point()
    assert slot_mapping.shape == (num_tokens,) and not slot_mapping.is_floating_point()
    assert head_dim % 2 == 0 and (head_dim & (head_dim - 1)) == 0, f"head_dim {head_dim} must be a power of two"
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim), \
        f"k_cache {tuple(k_cache.shape)} does not hold [*, *, {num_kv_heads}, {head_dim}] rows"
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches must be contiguous in head_dim"
    quantized = check_scales(k_cache, v_cache, k_scales, v_scales)
    if quantized:
        assert k_scales.stride() == v_scales.stride() and k_scales.stride(-1) == 1
    else:
        k_scales = v_scales = k_cache  # not read: QUANTIZED=False compiles the plain copy
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    inv_freq = reference.rope_inv_freq(head_dim, float(theta), reference.scaling_key(scaling),
                                       str(q.device))  # [head_dim // 2] fp32
    _rope_store_kv_kernel[(num_tokens,)](
        q, k, v, q_out, positions.contiguous(), inv_freq,
        k_cache, v_cache, slot_mapping.contiguous(), k_scales, v_scales,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scales.stride(0) if quantized else 0, k_scales.stride(1) if quantized else 0,
        num_heads, num_kv_heads,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        HALF=head_dim // 2, BLOCK_SIZE=k_cache.shape[1],
        QUANTIZED=quantized, QMAX=QUANT_MAX.get(k_cache.dtype, 0.0),
        ROUND=k_cache.dtype == torch.int8, QUANT_EPS=QUANT_EPS, num_warps=4, **launch_options(q),
    )
    return q_out
