"""Exercise 03 -- rotary position embedding (RoPE) in Triton.  Difficulty: ** (easy)

Read first: notebooks/02_rmsnorm_rope_swiglu.ipynb and kernels_explained/rope.md.

Task
    Write `_rope_kernel`. RoPE rotates each head vector x of a token at position p, in
    pairs: with HF's "rotate half" layout the pair is (x[i], x[i + D/2]) and it turns by
    the angle p * inv_freq[i]:

        out[i]       = x[i] * cos - x[i + D/2] * sin
        out[i + D/2] = x[i + D/2] * cos + x[i] * sin

    One program rotates one head of one token. The launcher runs the kernel twice, over
    the query heads and over the key heads, and computes inv_freq (theta^(-2i/D), with
    LLaMA-3.1's frequency scaling when given) on the host. The spec is
    `llmlab.kernels.reference.rope`; the launcher `rope` has its signature, so
    `llmlab.kernels.override(rope=rope)` runs the whole model on your kernel.

Shapes
    q [num_tokens, num_heads, head_dim], k [num_tokens, num_kv_heads, head_dim],
    positions [num_tokens] integers, inv_freq [head_dim // 2] float32.
    Returns new tensors (q_rotated, k_rotated) of the same shapes.

Hints
    - The launcher makes the inputs contiguous: head h of token t starts at
      (t * num_heads + h) * head_dim.
    - Load the two halves as two [HALF] vectors (offsets `tl.arange(0, HALF)` and
      `HALF + tl.arange(0, HALF)`); no mask is needed, HALF is a power of two.
    - The angle is position * inv_freq in float32; `tl.cos` / `tl.sin` take vectors.

Grade: `make grade`, or `pytest tests/exercises/test_ex03_rope.py --impl=exercises`.
"""
from __future__ import annotations

import torch

from llmlab.kernels import enable_interpreter_if_no_cuda, reference

# On a machine without CUDA, Triton must be told to interpret before any @triton.jit runs.
enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _rope_kernel(x_ptr, out_ptr, positions_ptr, inv_freq_ptr, num_heads, HALF: tl.constexpr):
    """Program (token, head): rotate the pairs (x[i], x[i + HALF]) of one head vector."""
    # 1. token = tl.program_id(0), head = tl.program_id(1), offs = tl.arange(0, HALF)
    # 2. angle = position of the token * inv_freq[offs]; cos, sin of it
    # 3. load the two halves x1, x2 of head `head` of token `token`
    # 4. store x1 * cos - x2 * sin and x2 * cos + x1 * sin to the same place in out
    pass


def rope(q, k, positions, theta, scaling=None):
    """Rotate q and k by position (HF "rotate half" layout, LLaMA-3.1 frequency scaling).
    See kernels_explained/rope.md."""
    raise NotImplementedError("ex03: write _rope_kernel above, then delete this line")
    # q:         [num_tokens, num_heads, head_dim]
    # k:         [num_tokens, num_kv_heads, head_dim]
    # positions: [num_tokens] integer
    # returns (q_out, k_out), new tensors of the same shapes
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim), f"k {tuple(k.shape)} vs q {tuple(q.shape)}"
    assert positions.shape == (num_tokens,), f"positions {tuple(positions.shape)} != ({num_tokens},)"
    assert head_dim % 2 == 0 and (head_dim & (head_dim - 1)) == 0, f"head_dim {head_dim} must be a power of two"
    q, k, positions = q.contiguous(), k.contiguous(), positions.contiguous()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if num_tokens == 0:
        return q_out, k_out
    # The frequencies depend only on head_dim, theta and the scaling: computed once, on the host.
    inv_freq = reference.rope_inv_freq(head_dim, float(theta), reference.scaling_key(scaling),
                                       str(q.device))  # [head_dim // 2] float32
    _rope_kernel[(num_tokens, num_heads)](q, q_out, positions, inv_freq, num_heads, HALF=head_dim // 2)
    _rope_kernel[(num_tokens, num_kv_heads)](k, k_out, positions, inv_freq, num_kv_heads, HALF=head_dim // 2)
    return q_out, k_out
