"""SwiGLU activation in Triton: silu(gate) * up, reading gate and up from one row of x."""
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
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_for_previous_grid(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + offs, mask=mask, other=0.0).to(tl.float32)
    # Round silu(gate) to the input dtype before the product, as F.silu(gate) * up does.
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x):
    """silu(x[..., :n]) * x[..., n:]. See kernels_explained/silu_mul.md."""
    # x:   [num_tokens, 2 * n]  (gate | up; any leading dims are flattened)
    # out: [num_tokens, n]
    assert x.shape[-1] % 2 == 0, f"last dim {x.shape[-1]} must be even (gate | up)"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), x.dtype
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)  # [num_tokens, n]
    if x2.shape[0] > 0 and n > 0:
        block = min(triton.next_power_of_2(n), 2048)
        grid = (x2.shape[0], triton.cdiv(n, block))
        _silu_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), n, BLOCK=block,
                               num_warps=max(block // 256, 1), **launch_options(x2))
    return out.reshape(*x.shape[:-1], n)
