"""Exercise 01 -- fused residual RMSNorm in Triton.  Difficulty: * (warm-up)

Read first: notebooks/02_rmsnorm_rope_swiglu.ipynb and kernels_explained/rms_norm.md.

Task
    Write `_rms_norm_kernel`: one program normalizes one row (one token) of x,

        out = x / sqrt(mean(x ** 2) + eps) * weight

    and, when a residual is given, first adds it: h = x + residual, out = rms_norm(h),
    and also writes h, which the LLaMA layer carries forward as the next residual
    ("add & norm" fused in one pass over the row). The spec is
    `llmlab.kernels.reference.rms_norm`; the launcher `rms_norm` below has its signature,
    so `llmlab.kernels.override(rms_norm=rms_norm)` runs the whole model on your kernel.

Shapes
    x, residual: [num_tokens, hidden_size]   (leading dims are flattened by the launcher)
    weight:      [hidden_size]
    hidden_size need not be a power of two (SmolLM2 has 576).

Hints
    - `tl.arange(0, BLOCK)` needs a power-of-two BLOCK: the launcher passes the next power
      of two >= hidden_size; mask the lanes past hidden_size.
    - Masked lanes load 0.0, so they add nothing to the sum of squares, but divide by
      hidden_size, not by BLOCK.
    - Do the arithmetic in float32 (`.to(tl.float32)`); `tl.store` casts to the output's dtype.

Grade: `make grade`, or `pytest tests/exercises/test_ex01_rms_norm.py --impl=exercises`.
"""
from __future__ import annotations

import torch

from llmlab.kernels import enable_interpreter_if_no_cuda

# On a machine without CUDA, Triton must be told to interpret before any @triton.jit runs.
enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                     hidden_size, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One program = one row: out[row] = rms_norm(x[row] (+ residual[row])) * weight."""
    # 1. row = tl.program_id(0); cols = tl.arange(0, BLOCK); mask = cols < hidden_size
    # 2. x = load row `row` of x (masked lanes 0.0), as float32
    # 3. if HAS_RESIDUAL: add the residual row, and store the sum to residual_out_ptr
    # 4. mean of x*x over hidden_size -> x * rsqrt(mean + eps) * weight -> store to out_ptr
    pass


def rms_norm(x, weight, eps, residual=None):
    """out = x / sqrt(mean(x^2) + eps) * weight; with `residual`, h = x + residual is
    normalized instead and (out, h) returned. See kernels_explained/rms_norm.md."""
    raise NotImplementedError("ex01: write _rms_norm_kernel above, then delete this line")
    # x:        [num_tokens, hidden_size]  (any leading dims)
    # weight:   [hidden_size]
    # residual: [num_tokens, hidden_size] or None
    hidden_size = x.shape[-1]
    assert weight.shape == (hidden_size,), f"weight {tuple(weight.shape)} != ({hidden_size},)"
    if residual is not None:
        assert residual.shape == x.shape, f"residual {tuple(residual.shape)} != x {tuple(x.shape)}"
    # Contiguous rows, so row r starts at r * hidden_size.
    x2 = x.reshape(-1, hidden_size).contiguous()
    weight = weight.contiguous()
    out = torch.empty_like(x2)  # [num_tokens, hidden_size]
    if residual is not None:
        residual2 = residual.reshape(-1, hidden_size).contiguous()
        residual_out = torch.empty_like(x2)  # [num_tokens, hidden_size]: x + residual
    else:
        residual2 = residual_out = x2  # not read: HAS_RESIDUAL=False skips those lines
    num_tokens = x2.shape[0]
    if num_tokens > 0:
        _rms_norm_kernel[(num_tokens,)](
            x2, residual2, weight, out, residual_out, hidden_size, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden_size),
        )
    out = out.reshape(x.shape)
    if residual is None:
        return out
    return out, residual_out.reshape(x.shape)
