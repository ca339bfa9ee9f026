"""Triton's interpreter on a machine without CUDA.

Triton decides at `@triton.jit` time whether a kernel runs compiled or interpreted, so
every implementation module calls `enable_interpreter_if_no_cuda()` before it imports
Triton. It lives here, not in the contract (`kernels/__init__.py`), so that no
implementation imports the contract that dispatches to it.
"""
from __future__ import annotations

import os

import torch


def enable_interpreter_if_no_cuda() -> None:
    """Switch Triton's interpreter on (TRITON_INTERPRET=1) when torch finds no CUDA device:
    the kernels then run on CPU tensors (slowly, without bf16)."""
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
