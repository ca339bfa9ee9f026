"""linear, the Triton backend's entry: decode steps' few rows to Triton's dense kernels,
everything else to the torch backend's product (cuBLAS on a GPU, oneDNN on a CPU).

On a GPU one row (a batch-1 decode step) goes to the GEMV (kernels/dense/gemv.py), 33-64
rows (a decode batch) to the skinny GEMM (dense/skinny_gemm.py): on the H200 each is as
fast as cuBLAS or faster on every Llama-3-8B weight, and both take programmatic dependent
launch (triton/pdl.py), which cuBLAS's kernels do not. knobs.gemv off (LLMLAB_GEMV=0): cuBLAS
for all rows.

Those two kernels can also take the steps around a product (`folds`, kernels.norm_linear and
kernels.linear_residual): the rms_norm before qkv, gate_up and lm_head, the residual add after
o_proj and down, at one row the silu_mul before down, and the logits' cast to float32, so a
decode step runs 66 (one row: 98) launches fewer. knobs.fold_norms (LLMLAB_FOLD_NORMS=1)
turns it on; off until timed on a GPU.
See kernels_explained/gemv.md.
"""
from __future__ import annotations

import torch

from .. import torch_backend
from ..dense import gemv, skinny_gemm   # modules, so that tests can watch their functions
from ..tuning import knobs
from . import silu_mul as triton_silu_mul

_GEMV_DTYPES = (torch.float16, torch.bfloat16)
_SKINNY_ROWS = 64
# 2-32 rows stay with cuBLAS: a decode step of 16 sequences measured 6.17 ms with the skinny
# GEMM and 5.47 ms with cuBLAS (H200, Llama-3-8B), though each weight alone timed the same.
_CUBLAS_ROWS = 32
# gate_up and silu_mul in one skinny launch (skinny_gemm.swiglu_gemm) for 33-64 rows:
# correct, but no faster on the H200 (a 64-sequence step 5.84-5.91 ms with it, 5.84-5.86
# without; kernels_explained/gemv.md), so off unless knobs.swiglu_gemm (LLMLAB_SWIGLU_GEMM=1).


def _triton_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (knobs.gemv and x.is_cuda and x.dim() == 2 and x.shape[0] <= _SKINNY_ROWS and x.dtype in _GEMV_DTYPES
            and weight.dtype == x.dtype and weight.stride(-1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as reference.linear."""
    # x: [rows, in]; weight: [out, in]; bias: [out] or None; returns [rows, out]
    if bias is None and _triton_rows(x, weight) and (x.shape[0] == 1 or x.shape[0] > _CUBLAS_ROWS):
        return _dense(x, weight)
    return torch_backend.linear(x, weight, bias)


def _dense(x: torch.Tensor, weight: torch.Tensor, **folded) -> torch.Tensor:
    """x W^T, with the steps `folded` names folded in: the GEMV for one row, else the skinny GEMM."""
    if x.shape[0] == 1:
        return gemv.gemv(x, weight, **folded)
    return skinny_gemm.skinny_gemm(x, weight, **folded)


def swiglu(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu_mul(x gate_up^T) in one skinny-GEMM launch where LLMLAB_SWIGLU_GEMM=1 and the
    rows would take the skinny GEMM; None where it does not apply (the contract's `swiglu`
    then runs linear and silu_mul)."""
    # x: [rows, in]; gate_up: [2 * intermediate, in], the gate rows then the up rows
    if knobs.swiglu_gemm and _triton_rows(x, gate_up) and x.shape[0] > _CUBLAS_ROWS:
        return skinny_gemm.swiglu_gemm(x, gate_up)
    return None


def folds(x: torch.Tensor) -> bool:
    """Whether a step whose products take x's rows runs them with the norm and the residual
    add folded in: on a GPU at the rows the GEMV (1) or the skinny GEMM (33-64) takes. The
    skinny GEMM's tensor cores take x * norm weight before the row is normalized, rounded to
    x's dtype: bf16 only there (fp16 could overflow where the normalized row would not)."""
    rows = x.shape[0] if x.dim() == 2 else 0
    return (knobs.fold_norms and knobs.gemv and x.is_cuda and x.dtype in _GEMV_DTYPES
            and (rows == 1 or (_CUBLAS_ROWS < rows <= _SKINNY_ROWS and x.dtype == torch.bfloat16)))


def _takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return weight.dtype == x.dtype and weight.stride(-1) == 1 and 1 <= x.shape[0] <= _SKINNY_ROWS


def norm_linear(x: torch.Tensor, norm: torch.Tensor, eps: float, weight: torch.Tensor,
                out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """linear(rms_norm(x, norm, eps), weight).to(out_dtype) in one launch, for rows that `folds`
    (None for a weight the kernels do not take: the contract's norm_linear then runs the pair)."""
    if not _takes(x, weight):
        return None
    return _dense(x, weight, norm=norm.contiguous(), eps=eps, out_dtype=out_dtype)


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                    silu_mul_first: bool = False) -> torch.Tensor | None:
    """residual + linear(x, weight) (of silu_mul(x) with silu_mul_first) for rows that `folds`:
    one launch, silu_mul included at one row; 33-64 rows run silu_mul first (folded into the
    skinny GEMM, each program would read all of x's gate and up halves: 4x the bytes of a
    tile of down's weight). None for a weight the kernels do not take."""
    if not _takes(x, weight):
        return None
    if x.shape[0] == 1:
        return _dense(x, weight, residual=residual, swiglu=silu_mul_first)
    if silu_mul_first:
        x = triton_silu_mul.silu_mul(x)
    return _dense(x, weight, residual=residual)
