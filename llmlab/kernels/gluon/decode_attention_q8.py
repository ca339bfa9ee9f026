"""Paged decode attention from an 8-bit KV cache, written in Gluon: every code goes from
global memory, through a shared-memory stage, into a tensor-core operand register with no
re-layout on the way.

Why not plain Triton (triton/decode_attention_q8.py): Triton picks the register layout of
a loaded tile itself, so codes loaded and then converted must be re-laid out into the
MMA's operand layout through shared memory -- the converted (twice as wide) tile written
and read back for every byte fetched. That traffic, not DRAM, set the 8-bit kernel's speed
(about bf16's time for half of its bytes). Gluon, Triton's lower-level dialect, lets the
kernel say which thread holds which element: each thread reads back from a shared-memory
stage exactly the bytes its MMA fragments need and converts them in place.

A stage is filled by the Hopper's tensor memory accelerator (TMA): per cache block the tile
spans (two, for the default 32-token tiles over 16-token blocks), one copy of its K rows and
one of its V rows (128 bytes each, 128-byte swizzle), an mbarrier counting their bytes, from
a descriptor that sees the cache as one row of all kv heads per token slot. Where the cache
is not laid out that way (blocks or kv heads not back to back, tiles neither inside one block
nor a whole number of blocks), or the GPU has no TMA (compute capability 8.9), each thread
copies its own 16-byte pieces with cp.async instead; both give the same bits. The TMA made the
kernel 1-3% faster on the H200, and 32-token tiles, which only the TMA copies cheaply, 7% more
(BENCHMARKS.md).

One warp per (kv head, sequence, split), the kv heads of a sequence side by side in the
grid (their rows share DRAM pages and their scales share sectors). The products are
transposed so the few query heads of a GQA group are the MMA's narrow side (N = 8): S^T =
K q^T, then out^T = V^T P^T, with mma.m16n8k16 (K and V^T are the A operands, 16 tokens or
16 channels per fragment). For lane 4 g + t:

- K's fragment holds channels 2t, 2t+1, 2t+8, 2t+9 of every 16 for tokens g and g + 8. A
  sum over channels does not depend on their order, so the kernel numbers channels so that
  one thread's 32 channels are 32 adjacent bytes of the token's row: `_k_channel`; q^T is
  loaded in the same order.
- V^T's fragment holds tokens 2t, 2t+1, 2t+8, 2t+9 of every 16 for channels g + 8 j.
  Output channels can be numbered freely too: thread g's 16 channels are 16 adjacent
  bytes, `_v_channel`, and the output is stored back in memory order. A byte permute pairs
  token 2t's code with token 2t+1's in one fp16x2 register.
- P^T moves from S^T's accumulator layout to the B operand with two `movmatrix` (8 x 8
  transposes across the warp).

Codes become fp16 exactly: e4m3 by the hardware's cvt.f16x2.e4m3x2, int8 by the "magic
number" 1024 + 128 + c (byte permutes into 0x64xx). The 1152 offset never leaves the
dots one code at a time: q . (c + 1152) = q . c + 1152 sum(q), and the output's offset is
1152 times the sum of the weights. Scales apply per tile: key scales to S^T's rows with the
softmax scale, value scales to P's rows over the largest value scale so far (so weights
stay in [0, 1]); the accumulator is rescaled only when that unit or a running max grows.

GPU only (Gluon has no interpreter); head size 128 and up to 8 query heads per kv head.
decode_attention_q8 runs the Triton kernel elsewhere. Measured in BENCHMARKS.md; the bytes
and FLOPs story is kernels_explained/kv_quantization.md.
"""
from __future__ import annotations

import functools

import torch

from ..interpreter import enable_interpreter_if_no_cuda

enable_interpreter_if_no_cuda()   # before Triton is imported, as in every kernel module

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - an older Triton
    gluon = None

HEAD_DIM = 128
BLOCK_G = 8            # the MMA's N: the query heads of one kv head, padded
WORDS = HEAD_DIM // 4  # int32 words per token row of 8-bit codes
if gluon is not None:  # the kernels read them as compile-time constants
    _HEAD_DIM, _BLOCK_G, _WORDS = gl.constexpr(HEAD_DIM), gl.constexpr(BLOCK_G), gl.constexpr(WORDS)


@functools.lru_cache(maxsize=None)
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)   # mma.sync, cp.async, e4m3 converts


