"""A decode step's rope, KV store and attention as one launch: the decode-attention kernel
(triton/decode_attention_bf16.py) with ROPE on. Each (sequence, kv head) program ropes its group's
queries in registers; the program whose context range holds the sequence's newest token
ropes that token's key, stores key and value into the token's cache slot, and folds them
into its softmax from registers instead of reading them back. The step launches one kernel
fewer per layer than rope_store_kv + decode_attention, and the rotated queries never go
through memory (kernels_explained/decode_attention.md, "The new token from registers").

A quantized cache runs the pair (rope_store_kv, then the 8-bit decode kernel): quantizing
the new row is rope_store_kv's work, and the 8-bit kernels read codes only."""
from __future__ import annotations

import torch

from .. import reference
from ..interpreter import enable_interpreter_if_no_cuda
from ..reference import check_scales

enable_interpreter_if_no_cuda()   # before Triton is imported, as in every kernel module
from .decode_attention import decode_attention  # noqa: E402
from .rope_store_kv import rope_store_kv  # noqa: E402


def rope_store_decode_attention(q, k, v, positions, theta, scaling, k_cache, v_cache, slot_mapping,
                                block_tables, seq_lens, scale, num_splits=1, k_scales=None, v_scales=None):
    """rope_store_kv(q, k, v, ...) then decode_attention(rotated q, ...), in one launch
    (plus flash-decoding's reduce when num_splits > 1)."""
    # q:            [num_seqs, num_heads, head_dim]     unrotated (token and head strides free:
    # k, v:         [num_seqs, num_kv_heads, head_dim]   views of the fused qkv output)
    # positions:    [num_seqs] integer, slot_mapping: [num_seqs] integer (-1: a padding row)
    # caches, block_tables, seq_lens, scale, num_splits: as in decode_attention
    # returns out:  [num_seqs, num_heads, head_dim]
    if check_scales(k_cache, v_cache, k_scales, v_scales):
        q = rope_store_kv(q, k, v, positions, theta, scaling, k_cache, v_cache, slot_mapping, k_scales, v_scales)
        return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, k_scales, v_scales)
    num_seqs, num_heads, head_dim = q.shape
    assert k.shape == (num_seqs, k_cache.shape[2], head_dim) and v.shape == k.shape, \
        f"k {tuple(k.shape)}, v {tuple(v.shape)}: one row per sequence of {k_cache.shape[2]} kv heads"
    assert q.dtype == k.dtype == v.dtype, "q, k and v come from one projection: one dtype"
    assert positions.shape == (num_seqs,) and not positions.is_floating_point()
    assert slot_mapping.shape == (num_seqs,) and not slot_mapping.is_floating_point()
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if num_seqs == 0:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    inv_freq = reference.rope_inv_freq(head_dim, float(theta), reference.scaling_key(scaling),
                                       str(q.device))  # [head_dim // 2] fp32
    return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits,
                            new_token=(k, v, positions.contiguous(), inv_freq, slot_mapping.contiguous()))
