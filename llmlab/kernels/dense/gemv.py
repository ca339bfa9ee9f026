"""y = x W^T for one row of x: the matrix product of a batch-1 decode step, in Triton.

At batch 1 every linear layer streams its whole weight to multiply it by one vector, so
the step's time is the weights' bytes over the memory bandwidth. cuBLAS runs these shapes
as split-K GEMMs (a tile of K per program, then a `splitKreduce` launch): on the H200 the
Llama-3-8B step's weights stream at well under the copy rate (BENCHMARKS.md). This kernel
is the plain GEMV instead: each program owns BLOCK_N output features and walks the whole
of K in BLOCK_K slices, multiplying in fp32 on the CUDA cores (a tensor core would be idle
at M = 1) and summing once at the end. Small BLOCK_N gives every SM several programs, so
enough bytes are in flight to hide the memory latency without a second pass over K.

The sum runs in a different order from cuBLAS's, so results differ in the last bits of
bf16 (both accumulate in fp32). See kernels_explained/gemv.md.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from ..interpreter import enable_interpreter_if_no_cuda
from ..triton.pdl import launch_options, wait_for_previous_grid

enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@dataclasses.dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1   # the skinny GEMM only: programs per output tile along K (the GEMV has none)
    block_m: int = 0   # the skinny GEMM only: rows per tile (0: every row in one tile)

    @property
    def name(self) -> str:
        split = f"-split{self.split_k}" if self.split_k != 1 else ""
        rows = f"-m{self.block_m}" if self.block_m else ""
        return f"n{self.block_n}-k{self.block_k}-w{self.num_warps}-s{self.num_stages}{split}{rows}"

    @classmethod
    def from_name(cls, name: str) -> "GemvConfig":
        """The config a `name` spells: nN-kK-wW-sS, optionally -splitS or -mM."""
        match = re.fullmatch(r"n(\d+)-k(\d+)-w(\d+)-s(\d+)(?:-split(\d+))?(?:-m(\d+))?", name)
        if match is None:
            raise ValueError(f"not a config name (nN-kK-wW-sS[-splitS][-mM]): {name!r}")
        *tile, split, rows = match.groups()
        return cls(*(int(part) for part in tile), int(split or 1), int(rows or 0))


GEMV_CONFIGS = {c.name: c for c in (
    GemvConfig(4, 1024, 4, 1), GemvConfig(8, 512, 4, 2), GemvConfig(8, 1024, 4, 1), GemvConfig(8, 1024, 8, 2),
    GemvConfig(16, 256, 4, 3), GemvConfig(16, 512, 4, 2), GemvConfig(16, 512, 8, 3), GemvConfig(16, 1024, 8, 1),
    GemvConfig(16, 1024, 8, 2), GemvConfig(32, 256, 4, 3), GemvConfig(32, 512, 8, 2), GemvConfig(32, 256, 8, 4),
)}


def config_for(n: int, k: int) -> GemvConfig:
    """The variant for an [n, k] weight. Measured on the H200 (`llmlab bench gemv`, Llama-3-8B
    shapes, us; cuBLAS in brackets): gate_up 55.6 (57.1) and lm_head 235 (250) with
    n16-k256-w4-s3; o_proj 10.4 (13.3) and down 29.0 (32.0) with n16-k1024-w8-s2; qkv 14.1
    (15.7) with n16-k512-w8-s3. Wide outputs have programs enough for short K slices and
    deep pipelines; narrow ones (few programs per SM) want long slices and 8 warps."""
    if n >= 16384:
        return GEMV_CONFIGS["n16-k256-w4-s3"]
    if n <= 4096 or k >= 8192:
        return GEMV_CONFIGS["n16-k1024-w8-s2"]
    return GEMV_CONFIGS["n16-k512-w8-s3"]


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_wn, norm_ptr, residual_ptr, eps,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 NORM: tl.constexpr = False, RESIDUAL: tl.constexpr = False, SWIGLU: tl.constexpr = False,
                 USE_PDL: tl.constexpr = False):
    """y[n] = w[n] . x, and the steps folded around it (kernels_explained/gemv.md):
    NORM: x is RMS-normalized first, its weight at norm_ptr (the row's scale, known only after
    the whole of K, is applied to the sum: y = (w . (x * norm)) * rsqrt(mean(x^2) + eps));
    SWIGLU: x is silu_mul's input [gate | up] of 2K and the product is of silu(gate) * up;
    RESIDUAL: y + residual[n] is stored, rounded as the unfused add."""
    wait_for_previous_grid(USE_PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_n = tl.where(n_ok, offs_n, 0)   # rows past N re-read row 0 and are never stored
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_k
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")   # each weight is read once
            x = tl.load(x_ptrs).to(tl.float32)
            if SWIGLU:
                up = tl.load(x_ptrs + K).to(tl.float32)
            if NORM:
                scale = tl.load(norm_ptr + k + offs_k).to(tl.float32)
        else:
            k_ok = offs_k + k < K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            if SWIGLU:
                up = tl.load(x_ptrs + K, mask=k_ok, other=0.0).to(tl.float32)
            if NORM:
                scale = tl.load(norm_ptr + k + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if SWIGLU:   # the roundings of triton/silu_mul, in its order
            silu = (x / (1.0 + tl.exp(-x))).to(x_ptr.dtype.element_ty).to(tl.float32)
            x = (silu * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        if NORM:
            squares += x * x
            x = x * scale
        acc += w.to(tl.float32) * x[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if NORM:
        y = y * tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    if RESIDUAL:   # round the product first, as linear's output would be, then the sum
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32) + tl.load(residual_ptr + offs_n).to(tl.float32)
    # rounded to x's dtype, as a product's output is, whatever y's (float32 logits)
    tl.store(y_ptr + offs_n, y.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None, *,
         norm: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
         swiglu: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [1, K] (or [K]), weight [N, K] with unit stride along K -> [1, N] (x's dtype).

    Folded in, each optional: `norm` (weight [K]) and `eps`: x is rms_norm(x, norm, eps)
    first; `swiglu`: x is [1, 2K], and silu_mul(x) is multiplied; `residual` [1, N]: the result
    is residual + x W^T; `out_dtype`: the result's (float32 logits), its values still rounded
    to x's dtype first."""
    n, k = weight.shape
    config = config or config_for(n, k)
    width = 2 * k if swiglu else k
    assert x.shape[-1] == width and x.numel() == width, f"gemv takes one row of {width}, got {tuple(x.shape)}"
    assert weight.stride(1) == 1, "weight rows must be contiguous"
    x = x.reshape(width)
    if x.stride(0) != 1:
        x = x.contiguous()
    if norm is not None:
        assert norm.shape == (k,) and norm.is_contiguous(), f"norm weight must be [{k}], got {tuple(norm.shape)}"
    if residual is not None:
        assert residual.numel() == n and residual.dtype == x.dtype, "residual must be one row of the output"
        residual = residual.reshape(n).contiguous()
    y = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, y, n, k, weight.stride(0), x if norm is None else norm, x if residual is None else residual,
        float(eps), BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0,
        NORM=norm is not None, RESIDUAL=residual is not None, SWIGLU=swiglu,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(x))
    return y
