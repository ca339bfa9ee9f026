"""Paged decode attention (v1 and v2) from an 8-bit KV cache: int8 or fp8 e4m3 codes, one
float32 scale per token per kv head.

The same programs as `triton/decode_attention_bf16.py` (one per sequence, kv head and split;
all query heads of the GQA group as the rows of each `tl.dot`), rebuilt for the one cost a
full-precision cache does not have: turning codes into numbers a tensor core takes. The
first int8 kernel ("legacy") wrote `codes.to(bf16)` before the dots; Triton then moved the
conversion into the MMA operand layout and read V's codes from shared memory one byte at
a time, and the kernel ran at 1.67 TB/s, slower than bf16 at half the bytes. Here:

- The dots run in fp16 (q is rescaled by a power of two if it would overflow): every int8
  and e4m3 code is exact in fp16, and fp16 has bit tricks bf16 lacks.
- "packed" loads four codes as one int32 and builds two fp16 pairs with integer ops: for
  int8, `(c + 128) | 0x6400` is the fp16 1024 + 128 + c (the "magic number" of
  FasterTransformer's int8 -> fp16); for e4m3, sign and magnitude bits shift into an fp16
  worth c / 256. "prmt" does the same with PTX byte permutes (int8) or the hardware's
  e4m3x2 -> f16x2 (fp8). The 1152 offset and the 1/256 never leave the tile one code at a
  time: they come out of the dots' results, `q.(c + 1152) = q.c + 1152 sum(q)`, once per
  score and once per output element.
- Scales apply once per tile: the key scales multiply the score columns (together with
  the softmax scale), the value scales the probabilities' columns, normalized by the
  tile's largest so that fp16 p stays in [0, 1].

Tile shapes and the conversion are a `Q8Config`, picked by name from `Q8_CONFIGS`
(env `LLMLAB_Q8_DECODE`); `llmlab bench decode-variants` times them all.
See kernels_explained/kv_quantization.md.
"""
from __future__ import annotations

import torch

from ..interpreter import enable_interpreter_if_no_cuda
from .flash_decoding import combine, partials
from .q8_configs import Q8Config

enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

FP16_MAGIC_BIAS = 1152.0  # int8 code c becomes the fp16 1024 + (c + 128)
FP8_IN_FP16_UNIT = 256.0  # an e4m3 code's bits moved into fp16 are worth c / 2^(15 - 7)


