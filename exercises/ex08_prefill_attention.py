"""Exercise 08 -- FlashAttention prefill over a paged KV cache.  Difficulty: **** (hard)

Read first: notebooks/03_flash_attention_prefill.ipynb, notebooks/04_paged_kv_cache.ipynb
and kernels_explained/prefill_attention.md (exercises 05 and 06 come first).

Task
    Write `_prefill_attention_kernel`. A prefill batch holds the new query tokens of
    several sequences back to back: sequence s owns query rows cu_seqlens_q[s] ..
    cu_seqlens_q[s+1] - 1, and has seq_lens[s] tokens in the cache in total, this chunk's
    K/V included (store_kv ran first). Its queries are its *newest* tokens, so query j
    sits at position

        context_len + j,   context_len = seq_len - num_queries

    and, causally, sees keys 0 .. context_len + j. (context_len > 0 is a later chunk of a
    long prompt -- chunked prefill -- or a prompt whose prefix was cached.)

    One program computes a tile of BLOCK_M query rows of one sequence for one head
    (FlashAttention-2): it walks the keys in tiles of BLOCK_N, gathering them through the
    block table (exercise 06), scores the whole tile with one `tl.dot`, masks what the
    causal rule hides, and keeps a running max, sum and output accumulator per query row
    (exercise 05's online softmax, on [BLOCK_M] vectors). The spec is
    `llmlab.kernels.reference.prefill_attention`; the launcher has its signature, so
    `llmlab.kernels.override(prefill_attention=prefill_attention)` runs the model's
    prompt processing on your kernel.

Shapes
    q [num_tokens, num_heads, head_dim] (all sequences' queries, concatenated);
    caches [num_blocks, block_size, num_kv_heads, head_dim]; block_tables [num_seqs,
    max_blocks_per_seq] int32; cu_seqlens_q [num_seqs + 1]; seq_lens [num_seqs];
    out [num_tokens, num_heads, head_dim]. The grid is (num_seqs, num_heads,
    query tiles of the longest sequence): a program whose tile starts past its sequence's
    queries returns at once. A sequence may have 0 queries this step.

Hints
    - Rows of the tile past num_queries: mask their q load and their store.
    - Causal upper bound: the tile's last row sits at context_len + (m_block + 1) * BLOCK_M - 1;
      keys past it are hidden from every row, so the key loop can stop at
      min(seq_len, context_len + (m_block + 1) * BLOCK_M).
    - Mask per score: key n is visible to row j if n <= query_pos[j] and n < seq_len.
    - `tl.dot(a, b, input_precision="ieee")` keeps float32 exact enough to match the
      reference; `tl.trans(k)` turns [BLOCK_N, D] into [D, BLOCK_N].
    - acc [BLOCK_M, HEAD_DIM] is rescaled per row: `acc * alpha[:, None]`.

Grade: `make grade`, or `pytest tests/exercises/test_ex08_prefill_attention.py --impl=exercises`.
"""
from __future__ import annotations

import torch

from llmlab.kernels import enable_interpreter_if_no_cuda

# On a machine without CUDA, Triton must be told to interpret before any @triton.jit runs.
enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

BLOCK_M = 32  # query rows per program
BLOCK_N = 16  # keys per tile (tl.dot wants at least 16 rows and columns)


@triton.jit
def _prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr, out_ptr,
    scale, num_heads, num_kv_heads, max_blocks_per_seq,
    stride_block, stride_slot, stride_head,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (sequence, head, query tile): causal attention of BLOCK_M query rows over
    the sequence's paged context, with an online softmax per row."""
    # 1. seq, head, m_block = the program ids; this sequence's q_start and num_queries
    #    (return if the tile starts past them); seq_len, context_len, kv_head
    # 2. the tile's rows offs_m, their positions query_pos, and q [BLOCK_M, HEAD_DIM]
    # 3. m [BLOCK_M] = -1e30, l [BLOCK_M] = 0, acc [BLOCK_M, HEAD_DIM] = 0
    # 4. for each key tile up to the causal bound: gather k, v through the block table;
    #      scores = tl.dot(q, tl.trans(k)) * scale, -inf where not visible; online softmax
    # 5. store acc / l[:, None] for the rows that exist
    pass


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                      k_scales=None, v_scales=None):
    """Causal attention of each sequence's new query tokens over its whole paged context.
    See kernels_explained/prefill_attention.md."""
    raise NotImplementedError("ex08: write _prefill_attention_kernel above, then delete this line")
    # q:            [num_tokens, num_heads, head_dim]   queries of all sequences, concatenated
    # k/v_cache:    [num_blocks, block_size, num_kv_heads, head_dim]
    # block_tables: [num_seqs, max_blocks_per_seq] int32
    # cu_seqlens_q: [num_seqs + 1] int   sequence s owns q rows cu[s]:cu[s+1]
    # seq_lens:     [num_seqs] int       cached tokens of sequence s, this chunk included
    # returns out:  [num_tokens, num_heads, head_dim]
    # k_scales, v_scales: the per-token scales of an int8/fp8 cache (llmlab's kv_cache_dtype);
    # the exercise's kernel reads float caches, for which the engine passes none.
    assert k_scales is None and v_scales is None, "this exercise's kernel reads float KV caches only"
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape
    assert v_cache.stride() == k_cache.stride() and k_cache.stride(-1) == 1
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} kv heads"
    assert head_dim >= 16 and (head_dim & (head_dim - 1)) == 0, f"head_dim {head_dim} must be a power of two >= 16"
    assert block_tables.shape[0] == num_seqs and cu_seqlens_q.shape == (num_seqs + 1,)
    q, block_tables = q.contiguous(), block_tables.contiguous()
    cu_seqlens_q, seq_lens = cu_seqlens_q.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    # The grid needs the longest query count, read on the host (simple; the engine's
    # kernel finds its tiles on the GPU instead, to avoid waiting for the host).
    max_queries = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    grid = (num_seqs, num_heads, triton.cdiv(max_queries, BLOCK_M))
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out,
        scale, num_heads, num_kv_heads, block_tables.shape[1],
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )
    return out
