"""Exercise 07 -- flash-decoding (PagedAttention v2): split the context, then reduce.
Difficulty: **** (hard)

Read first: notebooks/05_paged_attention_v1_v2.ipynb and kernels_explained/decode_attention.md
(do exercise 06 first: the split kernel is its kernel over a part of the context).

Task
    In a decode step with few sequences, v1 has only num_seqs * num_heads programs, each
    walking a whole long context: most of a GPU sits idle. Flash-decoding (Dao et al.,
    2023) also splits each context into num_splits ranges of keys, one program per
    (sequence, head, split), and then combines the partial results:

    1. `_split_kernel`: like v1 over keys [start, end) of its split only. It writes the
       split's normalized output o_i = acc / l and its log-sum-exp lse_i = m + log(l)
       (the log of the split's softmax denominator). A split with no keys (start >=
       seq_len, when num_splits is large) writes o_i = 0 and lse_i = -inf.
    2. `_combine_kernel`, one program per (sequence, head): each split's share of the
       whole softmax is proportional to exp(lse_i), so

           out = sum_i exp(lse_i - M) * o_i / sum_i exp(lse_i - M),   M = max_i lse_i

       (subtracting M keeps exp from overflowing; empty splits weigh exp(-inf) = 0).

    The result must equal v1 for any num_splits >= 1. The spec is
    `llmlab.kernels.reference.decode_attention`; the launcher has its signature.

Shapes
    q [num_seqs, num_heads, head_dim]; caches [num_blocks, block_size, num_kv_heads,
    head_dim]; block_tables [num_seqs, max_blocks_per_seq] int32; seq_lens [num_seqs].
    Scratch, float32: partial_out [num_seqs, num_heads, num_splits, head_dim],
    partial_lse [num_seqs, num_heads, num_splits].

Hints
    - Split s covers keys [s * keys_per_split, min((s + 1) * keys_per_split, seq_len))
      with keys_per_split = cdiv(seq_len, num_splits): computed in the kernel, because
      seq_len differs per sequence.
    - Mask keys with `n < end` (not `n < seq_len`): the next split owns the rest.
    - Empty split: l = 0. Guard the division (`tl.where(l > 0, l, 1.0)`) and write -inf.

Grade: `make grade`, or `pytest tests/exercises/test_ex07_flash_decoding.py --impl=exercises`.
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
def _split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, partial_out_ptr, partial_lse_ptr,
    scale, num_heads, num_kv_heads, max_blocks_per_seq, num_splits,
    stride_block, stride_slot, stride_head,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (sequence, query head, split): attention over the split's keys only;
    writes the normalized partial output and its log-sum-exp."""
    # 1. as in exercise 06, plus split = tl.program_id(2) and this split's [start, end)
    # 2. the online-softmax loop over the tiles of [start, end), masking with n < end
    # 3. row = (seq * num_heads + head) * num_splits + split:
    #      partial_out[row] = acc / l (0 if the split was empty), partial_lse[row] = m + log(l) (or -inf)
    pass


@triton.jit
def _combine_kernel(partial_out_ptr, partial_lse_ptr, out_ptr, num_splits,
                    HEAD_DIM: tl.constexpr, BLOCK_SPLITS: tl.constexpr):
    """Program (sequence, head): out = sum_i w_i o_i / sum_i w_i with w_i = exp(lse_i - max lse)."""
    # 1. row = seq * num_heads + head; splits = tl.arange(0, BLOCK_SPLITS), valid = splits < num_splits
    # 2. load the lse of every split (-inf where not valid) and the partial outputs [BLOCK_SPLITS, HEAD_DIM]
    # 3. weights exp(lse - max lse); store sum(weights * outputs) / sum(weights) to out[row]
    pass


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=1,
                     k_scales=None, v_scales=None):
    """One query token per sequence attending to its seq_lens[i] cached tokens, each
    context split into num_splits ranges and the partial results combined
    (flash-decoding). See kernels_explained/decode_attention.md."""
    raise NotImplementedError("ex07: write _split_kernel and _combine_kernel above, then delete this line")
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
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    q, block_tables, seq_lens = q.contiguous(), block_tables.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    partial_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    partial_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    _split_kernel[(num_seqs, num_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, partial_out, partial_lse,
        scale, num_heads, num_kv_heads, block_tables.shape[1], num_splits,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_N=BLOCK_N,
    )
    _combine_kernel[(num_seqs, num_heads)](
        partial_out, partial_lse, out, num_splits,
        HEAD_DIM=head_dim, BLOCK_SPLITS=max(2, triton.next_power_of_2(num_splits)),
    )
    return out
