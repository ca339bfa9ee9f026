"""FlashAttention-2 style causal prefill over a paged KV cache, in Triton.

One program owns BLOCK_M query rows of one head of one sequence. It streams that
sequence's keys and values in tiles of BLOCK_N rows, gathering each row's cache block
through the block table, and keeps a running max and sum of the softmax (online
softmax) so the full score matrix never exists. Queries are the sequence's newest
tokens: query j sits at position seq_len - num_queries + j, which is what lets a prompt
chunk attend to earlier chunks and to a cached prefix (chunked prefill, prefix caching).

The grid is (query tiles of all sequences, heads). Each program finds its sequence from
cu_seqlens_q on the GPU, so a launch never waits for the host to read the query lengths
(and can be captured in a CUDA graph).

A quantized cache (int8 or fp8 codes, a float32 scale per token per kv head) is
dequantized in registers as in decode: codes convert exactly to the query's dtype, key
scales multiply the score columns, value scales the probabilities' columns before P @ V.

The launch variants (prefill_configs.py) also choose tile sizes, whether a program takes all
query heads of a kv head (HEADS > 1: rows are tokens x heads), and whether an 8-bit cache's
blocks are first dequantized into a 16-bit scratch cache (_dequantize_into_scratch), after
which the plain kernel runs.
"""
from __future__ import annotations

import math

import torch

from ..interpreter import enable_interpreter_if_no_cuda
from ..reference import check_scales
from .prefill_configs import FLOAT32_CONFIG, INTERPRETER_CONFIG, PrefillConfig, prefill_config

# Triton decides when it is imported whether kernels run compiled or interpreted: on a
# machine without CUDA, switch the interpreter on first (also when imported directly).
enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, table_row_ptr, kv_head,
                 start_n, seq_len, query_pos, qk_scale,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss,
                 MASKED: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANTIZED: tl.constexpr):
    """Fold keys start_n .. start_n + BLOCK_N into the running softmax (m_i, l_i, acc).
    MASKED tiles apply the causal mask and the seq_len bound; the others need neither."""
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

    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    if QUANTIZED:
        scores = scores * k_scale[None, :]  # q . (c_n * s_n) = (q . c_n) * s_n
    if MASKED:
        visible = (offs_n[None, :] <= query_pos[:, None]) & in_seq[None, :]
        scores = tl.where(visible, scores, float("-inf"))
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
def _find_query_tile(cu_seqlens_q_ptr, num_seqs, tile, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """(sequence, query tile within it) of flat tile number `tile`, the tiles of all
    sequences being numbered one sequence after another. Past the last tile the sequence
    is >= num_seqs. Computed on the GPU, so the launcher never waits for the host."""
    offs_s = tl.arange(0, BLOCK_S)
    starts = tl.load(cu_seqlens_q_ptr + offs_s, mask=offs_s < num_seqs, other=0)
    ends = tl.load(cu_seqlens_q_ptr + offs_s + 1, mask=offs_s < num_seqs, other=0)
    num_tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M  # 0 for empty and padding sequences
    # tiles_end[s] = num_tiles[0] + ... + num_tiles[s]: one past sequence s's last tile (a
    # scan: linear in BLOCK_S, the step's sequences to a power of two; a prompt graph pads
    # them to MAX_PROMPTS = 16, cuda_graphs/prompt.py)
    tiles_end = tl.cumsum(num_tiles, axis=0)
    seq = tl.sum((tiles_end <= tile).to(tl.int32), axis=0)
    first_tile = tl.sum(tl.where(offs_s == seq, tiles_end - num_tiles, 0), axis=0)
    return seq, tile - first_tile


# The block-table width and the number of sequences change from step to step: not
# specialized on, so that they do not each compile a variant.
@triton.jit(do_not_specialize=["stride_table", "num_seqs"])
def _prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr, out_ptr,
    k_scales_ptr, v_scales_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss,
    stride_table,
    num_seqs, num_queries_per_kv,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANTIZED: tl.constexpr, HEADS: tl.constexpr,
):
    # A program's BLOCK_M rows are BLOCK_M // HEADS tokens times HEADS query heads of one kv
    # head (row r: token r // HEADS, head r % HEADS), so the heads that share a kv head share
    # each key and value tile it loads (and dequantizes). HEADS = 1: one head a program.
    TOKENS: tl.constexpr = BLOCK_M // HEADS
    # Number the tiles backwards: a sequence's last tiles see the most keys, and starting
    # them first keeps the longest programs out of the final wave (causal load balance).
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    first_head = tl.program_id(1) * HEADS
    seq, m_block = _find_query_tile(cu_seqlens_q_ptr, num_seqs, tile, TOKENS, BLOCK_S)
    if seq >= num_seqs:
        return  # the grid is an upper bound on the number of tiles
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    num_queries = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - num_queries  # tokens cached before this chunk
    kv_head = first_head // num_queries_per_kv  # grouped-query attention

    offs_r = tl.arange(0, BLOCK_M)
    offs_m = m_block * TOKENS + offs_r // HEADS    # each row's query token within the chunk
    heads = first_head + offs_r % HEADS
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < num_queries
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    query_pos = context_len + offs_m  # padding rows get positions >= seq_len: harmless, never stored

    # Finite start for the running max, so a row whose keys are all masked in a tile
    # gives exp2(-inf - m) = 0 rather than NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table

    # Keys below the first query's position are visible to every row of the tile and lie
    # inside the sequence: those whole tiles skip the mask.
    first_pos = context_len + m_block * TOKENS
    unmasked_end = (first_pos // BLOCK_N) * BLOCK_N
    for start_n in range(0, unmasked_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, table_row_ptr, kv_head,
            start_n, seq_len, query_pos, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss,
            False, BLOCK_SIZE, BLOCK_N, HEAD_DIM, DOT_PRECISION, QUANTIZED)
    # Causal upper bound: the tile's last row sees keys up to its own position; tiles
    # beyond it would be fully masked and are skipped.
    kv_end = tl.minimum(seq_len, first_pos + TOKENS)
    for start_n in range(unmasked_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, table_row_ptr, kv_head,
            start_n, seq_len, query_pos, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss,
            True, BLOCK_SIZE, BLOCK_N, HEAD_DIM, DOT_PRECISION, QUANTIZED)

    out = acc / l_i[:, None]  # every real row saw at least key 0, so l_i > 0
    tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


# The table's width changes from step to step: not specialized on (no variant per width).
@triton.jit(do_not_specialize=["stride_table"])
def _dequantize_blocks_kernel(k_codes_ptr, v_codes_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr, seq_lens_ptr,
                              cu_seqlens_q_ptr, k_out_ptr, v_out_ptr,
                              stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss,
                              stride_table, stride_ob, stride_os, stride_oh,
                              BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (i, j, h): kv head h of block j of sequence i's table, dequantized (codes x
    scales, rounded to the output's dtype) into scratch block i * width + j. Blocks past the
    sequence's end, and sequences with no queries, are skipped: attention never reads them."""
    seq, j, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_queries = tl.load(cu_seqlens_q_ptr + seq + 1) - tl.load(cu_seqlens_q_ptr + seq)
    if j * BLOCK_SIZE >= seq_len or num_queries == 0:
        return
    block = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_table + j).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, HEAD_DIM)
    scale_offs = block * stride_sb + offs_s * stride_ss + kv_head
    k = tl.load(k_codes_ptr + block * stride_kb + offs_s[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :])
    v = tl.load(v_codes_ptr + block * stride_vb + offs_s[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :])
    k = k.to(tl.float32) * tl.load(k_scales_ptr + scale_offs)[:, None]
    v = v.to(tl.float32) * tl.load(v_scales_ptr + scale_offs)[:, None]
    out_offs = ((seq.to(tl.int64) * tl.num_programs(1) + j) * stride_ob + offs_s[:, None] * stride_os
                + kv_head * stride_oh + offs_d[None, :])
    tl.store(k_out_ptr + out_offs, k.to(k_out_ptr.dtype.element_ty))
    tl.store(v_out_ptr + out_offs, v.to(v_out_ptr.dtype.element_ty))


