"""Paged decode attention from an 8-bit KV cache, written in Gluon: every code goes from
global memory to a tensor-core operand register without touching shared memory.

Why not plain Triton (triton_decode_attention_q8.py): Triton picks the register layout of
a loaded tile itself, so codes loaded, then converted, must be re-laid out into the MMA's
operand layout through shared memory -- twice the codes' bytes written and read again for
every byte fetched, and that traffic, not DRAM, set the 8-bit kernel's speed (about bf16's
time for half of its bytes). Gluon (Triton's lower-level dialect) lets the kernel say
which thread loads which bytes, so each thread loads exactly the bytes its MMA fragments
hold and converts them in place.

One warp per (sequence, kv head, split): the query heads of the GQA group are the MMA's
16 rows (4 used for Llama-3), and every reduction of the online softmax stays inside a
warp. For mma.m16n8k16 each thread (lane = 4 g + t) holds:

- of K^T (k = head channel, n = token): channels 2t, 2t+1, 2t+8, 2t+9 of each 16-channel
  block, for tokens g and g + 8 of each 16. A sum over channels does not depend on their
  order, so the kernel numbers channels so that one thread's 32 channels are 32 adjacent
  bytes of the token's row (two 16-byte loads): `_k_channel`. q is loaded in the same order.
- of V (k = token, n = channel): tokens 2t, 2t+1, 2t+8, 2t+9 of each 16, channel g of each
  8. Output channels can be numbered freely too: thread g's 16 channels are 16 adjacent
  bytes (one load per token), `_v_channel`, and the output is stored back in memory order.
  A byte permute pairs token 2t's code with token 2t+1's into one fp16x2 register.

Codes become fp16 exactly: int8 by the 1024 + 128 + c "magic number" (byte permutes into
0x64xx, then one fp16x2 subtract), e4m3 by the hardware's cvt.f16x2.e4m3x2. Scales apply
per tile, as in the Triton kernel: key scales to the score columns, value scales to the
probabilities (normalized by the tile's largest). The next tile's codes are loaded into
registers before this tile is computed, so a tile's loads are always in flight.

GPU only (Gluon has no interpreter); HEAD_DIM 128 and up to 16 query heads per kv head.
`decode_attention_q8` falls back to the Triton kernel elsewhere.
"""
from __future__ import annotations

import torch

from . import enable_interpreter_if_no_cuda

enable_interpreter_if_no_cuda()
import triton  # noqa: E402

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
except ImportError:  # pragma: no cover - an older Triton
    gluon = None

HEAD_DIM = 128
BLOCK_G = 16           # MMA rows: the query heads of one kv head, padded
WORDS = HEAD_DIM // 4  # int32 words per token row of 8-bit codes
if gluon is not None:  # the kernels read them as compile-time constants
    _HEAD_DIM, _BLOCK_G, _WORDS = gl.constexpr(HEAD_DIM), gl.constexpr(BLOCK_G), gl.constexpr(WORDS)


