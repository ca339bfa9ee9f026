"""y = x W^T for a few rows of x (a decode step of 33 to 64 sequences), in Triton.

A decode step of 64 sequences still reads every weight once per step and does little with
it (64 FLOPs per weight element): it is bound by the weights' bytes like the batch-1 GEMV
(dense/gemv.py), but 64 rows are enough to use the tensor cores. Each program computes a
[BLOCK_M, BLOCK_N] tile of y (BLOCK_M: the rows, padded to a power of two >= 16, so every
program holds all of x's rows) over the whole of K, `tl.dot` by `tl.dot`, with the next
slices' loads in flight (num_stages). What decides the speed is the tile count: one tile
per BLOCK_N output features, and fewer programs than the GPU has SMs leaves SMs idle; a
narrower tile re-reads x (from L2) more often.

A config with split_k > 1 gives each tile SPLIT_K programs, each over its share of K: wide
tiles (a 128-wide one reads x from L2 4x less often than a 32-wide one) and still ~128
programs on a 4096-wide weight. The reduction is in the same launch and in a fixed order:
each program stores its fp32 partial in a workspace and counts itself on the tile's
counter; the last one sums the partials 0..SPLIT_K-1 and resets the counter. No atomics
touch y, so the bits do not depend on which program finishes first.

It exists for the same reason as the GEMV: cuBLAS's kernels for these shapes are not
launched with programmatic dependent launch (triton/pdl.py), so each one is a full stop in a
decode step of Triton kernels. See kernels_explained/gemv.md.
"""
from __future__ import annotations

import torch

from ..interpreter import enable_interpreter_if_no_cuda
from ..triton.pdl import launch_options, prefetch_lines, prefetch_weight_rows, wait_for_previous_grid
from .gemv import GemvConfig

enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MAX_ROWS = 64
# The kernel holds all of x's rows in one tile: the engine sends it 33-64 (triton/linear.py);
# `llmlab bench gemv --rows 128,192,256` times tiles without split-K up to MORE_ROWS against
# cuBLAS, the rows of the offline benchmark's large decode steps (kernels_explained/gemv.md).
MORE_ROWS = 256
# Split-K scratch, per (device, split count, padded N, tiles): never freed, so a CUDA graph
# that captured a launch keeps reading live memory. The first (eager) call of a tiling
# allocates it for MAX_ROWS rows whatever its own row count, so graph capture, which always
# follows an eager run of the same step (cuda_graphs/decode.py), allocates nothing. One set
# serves every weight of that tiling: the engine's kernels run on one stream, one at a time,
# and every call leaves its tile counters at 0, so no call sees another's state. (Two skinny
# GEMMs of one tiling on two streams at once would need their own buffers.)
_split_buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


@triton.jit
def _tile_product(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, offs_m, offs_n, k_lo, k_hi,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, norm_ptr, eps, NORM: tl.constexpr):
    """acc[BLOCK_M, BLOCK_N] = x[:, k_lo:k_hi] @ w[offs_n, k_lo:k_hi]^T in fp32 (k_lo and
    k_hi at whole BLOCK_K slices; the slice past K is masked unless EVEN_K). NORM (the whole
    of K in one program): of rms_norm(x) with its weight at norm_ptr, each row's scale applied
    to the sum: (x * norm) @ w^T * rsqrt(mean(x^2) + eps)."""
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    rows = tl.where(offs_n < N, offs_n, 0)    # features past N re-read row 0 and are never stored
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            if NORM:
                scale = tl.load(norm_ptr + k + offs_k).to(tl.float32)
        else:
            k_ok = offs_k + k < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            if NORM:
                scale = tl.load(norm_ptr + k + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if NORM:
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, axis=1)
            x = (xf * scale[None, :]).to(x_ptr.dtype.element_ty)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if NORM:
        acc = acc * tl.rsqrt(squares / K + eps)[:, None]
    return acc