# The largest scratch (K and V) a dequantize-first call allocates; past it the call converts
# in the kernel instead. The scratch holds every table entry of every sequence (num_seqs x
# table width blocks: shapes, so that a launch never waits for the host to read lengths),
# and lives for the call (the caching allocator hands it to the next layer's call).
DEQUANT_SCRATCH_MAX_BYTES = 512 << 20


def _dequantize_into_scratch(k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, cu_seqlens_q, dtype):
    """(k, v, block tables) of a `dtype` scratch cache holding the blocks of `block_tables`
    that the sequences use, dequantized; None when the scratch would pass the limit."""
    num_seqs, width = block_tables.shape
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    shape = (num_seqs * width, block_size, num_kv_heads, head_dim)
    if 2 * math.prod(shape) * dtype.itemsize > DEQUANT_SCRATCH_MAX_BYTES or width == 0:
        return None
    k_out = torch.empty(shape, dtype=dtype, device=k_cache.device)
    v_out = torch.empty_like(k_out)
    _dequantize_blocks_kernel[(num_seqs, width, num_kv_heads)](
        k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, cu_seqlens_q, k_out, v_out,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), k_scales.stride(0), k_scales.stride(1), block_tables.stride(0),
        k_out.stride(0), k_out.stride(1), k_out.stride(2), BLOCK_SIZE=block_size, HEAD_DIM=head_dim)
    tables = torch.arange(num_seqs * width, dtype=torch.int32, device=k_cache.device).view(num_seqs, width)
    return k_out, v_out, tables


def _heads_per_program(config: PrefillConfig, num_queries_per_kv: int) -> int:
    """The query heads a program takes: all of a kv head's when the config packs them (a
    power of two, at least 16 tokens a tile left), else one."""
    group = num_queries_per_kv
    pack = config.pack_gqa and group > 1 and group & (group - 1) == 0 and config.block_m // group >= 16
    return group if pack else 1


