"""y = x W^T for a few rows of x (a decode step of 33 to 64 sequences), in Triton.

A decode step of 64 sequences still reads every weight once per step and does little with
it (64 FLOPs per weight element): it is bound by the weights' bytes like the batch-1 GEMV
(triton_gemv.py), but 64 rows are enough to use the tensor cores. Each program computes a
[BLOCK_M, BLOCK_N] tile of y (BLOCK_M: the rows, padded to a power of two >= 16, so every
program holds all of x's rows) over the whole of K, `tl.dot` by `tl.dot`, with the next
slices' loads in flight (num_stages). What decides the speed is the tile count: one tile
per BLOCK_N output features, and fewer programs than the GPU has SMs leaves SMs idle; a
narrower tile re-reads x (from L2) more often. There is no split of K, so no reduction
pass and no atomics: the result does not depend on the launch.

It exists for the same reason as the GEMV: cuBLAS's kernels for these shapes are not
launched with programmatic dependent launch (pdl.py), so each one is a full stop in a
decode step of Triton kernels. See kernels_explained/gemv.md.
"""
from __future__ import annotations

import torch

from . import enable_interpreter_if_no_cuda
from .pdl import launch_options, wait_for_previous_grid
from .triton_gemv import GemvConfig

enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MAX_ROWS = 64


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False):
    wait_for_previous_grid(USE_PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0)    # features past N re-read row 0 and are never stored
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            k_ok = offs_k + k < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def config_for(n: int, k: int) -> GemvConfig:
    """The tile for an [n, k] weight. Measured at 64 rows on the H200 (`llmlab bench gemv
    --rows 64`, Llama-3-8B shapes, us; cuBLAS in brackets): gate_up 60.9 (62.7) and lm_head
    254 (286) with 128-wide tiles of 8 warps; down 33.6 (36.6, plus its split-K reduction)
    and o_proj 11.4 (11.8) with 32-wide tiles and 256-deep slices: 4096 outputs make only
    128 of them, one per SM; qkv 16.4 (16.4) with 64-wide tiles."""
    if n >= 16384:
        return GemvConfig(128, 128, 8, 4)
    if n <= 4096 or k >= 8192:
        return GemvConfig(32, 256, 4, 4)
    return GemvConfig(64, 128, 4, 5)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] with 1 <= M <= 64, weight [N, K] (unit stride along K) -> [M, N] (x's dtype)."""
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= MAX_ROWS and weight.shape[1] == k, f"skinny_gemm takes 1..{MAX_ROWS} rows of {k}"
    assert weight.stride(1) == 1, "weight rows must be contiguous"
    if x.stride(1) != 1:
        x = x.contiguous()
    config = config or config_for(n, k)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _skinny_gemm_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(x))
    return y
