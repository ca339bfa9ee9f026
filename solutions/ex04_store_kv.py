"""Exercise 04 -- write new K/V rows into the paged cache through the slot mapping.
Difficulty: ** (easy)

Read first: notebooks/04_paged_kv_cache.ipynb and kernels_explained/store_kv.md.

Task
    Write `_store_kv_kernel`. The KV cache is split into blocks of block_size token slots
    (PagedAttention). For each new token the engine computed a slot,

        slot = block_table[position // block_size] * block_size + position % block_size,

    so token t's key and value rows go to cache block slot // block_size, row
    slot % block_size. A slot < 0 marks a padding token: write nothing. One program
    copies one kv head of one token. The spec is `llmlab.kernels.reference.store_kv`;
    the launcher `store_kv` has its signature, so
    `llmlab.kernels.override(store_kv=store_kv)` runs the whole model on your kernel.

Shapes
    k, v:             [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]  (written in place)
    slot_mapping:     [num_tokens] integer, -1 for padding
    Returns None.

Hints
    - Load the slot as int64 before multiplying by strides: a big cache has more than
      2**31 elements.
    - `if slot < 0: return` ends a program early.
    - Address the cache with its strides (the launcher passes them), so that the block
      and the offset inside it stay visible: block * stride_block + offset * stride_slot
      + head * stride_head + d.

Grade: `make grade`, or `pytest tests/exercises/test_ex04_store_kv.py --impl=exercises`.
"""
from __future__ import annotations

from llmlab.kernels import enable_interpreter_if_no_cuda

# On a machine without CUDA, Triton must be told to interpret before any @triton.jit runs.
enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     num_kv_heads, stride_block, stride_slot, stride_head,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (token, kv head): copy k[token, head] and v[token, head] to the token's slot."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # a padding token: nothing to write
    block = slot // BLOCK_SIZE   # which cache block ...
    offset = slot % BLOCK_SIZE   # ... and which row inside it
    d = tl.arange(0, HEAD_DIM)
    src = (token * num_kv_heads + head) * HEAD_DIM + d  # k and v are contiguous
    dst = block * stride_block + offset * stride_slot + head * stride_head + d
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + src))
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + src))


def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scales=None, v_scales=None):
    """k_cache/v_cache[slot // block_size, slot % block_size] = k/v[t] for each slot =
    slot_mapping[t] >= 0; in place, returns None. See kernels_explained/store_kv.md."""
    # k, v:             [num_tokens, num_kv_heads, head_dim]
    # k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    # slot_mapping:     [num_tokens] integer, -1 for padding tokens
    # k_scales, v_scales: the per-token scales of an int8/fp8 cache (llmlab's kv_cache_dtype);
    # the exercise's kernel reads float caches, for which the engine passes none.
    assert k_scales is None and v_scales is None, "this exercise's kernel reads float KV caches only"
    num_tokens, num_kv_heads, head_dim = k.shape
    num_blocks, block_size = k_cache.shape[:2]
    assert v.shape == k.shape, f"v {tuple(v.shape)} != k {tuple(k.shape)}"
    assert k_cache.shape == (num_blocks, block_size, num_kv_heads, head_dim), \
        f"k_cache {tuple(k_cache.shape)} does not hold [*, *, {num_kv_heads}, {head_dim}] rows"
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    assert k_cache.stride(-1) == 1, "cache rows must be contiguous in head_dim"
    assert slot_mapping.shape == (num_tokens,)
    assert (head_dim & (head_dim - 1)) == 0, f"head_dim {head_dim} must be a power of two"
    if num_tokens == 0:
        return None
    k, v, slot_mapping = k.contiguous(), v.contiguous(), slot_mapping.contiguous()
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping,
        num_kv_heads, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
    )
    return None
