"""Triton's interpreter on a machine without CUDA.

Triton decides at `@triton.jit` time whether a kernel runs compiled or interpreted (its own
helpers too, at `import triton`), so every implementation module calls
`enable_interpreter_if_no_cuda()` before it imports Triton, and `import llmlab.kernels` does. It lives here, not in the contract (`kernels/__init__.py`), so that no
implementation imports the contract that dispatches to it.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch


def enable_interpreter_if_no_cuda() -> None:
    """Switch Triton's interpreter on (TRITON_INTERPRET=1) when torch finds no CUDA device:
    the kernels then run on CPU tensors (slowly, without bf16)."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:   # too late for Triton's own @jit helpers (tl.sum's combine, ...)
            warnings.warn("Triton was imported before llmlab switched its interpreter on (transformers "
                          "imports it): Triton kernels will fail on this CPU-only machine. Set "
                          "TRITON_INTERPRET=1 before importing anything, or import llmlab.kernels first.",
                          stacklevel=2)
        os.environ["TRITON_INTERPRET"] = "1"
