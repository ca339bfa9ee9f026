"""decode_attention, the Triton backend's entry: the checks, then one of three kernels.

  full-precision cache            decode_attention_bf16.py (PagedAttention v1, flash-decoding v2)
  8-bit cache, on a Hopper GPU    kernels/gluon/decode_attention_q8.py (codes straight into MMA
                                  fragments; the default variant where it runs)
  8-bit cache, elsewhere          decode_attention_q8.py (fp16 dots on codes turned into fp16
                                  by bit tricks), or the "legacy" variant of the bf16 kernel

The 8-bit variant is a `Q8Config` (q8_configs.py). Every path that splits the context
shares flash-decoding's reduce (flash_decoding.py). See kernels_explained/decode_attention.md
and kv_quantization.md.
"""
from __future__ import annotations

import math

import torch

from ..reference import check_scales
from .decode_attention_bf16 import decode_attention_bf16
from .decode_attention_q8 import decode_attention_q8
from .flash_decoding import choose_num_splits, combine, partials
from .pdl import use_pdl
from .q8_configs import GLUON_FALLBACK, Q8_CONFIGS, q8_config


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=1,
                     k_scales=None, v_scales=None, q8_variant=None, new_token=None):
    """One query token per sequence attending to its seq_lens[i] cached tokens (v1, or
    v2 split-K + reduce when num_splits > 1; 0/None picks with choose_num_splits), from a
    full-precision or a quantized cache. See kernels_explained/decode_attention.md.
    A quantized cache runs the variant q8_variant names (a Q8_CONFIGS name; None:
    $LLMLAB_Q8_DECODE, else the default for this step's shape, q8_configs.default_q8_config).
    new_token: (k, v, positions, inv_freq, slot_mapping), full-precision caches only: the
    bf16 kernel ropes q and k, stores k and v and attends to them from registers
    (rope_store_decode_attention)."""
    # q:            [num_seqs, num_heads, head_dim]
    # k/v_cache:    [num_blocks, block_size, num_kv_heads, head_dim]
    # block_tables: [num_seqs, max_blocks_per_seq] int32
    # seq_lens:     [num_seqs] int
    # k/v_scales:   [num_blocks, block_size, num_kv_heads] float32, quantized caches only
    # returns out:  [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16)
    quantized = check_scales(k_cache, v_cache, k_scales, v_scales)
    assert v_cache.dtype == k_cache.dtype and (quantized or k_cache.dtype == q.dtype)
    if quantized:
        assert k_scales.stride() == v_scales.stride()   # any head stride for the Gluon kernel; 1 for Triton's
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} kv heads"
    assert head_dim >= 16 and (head_dim & (head_dim - 1)) == 0, f"head_dim {head_dim} must be a power of two >= 16"
    assert (block_size & (block_size - 1)) == 0, f"block_size {block_size} must be a power of two"
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    assert seq_lens.shape == (num_seqs,)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1

    if num_seqs == 0:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    assert scale > 0, "the kernel takes the running max before scaling, which needs scale > 0"
    if not num_splits:  # 0 or None: choose (costs a host sync to read the longest context)
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 132
        num_splits = choose_num_splits(num_seqs, num_kv_heads, int(seq_lens.max()), num_sms)
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    if not quantized:
        return decode_attention_bf16(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, None, None,
                                     new_token)
    assert new_token is None, "the fused rope + store path takes full-precision caches"
    config = q8_config(q8_variant, num_seqs, num_kv_heads, num_splits)
    if config.dequant == "legacy":
        return decode_attention_bf16(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits,
                                     k_scales, v_scales)
    if config.dequant == "gluon":
        from ..gluon import decode_attention_q8 as gluon_q8   # imported where it may run (Triton >= 3.5)

        if gluon_q8.supported(q, k_cache, num_heads, num_kv_heads):
            return _run_gluon(gluon_q8, q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, k_scales, v_scales,
                              config)
        config = Q8_CONFIGS[GLUON_FALLBACK]
    return decode_attention_q8(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, k_scales, v_scales,
                               config)


def _run_gluon(gluon_q8, q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, k_scales, v_scales, config):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    partial_out, partial_lse = partials(q, num_splits) if num_splits > 1 else (out, out)
    gluon_q8.launch(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, k_scales, v_scales,
                    out, partial_out, partial_lse, block_n=config.block_n, stages=config.num_stages,
                    max_registers=config.max_registers, use_pdl=use_pdl(q))
    if num_splits > 1:
        combine(partial_out, partial_lse, out, num_splits)
    return out
