"""Exercise 02 -- the SwiGLU activation, silu(gate) * up, in Triton.  Difficulty: * (warm-up)

Read first: notebooks/02_rmsnorm_rope_swiglu.ipynb and kernels_explained/silu_mul.md.

Task
    Write `_silu_mul_kernel`. The MLP's gate and up projections come out of one matmul
    as one row [gate | up] per token; the kernel computes

        out = silu(gate) * up,   silu(g) = g * sigmoid(g) = g / (1 + exp(-g))

    Program (row, column block) handles BLOCK columns of one row, so rows of any width
    work (Llama-3-8B's is 14336). The spec is `llmlab.kernels.reference.silu_mul`; the
    launcher `silu_mul` below has its signature, so
    `llmlab.kernels.override(silu_mul=silu_mul)` runs the whole model on your kernel.

Shapes
    x:   [num_tokens, 2 * n]   gate = x[:, :n], up = x[:, n:]   (leading dims flattened)
    out: [num_tokens, n]

Hints
    - Row r of x starts at r * 2n; its up half starts n elements later.
    - The last column block is partial: mask `cols < n` on every load and store.
    - Compute in float32; `tl.exp` of a large positive number is inf, and g / (1 + inf)
      is (-)0 -- the right limit, so no special case is needed.

Grade: `make grade`, or `pytest tests/exercises/test_ex02_silu_mul.py --impl=exercises`.
"""
from __future__ import annotations

import torch

from llmlab.kernels import enable_interpreter_if_no_cuda

# On a machine without CUDA, Triton must be told to interpret before any @triton.jit runs.
enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Program (row, block): out[row, cols] = silu(x[row, cols]) * x[row, n + cols]."""
    # 1. row = tl.program_id(0); cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK); mask
    # 2. gate = x[row, cols], up = x[row, n + cols] (row r starts at r * 2 * n), as float32
    # 3. store silu(gate) * up to out[row, cols] (row r of out starts at r * n)
    pass


def silu_mul(x):
    """silu(x[..., :n]) * x[..., n:]. See kernels_explained/silu_mul.md."""
    raise NotImplementedError("ex02: write _silu_mul_kernel above, then delete this line")
    # x:   [num_tokens, 2 * n]  (gate | up; any leading dims)
    # out: [num_tokens, n]
    assert x.shape[-1] % 2 == 0, f"last dim {x.shape[-1]} must be even (gate | up)"
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n).contiguous()  # contiguous rows: row r starts at r * 2n
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and n > 0:
        block = min(triton.next_power_of_2(n), 1024)
        grid = (x2.shape[0], triton.cdiv(n, block))  # (row, column block)
        _silu_mul_kernel[grid](x2, out, n, BLOCK=block)
    return out.reshape(*x.shape[:-1], n)
