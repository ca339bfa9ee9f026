"""Notebook 02, RMSNorm, RoPE and SwiGLU: each answer is computed by the kernels themselves."""
from __future__ import annotations

import inspect
import math

import torch

from llmlab import kernels, viz
from llmlab.teach.ground_truth import embedded_config
from llmlab.teach.check import close, integer, integers, number, right, wrong


def full_turns(last_position: int) -> int:
    """Pairs of a head vector that turn at least once around the circle by `last_position`."""
    c = embedded_config()
    inv_freq = c.rope_theta ** (-torch.arange(0, c.head_dim, 2).double() / c.head_dim)   # radians per position
    return int((last_position * inv_freq >= 2 * math.pi).sum())


def q1(answer):
    """Rotate the vector to positions 0-200 instead of 0-15: how many of its 32 pairs turn at least one
    full circle (2π) by position 200?"""
    count = integer(answer)
    if count == full_turns(200):
        return right("pair i turns position x theta^(-2i/64) radians: the first pairs spin fast, the last ones "
                     "barely move in 200 positions (they tell far-apart positions apart).")
    if count == full_turns(15):
        return wrong("that is for positions 0-15; go to position 200.")
    return wrong("pair i turns by position x theta^(-2i/64) radians (the notebook's inv_freq): count the pairs "
                 "for which 200 x inv_freq[i] reaches 2π. rope_theta is in the model's config.")


def q2(answer):
    """Multiply one row x by 10: by what factor does rms_norm(x, weight, eps) change?"""
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(0))
    weight = torch.rand(576, generator=torch.Generator().manual_seed(1)) + 0.5
    ratio = (kernels.rms_norm(10 * x, weight, 1e-5) / kernels.rms_norm(x, weight, 1e-5)).mean().item()
    factor = number(answer)
    if close(factor, ratio, 0.01):
        return right("the row is divided by its own root mean square, which grows 10x too: RMSNorm does not "
                     "see a row's scale, only its direction (up to eps).")
    if close(factor, 10, 0.5) or close(factor, 0.1, 0.01):
        return wrong("rms(10 x) = 10 rms(x): what happens to x / rms(x)?")
    return wrong("try it: kernels.rms_norm(10 * x, weight, eps) against kernels.rms_norm(x, weight, eps).")


def silu_mul_grid(num_rows: int, width: int) -> tuple[int, ...]:
    """The grid the Triton launcher picks for gate_up [num_rows, 2 x width], read off a real launch
    (in the interpreter on a CPU). The kernel file is the one the contract dispatches to."""
    launcher = inspect.getmodule(kernels.get_kernel("silu_mul", backend="triton"))
    with viz.record_launches(launcher) as launches:
        kernels.silu_mul(torch.zeros(num_rows, 2 * width), backend="triton")
    return launches[0].grid


def q3(answer):
    """silu_mul on 4 rows of Llama-3-8B's MLP (gate_up is 4 x (2 x 14336)): what grid does the launcher
    start? Answer a tuple, e.g. (8, 1)."""
    grid = integers(answer)
    if grid == silu_mul_grid(4, 14336):
        return right("one program per row and per 2048 output columns: BLOCK stops growing at 2048.")
    if len(grid) == 2 and grid[1] == 1:
        return wrong("a program's BLOCK stops growing at 2048 columns; 14336 do not fit in one.")
    if len(grid) == 2 and grid[1] == math.ceil(2 * 14336 / 2048):
        return wrong("the program blocks cover the output columns, silu(gate) * up, not gate_up's.")
    return wrong("the grid is (rows, column blocks) and a block is at most 2048 output columns; check with "
                 "viz.record_launches as in the notebook.")


QUESTIONS = {"q1": q1, "q2": q2, "q3": q3}
