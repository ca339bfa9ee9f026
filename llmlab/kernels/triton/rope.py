"""Rotary position embedding in Triton: one program rotates every query and key head of
one token, computing that token's cos/sin once for all of them."""
from __future__ import annotations

import torch

from .. import reference
from ..interpreter import enable_interpreter_if_no_cuda

# Triton decides when it is imported whether kernels run compiled or interpreted: on a
# machine without CUDA, switch the interpreter on first (also when imported directly).
enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _rotate_heads(in_ptr, out_ptr, stride_in_t, stride_in_h, stride_out_t, stride_out_h,
                  token, num_heads, cos, sin,
                  BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """Rotate the pairs (x[i], x[i + D/2]) of all heads of one token by the angles in cos/sin."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < num_heads)[:, None]
    src = in_ptr + token * stride_in_t + offs_h[:, None] * stride_in_h + offs_d[None, :]
    dst = out_ptr + token * stride_out_t + offs_h[:, None] * stride_out_h + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)         # [BLOCK_H, HALF] first halves
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)  # second halves
    # rotate_half(x) = [-x2, x1], so x * cos + rotate_half(x) * sin is, per half:
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, inv_freq_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    num_heads, num_kv_heads,
    BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.float32)
    angle = position * tl.load(inv_freq_ptr + tl.arange(0, HALF))  # [HALF], fp32 like the reference
    # The reference rounds cos/sin to the input dtype before using them (as HF does).
    cos = tl.cos(angle).to(q_ptr.dtype.element_ty).to(tl.float32)[None, :]
    sin = tl.sin(angle).to(q_ptr.dtype.element_ty).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh,
                  token, num_heads, cos, sin, BLOCK_H, HALF)
    _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh,
                  token, num_kv_heads, cos, sin, BLOCK_HKV, HALF)


def rope(q, k, positions, theta, scaling=None, inplace=False):
    """Rotate q and k by position (HF "rotate half" layout, LLaMA-3.1 frequency scaling).
    See kernels_explained/rope.md."""
    # q:         [num_tokens, num_heads, head_dim]     (token and head strides are free)
    # k:         [num_tokens, num_kv_heads, head_dim]
    # positions: [num_tokens] integer
    # returns (q, k) rotated: new tensors, or q and k themselves when inplace=True
    assert q.dim() == 3 and k.dim() == 3, "q and k must be [num_tokens, heads, head_dim]"
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim), f"k {tuple(k.shape)} vs q {tuple(q.shape)}"
    assert positions.shape == (num_tokens,), f"positions {tuple(positions.shape)} != ({num_tokens},)"
    assert not positions.is_floating_point(), "positions must be integers"
    assert q.dtype == k.dtype and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
    assert head_dim % 2 == 0 and (head_dim & (head_dim - 1)) == 0, f"head_dim {head_dim} must be a power of two"
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()

    q_out = q if inplace else torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = k if inplace else torch.empty_like(k, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return q_out, k_out
    inv_freq = reference.rope_inv_freq(head_dim, float(theta), reference.scaling_key(scaling),
                                       str(q.device))  # [head_dim // 2] fp32
    _rope_kernel[(num_tokens,)](
        q, k, q_out, k_out, positions.contiguous(), inv_freq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        num_heads, num_kv_heads,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        HALF=head_dim // 2, num_warps=2,  # small programs, many per SM: fastest on an H200
    )
    return q_out, k_out