def _launch_config(dtype, device, config=None) -> PrefillConfig:
    """The config a call runs: `config` (a PrefillConfig or a name), else the interpreter's,
    float32's or the named default (knobs.prefill_config) for 16-bit queries on a GPU."""
    if isinstance(config, PrefillConfig):
        return config
    if config is None and device.type != "cuda":
        return INTERPRETER_CONFIG
    if config is None and dtype == torch.float32:
        return FLOAT32_CONFIG
    return prefill_config(config)


def runs_gluon(q, k_cache, v_cache) -> bool:
    """Whether a warp-specialized config (`-ws`) runs the Gluon kernel on these operands (a
    16-bit cache, or an 8-bit one's 16-bit scratch), else the Triton kernel with its tiles."""
    if not q.is_cuda:
        return False
    from ..gluon import prefill_attention as gluon_prefill   # imported where it may run (Triton >= 3.5)
    if k_cache.dtype != q.dtype:   # an 8-bit cache: its scratch, contiguous, in q's dtype (one block of it here)
        k_cache = v_cache = torch.empty((1, *k_cache.shape[1:]), dtype=q.dtype, device=q.device)
    return gluon_prefill.supported(q, k_cache, v_cache)


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                      k_scales=None, v_scales=None, config=None, scratch_in_graphs=False):
    """Causal attention of each sequence's new query tokens over its whole paged context,
    from a full-precision or a quantized cache. See kernels_explained/prefill_attention.md.
    `config`: a launch variant (prefill_configs.py; a name or a PrefillConfig), else the default.
    A dequantize-first config makes no scratch while a CUDA graph captures (the graph would keep
    it, sized by padded tables) unless `scratch_in_graphs` (a benchmark timing graph replays)."""
    # q:            [num_tokens, num_heads, head_dim]   queries of all sequences, concatenated
    # k/v_cache:    [num_blocks, block_size, num_kv_heads, head_dim]
    # block_tables: [num_seqs, max_blocks_per_seq] int32
    # cu_seqlens_q: [num_seqs + 1] int   sequence i owns q rows cu[i]:cu[i+1]
    # seq_lens:     [num_seqs] int       cached tokens of sequence i, this chunk included
    # k/v_scales:   [num_blocks, block_size, num_kv_heads] float32, quantized caches only
    # returns out:  [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16)
    quantized = check_scales(k_cache, v_cache, k_scales, v_scales)
    assert v_cache.dtype == k_cache.dtype and (quantized or k_cache.dtype == q.dtype)
    if quantized:
        assert k_scales.stride() == v_scales.stride() and k_scales.stride(-1) == 1
    else:
        k_scales = v_scales = k_cache  # not read: QUANTIZED=False compiles the plain kernel
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} kv heads"
    assert head_dim >= 16 and (head_dim & (head_dim - 1)) == 0, f"head_dim {head_dim} must be a power of two >= 16"
    assert (block_size & (block_size - 1)) == 0, f"block_size {block_size} must be a power of two"
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    assert cu_seqlens_q.shape == (num_seqs + 1,)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1

    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_tables, cu_seqlens_q, seq_lens = block_tables.contiguous(), cu_seqlens_q.contiguous(), seq_lens.contiguous()
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    assert scale > 0, "the kernel takes the running max before scaling, which needs scale > 0"
    launch = _launch_config(q.dtype, q.device, config)
    block_m, block_n = launch.block_m, launch.block_n
    if quantized and launch.dequant_first and (
            scratch_in_graphs or not (q.is_cuda and torch.cuda.is_current_stream_capturing())):
        scratch = _dequantize_into_scratch(k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens,
                                           cu_seqlens_q, q.dtype)
        if scratch is not None:   # from here on a 16-bit cache
            (k_cache, v_cache, block_tables), quantized = scratch, False
            k_scales = v_scales = k_cache
    if launch.warp_specialized:
        if not quantized and runs_gluon(q, k_cache, v_cache):
            from ..gluon import prefill_attention as gluon_prefill
            return gluon_prefill.launch(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out,
                                        scale * math.log2(math.e), stages=launch.num_stages)
        launch = PrefillConfig(launch.block_m, launch.block_n, 8, launch.num_stages)   # the Triton kernel's warps
    heads = _heads_per_program(launch, num_heads // num_kv_heads)
    # Sequence i has cdiv(query_len_i, T) query tiles of T = BLOCK_M / heads tokens, fewer
    # than query_len_i / T + 1, so this bounds the total without reading the lengths on the host.
    grid = (triton.cdiv(num_tokens, block_m // heads) + num_seqs, num_heads // heads)
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, k_scales, v_scales,
        scale * math.log2(math.e),  # softmax in base 2: exp(x * scale) = exp2(x * scale * log2 e)
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scales.stride(0) if quantized else 0, k_scales.stride(1) if quantized else 0,
        block_tables.stride(0),
        num_seqs, num_heads // num_kv_heads,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_S=max(16, triton.next_power_of_2(num_seqs)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # tf32 only affects fp32 inputs
        QUANTIZED=quantized, HEADS=heads, num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    return out
