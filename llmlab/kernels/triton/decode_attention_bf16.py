"""Paged decode attention in Triton from a full-precision cache: PagedAttention v1 and
flash-decoding (v2); also the first ("legacy") 8-bit kernel.

Each sequence has one new query token per head. v1 runs one program per (sequence,
kv head): it streams that head's K/V tiles once through the block table and applies
them to all query heads of the GQA group at once, as the rows of one `tl.dot` (padded
to 16 rows, the smallest the tensor cores take). When there are too few such programs
to fill the GPU and the context is long, v2 also splits the context into `num_splits`
ranges of whole tiles: each program writes its range's normalized partial output and
log-sum-exp, and a second kernel combines the ranges (Dao et al., "Flash-Decoding"; with
knobs.combine_in_launch the last program of each (sequence, kv head) to finish does).

From a quantized cache (int8 or fp8 codes, one float32 scale per token per kv head) a
tile is dequantized in registers, folded into the two products: codes convert exactly to
the query's dtype, the key scales multiply the score columns, and the value scales the
probabilities' columns before P @ V. The cache is read as 8-bit codes and never rewritten.
"""
from __future__ import annotations

import math

import torch

from ..interpreter import enable_interpreter_if_no_cuda

# Triton decides when it is imported whether kernels run compiled or interpreted: on a
# machine without CUDA, switch the interpreter on first (also when imported directly).
enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from .flash_decoding import combine, partials  # noqa: E402
from .pdl import launch_options, wait_for_previous_grid  # noqa: E402
from ..tuning import knobs  # noqa: E402


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, table_row_ptr, kv_head,
                 start_n, seq_len, qk_scale,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANTIZED: tl.constexpr):
    """Fold keys start_n .. start_n + BLOCK_N (those below seq_len) into the running
    softmax of every query head of the group."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_seq = offs_n < seq_len
    # Paged gather: key row n lives in cache block table[n // BLOCK_SIZE], slot n % BLOCK_SIZE.
    block_idx = tl.load(table_row_ptr + offs_n // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
    k_offs = block_idx * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    v_offs = block_idx * stride_vb + (offs_n % BLOCK_SIZE) * stride_vs + kv_head * stride_vh
    k = tl.load(k_cache_ptr + k_offs[:, None] + offs_d[None, :], mask=in_seq[:, None], other=0.0)
    v = tl.load(v_cache_ptr + v_offs[:, None] + offs_d[None, :], mask=in_seq[:, None], other=0.0)
    if QUANTIZED:
        s_offs = block_idx * stride_sb + (offs_n % BLOCK_SIZE) * stride_ss + kv_head
        k_scale = tl.load(k_scales_ptr + s_offs, mask=in_seq, other=0.0)  # [BLOCK_N] float32
        v_scale = tl.load(v_scales_ptr + s_offs, mask=in_seq, other=0.0)
        k, v = k.to(q.dtype), v.to(q.dtype)  # codes (|c| <= 127, or e4m3 values) are exact in q's dtype

    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N], unscaled
    if QUANTIZED:
        scores = scores * k_scale[None, :]  # q . (c_n * s_n) = (q . c_n) * s_n
    scores = tl.where(in_seq[None, :], scores, float("-inf"))
    # Running max in scaled log2 units; scaling inside exp2's argument makes it one FMA.
    m_new = tl.maximum(m_i, tl.max(scores, axis=1) * qk_scale)
    p = tl.exp2(scores * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if QUANTIZED:
        p = p * v_scale[None, :]  # sum_n p_n (c_n * s_n) = sum_n (p_n * s_n) c_n
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _rope_angles(positions_ptr, inv_freq_ptr, seq, dtype, HEAD_DIM: tl.constexpr):
    """cos and [-sin | sin] over the head's channels at the token's position, rounded to the
    input dtype as the reference (and HF) round them: rope's x * cos + partner * signed_sin,
    with partner[d] = x[(d + D/2) % D]."""
    offs_d = tl.arange(0, HEAD_DIM)
    angle = tl.load(positions_ptr + seq).to(tl.float32) * tl.load(inv_freq_ptr + offs_d % (HEAD_DIM // 2))
    cos = tl.cos(angle).to(dtype).to(tl.float32)
    sin = tl.sin(angle).to(dtype).to(tl.float32)
    return cos, tl.where(offs_d < HEAD_DIM // 2, -sin, sin)


@triton.jit
def _load_new_token(k_new_ptr, v_new_ptr, slot_mapping_ptr, seq, kv_head, stride_kns, stride_knh, stride_vns,
                    stride_vnh, HEAD_DIM: tl.constexpr):
    """The newest token's key (and its rope partner), value and slot: loaded before the loop,
    so that their latency hides behind the tiles' instead of lengthening the program's end."""
    offs_d = tl.arange(0, HEAD_DIM)
    k_row = k_new_ptr + seq.to(tl.int64) * stride_kns + kv_head * stride_knh
    k = tl.load(k_row + offs_d)
    partner = tl.load(k_row + (offs_d + HEAD_DIM // 2) % HEAD_DIM)
    v = tl.load(v_new_ptr + seq.to(tl.int64) * stride_vns + kv_head * stride_vnh + offs_d)
    return k, partner, v, tl.load(slot_mapping_ptr + seq).to(tl.int64)


@triton.jit
def _new_token(q, m_i, l_i, acc, k, partner, v, slot, k_cache_ptr, v_cache_ptr, kv_head, cos, signed_sin, qk_scale,
               stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
               BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The sequence's newest token: rotate its key, store key and value into its cache slot
    (none for slot -1, a padding row), and fold it into the running softmax from registers.
    Only this program writes that kv head's row, and no program of this launch reads it."""
    offs_d = tl.arange(0, HEAD_DIM)
    k = (k.to(tl.float32) * cos + partner.to(tl.float32) * signed_sin).to(k.dtype)
    if slot >= 0:
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        tl.store(k_cache_ptr + block * stride_kb + offset * stride_ks + kv_head * stride_kh + offs_d,
                 k.to(k_cache_ptr.dtype.element_ty))
        tl.store(v_cache_ptr + block * stride_vb + offset * stride_vs + kv_head * stride_vh + offs_d,
                 v.to(v_cache_ptr.dtype.element_ty))
    # the cache's rounding of k and v, as the tiles would have read them
    k = k.to(k_cache_ptr.dtype.element_ty).to(tl.float32)
    v = v.to(v_cache_ptr.dtype.element_ty).to(tl.float32)
    score = tl.sum(q.to(tl.float32) * k[None, :], axis=1)   # [BLOCK_G]
    m_new = tl.maximum(m_i, score * qk_scale)
    p = tl.exp2(score * qk_scale - m_new)
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + p, acc * alpha[:, None] + p[:, None] * v[None, :]


