"""RMSNorm in Triton: one program normalizes one row (token), optionally after adding the
residual stream in the same pass (the fused "add & norm" of a LLaMA layer)."""
from __future__ import annotations

import torch

from ..interpreter import enable_interpreter_if_no_cuda
from .pdl import launch_options, wait_for_previous_grid

# Triton decides when it is imported whether kernels run compiled or interpreted: on a
# machine without CUDA, switch the interpreter on first (also when imported directly).
enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_residual, stride_out, stride_residual_out,
    hidden_size, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= hidden_size; the tail is masked
    USE_PDL: tl.constexpr = False,  # launched with programmatic dependent launch (triton/pdl.py)
):
    wait_for_previous_grid(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden_size
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + offs, mask=mask, other=0.0)
        # Round the sum to the input dtype, as the reference's `x + residual` does: the
        # caller carries exactly this tensor forward as the next residual.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    mean_square = tl.sum(xf * xf, axis=0) / hidden_size  # masked lanes are 0: they add nothing
    normed = (xf * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    # HF order: cast the normalized row back to the input dtype, then scale by the weight.
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x, weight, eps, residual=None):
    """out = x / sqrt(mean(x^2) + eps) * weight (after h = x + residual when given; then
    returns (out, h)). See kernels_explained/rms_norm.md."""
    # x:        [num_tokens, hidden_size]  (any leading dims are flattened)
    # weight:   [hidden_size]
    # residual: [num_tokens, hidden_size] or None
    hidden_size = x.shape[-1]
    assert weight.shape == (hidden_size,), f"weight {tuple(weight.shape)} != ({hidden_size},)"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), x.dtype
    assert weight.device == x.device
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x"
    # Same result dtype as the reference's `weight * normed.to(x.dtype)`.
    out_dtype = torch.promote_types(weight.dtype, x.dtype)

    x2 = x.reshape(-1, hidden_size)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight.contiguous()
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)  # [num_tokens, hidden_size]
    if residual is not None:
        residual2 = residual.reshape(-1, hidden_size)
        if residual2.stride(-1) != 1:
            residual2 = residual2.contiguous()
        residual_out = torch.empty_like(x2)  # [num_tokens, hidden_size]: x + residual
    else:
        residual2 = residual_out = x2  # unused: HAS_RESIDUAL=False compiles those loads away

    num_tokens = x2.shape[0]
    if num_tokens > 0:
        block = triton.next_power_of_2(hidden_size)
        # ~32 elements per thread: 4096 -> 4 warps (2 to 8 ran equally fast on an H200).
        num_warps = min(max(block // 1024, 1), 16)
        _rms_norm_kernel[(num_tokens,)](
            x2, residual2, weight, out, residual_out,
            x2.stride(0), residual2.stride(0), out.stride(0), residual_out.stride(0),
            hidden_size, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps, **launch_options(x2),
        )
    out = out.reshape(x.shape)
    if residual is None:
        return out
    return out, residual_out.reshape(x.shape)
