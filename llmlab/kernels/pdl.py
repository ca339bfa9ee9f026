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

LLMLAB_PDL=0 turns it off (same results, one launch at a time)."""
from __future__ import annotations

import functools
import os

import torch

from . import enable_interpreter_if_no_cuda

enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9 and os.environ.get("LLMLAB_PDL", "1") != "0"


def use_pdl(tensor: torch.Tensor) -> bool:
    """Whether kernels reading `tensor` should be launched with PDL (a CUDA device of compute
    capability 9.0 or more, and not turned off)."""
    return tensor.is_cuda and _supported(tensor.device.index if tensor.device.index is not None
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