# Ints that change from step to step are not specialized on (Triton would compile a variant
# each for == 1, divisible by 16 and other values): the block-table width and the splits.
@triton.jit(do_not_specialize=["stride_table", "num_splits"])
def _decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr, k_scales_ptr, v_scales_ptr,
    k_new_ptr, v_new_ptr, positions_ptr, inv_freq_ptr, slot_mapping_ptr,
    qk_scale,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss,
    stride_table, stride_kns, stride_knh, stride_vns, stride_vnh,
    num_heads, num_queries_per_kv, num_splits, counters_ptr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANTIZED: tl.constexpr, ROPE: tl.constexpr = False,
    COMBINE: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    wait_for_previous_grid(USE_PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    head_ok = offs_g < num_queries_per_kv  # BLOCK_G pads the group to a power of two >= 16
    heads = kv_head * num_queries_per_kv + offs_g
    q_rows = q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=head_ok[:, None], other=0.0)  # padding rows: zero queries
    if ROPE:  # q is not rotated yet: rope here, in fp32, rounded as rope's output is
        cos, signed_sin = _rope_angles(positions_ptr, inv_freq_ptr, seq, q_ptr.dtype.element_ty, HEAD_DIM)
        partner = tl.load(q_rows + ((offs_d + HEAD_DIM // 2) % HEAD_DIM)[None, :], mask=head_ok[:, None], other=0.0)
        q = (q.to(tl.float32) * cos[None, :] + partner.to(tl.float32) * signed_sin[None, :]).to(q.dtype)

    # This program's key range: everything for v1; for v2 a run of whole tiles, so that
    # only the sequence's last tile is ever partial.
    if SPLIT:
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
        start = split * tiles_per_split * BLOCK_N
        end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    else:
        start = 0
        end = seq_len

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)  # finite: exp2(-inf - m) stays 0, not NaN
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
    # One loop, every tile masked: the last, partial tile's loads are then issued while the
    # tile before it computes, like the others. A second loop for it alone (unmasked full
    # tiles first) drains the pipeline before it: at 64 sequences x 513 tokens 39.9 us
    # against 39.0, though 251.5 against 254.0 us when no tile is partial (64 x 4096).
    # With ROPE the sequence's newest token (the last of seq_len) is not read from the cache:
    # the program whose range holds it stores it there and folds it in from registers.
    loop_end = tl.minimum(end, seq_len - 1) if ROPE else end
    if ROPE:
        k_new, k_partner, v_new, new_slot = _load_new_token(k_new_ptr, v_new_ptr, slot_mapping_ptr, seq, kv_head,
                                                            stride_kns, stride_knh, stride_vns, stride_vnh, HEAD_DIM)
    for start_n in range(start, loop_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, table_row_ptr, kv_head,
            start_n, loop_end, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, DOT_PRECISION, QUANTIZED)
    if ROPE:
        if (start <= seq_len - 1) & (seq_len - 1 < end):
            m_i, l_i, acc = _new_token(q, m_i, l_i, acc, k_new, k_partner, v_new, new_slot, k_cache_ptr, v_cache_ptr,
                                       kv_head, cos, signed_sin, qk_scale,
                                       stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                       BLOCK_SIZE, HEAD_DIM)

    # An empty range (a split past the end of a short sequence) has l_i = 0: it writes a
    # zero output and lse = -inf, which the reduce weighs by exp2(-inf) = 0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        row = (seq * num_heads + heads).to(tl.int64) * num_splits + split  # [S, H, num_splits] layout
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=head_ok[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + row, lse, mask=head_ok)
        if COMBINE:
            # the last of the (sequence, kv head)'s split programs to finish combines them all
            # (the skinny GEMM's split-K pattern, dense/skinny_gemm.py): the barrier puts every
            # thread's stores before the count, and .cg reads L2, where the others' stores are
            tl.debug_barrier()
            counter = counters_ptr + seq * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                first = (seq * num_heads + heads).to(tl.int64) * num_splits
                lse_max = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)   # finite if every split was empty
                for other in range(num_splits):
                    lse_max = tl.maximum(lse_max, tl.load(partial_lse_ptr + first + other, mask=head_ok,
                                                          other=float("-inf"), cache_modifier=".cg"))
                total = tl.zeros([BLOCK_G], dtype=tl.float32)
                acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
                for other in range(num_splits):
                    weight = tl.exp2(tl.load(partial_lse_ptr + first + other, mask=head_ok, other=float("-inf"),
                                             cache_modifier=".cg") - lse_max)
                    partial = tl.load(partial_out_ptr + (first + other)[:, None] * HEAD_DIM + offs_d[None, :],
                                      mask=head_ok[:, None], other=0.0, cache_modifier=".cg")
                    total += weight
                    acc += weight[:, None] * partial
                out = acc / tl.where(total > 0, total, 1.0)[:, None]
                tl.store(out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                         out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
                tl.store(counter, 0)   # the next call (or graph replay) starts at 0
    else:
        tl.store(out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


# With knobs.combine_in_launch (LLMLAB_COMBINE_IN_LAUNCH=1) split steps combine their ranges
# in the attention launch itself (COMBINE), one launch fewer than flash_decoding.combine after
# it, while a step's (sequence, kv head) pairs fit the counters: one int32 each, per device,
# made on the first (eager) call, so graph capture allocates nothing, and left at 0 by every
# call. Off until timed on a GPU.
MAX_COUNTERS = 1 << 16
_counters: dict[torch.device, torch.Tensor] = {}


def _split_counters(device: torch.device) -> torch.Tensor:
    if device not in _counters:
        _counters[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def _launch_config(head_dim, dtype, device):
    """(BLOCK_N, num_warps, num_stages) for this problem."""
    if device.type != "cuda":
        return 32, 4, 1  # interpreter: a small BLOCK_N exercises multi-tile paths on short inputs
    # Tuned on an H200 (Llama-3-8B shapes): 64-row tiles, the next tile's loads in flight.
    return 64, 4, 2


def decode_attention_bf16(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, k_scales, v_scales,
                          new_token=None):
    """This file's kernel, called by `decode_attention.decode_attention` after its checks
    (num_splits >= 1; k/v_scales None for a full-precision cache, else the legacy 8-bit path).
    new_token: (k, v, positions, inv_freq, slot_mapping), full-precision caches only: q is not
    rotated yet and each sequence's last token is not in the cache; the kernel ropes q and k,
    stores k and v and attends to them from registers (rope_store_decode_attention)."""
    # q:            [num_seqs, num_heads, head_dim]
    # k/v_cache:    [num_blocks, block_size, num_kv_heads, head_dim]
    # block_tables: [num_seqs, max_blocks_per_seq] int32, contiguous; seq_lens: [num_seqs], contiguous
    # k/v_scales:   [num_blocks, block_size, num_kv_heads] float32, or None
    # returns out:  [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    quantized = k_scales is not None
    if not quantized:
        k_scales = v_scales = k_cache  # not read: QUANTIZED=False compiles the plain kernel
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if new_token is None:   # the ROPE=False kernel does not read these
        k_new = v_new = positions = inv_freq = slot_mapping = seq_lens
        new_strides = (0, 0, 0, 0)
    else:
        assert not quantized, "the fused rope + store path takes full-precision caches"
        k_new, v_new, positions, inv_freq, slot_mapping = new_token
        new_strides = (k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1))
    assert not quantized or k_scales.stride(-1) == 1, "this kernel reads a slot's kv-head scales side by side"
    group = num_heads // num_kv_heads
    block_n, num_warps, num_stages = _launch_config(head_dim, q.dtype, q.device)
    split = num_splits > 1
    partial_out, partial_lse = partials(q, num_splits) if split else (out, out)  # unused when SPLIT=False
    in_kernel = split and knobs.combine_in_launch and num_seqs * num_kv_heads <= MAX_COUNTERS
    counters = _split_counters(q.device) if in_kernel else seq_lens   # not read without COMBINE
    _decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, partial_out, partial_lse, k_scales, v_scales,
        k_new, v_new, positions, inv_freq, slot_mapping,
        scale * math.log2(math.e),  # softmax in base 2: exp(x * scale) = exp2(x * scale * log2 e)
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scales.stride(0) if quantized else 0, k_scales.stride(1) if quantized else 0,
        block_tables.stride(0), *new_strides,
        num_heads, group, num_splits, counters,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, SPLIT=split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # tf32 only affects fp32 inputs
        QUANTIZED=quantized, ROPE=new_token is not None, COMBINE=in_kernel, num_warps=num_warps,
        num_stages=num_stages, **launch_options(q),
    )
    if split and not in_kernel:
        combine(partial_out, partial_lse, out, num_splits)
    return out
