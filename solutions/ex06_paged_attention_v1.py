"""Exercise 06 -- PagedAttention v1: decode attention over a paged KV cache.
Difficulty: *** (medium)

Read first: notebooks/05_paged_attention_v1_v2.ipynb and kernels_explained/decode_attention.md
(and exercises 04 and 05: the slot arithmetic and the online softmax come back here).

Task
    Write `_paged_attention_v1_kernel`. In a decode step every sequence has one new query
    token; per head, its output is

        out = softmax(q . K^T * scale) V

    over the sequence's seq_len cached keys and values. The cache is paged: key n of
    sequence s lives in block block_tables[s, n // block_size], row n % block_size. One
    program computes one (sequence, query head): it walks the context in tiles of BLOCK_N
    keys, gathers each key's row through the block table, and folds the tile into a
    running softmax (exercise 05), rescaling the output accumulator too:

        m_new = max(m, max(scores));  alpha = exp(m - m_new);  p = exp(scores - m_new)
        l   = l * alpha + sum(p)
        acc = acc * alpha + sum_n p[n] * v[n]          -> out = acc / l at the end

    Grouped-query attention: num_heads query heads share num_kv_heads kv heads, query
    head h reads kv head h // (num_heads // num_kv_heads). The spec is
    `llmlab.kernels.reference.decode_attention`; the launcher `decode_attention` has its
    signature, so `llmlab.kernels.override(decode_attention=decode_attention)` runs the
    model's decode steps on your kernel. v1 ignores num_splits (exercise 07 uses it).

Shapes
    q [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size,
    num_kv_heads, head_dim]; block_tables [num_seqs, max_blocks_per_seq] int32;
    seq_lens [num_seqs]; out [num_seqs, num_heads, head_dim].

Hints
    - One query row is a vector: scores = tl.sum(q[None, :] * k, axis=1) needs no tl.dot.
    - Keys past seq_len: mask their loads (block table entry and K/V rows) and set their
      scores to -inf, so they get probability 0. The grader fills every cache slot no
      sequence owns with NaN: a kernel that reads one returns NaN.
    - Start the running max at -1e30 (finite, see exercise 05).

Grade: `make grade`, or `pytest tests/exercises/test_ex06_paged_attention_v1.py --impl=exercises`.
"""
from __future__ import annotations

import torch

from llmlab.kernels import enable_interpreter_if_no_cuda

# On a machine without CUDA, Triton must be told to interpret before any @triton.jit runs.
enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

BLOCK_N = 16  # keys per tile


@triton.jit
def _paged_attention_v1_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    scale, num_heads, num_kv_heads, max_blocks_per_seq,
    stride_block, stride_slot, stride_head,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (sequence, query head): out = softmax(q K^T * scale) V over the paged context."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    kv_head = head // (num_heads // num_kv_heads)  # grouped-query attention
    seq_len = tl.load(seq_lens_ptr + seq)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (seq * num_heads + head) * HEAD_DIM + d).to(tl.float32)  # [HEAD_DIM]

    m = -1.0e30                                      # running max of the scores
    l = 0.0                                          # running sum of exp(score - m)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)     # running sum of exp(score - m) * v
    for start in range(0, seq_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)            # key positions of this tile
        in_seq = n < seq_len                         # the last tile is partial
        # Paged gather: key n lives in block block_tables[seq, n // BLOCK_SIZE], row n % BLOCK_SIZE.
        block = tl.load(block_tables_ptr + seq * max_blocks_per_seq + n // BLOCK_SIZE,
                        mask=in_seq, other=0).to(tl.int64)
        rows = block * stride_block + (n % BLOCK_SIZE) * stride_slot + kv_head * stride_head  # [BLOCK_N]
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=in_seq[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=in_seq[:, None], other=0.0).to(tl.float32)

        scores = tl.sum(q[None, :] * k, axis=1) * scale    # [BLOCK_N]
        scores = tl.where(in_seq, scores, float("-inf"))  # keys past the end get probability 0
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)       # what was accumulated under the old max, rescaled
        p = tl.exp(scores - m_new)      # [BLOCK_N]
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new

    tl.store(out_ptr + (seq * num_heads + head) * HEAD_DIM + d, acc / l)  # seq_len >= 1, so l > 0


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=1,
                     k_scales=None, v_scales=None):
    """One query token per sequence attending to its seq_lens[i] cached tokens
    (PagedAttention v1; num_splits is ignored). See kernels_explained/decode_attention.md."""
    # q:            [num_seqs, num_heads, head_dim]
    # k/v_cache:    [num_blocks, block_size, num_kv_heads, head_dim]
    # block_tables: [num_seqs, max_blocks_per_seq] int32
    # seq_lens:     [num_seqs] int, each >= 1
    # returns out:  [num_seqs, num_heads, head_dim]
    # k_scales, v_scales: the per-token scales of an int8/fp8 cache (llmlab's kv_cache_dtype);
    # the exercise's kernel reads float caches, for which the engine passes none.
    assert k_scales is None and v_scales is None, "this exercise's kernel reads float KV caches only"
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape
    assert v_cache.stride() == k_cache.stride() and k_cache.stride(-1) == 1
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} kv heads"
    assert (head_dim & (head_dim - 1)) == 0, f"head_dim {head_dim} must be a power of two"
    assert block_tables.shape[0] == num_seqs and seq_lens.shape == (num_seqs,)
    q, block_tables, seq_lens = q.contiguous(), block_tables.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    _paged_attention_v1_kernel[(num_seqs, num_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, out,
        scale, num_heads, num_kv_heads, block_tables.shape[1],
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_N=BLOCK_N,
    )
    return out
