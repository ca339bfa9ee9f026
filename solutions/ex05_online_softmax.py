"""Exercise 05 -- online softmax: a row longer than a tile, in two passes.
Difficulty: ** (the idea behind FlashAttention)

Read first: notebooks/03_flash_attention_prefill.ipynb and kernels_explained/online_softmax.md.

Task
    Write `_online_softmax_kernel`. softmax(x)_j = exp(x_j - m) / l, where m = max(x)
    (subtracted so exp never overflows) and l = sum_j exp(x_j - m). A program that sees
    its row one tile of BLOCK columns at a time does not know m until the end -- the
    online softmax (Milakov & Gimelshein, 2018) keeps a running max m and a running sum
    l of exp(x - m) and, whenever a tile raises the max, rescales what it summed so far:

        m_new = max(m, max(tile))
        l     = l * exp(m - m_new) + sum(exp(tile - m_new))

    Pass 1 walks the row once to get m and l; pass 2 walks it again to write
    exp(x - m) / l. (FlashAttention applies the same rescale to its output accumulator,
    which removes pass 2: exercises 06-08.) Graded against `torch.softmax(x, dim=-1)`.

Shapes
    x: [num_rows, num_cols] (leading dims flattened), any num_cols; out: same shape.
    BLOCK is fixed at 64 columns, so most rows span several tiles.

Hints
    - Masked lanes must not count: load them as -inf, so exp(-inf - m) = 0.
    - Start the running max at a large finite negative number (-1e30), not -inf: if a
      whole tile is -inf, exp(m - m_new) must be exp(0) = 1, not exp(-inf + inf) = NaN.
    - A scalar can be carried through a `for` loop: `m = tl.maximum(m, tl.max(x, axis=0))`.

Grade: `make grade`, or `pytest tests/exercises/test_ex05_online_softmax.py --impl=exercises`.
"""
from __future__ import annotations

import torch

from llmlab.kernels import enable_interpreter_if_no_cuda

# On a machine without CUDA, Triton must be told to interpret before any @triton.jit runs.
enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

BLOCK = 64  # columns per tile: small on purpose, so a row of a few hundred takes several


@triton.jit
def _online_softmax_kernel(x_ptr, out_ptr, num_cols, BLOCK: tl.constexpr):
    """One program = one row: pass 1 finds max and sum of exp online, pass 2 normalizes."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * num_cols
    out_row = out_ptr + row * num_cols

    # Pass 1. Invariant after each tile: m = max of the columns seen so far, and
    # l = sum over them of exp(x - m).
    m = -1.0e30  # finite, so that exp(m - m_new) is never exp(-inf + inf) = NaN
    l = 0.0
    for start in range(0, num_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < num_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # The terms summed so far were exp(x - m); under the new max they are
        # exp(x - m_new) = exp(x - m) * exp(m - m_new): rescale the sum, then add the tile.
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new

    # Pass 2: now that m and l are final, every probability is one exp and one divide.
    for start in range(0, num_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < num_cols, other=float("-inf")).to(tl.float32)
        tl.store(out_row + cols, tl.exp(x - m) / l, mask=cols < num_cols)


def online_softmax(x):
    """softmax over the last dim, each row read in tiles of BLOCK columns. See
    kernels_explained/online_softmax.md."""
    # x:   [num_rows, num_cols]  (any leading dims)
    # out: [num_rows, num_cols]
    num_cols = x.shape[-1]
    x2 = x.reshape(-1, num_cols).contiguous()  # contiguous rows: row r starts at r * num_cols
    out = torch.empty_like(x2)
    if x2.shape[0] > 0 and num_cols > 0:
        _online_softmax_kernel[(x2.shape[0],)](x2, out, num_cols, BLOCK=BLOCK)
    return out.reshape(x.shape)