def supported(q: torch.Tensor, k_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> bool:
    """Whether this kernel takes the problem (else the Triton kernel does)."""
    return (gluon is not None and q.is_cuda and q.dtype != torch.float32 and q.shape[-1] == HEAD_DIM
            and num_heads // num_kv_heads <= BLOCK_G
            and _device_ok(q.device.index if q.device.index is not None else torch.cuda.current_device())
            and all(s % 4 == 0 for s in k_cache.stride()[:3]) and k_cache.storage_offset() % 4 == 0)


@functools.lru_cache(maxsize=None)   # built once per tile size, not on every launch
def _layouts(block_n: int):
    """The register layouts (as constexprs) for block_n-token tiles and one warp."""
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    # K words [block_n, WORDS]: lane 4g + t holds rows g + 8i, words 4t..4t+3 and 16+4t..16+4t+3.
    row_bits_k = [[8 << i, 0] for i in range((block_n // 8).bit_length() - 1)]
    k_words = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 16]] + row_bits_k,
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[], block_bases=[], shape=[block_n, WORDS])
    # V words [block_n, WORDS]: lane 4g + t holds words 4g..4g+3 of rows 2t, 2t+1, 2t+8, 2t+9 (+16 each).
    row_bits_v = [[16 << i, 0] for i in range((block_n // 16).bit_length() - 1)]
    v_words = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [1, 0], [8, 0]] + row_bits_v,
        lane_bases=[[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]],
        warp_bases=[], block_bases=[], shape=[block_n, WORDS])
    return mma, k_words, v_words


if gluon is not None:
    @gluon.jit
    def _k_channel(k):
        """The memory channel of logical K channel k (see the module docstring)."""
        b = k // 16
        r = k % 16
        word = 16 * (b // 4) + 4 * ((r % 8) // 2) + b % 4
        return 4 * word + 2 * (r // 8) + r % 2

    @gluon.jit
    def _v_channel(n):
        """The memory channel of logical V / output channel n."""
        return 16 * (n % 8) + n // 8

    @gluon.jit
    def _codes_k(words, IS_FP8: gl.constexpr):
        """Four fp16 values (bytes 0..3) of each int32 word of codes, exactly: c for e4m3,
        c + 1152 for int8 (the scores take the offset out once, not every code)."""
        if IS_FP8:
            c0, c1, c2, c3 = gl.inline_asm_elementwise(
                "{ .reg .b16 a, b; .reg .b32 x, y; mov.b32 {a, b}, $4; "
                "cvt.rn.f16x2.e4m3x2 x, a; cvt.rn.f16x2.e4m3x2 y, b; "
                "mov.b32 {$0, $1}, x; mov.b32 {$2, $3}, y; }",
                "=h,=h,=h,=h,r", [words], dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
                is_pure=True, pack=1)
        else:
            c0, c1, c2, c3 = gl.inline_asm_elementwise(
                "{ .reg .b32 u, x, y; xor.b32 u, $4, 0x80808080; "
                "prmt.b32 x, u, 0x64, 0x4140; prmt.b32 y, u, 0x64, 0x4342; "
                "mov.b32 {$0, $1}, x; mov.b32 {$2, $3}, y; }",
                "=h,=h,=h,=h,r", [words], dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
                is_pure=True, pack=1)
        return c0, c1, c2, c3

    @gluon.jit
    def _codes_v(even, odd, IS_FP8: gl.constexpr):
        """Byte m of two tokens' words as fp16 pairs (even_m, odd_m), m = 0..3: c (e4m3) or c + 1152 (int8)."""
        if IS_FP8:
            e0, o0, e1, o1, e2, o2, e3, o3 = gl.inline_asm_elementwise(
                "{ .reg .b32 x, y, a, b, c, d; .reg .b16 p, q, r, s; "
                "prmt.b32 x, $8, $9, 0x5140; prmt.b32 y, $8, $9, 0x7362; "
                "mov.b32 {p, q}, x; mov.b32 {r, s}, y; "
                "cvt.rn.f16x2.e4m3x2 a, p; cvt.rn.f16x2.e4m3x2 b, q; "
                "cvt.rn.f16x2.e4m3x2 c, r; cvt.rn.f16x2.e4m3x2 d, s; "
                "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; mov.b32 {$4, $5}, c; mov.b32 {$6, $7}, d; }",
                "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [even, odd], dtype=(gl.float16,) * 8, is_pure=True, pack=1)
        else:       # c + 1152, like the keys: the output takes the offset out once
            e0, o0, e1, o1, e2, o2, e3, o3 = gl.inline_asm_elementwise(
                "{ .reg .b32 x, y, a, b, c, d; "
                "prmt.b32 x, $8, $9, 0x5140; prmt.b32 y, $8, $9, 0x7362; "
                "xor.b32 x, x, 0x80808080; xor.b32 y, y, 0x80808080; "
                "prmt.b32 a, x, 0x64, 0x4140; prmt.b32 b, x, 0x64, 0x4342; "
                "prmt.b32 c, y, 0x64, 0x4140; prmt.b32 d, y, 0x64, 0x4342; "
                "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; mov.b32 {$4, $5}, c; mov.b32 {$6, $7}, d; }",
                "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [even, odd], dtype=(gl.float16,) * 8, is_pure=True, pack=1)
        return e0, o0, e1, o1, e2, o2, e3, o3

    @gluon.jit
    def _k_operand(words, BLOCK_N: gl.constexpr, IS_FP8: gl.constexpr, A_OP: gl.constexpr):
        """K [BLOCK_N, _HEAD_DIM (logical channels)] in the MMA's A layout, from the K words."""
        c0, c1, c2, c3 = _codes_k(words, IS_FP8)
        x = gl.join(gl.join(c0, c1), gl.join(c2, c3))               # [n, word, e, h]
        x = gl.reshape(x, [BLOCK_N, 2, 4, 4, 2, 2])                   # word = 16 B + 4 t + bb
        x = gl.permute(x, [0, 1, 3, 5, 2, 4])                         # k = 16 (4 B + bb) + 8 h + 2 t + e
        x = gl.reshape(x, [BLOCK_N, _HEAD_DIM])
        return gl.convert_layout(x, A_OP, assert_trivial=True)

    @gluon.jit
    def _v_operand(words, BLOCK_N: gl.constexpr, IS_FP8: gl.constexpr, A_OP: gl.constexpr):
        """V^T [_HEAD_DIM (logical channels), BLOCK_N] in the MMA's A layout, from the V words."""
        pairs = gl.permute(gl.reshape(words, [BLOCK_N // 2, 2, _WORDS]), [0, 2, 1])
        even, odd = gl.split(pairs)                                    # tokens 2p and 2p + 1
        e0, o0, e1, o1, e2, o2, e3, o3 = _codes_v(even, odd, IS_FP8)
        x = gl.join(gl.join(gl.join(e0, o0), gl.join(e1, o1)),
                    gl.join(gl.join(e2, o2), gl.join(e3, o3)))        # [p, word, e, m0, m1]
        x = gl.reshape(x, [BLOCK_N // 2, 8, 4, 2, 2, 2])              # word = 4 g + jj
        x = gl.permute(x, [0, 3, 2, 5, 4, 1])                         # token 2p + e; n = 32 jj + 16 m1 + 8 m0 + g
        x = gl.reshape(x, [BLOCK_N, _HEAD_DIM])
        return gl.convert_layout(gl.permute(x, [1, 0]), A_OP, assert_trivial=True)

    @gluon.jit
    def _transpose_probs(p, BLOCK_N: gl.constexpr, B_OP: gl.constexpr):
        """P^T [BLOCK_N, heads] fp16 from the scores' accumulator layout into the B layout of
        V^T @ P^T, in registers: movmatrix transposes each 8 x 8 fp16 block across the warp,
        which leaves every thread holding the B fragment; the reshapes only rename registers."""
        x = gl.inline_asm_elementwise("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r", [p],
                                      dtype=gl.float16, is_pure=True, pack=2)
        x = gl.permute(gl.reshape(x, [BLOCK_N // 8, 8, 8]), [0, 2, 1])
        return gl.convert_layout(gl.reshape(x, [BLOCK_N, 8]), B_OP, assert_trivial=True)

    @gluon.jit
    def _row_offsets(table_row_ptr, start_n, r, end, kv_off, stride_b, stride_s,
                     BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):
        """Element offsets of token rows start_n + r (those < end) of one kv head."""
        rows = start_n + r
        ok = rows < end
        if BLOCK_N <= BLOCK_SIZE:  # tiles start at multiples of BLOCK_N: one cache block holds the tile
            block = gl.load(table_row_ptr + start_n // BLOCK_SIZE, mask=start_n < end, other=0).to(gl.int64)
            off = block * stride_b + ((start_n % BLOCK_SIZE) * stride_s + kv_off) + r * stride_s
        else:  # BLOCK_N // BLOCK_SIZE whole blocks: one table read and one base per block, chosen per row
            first = start_n // BLOCK_SIZE
            base = gl.load(table_row_ptr + first, mask=start_n < end, other=0).to(gl.int64) * stride_b
            for j in gl.static_range(1, BLOCK_N // BLOCK_SIZE):
                block_j = gl.load(table_row_ptr + first + j, mask=start_n + j * BLOCK_SIZE < end, other=0)
                base = gl.where(r >= j * BLOCK_SIZE, block_j.to(gl.int64) * stride_b, base)
            off = base + (kv_off + (r % BLOCK_SIZE) * stride_s)
        return off, ok

    @gluon.jit
    def _copy_tile(k_stage, v_stage, k_ptr, v_ptr, table_row_ptr, kv_head, start_n, end,
                   stride_kb, stride_ks, stride_kh, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                   K_WORDS: gl.constexpr, V_WORDS: gl.constexpr):
        """Start copying tokens start_n .. start_n + BLOCK_N's K and V words into one stage of
        shared memory, each thread the words it will read back itself (rows >= end: zeros)."""
        r_k = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, K_WORDS))
        r_v = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, V_WORDS))
        off_k, ok_k = _row_offsets(table_row_ptr, start_n, r_k, end, kv_head * stride_kh, stride_kb, stride_ks,
                                   BLOCK_SIZE, BLOCK_N)
        off_v, ok_v = _row_offsets(table_row_ptr, start_n, r_v, end, kv_head * stride_kh, stride_kb, stride_ks,
                                   BLOCK_SIZE, BLOCK_N)
        cols_k = gl.arange(0, _WORDS, layout=gl.SliceLayout(0, K_WORDS))
        cols_v = gl.arange(0, _WORDS, layout=gl.SliceLayout(0, V_WORDS))
        async_copy.async_copy_global_to_shared(k_stage, k_ptr + off_k[:, None] + cols_k[None, :], mask=ok_k[:, None])
        async_copy.async_copy_global_to_shared(v_stage, v_ptr + off_v[:, None] + cols_v[None, :], mask=ok_v[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _tma_tile(k_desc, v_desc, bar, k_stage, v_stage, table_row_ptr, kv_head, start_n, end,
                  BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):
        """The same with the Hopper's tensor memory accelerator: one copy each of the K and V
        rows of every cache block the tile spans (one, when the tile fits in a block) into one
        stage, bar counting their bytes; nothing when the tile starts past end. Rows past end
        arrive too (not zeros): a block's other slots, or block 0's for a block past end."""
        if BLOCK_N <= BLOCK_SIZE:
            live = start_n < end
            block = gl.load(table_row_ptr + start_n // BLOCK_SIZE, mask=live, other=0)
            row = block * BLOCK_SIZE + start_n % BLOCK_SIZE
            mbarrier.expect(bar, 2 * BLOCK_N * _WORDS * 4, pred=live)
            tma.async_copy_global_to_shared(k_desc, [row, kv_head * _WORDS], bar, k_stage, pred=live)
            tma.async_copy_global_to_shared(v_desc, [row, kv_head * _WORDS], bar, v_stage, pred=live)
        else:  # whole blocks (tiles start at multiples of BLOCK_N, a multiple of BLOCK_SIZE)
            live = start_n < end   # a block past end copies block 0's rows: masked like rows past end
            mbarrier.expect(bar, 2 * BLOCK_N * _WORDS * 4, pred=live)
            for j in gl.static_range(BLOCK_N // BLOCK_SIZE):
                block = gl.load(table_row_ptr + start_n // BLOCK_SIZE + j, mask=start_n + j * BLOCK_SIZE < end,
                                other=0)
                row = block * BLOCK_SIZE
                tma.async_copy_global_to_shared(k_desc, [row, kv_head * _WORDS], bar,
                                                k_stage.slice(j * BLOCK_SIZE, BLOCK_SIZE), pred=live)
                tma.async_copy_global_to_shared(v_desc, [row, kv_head * _WORDS], bar,
                                                v_stage.slice(j * BLOCK_SIZE, BLOCK_SIZE), pred=live)

    @gluon.jit
    def _load_scales(ks_ptr, vs_ptr, table_row_ptr, kv_off, start_n, end, stride_sb, stride_ss,
                     BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, MMA: gl.constexpr):
        """The K and V scales of tokens start_n .. start_n + BLOCK_N, as S^T's rows (0 past end)."""
        r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
        off, ok = _row_offsets(table_row_ptr, start_n, r, end, kv_off, stride_sb, stride_ss, BLOCK_SIZE, BLOCK_N)
        return gl.load(ks_ptr + off, mask=ok, other=0.0), gl.load(vs_ptr + off, mask=ok, other=0.0)

    @gluon.jit(do_not_specialize=["stride_table", "num_splits"])
    def _decode_q8_kernel(
        k_desc, v_desc, q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, partial_out_ptr, partial_lse_ptr,
        ks_ptr, vs_ptr, qk_scale,
        stride_qs, stride_qh, stride_os, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_sh, stride_table,
        num_heads, num_queries_per_kv, num_splits,
        BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
        IS_FP8: gl.constexpr, MMA: gl.constexpr, K_WORDS: gl.constexpr, V_WORDS: gl.constexpr, SMEM: gl.constexpr,
        USE_TMA: gl.constexpr, USE_PDL: gl.constexpr,
    ):
        A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
        COLS: gl.constexpr = gl.SliceLayout(0, MMA)
        if USE_PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        kv_head = gl.program_id(0)  # a sequence's kv heads run side by side: their rows share DRAM
        seq = gl.program_id(1)      # pages and their scales' sectors (1-2% faster than sequences first)
        split = gl.program_id(2)
        seq_len = gl.load(seq_lens_ptr + seq)

        # q^T [channels in _k_channel order, heads] in the MMA's B layout, rescaled into fp16's range.
        g = gl.arange(0, _BLOCK_G, layout=COLS)
        head_ok = g < num_queries_per_kv
        heads = kv_head * num_queries_per_kv + g
        kk = gl.arange(0, _HEAD_DIM, layout=ROWS)
        q = gl.load(q_ptr + seq.to(gl.int64) * stride_qs + heads[None, :] * stride_qh + _k_channel(kk)[:, None],
                    mask=head_ok[None, :], other=0.0).to(gl.float32)
        q_unit = gl.maximum(gl.exp2(gl.ceil(gl.log2(gl.max(gl.max(gl.abs(q), axis=1), axis=0) * (1.0 / 32768.0)))),
                            1.0)
        q16 = (q * (1.0 / q_unit)).to(gl.float16)
        q_op = gl.convert_layout(q16, B_OP)
        log2_scale = qk_scale * q_unit
        # int8 keys reach the dot as c + 1152: q . (c + 1152) = q . c + 1152 sum(q)
        k_offset = gl.sum(q16.to(gl.float32), axis=0) * (0.0 if IS_FP8 else 1152.0)

        if SPLIT:
            tiles_per_split = gl.cdiv(gl.cdiv(seq_len, BLOCK_N), num_splits)
            start = split * tiles_per_split * BLOCK_N
            end = gl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
        else:
            start = 0
            end = seq_len

        table_row_ptr = block_tables_ptr + seq.to(gl.int64) * stride_table
        m_i = gl.full([_BLOCK_G], -1.0e30, gl.float32, layout=COLS)   # per head, in log2 units
        l_i = gl.zeros([_BLOCK_G], gl.float32, layout=COLS)
        # acc = out^T (unnormalized, channels in _v_channel order) / acc_unit, the largest V
        # scale so far; p_sum = the sum of the fp16 weights the dots took, in the same units.
        acc = gl.zeros([_HEAD_DIM, _BLOCK_G], gl.float32, layout=MMA)
        p_sum = gl.zeros([_BLOCK_G], gl.float32, layout=COLS)
        acc_unit = 0.0
        V_OFFSET: gl.constexpr = 0.0 if IS_FP8 else 1152.0
        # Stages of 128-byte rows, 16-byte chunks swizzled by row (the TMA's 128-byte swizzle).
        k_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, _WORDS], SMEM)
        v_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, _WORDS], SMEM)
        if USE_TMA:
            bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for s in gl.static_range(STAGES):
                mbarrier.init(bars.index(s), count=1)
        for s in gl.static_range(STAGES - 1):  # the first tiles' copies in flight
            if USE_TMA:
                _tma_tile(k_desc, v_desc, bars.index(s), k_smem.index(s), v_smem.index(s), table_row_ptr, kv_head,
                          start + s * BLOCK_N, end, BLOCK_SIZE, BLOCK_N)
            else:
                _copy_tile(k_smem.index(s), v_smem.index(s), k_ptr, v_ptr, table_row_ptr, kv_head,
                           start + s * BLOCK_N, end, stride_kb, stride_ks, stride_kh, BLOCK_SIZE, BLOCK_N,
                           K_WORDS, V_WORDS)
        ks, vs = _load_scales(ks_ptr, vs_ptr, table_row_ptr, kv_head * stride_sh, start, end, stride_sb, stride_ss,
                              BLOCK_SIZE, BLOCK_N, MMA)
        num_tiles = gl.cdiv(end - start, BLOCK_N)
        stage = 0                 # tile i's stage: i % STAGES, counted rather than divided
        phase = 0                 # the phase of its barrier tile i completes (TMA): (i // STAGES) % 2
        free_stage = STAGES - 1   # where tile i + STAGES - 1 goes: the stage tile i - 1 used (read back)
        for i in range(0, num_tiles):
            start_n = start + i * BLOCK_N
            if USE_TMA:
                _tma_tile(k_desc, v_desc, bars.index(free_stage), k_smem.index(free_stage), v_smem.index(free_stage),
                          table_row_ptr, kv_head, start_n + (STAGES - 1) * BLOCK_N, end, BLOCK_SIZE, BLOCK_N)
            else:
                _copy_tile(k_smem.index(free_stage), v_smem.index(free_stage), k_ptr, v_ptr, table_row_ptr,
                           kv_head, start_n + (STAGES - 1) * BLOCK_N, end, stride_kb, stride_ks, stride_kh,
                           BLOCK_SIZE, BLOCK_N, K_WORDS, V_WORDS)
            ks_next, vs_next = _load_scales(ks_ptr, vs_ptr, table_row_ptr, kv_head * stride_sh, start_n + BLOCK_N, end,
                                            stride_sb, stride_ss, BLOCK_SIZE, BLOCK_N, MMA)
            if USE_TMA:   # tile i has landed
                mbarrier.wait(bars.index(stage), phase)
            else:
                async_copy.wait_group(STAGES - 1)
            kw = k_smem.index(stage).load(K_WORDS)
            rows = start_n + gl.arange(0, BLOCK_N, layout=ROWS)
            scores = mma_v2(_k_operand(kw, BLOCK_N, IS_FP8, A_OP), q_op,
                            gl.zeros([BLOCK_N, _BLOCK_G], gl.float32, layout=MMA))    # S^T [tokens, heads]
            scores = (scores - k_offset[None, :]) * (ks * log2_scale)[:, None]
            scores = gl.where((rows < end)[:, None], scores, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(scores, axis=0))
            p = gl.exp2(scores - m_new[None, :])
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p, axis=0)
            # Weights p * s / unit stay in [0, 1], where fp16 keeps 11 bits. The unit only grows, so
            # most tiles leave acc as it is (alpha is 1 too once the running max has settled).
            unit = gl.maximum(acc_unit, gl.max(vs, axis=0))
            factor = alpha * (acc_unit / gl.maximum(unit, 1e-30))
            if gl.min(factor, axis=0) < 1.0:
                acc = acc * factor[None, :]
            p16 = (p * (vs * (1.0 / gl.maximum(unit, 1e-30)))[:, None]).to(gl.float16)
            p_sum = p_sum * factor + gl.sum(p16.to(gl.float32), axis=0)
            vw = v_smem.index(stage).load(V_WORDS)
            if USE_TMA and IS_FP8:   # a TMA tile's rows past end are the block's: no NaN code may meet weight 0
                r_v = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, V_WORDS))
                vw = gl.where((r_v < end)[:, None], vw, 0)
            acc = mma_v2(_v_operand(vw, BLOCK_N, IS_FP8, A_OP), _transpose_probs(p16, BLOCK_N, B_OP), acc)
            acc_unit = unit
            free_stage = stage
            phase = gl.where(stage == STAGES - 1, phase ^ 1, phase)
            stage = gl.where(stage == STAGES - 1, 0, stage + 1)
            m_i = m_new
            ks, vs = ks_next, vs_next
        if not USE_TMA:
            async_copy.wait_group(0)

        out = (acc - V_OFFSET * p_sum[None, :]) * (acc_unit / gl.where(l_i > 0, l_i, 1.0))[None, :]
        channel = _v_channel(gl.arange(0, _HEAD_DIM, layout=ROWS))
        if SPLIT:  # an empty split writes a zero output with lse = -inf, which the reduce weighs 0
            row = (seq * num_heads + heads).to(gl.int64) * num_splits + split
            gl.store(partial_out_ptr + row[None, :] * _HEAD_DIM + channel[:, None], out, mask=head_ok[None, :])
            lse = gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            gl.store(partial_lse_ptr + row, lse, mask=head_ok)
        else:
            gl.store(out_ptr + seq.to(gl.int64) * stride_os + heads[None, :] * stride_oh + channel[:, None],
                     out.to(out_ptr.dtype.element_ty), mask=head_ok[None, :])


@functools.lru_cache(maxsize=None)
def _has_tma(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)   # Hopper and later; Ada (8.9) has none


@functools.lru_cache(maxsize=None)
def _placeholder(device: torch.device, block_n: int) -> torch.Tensor:
    return torch.zeros(block_n, WORDS, dtype=torch.int32, device=device)


def _tma_descriptors(kw: torch.Tensor, vw: torch.Tensor, block_n: int):
    """(k_desc, v_desc, shared layout). The caches' int32 words seen as one row of all kv heads
    per token slot, [num_blocks * block_size, num_kv_heads * WORDS], and copied by the TMA in
    [block_n, WORDS] boxes (one kv head, block_n slots of one block): where a block's slots and
    a slot's kv heads lie back to back, as in the engine's cache, and a tile fits in a block.
    Elsewhere (and on GPUs without a TMA) the kernel copies with cp.async and the descriptors
    are placeholders (base not kw)."""
    num_blocks, block_size, num_kv_heads, _ = kw.shape
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    box = [min(block_n, block_size), WORDS]
    if (block_n <= block_size or block_n % block_size == 0) and _has_tma(kw.device.index) and all(
            c.stride(0) == block_size * c.stride(1) and c.stride(2) == WORDS and c.stride(1) % 4 == 0
            and c.data_ptr() % 16 == 0 for c in (kw, vw)):
        shape = [num_blocks * block_size, num_kv_heads * WORDS]
        return (TensorDescriptor(kw, shape, [kw.stride(1), 1], box, layout),
                TensorDescriptor(vw, shape, [vw.stride(1), 1], box, layout), layout)
    stub = _placeholder(kw.device, block_n)
    desc = TensorDescriptor(stub, list(stub.shape), [WORDS, 1], box, layout)
    return desc, desc, gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])


def launch(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, k_scales, v_scales,
           out, partial_out, partial_lse, block_n: int = 16, stages: int = 2, max_registers: int | None = None,
           use_pdl: bool = False):
    """Run the kernel (checks done by the caller). k/v caches are 8-bit codes."""
    num_seqs, num_heads, _ = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    is_fp8 = k_cache.dtype == torch.float8_e4m3fn
    kw, vw = k_cache.view(torch.int32), v_cache.view(torch.int32)
    mma, k_words, v_words = _layouts(block_n)
    k_desc, v_desc, smem = _tma_descriptors(kw, vw, block_n)
    _decode_q8_kernel[(num_kv_heads, num_seqs, num_splits)](
        k_desc, v_desc, q, kw, vw, block_tables, seq_lens, out, partial_out, partial_lse, k_scales, v_scales,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kw.stride(0), kw.stride(1), kw.stride(2), k_scales.stride(0), k_scales.stride(1), k_scales.stride(2),
        block_tables.stride(0),
        num_heads, num_heads // num_kv_heads, num_splits,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, STAGES=stages, SPLIT=num_splits > 1, IS_FP8=is_fp8,
        MMA=mma, K_WORDS=k_words, V_WORDS=v_words, SMEM=smem, USE_TMA=k_desc.base is kw, USE_PDL=use_pdl,
        num_warps=1, **({"launch_pdl": True} if use_pdl else {}), **({"maxnreg": max_registers} if max_registers else {}),
    )