@triton.jit
def _fp16_from_halves(x, SHIFT: tl.constexpr):
    """The fp16 whose bits are the low (SHIFT=0) or high (16) half of each int32 of x."""
    return ((x >> SHIFT) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _channel_order(offs_d, PACKED: tl.constexpr):
    """The head-dim channel each tile column holds: packed tiles swap the middle two of
    every four (see _load_tile). q is loaded and the output stored in this order, so the
    dots never see the difference (a sum over channels does not depend on their order)."""
    if PACKED:
        return (offs_d & -4) | ((offs_d & 1) << 1) | ((offs_d >> 1) & 1)
    return offs_d


@triton.jit
def _load_tile(cache_ptr, row_offs, in_seq, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
               DEQUANT: tl.constexpr, IS_FP8: tl.constexpr, COMPUTE: tl.constexpr):
    """A [BLOCK_N, HEAD_DIM] tile of codes in COMPUTE's dtype: exactly c ("cast"; fp8
    "prmt"), c + 1152 (int8 "magic", "packed", "prmt") or c / 256 (fp8 "magic", "packed").
    Rows past seq_len read as code 0. "packed" tiles hold their channels in channel_order."""
    if DEQUANT == "packed" or DEQUANT == "prmt":  # cache_ptr is the cache viewed as int32: 4 codes per word
        offs_w = tl.arange(0, HEAD_DIM // 4)
        if MASKED:
            w = tl.load(cache_ptr + row_offs[:, None] + offs_w[None, :], mask=in_seq[:, None], other=0)
        else:
            w = tl.load(cache_ptr + row_offs[:, None] + offs_w[None, :])
    if DEQUANT == "prmt":  # PTX, GPU only: fp16 pairs of bytes (0, 1) and (2, 3), channels in order
        if IS_FP8:  # the hardware's e4m3x2 -> f16x2 (compute capability 8.9+): exactly c
            low, high = tl.inline_asm_elementwise(
                "{ .reg .b16 a, b; mov.b32 {a, b}, $2; "
                "cvt.rn.f16x2.e4m3x2 $0, a; cvt.rn.f16x2.e4m3x2 $1, b; }",
                "=r,=r,r", [w], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        else:       # c ^ 0x80 = c + 128 under the byte 0x64: 1024 + 128 + c, two codes per byte permute
            low, high = tl.inline_asm_elementwise(
                "{ .reg .b32 u; xor.b32 u, $2, 0x80808080; "
                "prmt.b32 $0, u, 0x64, 0x4140; prmt.b32 $1, u, 0x64, 0x4342; }",
                "=r,=r,r", [w], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        tile = tl.reshape(tl.join(tl.join(_fp16_from_halves(low, 0), _fp16_from_halves(high, 0)),
                                  tl.join(_fp16_from_halves(low, 16), _fp16_from_halves(high, 16))),
                          (BLOCK_N, HEAD_DIM))
    elif DEQUANT == "packed":
        # Bytes 0 and 2 of each word go to `even`'s two halves, bytes 1 and 3 to `odd`'s.
        if IS_FP8:  # sign bit to bit 15, the 7 exponent+mantissa bits to bits 7..13
            even = ((w << 8) & -2147450880) | ((w << 7) & 0x3F803F80)     # -2147450880 = 0x80008000
            odd = (w & -2147450880) | ((w >> 1) & 0x3F803F80)
        else:       # (byte ^ 0x80) | 0x6400 per half, in one and two ops
            even = (w & 0x00FF00FF) ^ 0x64806480
            odd = ((w >> 8) & 0x00FF00FF) ^ 0x64806480
        # Tile column 4j + t holds word j's byte 0, 2, 1, 3 for t = 0, 1, 2, 3 (channel_order):
        # then `even` and `odd` are already the fp16 pairs a register holds, with no repacking.
        tile = tl.reshape(tl.join(tl.join(_fp16_from_halves(even, 0), _fp16_from_halves(odd, 0)),
                                  tl.join(_fp16_from_halves(even, 16), _fp16_from_halves(odd, 16))),
                          (BLOCK_N, HEAD_DIM))
    else:  # cache_ptr is the codes, fp8 ones viewed as int8
        offs_d = tl.arange(0, HEAD_DIM)
        if MASKED:
            c = tl.load(cache_ptr + row_offs[:, None] + offs_d[None, :], mask=in_seq[:, None], other=0)
        else:
            c = tl.load(cache_ptr + row_offs[:, None] + offs_d[None, :])
        if DEQUANT == "magic":
            b = c.to(tl.int32)  # sign-extended byte
            if IS_FP8:
                bits = ((b << 8) & 0x8000) | ((b << 7) & 0x3F80)
            else:
                bits = b + 0x6480  # 0x6400 + (c + 128): no carry leaves the low byte
            tile = bits.to(tl.int16).to(tl.float16, bitcast=True)
        elif IS_FP8:
            tile = c.to(tl.float8e4nv, bitcast=True)  # loaded as bytes: masked fp8 loads trip the interpreter
        else:
            tile = c
    return tile.to(COMPUTE)


@triton.jit
def _attend_tile_q8(q, q_sum, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr,
                    table_row_ptr, kv_head, start_n, seq_len, log2_scale,
                    stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
                    MASKED: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                    DEQUANT: tl.constexpr, IS_FP8: tl.constexpr, COMPUTE: tl.constexpr,
                    BIAS: tl.constexpr, UNIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold keys start_n .. start_n + BLOCK_N into every query head's running softmax."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    in_seq = offs_n < seq_len
    # Paged gather: key row n lives in cache block table[n // BLOCK_SIZE], slot n % BLOCK_SIZE.
    if MASKED:
        block_idx = tl.load(table_row_ptr + offs_n // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
    else:
        block_idx = tl.load(table_row_ptr + offs_n // BLOCK_SIZE).to(tl.int64)
    slot = offs_n % BLOCK_SIZE
    row_offs = block_idx * stride_kb + slot * stride_ks + kv_head * stride_kh  # K and V share the layout
    s_offs = block_idx * stride_sb + slot * stride_ss + kv_head
    if MASKED:
        k_scale = tl.load(k_scales_ptr + s_offs, mask=in_seq, other=0.0)   # [BLOCK_N] float32
        v_scale = tl.load(v_scales_ptr + s_offs, mask=in_seq, other=0.0)
    else:
        k_scale = tl.load(k_scales_ptr + s_offs)
        v_scale = tl.load(v_scales_ptr + s_offs)
    k = _load_tile(k_cache_ptr, row_offs, in_seq, MASKED, BLOCK_N, HEAD_DIM, DEQUANT, IS_FP8, COMPUTE)

    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)    # [BLOCK_G, BLOCK_N]
    if BIAS != 0.0:
        scores -= BIAS * q_sum[:, None]                                # q . (c + B) - B sum(q) = q . c
    scores = scores * (k_scale * log2_scale)[None, :]  # key scales, softmax scale, q's and the codes' units
    if MASKED:
        scores = tl.where(in_seq[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
    l_i = l_i * alpha + tl.sum(p, axis=1)

    # sum_n p_n (c_n s_n) = s_max sum_n (p_n s_n / s_max) c_n: the weights stay in [0, 1],
    # where fp16 keeps 11 bits (p * s alone could sink into fp16's subnormals).
    v_scale_max = tl.maximum(tl.max(v_scale, axis=0), 1e-30)
    p_v = (p * (v_scale * (1.0 / v_scale_max))[None, :]).to(COMPUTE)
    v = _load_tile(v_cache_ptr, row_offs, in_seq, MASKED, BLOCK_N, HEAD_DIM, DEQUANT, IS_FP8, COMPUTE)
    out = tl.dot(p_v, v, input_precision=DOT_PRECISION)               # [BLOCK_G, HEAD_DIM]
    if BIAS != 0.0:
        out -= BIAS * tl.sum(p_v.to(tl.float32), axis=1)[:, None]     # the same rounded weights the dot took
    acc = acc * alpha[:, None] + out * (v_scale_max * UNIT)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_table", "num_splits"])
def _decode_attention_q8_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr, k_scales_ptr, v_scales_ptr,
    qk_scale,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
    stride_table,
    num_heads, num_queries_per_kv, num_splits,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DEQUANT: tl.constexpr, IS_FP8: tl.constexpr, COMPUTE: tl.constexpr,
    BIAS: tl.constexpr, UNIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = _channel_order(tl.arange(0, HEAD_DIM), DEQUANT == "packed")
    head_ok = offs_g < num_queries_per_kv  # BLOCK_G pads the group to a power of two >= 16
    heads = kv_head * num_queries_per_kv + offs_g
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_ok[:, None], other=0.0).to(tl.float32)  # padding rows are zero queries
    # Into fp16 without overflow: divide by a power of two (exact; 1 for any real q) when
    # |q| > 2^15, and multiply it back into the scores.
    q_unit = tl.maximum(tl.exp2(tl.ceil(tl.log2(tl.max(tl.abs(q)) * (1.0 / 32768.0)))), 1.0)
    q = (q * (1.0 / q_unit)).to(COMPUTE)
    q_sum = tl.sum(q.to(tl.float32), axis=1)  # [BLOCK_G]: the offset codes' correction
    log2_scale = qk_scale * q_unit * UNIT

    # This program's key range: everything for v1; for v2 a run of whole tiles.
    if SPLIT:
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
        start = split * tiles_per_split * BLOCK_N
        end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    else:
        start = 0
        end = seq_len
    full_end = tl.maximum(start, tl.minimum(end, (seq_len // BLOCK_N) * BLOCK_N))

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)  # finite: exp2(-inf - m) stays 0, not NaN
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
    for start_n in range(start, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile_q8(
            q, q_sum, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, table_row_ptr,
            kv_head, start_n, seq_len, log2_scale, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
            False, BLOCK_SIZE, BLOCK_N, HEAD_DIM, DEQUANT, IS_FP8, COMPUTE, BIAS, UNIT, DOT_PRECISION)
    for start_n in range(full_end, end, BLOCK_N):  # at most one partial tile
        m_i, l_i, acc = _attend_tile_q8(
            q, q_sum, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, table_row_ptr,
            kv_head, start_n, seq_len, log2_scale, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
            True, BLOCK_SIZE, BLOCK_N, HEAD_DIM, DEQUANT, IS_FP8, COMPUTE, BIAS, UNIT, DOT_PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:  # an empty split writes a zero output with lse = -inf, which the reduce weighs 0
        row = (seq * num_heads + heads).to(tl.int64) * num_splits + split  # [S, H, num_splits] layout
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=head_ok[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + row, lse, mask=head_ok)
    else:
        tl.store(out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


def decode_attention_q8(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, k_scales, v_scales,
                        config: Q8Config):
    """decode_attention from an int8/fp8 cache with the given Triton config (not "legacy",
    not "gluon"). Called by decode_attention.decode_attention after its checks; num_splits >= 1."""
    # q:            [num_seqs, num_heads, head_dim] fp32 | fp16 | bf16
    # k/v_cache:    [num_blocks, block_size, num_kv_heads, head_dim] int8 | float8_e4m3fn codes
    # block_tables: [num_seqs, max_blocks_per_seq] int32 (contiguous); seq_lens: [num_seqs] (contiguous)
    # k/v_scales:   [num_blocks, block_size, num_kv_heads] float32, the same strides
    # returns out:  [num_seqs, num_heads, head_dim], q's dtype
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert config.dequant in ("cast", "magic", "packed", "prmt"), config
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share one layout"
    assert k_scales.stride(-1) == 1, "the Triton 8-bit kernel reads a slot's kv-head scales side by side"
    is_fp8 = k_cache.dtype == torch.float8_e4m3fn
    # fp32 queries (the interpreter, tests) keep fp32 dots on exactly converted codes.
    compute = tl.float32 if q.dtype == torch.float32 else tl.float16
    dequant = config.dequant if compute == tl.float16 else "cast"
    if dequant == "prmt" and not q.is_cuda:  # the interpreter runs no PTX: the same tile from Triton ops
        dequant = "packed"
    bias = FP16_MAGIC_BIAS if dequant != "cast" and not is_fp8 else 0.0
    unit = FP8_IN_FP16_UNIT if dequant in ("magic", "packed") and is_fp8 else 1.0
    if dequant in ("packed", "prmt"):
        assert all(s % 4 == 0 for s in k_cache.stride()[:3]) and k_cache.storage_offset() % 4 == 0
        k_cache, v_cache = k_cache.view(torch.int32), v_cache.view(torch.int32)
    elif is_fp8:
        k_cache, v_cache = k_cache.view(torch.int8), v_cache.view(torch.int8)

    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    split = num_splits > 1
    partial_out, partial_lse = partials(q, num_splits) if split else (out, out)  # unused when SPLIT=False
    group = num_heads // num_kv_heads
    _decode_attention_q8_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, partial_out, partial_lse, k_scales, v_scales,
        scale * 1.4426950408889634,  # log2(e): softmax in base 2
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_scales.stride(0), k_scales.stride(1),
        block_tables.stride(0),
        num_heads, group, num_splits,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=config.block_n, SPLIT=split, DEQUANT=dequant, IS_FP8=is_fp8, COMPUTE=compute,
        BIAS=bias, UNIT=unit, DOT_PRECISION="ieee" if compute == tl.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
        **({"maxnreg": config.max_registers} if config.max_registers and q.is_cuda else {}),
    )
    if split:
        combine(partial_out, partial_lse, out, num_splits)
    return out
