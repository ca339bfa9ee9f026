"""Exercise 12 -- store K/V rows in an int8 cache (codes + a scale per row), and read them back.
Difficulty: ** (easy, after ex04)

Read first: notebooks/13_kv_cache_quantization.ipynb and kernels_explained/kv_quantization.md
(ex04's store_kv, which this extends, is in kernels_explained/store_kv.md).

Task
    Write `_quantized_store_kv_kernel` and `_dequantize_slots_kernel`. With
    EngineConfig(kv_cache_dtype="int8") the cache holds, for each token and kv head, D int8
    codes and one float32 scale, so that row ~= codes * scale (kernels.reference.quantize):

        absmax = max(max_d |x[d]|, 1e-12)         # the row's largest magnitude
        codes  = floor(x * (127 / absmax) + 0.5)  # the largest lands on +-127; round half up
        codes  = clamp(codes, -127, 127), stored as int8
        scale  = absmax / 127                     # stored at the same slot, in k_scales / v_scales

    Token t goes to slot = slot_mapping[t] as in ex04 (block slot // block_size, row
    slot % block_size; slot < 0 is padding: write nothing), its codes into the cache and
    its scale into the scales tensor at the same (block, row, head). The read back,
    `dequantize_slots`, gathers the rows of some slots and returns codes * scale in
    float32 -- what an attention kernel does with each key and value row it loads. One
    program handles one kv head of one token (of one slot, for the read).
    `llmlab.kernels.override(store_kv=store_kv)` runs an int8-cache engine on your kernel.

Shapes
    k, v:               [num_tokens, num_kv_heads, head_dim] float32 (or 16-bit)
    k_cache, v_cache:   [num_blocks, block_size, num_kv_heads, head_dim] int8 (written in place)
    slot_mapping:       [num_tokens] integer, -1 for padding
    k_scales, v_scales: [num_blocks, block_size, num_kv_heads] float32 (written in place)
    dequantize_slots(cache, scales, slots [n]) -> [n, num_kv_heads, head_dim] float32

Hints
    - Do the arithmetic in float32 (`.to(tl.float32)` after the load), and compute
      127 / absmax once: the reference does exactly this, so on a CPU your codes must
      match it bit for bit.
    - Triton's float -> int8 cast truncates toward zero: round with tl.floor(y + 0.5) first.
    - The scale of a row is one number: `tl.store(scale_ptr, value)` with a scalar works.
    - A scales tensor has its own strides (one fewer dim than the cache): pass them too.

Grade: `make grade`, or `pytest tests/exercises/test_ex12_quantized_store_kv.py --impl=exercises`.
"""
from __future__ import annotations

import torch

from llmlab.kernels import enable_interpreter_if_no_cuda

# On a machine without CUDA, Triton must be told to interpret before any @triton.jit runs.
enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _quantize_row(src, dst, scale_dst, HEAD_DIM: tl.constexpr):
    """codes of the HEAD_DIM values at src to dst (int8), their scale to scale_dst."""
    # 1. x = the HEAD_DIM values at src, as float32
    # 2. absmax = max(max |x|, 1e-12); codes = clamp(floor(x * (127 / absmax) + 0.5), -127, 127)
    # 3. store codes (as int8) at dst, absmax / 127 at scale_dst
    pass


@triton.jit
def _quantized_store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scales_ptr, v_scales_ptr,
                               num_kv_heads, stride_block, stride_slot, stride_head,
                               stride_scale_block, stride_scale_slot,
                               BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (token, kv head): quantize k[token, head] and v[token, head] into the token's slot."""
    # 1. token, head = the program ids; slot = slot_mapping[token] as int64; padding returns
    # 2. block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    # 3. quantize k[token, head] into k_cache / k_scales at (block, offset, head), v likewise
    #    (_quantize_row above does one row: write it first)
    pass


@triton.jit
def _dequantize_slots_kernel(cache_ptr, scales_ptr, slots_ptr, out_ptr, num_kv_heads,
                             stride_block, stride_slot, stride_head, stride_scale_block, stride_scale_slot,
                             BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (row, kv head): out[row, head] = codes * scale of slot slots[row]."""
    # 1. row, head = the program ids; slot = slots[row] as int64; block, offset as in store_kv
    # 2. codes = the HEAD_DIM int8 values of (block, offset, head); scale = its one float32
    # 3. store codes * scale (float32) at out[row, head]
    pass


def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scales=None, v_scales=None):
    """Quantize each k/v[t] row into the int8 caches at slot slot_mapping[t] >= 0, its scale
    into k/v_scales at the same slot; in place, returns None. See kernels_explained/kv_quantization.md."""
    raise NotImplementedError("ex12: write _quantize_row and _quantized_store_kv_kernel above, then delete this line")
    # k, v:               [num_tokens, num_kv_heads, head_dim]
    # k_cache, v_cache:   [num_blocks, block_size, num_kv_heads, head_dim] int8
    # slot_mapping:       [num_tokens] integer, -1 for padding tokens
    # k_scales, v_scales: [num_blocks, block_size, num_kv_heads] float32
    num_tokens, num_kv_heads, head_dim = k.shape
    num_blocks, block_size = k_cache.shape[:2]
    assert k_scales is not None and v_scales is not None and k_cache.dtype == torch.int8, \
        "this exercise writes int8 caches with their scales (an engine with kv_cache_dtype='int8')"
    assert v.shape == k.shape, f"v {tuple(v.shape)} != k {tuple(k.shape)}"
    assert k_cache.shape == (num_blocks, block_size, num_kv_heads, head_dim), \
        f"k_cache {tuple(k_cache.shape)} does not hold [*, *, {num_kv_heads}, {head_dim}] rows"
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride() and k_cache.stride(-1) == 1
    assert k_scales.shape == v_scales.shape == k_cache.shape[:3] and k_scales.dtype == v_scales.dtype == torch.float32
    assert k_scales.stride() == v_scales.stride() and k_scales.stride(-1) == 1
    assert slot_mapping.shape == (num_tokens,)
    assert (head_dim & (head_dim - 1)) == 0, f"head_dim {head_dim} must be a power of two"
    if num_tokens == 0:
        return None
    k, v, slot_mapping = k.contiguous(), v.contiguous(), slot_mapping.contiguous()
    _quantized_store_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales,
        num_kv_heads, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scales.stride(0), k_scales.stride(1),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
    )
    return None


def dequantize_slots(cache, scales, slots):
    """The rows of `slots`, dequantized: cache[slot] * scales[slot] as float32 [n, Hkv, D]."""
    raise NotImplementedError("ex12: write _dequantize_slots_kernel above, then delete this line")
    # cache:  [num_blocks, block_size, num_kv_heads, head_dim] int8
    # scales: [num_blocks, block_size, num_kv_heads] float32
    # slots:  [n] integer, each in [0, num_blocks * block_size)
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    assert scales.shape == cache.shape[:3] and cache.stride(-1) == 1 and scales.stride(-1) == 1
    out = torch.empty(slots.shape[0], num_kv_heads, head_dim, dtype=torch.float32, device=cache.device)
    if slots.shape[0] == 0:
        return out
    _dequantize_slots_kernel[(slots.shape[0], num_kv_heads)](
        cache, scales, slots.contiguous(), out, num_kv_heads,
        cache.stride(0), cache.stride(1), cache.stride(2), scales.stride(0), scales.stride(1),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
    )
    return out
