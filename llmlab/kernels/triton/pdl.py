"""Programmatic dependent launch (PDL, Hopper and newer): a kernel may start while the one
before it in the stream is finishing, and waits inside itself, not in the launch queue.

A decode step at batch 1 is ~320 short kernels back to back; between two of them the GPU
drains one grid, then launches and sets up the next. With PDL each kernel's programs are
placed on the SMs while the previous grid's last programs still run: the setup overlaps,
and only `gdc_wait` (griddepcontrol.wait: until the previous grid has completed and its
writes are visible) stands between them. Every kernel launched this way must call
`wait_for_previous_grid` before it touches memory the previous kernel writes or reads,
which is why it comes first. Kernels that are not launched with PDL (cuBLAS, torch ops)
keep the stream's usual order on both sides.

LLMLAB_PDL=0 turns it off (same results, one launch at a time).

What a kernel reads that no kernel writes (weights) may be read before the wait: the skinny
GEMM asks L2 for the first bytes of its weight rows first (`prefetch_weight_rows`), so they
arrive while the previous kernel finishes; LLMLAB_PREFETCH sets how many KB a program asks
for (0: none)."""
from __future__ import annotations

import functools

import torch

from ..interpreter import enable_interpreter_if_no_cuda
from ..tuning import knobs

enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(tensor: torch.Tensor) -> bool:
    """Whether kernels reading `tensor` should be launched with PDL (a CUDA device of compute
    capability 9.0 or more, and not turned off)."""
    return knobs.pdl and tensor.is_cuda and _supported(tensor.device.index if tensor.device.index is not None
                                         else torch.cuda.current_device())


def launch_options(tensor: torch.Tensor) -> dict:
    """The launch keywords and the USE_PDL constexpr for a kernel about to read `tensor`."""
    return {"USE_PDL": True, "launch_pdl": True} if use_pdl(tensor) else {}


@triton.jit
def wait_for_previous_grid(USE_PDL: tl.constexpr):
    """First thing in a PDL-launched kernel: wait until the previous grid is done, then let
    the next grid's programs be placed (they wait in turn)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# Bytes of its weight rows a skinny-GEMM program asks L2 for before it waits (PDL only):
# ~32 KB a program, so the first wave's asks stay a few MB. Measured on the H200 (BENCHMARKS.md,
# `bench single-forward`, paired in one call): a 64-sequence decode step 5.79-5.91 ms with it,
# 5.88-6.01 without.
# The batch-1 GEMV does not use it: there it made the step slower (4.35-4.37 ms, not 4.26).
# knobs.prefetch_kb (LLMLAB_PREFETCH=<KB per program>) sets it, 0 turns it off.


def prefetch_lines(tensor: torch.Tensor, rows_per_program: int, row_bytes: int) -> int:
    """How many 128-byte lines of each weight row a program prefetches into L2 before
    `wait_for_previous_grid` (0: none; without PDL there is nothing to overlap)."""
    kb = knobs.prefetch_kb
    if kb <= 0 or not use_pdl(tensor):
        return 0
    lines = max(1, min(row_bytes // 128, (kb << 10) // (rows_per_program * 128)))
    return 1 << (lines.bit_length() - 1)   # a power of two (tl.arange)


@triton.jit
def prefetch_weight_rows(w_ptr, rows, stride_wn, K, LINES: tl.constexpr):
    """Ask L2 for the first LINES 128-byte lines of weight rows `rows` (PTX prefetch: no
    register is written and nothing waits). A kernel calls it before
    wait_for_previous_grid: weights are no kernel's output, so their first bytes can be
    on their way while the previous kernel finishes, and the loads that follow the wait
    find them in L2 instead of starting cold."""
    if LINES > 0:
        step: tl.constexpr = 128 // (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
        cols = tl.minimum(tl.arange(0, LINES) * step, K - 1)
        ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
