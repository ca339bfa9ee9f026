"""Write each new token's K and V rows into the paged cache, in Triton: one program per
token copies all of its kv heads to the slot the block manager assigned it."""
from __future__ import annotations

from . import enable_interpreter_if_no_cuda

# Triton decides when it is imported whether kernels run compiled or interpreted: on a
# machine without CUDA, switch the interpreter on first (also when imported directly).
enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # a padding token: nothing to write
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < num_kv_heads)[:, None]
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
    tl.store(k_dst + offs_h[:, None] * stride_kc_head + offs_d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + offs_h[:, None] * stride_vc_head + offs_d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    """k_cache/v_cache[slot // block_size, slot % block_size] = k/v[t] for slot =
    slot_mapping[t] >= 0; in place, returns None. See kernels_explained/store_kv.md."""
    # k, v:             [num_tokens, num_kv_heads, head_dim]
    # k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    # slot_mapping:     [num_tokens] integer, -1 for padding tokens
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape, f"v {tuple(v.shape)} != k {tuple(k.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim), \
        f"k_cache {tuple(k_cache.shape)} does not hold [*, *, {num_kv_heads}, {head_dim}] rows"
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
    assert slot_mapping.shape == (num_tokens,) and not slot_mapping.is_floating_point()
    assert (head_dim & (head_dim - 1)) == 0, f"head_dim {head_dim} must be a power of two"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches must be contiguous in head_dim"
    if num_tokens == 0:
        return None
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping.contiguous(),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_H=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, num_warps=4,
    )
    return None