@triton.jit
def _store_tile(y_ptr, acc, M, N, stride_ym, offs_m, offs_n, residual_ptr, stride_rm, RESIDUAL: tl.constexpr,
                x_dtype: tl.constexpr):
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if RESIDUAL:   # round the product first, as linear's output would be, then the sum
        residual = tl.load(residual_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0)
        acc = acc.to(x_dtype).to(tl.float32) + residual.to(tl.float32)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    # rounded to x's dtype, as a product's output is, whatever y's (float32 logits)
    tl.store(y_ptrs, acc.to(x_dtype).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, counter_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        norm_ptr, residual_ptr, stride_rm, eps, m_tiles,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT_K: tl.constexpr = 1,
                        NORM: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
                        PREFETCH_LINES: tl.constexpr = 0, USE_PDL: tl.constexpr = False):
    """y = x @ w^T over tiles of BLOCK_N features; NORM (SPLIT_K 1 only): of rms_norm(x) with
    the weight at norm_ptr; RESIDUAL: y + residual is stored (see _tile_product, _store_tile).
    m_tiles > 1 (SPLIT_K 1 only): BLOCK_M rows a tile, the row tiles of one weight tile in
    consecutive programs, so that the weight tile is read from HBM once and from L2 after."""
    pid_m = tl.program_id(0) % m_tiles
    pid_n = tl.program_id(0) // m_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SPLIT_K == 1:  # the first bytes of this tile's weight rows, while the previous kernel finishes
        prefetch_weight_rows(w_ptr, tl.where(offs_n < N, offs_n, 0), stride_wn, K, PREFETCH_LINES)
    wait_for_previous_grid(USE_PDL)
    if SPLIT_K == 1:   # the whole of K in this program; ws_ptr and counter_ptr are unused
        acc = _tile_product(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, offs_m, offs_n, 0, K,
                            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION, norm_ptr, eps, NORM)
        _store_tile(y_ptr, acc, M, N, stride_ym, offs_m, offs_n, residual_ptr, stride_rm, RESIDUAL,
                    x_ptr.dtype.element_ty)
    else:
        # program (pid_n, pid_k) takes slices [pid_k * S / SPLIT_K, (pid_k + 1) * S / SPLIT_K)
        # of the S = cdiv(K, BLOCK_K): shares differ by one slice at most, and are empty
        # (a zero partial) when S < SPLIT_K
        pid_k = tl.program_id(1)
        slices = tl.cdiv(K, BLOCK_K)
        k_lo = (pid_k * slices // SPLIT_K) * BLOCK_K
        k_hi = ((pid_k + 1) * slices // SPLIT_K) * BLOCK_K
        acc = _tile_product(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, offs_m, offs_n, k_lo, k_hi,
                            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION, norm_ptr, eps, False)
        # the partial goes to workspace[pid_k, :, tile] (padded: no masks), then the tile's
        # counter counts it; the barrier makes every thread's stores come before the count
        n_pad = tl.num_programs(0) * BLOCK_N
        ws_tile = ws_ptr + offs_m[:, None] * n_pad + offs_n[None, :]
        tl.store(ws_tile + pid_k * BLOCK_M * n_pad, acc)
        tl.debug_barrier()
        done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            # the last of the tile's programs sums the partials in a fixed order (0, 1, ...),
            # whichever finished last, so the result is the same bits every call; .cg reads
            # L2, where the other SMs' stores are, not a stale line of this SM's L1 (its own
            # partial is reloaded too: keeping it in registers through the sum spilled them)
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(ws_tile + s * BLOCK_M * n_pad, cache_modifier=".cg")
            _store_tile(y_ptr, total, M, N, stride_ym, offs_m, offs_n, residual_ptr, stride_rm, RESIDUAL,
                        x_ptr.dtype.element_ty)
            tl.store(counter_ptr + pid_n, 0)   # the next call (or graph replay) starts at 0


@triton.jit
def _swiglu_gemm_kernel(x_ptr, w_ptr, h_ptr, M, I, K, stride_xm, stride_wn, stride_hm,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False):
    """h[:, n] = silu(x @ w[n]^T) * (x @ w[I + n]^T) for BLOCK_N of the I features: the gate
    and up rows of one feature in the same program, so each SwiGLU output is made once."""
    wait_for_previous_grid(USE_PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    rows = tl.where(offs_n < I, offs_n, 0).to(tl.int64)   # features past I re-read row 0, never stored
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w_g = tl.load(g_ptrs, eviction_policy="evict_first")
            w_u = tl.load(u_ptrs, eviction_policy="evict_first")
        else:
            k_ok = offs_k + k < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_g = tl.load(g_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            w_u = tl.load(u_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        acc_g = tl.dot(x, tl.trans(w_g), acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(x, tl.trans(w_u), acc_u, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    # The roundings of gate_up's output and of triton/silu_mul, in their order.
    dtype = h_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    h_ptrs = h_ptr + offs_m[:, None] * stride_hm + offs_n[None, :]
    tl.store(h_ptrs, (silu * up).to(dtype), mask=m_ok[:, None] & (offs_n < I)[None, :])


def swiglu_gemm(x: torch.Tensor, gate_up: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """silu_mul(x @ gate_up^T) in one launch: x [M, K] with 1 <= M <= 64, gate_up [2I, K]
    (gate rows, then up rows) -> h [M, I]. The config's block_n counts gate_up rows, as for
    skinny_gemm (each program takes block_n / 2 features, so block_n rows of the weight)."""
    m, k = x.shape
    assert 1 <= m <= MAX_ROWS and gate_up.shape[1] == k and gate_up.shape[0] % 2 == 0, (x.shape, gate_up.shape)
    assert gate_up.stride(1) == 1, "weight rows must be contiguous"
    if x.stride(1) != 1:
        x = x.contiguous()
    features = gate_up.shape[0] // 2
    config = config or config_for(2 * features, k)
    block_n = max(16, config.block_n // 2)
    h = torch.empty((m, features), dtype=x.dtype, device=x.device)
    _swiglu_gemm_kernel[(triton.cdiv(features, block_n),)](
        x, gate_up, h, m, features, k, x.stride(0), gate_up.stride(0), h.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(x))
    return h


def _split_k_buffers(device: torch.device, split_k: int, n_pad: int, n_tiles: int):
    """(fp32 workspace [split_k, MAX_ROWS, n_pad], int32 zeros [n_tiles]) for this device
    and tiling, made on its first call and reused by every later one (see _split_buffers)."""
    key = (device, split_k, n_pad, n_tiles)   # 96 outputs: n_pad 128 in 1 tile of 128 or 2 of 64
    if key not in _split_buffers:
        _split_buffers[key] = (torch.empty(split_k * MAX_ROWS * n_pad, dtype=torch.float32, device=device),
                               torch.zeros(n_tiles, dtype=torch.int32, device=device))
    return _split_buffers[key]


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


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None, *,
                norm: torch.Tensor | None = None, eps: float = 0.0,
                residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] with 1 <= M <= 64 (up to MORE_ROWS without split-K), weight [N, K] (unit
    stride along K) -> [M, N] (x's dtype).

    Folded in, each optional: `norm` (weight [K]) and `eps`: x is rms_norm(x, norm, eps)
    first (tiles without split-K only); `residual` [M, N]: the result is residual + x W^T;
    `out_dtype`: the result's (float32 logits), its values still rounded to x's dtype first."""
    m, k = x.shape
    n = weight.shape[0]
    config = config or config_for(n, k)
    most = MAX_ROWS if config.split_k > 1 else MORE_ROWS
    assert 1 <= m <= most and weight.shape[1] == k, f"skinny_gemm takes 1..{most} rows of {k} with this tile"
    assert not (config.block_m and config.split_k > 1), "a tile splits K or rows, not both"
    assert config.block_m == 0 or (config.block_m >= 16 and config.block_m & (config.block_m - 1) == 0), \
        f"block_m must be 0 or a power of two >= 16 (tl.dot's rows), got {config.block_m}"
    assert weight.stride(1) == 1, "weight rows must be contiguous"
    if x.stride(1) != 1:
        x = x.contiguous()
    if norm is not None:
        assert norm.shape == (k,) and norm.is_contiguous(), f"norm weight must be [{k}], got {tuple(norm.shape)}"
        assert config.split_k == 1, "a split-K tile sees part of a row: it cannot normalize it"
    if residual is not None:
        assert residual.shape == (m, n) and residual.dtype == x.dtype, "residual must match the output"
        if residual.stride(1) != 1:
            residual = residual.contiguous()
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    n_tiles = triton.cdiv(n, config.block_n)
    block_m = max(16, triton.next_power_of_2(m))
    if config.block_m and config.block_m < block_m:
        block_m = config.block_m
    m_tiles = triton.cdiv(m, block_m)
    if config.split_k == 1:
        workspace = counters = y   # not read: the SPLIT_K == 1 kernel has no reduction
    else:
        workspace, counters = _split_k_buffers(x.device, config.split_k, n_tiles * config.block_n, n_tiles)
    _skinny_gemm_kernel[(n_tiles * m_tiles, config.split_k)](
        x, weight, y, workspace, counters, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        x if norm is None else norm, y if residual is None else residual,
        0 if residual is None else residual.stride(0), float(eps), m_tiles,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        SPLIT_K=config.split_k, NORM=norm is not None, RESIDUAL=residual is not None,
        PREFETCH_LINES=prefetch_lines(x, config.block_n, k * weight.element_size()),
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(x))
    return y