def supported(q: torch.Tensor, k_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> bool:
    """Whether this kernel takes the problem (else the Triton kernel does)."""
    return (gluon is not None and q.is_cuda and q.dtype != torch.float32 and q.shape[-1] == HEAD_DIM
            and num_heads // num_kv_heads <= BLOCK_G and torch.cuda.get_device_capability(q.device) >= (8, 9)
            and all(s % 4 == 0 for s in k_cache.stride()[:3]) and k_cache.storage_offset() % 4 == 0)


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
        """Four fp16 values (bytes 0..3) of each int32 word of codes, exactly."""
        if IS_FP8:
            c0, c1, c2, c3 = gl.inline_asm_elementwise(
                "{ .reg .b16 a, b; .reg .b32 x, y; mov.b32 {a, b}, $4; "
                "cvt.rn.f16x2.e4m3x2 x, a; cvt.rn.f16x2.e4m3x2 y, b; "
                "mov.b32 {$0, $1}, x; mov.b32 {$2, $3}, y; }",
                "=h,=h,=h,=h,r", [words], dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
                is_pure=True, pack=1)
        else:
            c0, c1, c2, c3 = gl.inline_asm_elementwise(
                "{ .reg .b32 u, x, y, m; xor.b32 u, $4, 0x80808080; mov.b32 m, 0x64806480; "
                "prmt.b32 x, u, 0x64, 0x4140; prmt.b32 y, u, 0x64, 0x4342; "
                "sub.f16x2 x, x, m; sub.f16x2 y, y, m; "
                "mov.b32 {$0, $1}, x; mov.b32 {$2, $3}, y; }",
                "=h,=h,=h,=h,r", [words], dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
                is_pure=True, pack=1)
        return c0, c1, c2, c3

    @gluon.jit
    def _codes_v(even, odd, IS_FP8: gl.constexpr):
        """Byte m of two tokens' words as fp16 pairs: (even_m, odd_m) for m = 0..3."""
        if IS_FP8:
            e0, o0, e1, o1, e2, o2, e3, o3 = gl.inline_asm_elementwise(
                "{ .reg .b32 x, y, a, b, c, d; .reg .b16 p, q, r, s; "
                "prmt.b32 x, $8, $9, 0x5140; prmt.b32 y, $8, $9, 0x7362; "
                "mov.b32 {p, q}, x; mov.b32 {r, s}, y; "
                "cvt.rn.f16x2.e4m3x2 a, p; cvt.rn.f16x2.e4m3x2 b, q; "
                "cvt.rn.f16x2.e4m3x2 c, r; cvt.rn.f16x2.e4m3x2 d, s; "
                "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; mov.b32 {$4, $5}, c; mov.b32 {$6, $7}, d; }",
                "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [even, odd], dtype=(gl.float16,) * 8, is_pure=True, pack=1)
        else:
            e0, o0, e1, o1, e2, o2, e3, o3 = gl.inline_asm_elementwise(
                "{ .reg .b32 x, y, a, b, c, d, m; mov.b32 m, 0x64806480; "
                "prmt.b32 x, $8, $9, 0x5140; prmt.b32 y, $8, $9, 0x7362; "
                "xor.b32 x, x, 0x80808080; xor.b32 y, y, 0x80808080; "
                "prmt.b32 a, x, 0x64, 0x4140; prmt.b32 b, x, 0x64, 0x4342; "
                "prmt.b32 c, y, 0x64, 0x4140; prmt.b32 d, y, 0x64, 0x4342; "
                "sub.f16x2 a, a, m; sub.f16x2 b, b, m; sub.f16x2 c, c, m; sub.f16x2 d, d, m; "
                "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; mov.b32 {$4, $5}, c; mov.b32 {$6, $7}, d; }",
                "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [even, odd], dtype=(gl.float16,) * 8, is_pure=True, pack=1)
        return e0, o0, e1, o1, e2, o2, e3, o3

    @gluon.jit
    def _k_operand(words, BLOCK_N: gl.constexpr, IS_FP8: gl.constexpr, B_OP: gl.constexpr):
        """K^T [_HEAD_DIM (logical channels), BLOCK_N] in the MMA's B layout, from the K words."""
        c0, c1, c2, c3 = _codes_k(words, IS_FP8)
        x = gl.join(gl.join(c0, c1), gl.join(c2, c3))               # [n, word, e, h]
        x = gl.reshape(x, [BLOCK_N, 2, 4, 4, 2, 2])                   # word = 16 B + 4 t + bb
        x = gl.permute(x, [0, 1, 3, 5, 2, 4])                         # k = 16 (4 B + bb) + 8 h + 2 t + e
        x = gl.reshape(x, [BLOCK_N, _HEAD_DIM])
        return gl.convert_layout(gl.permute(x, [1, 0]), B_OP, assert_trivial=True)

    @gluon.jit
    def _v_operand(words, BLOCK_N: gl.constexpr, IS_FP8: gl.constexpr, B_OP: gl.constexpr):
        """V [BLOCK_N, _HEAD_DIM (logical channels)] in the MMA's B layout, from the V words."""
        pairs = gl.permute(gl.reshape(words, [BLOCK_N // 2, 2, _WORDS]), [0, 2, 1])
        even, odd = gl.split(pairs)                                    # tokens 2p and 2p + 1
        e0, o0, e1, o1, e2, o2, e3, o3 = _codes_v(even, odd, IS_FP8)
        x = gl.join(gl.join(gl.join(e0, o0), gl.join(e1, o1)),
                    gl.join(gl.join(e2, o2), gl.join(e3, o3)))        # [p, word, e, m0, m1]
        x = gl.reshape(x, [BLOCK_N // 2, 8, 4, 2, 2, 2])              # word = 4 g + jj
        x = gl.permute(x, [0, 3, 2, 5, 4, 1])                         # token 2p + e; n = 32 jj + 16 m1 + 8 m0 + g
        x = gl.reshape(x, [BLOCK_N, _HEAD_DIM])
        return gl.convert_layout(x, B_OP, assert_trivial=True)

    @gluon.jit
    def _row_offsets(table_row_ptr, rows, end, kv_head, stride_b, stride_s, BLOCK_SIZE: gl.constexpr):
        """Element offsets of token rows (those < end) of one kv head through the block table."""
        ok = rows < end
        block = gl.load(table_row_ptr + rows // BLOCK_SIZE, mask=ok, other=0).to(gl.int64)
        return block * stride_b + (rows % BLOCK_SIZE) * stride_s + kv_head, ok

    @gluon.jit
    def _copy_tile(k_stage, v_stage, k_ptr, v_ptr, table_row_ptr, kv_head, start_n, end,
                   stride_kb, stride_ks, stride_kh, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                   K_WORDS: gl.constexpr, V_WORDS: gl.constexpr):
        """Start copying tokens start_n .. start_n + BLOCK_N's K and V words into one stage of
        shared memory, each thread the words it will read back itself (rows >= end: zeros)."""
        rows_k = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, K_WORDS))
        rows_v = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, V_WORDS))
        off_k, ok_k = _row_offsets(table_row_ptr, rows_k, end, kv_head * stride_kh, stride_kb, stride_ks, BLOCK_SIZE)
        off_v, ok_v = _row_offsets(table_row_ptr, rows_v, end, kv_head * stride_kh, stride_kb, stride_ks, BLOCK_SIZE)
        cols_k = gl.arange(0, _WORDS, layout=gl.SliceLayout(0, K_WORDS))
        cols_v = gl.arange(0, _WORDS, layout=gl.SliceLayout(0, V_WORDS))
        async_copy.async_copy_global_to_shared(k_stage, k_ptr + off_k[:, None] + cols_k[None, :], mask=ok_k[:, None])
        async_copy.async_copy_global_to_shared(v_stage, v_ptr + off_v[:, None] + cols_v[None, :], mask=ok_v[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _load_scales(ks_ptr, vs_ptr, table_row_ptr, kv_head, start_n, end, stride_sb, stride_ss,
                     BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, MMA: gl.constexpr):
        rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
        off, ok = _row_offsets(table_row_ptr, rows, end, kv_head, stride_sb, stride_ss, BLOCK_SIZE)
        return gl.load(ks_ptr + off, mask=ok, other=0.0), gl.load(vs_ptr + off, mask=ok, other=0.0)

    @gluon.jit(do_not_specialize=["stride_table", "num_splits"])
    def _decode_q8_kernel(
        q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, partial_out_ptr, partial_lse_ptr,
        ks_ptr, vs_ptr, qk_scale,
        stride_qs, stride_qh, stride_os, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_table,
        num_heads, num_queries_per_kv, num_splits,
        BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
        IS_FP8: gl.constexpr, MMA: gl.constexpr, K_WORDS: gl.constexpr, V_WORDS: gl.constexpr, USE_PDL: gl.constexpr,
    ):
        A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
        COLS: gl.constexpr = gl.SliceLayout(0, MMA)
        if USE_PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        seq = gl.program_id(0)
        kv_head = gl.program_id(1)
        split = gl.program_id(2)
        seq_len = gl.load(seq_lens_ptr + seq)

        # q in the MMA's A layout, channels in _k_channel order, rescaled into fp16's range.
        g = gl.arange(0, _BLOCK_G, layout=ROWS)
        head_ok = g < num_queries_per_kv
        heads = kv_head * num_queries_per_kv + g
        kk = gl.arange(0, _HEAD_DIM, layout=COLS)
        q = gl.load(q_ptr + seq.to(gl.int64) * stride_qs + heads[:, None] * stride_qh + _k_channel(kk)[None, :],
                    mask=head_ok[:, None], other=0.0).to(gl.float32)
        q_unit = gl.maximum(gl.exp2(gl.ceil(gl.log2(gl.max(gl.max(gl.abs(q), axis=1), axis=0) * (1.0 / 32768.0)))),
                            1.0)
        q_op = gl.convert_layout((q * (1.0 / q_unit)).to(gl.float16), A_OP)
        log2_scale = qk_scale * q_unit

        if SPLIT:
            tiles_per_split = gl.cdiv(gl.cdiv(seq_len, BLOCK_N), num_splits)
            start = split * tiles_per_split * BLOCK_N
            end = gl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
        else:
            start = 0
            end = seq_len

        table_row_ptr = block_tables_ptr + seq.to(gl.int64) * stride_table
        m_i = gl.full([_BLOCK_G], -1.0e30, gl.float32, layout=ROWS)
        l_i = gl.zeros([_BLOCK_G], gl.float32, layout=ROWS)
        acc = gl.zeros([_BLOCK_G, _HEAD_DIM], gl.float32, layout=MMA)
        SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
        k_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, _WORDS], SMEM)
        v_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, _WORDS], SMEM)
        for s in gl.static_range(STAGES - 1):  # the first tiles' copies in flight
            _copy_tile(k_smem.index(s), v_smem.index(s), k_ptr, v_ptr, table_row_ptr, kv_head, start + s * BLOCK_N,
                       end, stride_kb, stride_ks, stride_kh, BLOCK_SIZE, BLOCK_N, K_WORDS, V_WORDS)
        ks, vs = _load_scales(ks_ptr, vs_ptr, table_row_ptr, kv_head, start, end, stride_sb, stride_ss,
                              BLOCK_SIZE, BLOCK_N, MMA)
        num_tiles = gl.cdiv(end - start, BLOCK_N)
        for i in range(0, num_tiles):
            start_n = start + i * BLOCK_N
            # Tile i + STAGES - 1 goes into the stage tile i - 1 used (read back, so free).
            ahead = i + STAGES - 1
            _copy_tile(k_smem.index(ahead % STAGES), v_smem.index(ahead % STAGES), k_ptr, v_ptr, table_row_ptr,
                       kv_head, start + ahead * BLOCK_N, end, stride_kb, stride_ks, stride_kh,
                       BLOCK_SIZE, BLOCK_N, K_WORDS, V_WORDS)
            ks_next, vs_next = _load_scales(ks_ptr, vs_ptr, table_row_ptr, kv_head, start_n + BLOCK_N, end,
                                            stride_sb, stride_ss, BLOCK_SIZE, BLOCK_N, MMA)
            async_copy.wait_group(STAGES - 1)  # tile i has landed
            kw = k_smem.index(i % STAGES).load(K_WORDS)
            cols = start_n + gl.arange(0, BLOCK_N, layout=COLS)
            scores = mma_v2(q_op, _k_operand(kw, BLOCK_N, IS_FP8, B_OP),
                            gl.zeros([_BLOCK_G, BLOCK_N], gl.float32, layout=MMA))
            scores = scores * (ks * log2_scale)[None, :]
            scores = gl.where((cols < end)[None, :], scores, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(scores, axis=1))
            p = gl.exp2(scores - m_new[:, None])
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            vs_max = gl.maximum(gl.max(vs, axis=0), 1e-30)
            p_v = gl.convert_layout((p * (vs * (1.0 / vs_max))[None, :]).to(gl.float16), A_OP)
            vw = v_smem.index(i % STAGES).load(V_WORDS)
            pv = mma_v2(p_v, _v_operand(vw, BLOCK_N, IS_FP8, B_OP), gl.zeros([_BLOCK_G, _HEAD_DIM], gl.float32,
                                                                            layout=MMA))
            acc = pv * vs_max + acc * alpha[:, None]
            m_i = m_new
            ks, vs = ks_next, vs_next
        async_copy.wait_group(0)

        out = acc / gl.where(l_i > 0, l_i, 1.0)[:, None]
        n = gl.arange(0, _HEAD_DIM, layout=COLS)
        channel = _v_channel(n)
        if SPLIT:  # an empty split writes a zero output with lse = -inf, which the reduce weighs 0
            row = (seq * num_heads + heads).to(gl.int64) * num_splits + split
            gl.store(partial_out_ptr + row[:, None] * _HEAD_DIM + channel[None, :], out, mask=head_ok[:, None])
            lse = gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            gl.store(partial_lse_ptr + row, lse, mask=head_ok)
        else:
            gl.store(out_ptr + seq.to(gl.int64) * stride_os + heads[:, None] * stride_oh + channel[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


def launch(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, k_scales, v_scales,
           out, partial_out, partial_lse, block_n: int = 16, stages: int = 4, max_registers: int | None = None,
           use_pdl: bool = False):
    """Run the kernel (checks done by the caller). k/v caches are 8-bit codes."""
    num_seqs, num_heads, _ = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    is_fp8 = k_cache.dtype == torch.float8_e4m3fn
    kw, vw = k_cache.view(torch.int32), v_cache.view(torch.int32)
    mma, k_words, v_words = _layouts(block_n)
    _decode_q8_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, kw, vw, block_tables, seq_lens, out, partial_out, partial_lse, k_scales, v_scales,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kw.stride(0), kw.stride(1), kw.stride(2), k_scales.stride(0), k_scales.stride(1), block_tables.stride(0),
        num_heads, num_heads // num_kv_heads, num_splits,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, STAGES=stages, SPLIT=num_splits > 1, IS_FP8=is_fp8,
        MMA=mma, K_WORDS=k_words, V_WORDS=v_words, USE_PDL=use_pdl,
        num_warps=1, **({"launch_pdl": True} if use_pdl else {}), **({"maxnreg": max_registers} if max_registers else {}),
    )
