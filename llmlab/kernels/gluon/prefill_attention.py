"""Causal prefill attention over a paged 16-bit KV cache for Hopper, written in Gluon:
FlashAttention-3's division of labour, one warpgroup loading and two computing.

Why not plain Triton (triton/prefill_attention.py): Triton 3.6 compiles that kernel's loop
into one instruction stream per warp in which every tile's `Q Kᵀ` is waited for before its
softmax and the softmax before `P V`, so the tensor cores idle while the exponentials run,
and `tl.range(..., warp_specialize=True)` leaves no partitions on Hopper
(kernels_explained/prefill_attention.md, section 3). Gluon says which warps do what:

  * the **loader** (the default partition, one warpgroup) copies the program's 128 query rows
    once, then each 128-key tile of K and of V, into a ring of STAGES shared-memory stages
    with the tensor memory accelerator (TMA): per cache block the tile spans, one copy of
    the kv head's rows (the cache seen as [slots, kv heads x head_dim]), all counted by the
    stage's `ready` mbarrier;
  * two **consumers** (worker partitions, one warpgroup each) own 64 of the query rows each.
    Per tile: S = Q Kᵀ (an asynchronous warpgroup MMA from shared memory), the online softmax
    in registers, O += P V with P straight from registers, then an arrive on the stage's
    `empty` mbarrier (count 2: the loader refills it once both are done). While one consumer
    runs its exponentials the other's MMAs keep the tensor cores busy: the warp schedulers
    interleave the two instruction streams (FlashAttention-3's ping-pong, without forcing it).

The loader gets few registers and the consumers most (`setmaxnreg`), so that the two 64 x 128
fp32 tiles a consumer keeps (S and O) and P fit without spilling.

The loader reads a tile's block numbers in one load before it waits for the tile's stage.

Paging: a 128-key tile is 8 cache blocks of 16 slots; the loader reads their numbers from
the block table and issues one copy per block. A tile that runs past the sequence's end
copies whole blocks anyway (block 0 for entries past the table's last used one): their keys
are masked, and the consumers zero those rows of V in shared memory before `P V`, since 0 x
NaN would be NaN (cache slots a sequence does not own are NaN in the tests).

Queries and output: the query rows of a program are the sequence's tokens
m_block x 128 .. + 127 of one head (one TMA box; rows past the sequence's end belong to the
next sequence or lie past the tensor and are computed and never stored). The output is stored
from registers, masked to the sequence's rows.

GPU only (Gluon has no interpreter), compute capability 9.x (warpgroup MMA), 16-bit queries
and caches, head size 64 or 128, cache blocks of 16 to 128 slots laid out as the engine's.
`prefill_attention.prefill_attention` runs it for the `-ws` configs (prefill_configs.py) where
`supported` says so, and the Triton kernel elsewhere. Measured in BENCHMARKS.md;
kernels_explained/prefill_attention.md has the roofline.
"""
from __future__ import annotations

import functools

import torch

from ..interpreter import enable_interpreter_if_no_cuda

enable_interpreter_if_no_cuda()   # before Triton is imported, as in every kernel module

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # Triton 3.6 (the lent H200's) names the TMA's load async_copy_global_to_shared; later ones async_load
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier     # (Triton 3.9: barrier)
except ImportError:  # pragma: no cover - an older Triton
    gluon = None

HEAD_DIMS = (64, 128)
BLOCK_M = 128          # query rows a program: 64 per consumer
BLOCK_N = 128          # keys a tile
CONSUMER_WARPS = 4     # one warpgroup each
LOADER_WARPS = 4       # the default partition (setmaxnreg acts on whole warpgroups)
# setmaxnreg: the consumers' S, O and P tiles and the softmax in 232 registers a thread; the
# loader gets the rest of the 64k, 40 (ptxas for sm_90a, Triton 3.6: no spills; at 240 the
# loader is left 24 and spills the tile's block numbers)
CONSUMER_REGISTERS = 232


@functools.lru_cache(maxsize=None)
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9   # wgmma: sm_90a only


def supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether this kernel takes the problem (else the Triton kernel does): a Hopper GPU,
    16-bit queries and cache of one dtype, head size 64 or 128, blocks of 16 to 128 slots, and
    the TMA's alignment (16-byte rows and bases) with slots and kv heads back to back."""
    if gluon is None or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return (k_cache.dtype == v_cache.dtype == q.dtype and head_dim in HEAD_DIMS and q.shape[-1] == head_dim
            and 16 <= block_size <= BLOCK_N and BLOCK_N % block_size == 0
            and _device_ok(q.device.index if q.device.index is not None else torch.cuda.current_device())
            and q.stride(2) == 1 and q.stride(1) == head_dim and (q.stride(0) * q.element_size()) % 16 == 0
            and q.data_ptr() % 16 == 0
            and all(c.stride(3) == 1 and c.stride(2) == head_dim and c.stride(1) == num_kv_heads * head_dim
                    and c.stride(0) == block_size * c.stride(1) and c.data_ptr() % 16 == 0 for c in (k_cache, v_cache)))


if gluon is not None:  # the kernel reads them as compile-time constants
    _CONSUMER_WARPS, _CONSUMER_REGISTERS = gl.constexpr(CONSUMER_WARPS), gl.constexpr(CONSUMER_REGISTERS)

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _find_query_tile(cu_seqlens_q_ptr, num_seqs, tile, TOKENS: gl.constexpr, BLOCK_S: gl.constexpr,
                         num_warps: gl.constexpr):
        """(sequence, query tile within it) of flat tile number `tile`, as the Triton kernel's
        _find_query_tile: the sequence is >= num_seqs past the last tile."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        offs_s = gl.arange(0, BLOCK_S, layout=layout)
        starts = gl.load(cu_seqlens_q_ptr + offs_s, mask=offs_s < num_seqs, other=0)
        ends = gl.load(cu_seqlens_q_ptr + offs_s + 1, mask=offs_s < num_seqs, other=0)
        num_tiles = (ends - starts + TOKENS - 1) // TOKENS
        tiles_end = gl.associative_scan(num_tiles, 0, _add)
        seq = gl.sum((tiles_end <= tile).to(gl.int32), axis=0)
        first_tile = gl.sum(gl.where(offs_s == seq, tiles_end - num_tiles, 0), axis=0)
        return seq, tile - first_tile

    @gluon.jit
    def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty,
                table_row_ptr, q_row, q_col, kv_col, num_tiles, seq_len,
                BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr):
        """The default partition: Q once, then K and V tile by tile into the ring."""
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row, q_col], q_bar, q_smem)
        BLOCKS: gl.constexpr = k_smem.shape[1] // BLOCK_SIZE     # cache blocks a tile
        TILE_BYTES: gl.constexpr = 2 * BLOCKS * k_desc.block_type.nbytes
        used_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
        # A tile's block numbers in one load, every thread holding all of them (no shuffles to
        # take one out), issued before the wait for the stage so that its latency hides there.
        ENTRIES: gl.constexpr = gl.BlockedLayout([BLOCKS], [32], [gl.num_warps()], [0])
        offs_b = gl.arange(0, BLOCKS, layout=ENTRIES)
        for j in range(num_tiles):
            entries = j * BLOCKS + offs_b
            blocks = gl.load(table_row_ptr + entries, mask=entries < used_blocks, other=0)
            stage = j % STAGES
            # a fresh barrier has completed the phase before its first: round 0 passes at once
            mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, TILE_BYTES)
            for b in gl.static_range(BLOCKS):
                row = gl.sum(gl.where(offs_b == b, blocks, 0), axis=0) * BLOCK_SIZE
                _tma_load(k_desc, [row, kv_col], bar,
                                                k_smem.index(stage).slice(b * BLOCK_SIZE, BLOCK_SIZE))
                _tma_load(v_desc, [row, kv_col], bar,
                                                v_smem.index(stage).slice(b * BLOCK_SIZE, BLOCK_SIZE))

    @gluon.jit
    def _zero_rows_past(v_tile, start_n, seq_len, ROWS_LAYOUT: gl.constexpr):
        """Rows start_n + r >= seq_len of a V stage set to 0 (they are weighted 0, and may be
        NaN), visible to this warpgroup's next MMA."""
        v = v_tile.load(ROWS_LAYOUT)
        rows = start_n + gl.arange(0, v_tile.shape[0], layout=gl.SliceLayout(1, ROWS_LAYOUT))
        v_tile.store(gl.where((rows < seq_len)[:, None], v, gl.zeros_like(v)))
        fence_async_shared()
        _barrier()

    @gluon.jit
    def _softmax(s, m_i, l_i, qk_scale, start_n, query_pos, seq_len, MASKED: gl.constexpr,
                 S_LAYOUT: gl.constexpr):
        """Fold a tile of raw scores into the running softmax: (p, m, l, alpha), all in
        scaled base-2 units as the Triton kernel's _attend_tile."""
        if MASKED:
            offs_n = start_n + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, S_LAYOUT))
            visible = (offs_n[None, :] <= query_pos[:, None]) & (offs_n < seq_len)[None, :]
            s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _tile(j, q, k_smem, v_smem, ready, empty, m_i, l_i, acc, qk_scale, query_pos, seq_len,
              MASKED: gl.constexpr, STAGES: gl.constexpr, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr,
              P_LAYOUT: gl.constexpr, ROWS_LAYOUT: gl.constexpr):
        """One key tile of one consumer: S = Q Kᵀ, softmax, O = O alpha + P V, stage released."""
        TILE_N: gl.constexpr = k_smem.shape[1]
        ROWS: gl.constexpr = q.shape[0]
        stage = j % STAGES
        start_n = j * TILE_N
        mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
        if MASKED:
            if start_n + TILE_N > seq_len:
                _zero_rows_past(v_smem.index(stage), start_n, seq_len, ROWS_LAYOUT)
        s = gl.zeros([ROWS, TILE_N], gl.float32, layout=S_LAYOUT)
        s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, start_n, query_pos, seq_len, MASKED, S_LAYOUT)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
        p = gl.convert_layout(p.to(q.dtype), P_LAYOUT)
        acc = warpgroup_mma(p, v_smem.index(stage), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(stage), count=1)
        return m_i, l_i, acc

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, q_bar, ready, empty, out_ptr, stride_ot, stride_oh, head,
                  q_start, num_queries, first_row, context_len, seq_len, num_full, num_tiles, qk_scale,
                  CONSUMER: gl.constexpr, STAGES: gl.constexpr, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr,
                  P_LAYOUT: gl.constexpr, ROWS_LAYOUT: gl.constexpr):
        """A worker partition: query rows first_row + CONSUMER x 64 .. + 63 of the program."""
        ROWS: gl.constexpr = q_smem.shape[0] // 2
        HEAD_DIM: gl.constexpr = q_smem.shape[1]
        offs_m = first_row + CONSUMER * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, S_LAYOUT))
        query_pos = context_len + offs_m        # padding rows: positions >= seq_len, never stored
        m_i = gl.full([ROWS], -1.0e30, gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
        l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=O_LAYOUT)
        mbarrier.wait(q_bar, 0)
        q = q_smem.slice(CONSUMER * ROWS, ROWS)
        # tiles below the program's first query position: every key visible to every row
        for j in range(0, num_full):
            m_i, l_i, acc = _tile(j, q, k_smem, v_smem, ready, empty, m_i, l_i, acc, qk_scale, query_pos,
                                  seq_len, False, STAGES, S_LAYOUT, O_LAYOUT, P_LAYOUT, ROWS_LAYOUT)
        for j in range(num_full, num_tiles):
            m_i, l_i, acc = _tile(j, q, k_smem, v_smem, ready, empty, m_i, l_i, acc, qk_scale, query_pos,
                                  seq_len, True, STAGES, S_LAYOUT, O_LAYOUT, P_LAYOUT, ROWS_LAYOUT)
        out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT))[:, None]   # l_i > 0: key 0 is seen
        rows = first_row + CONSUMER * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, O_LAYOUT))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_LAYOUT))
        offs = (q_start + rows).to(gl.int64)[:, None] * stride_ot + head * stride_oh + cols[None, :]
        gl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=(rows < num_queries)[:, None])

    @gluon.jit(do_not_specialize=["stride_table", "num_seqs"])
    def _prefill_ws_kernel(q_desc, k_desc, v_desc, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr, out_ptr,
                           qk_scale, stride_ot, stride_oh, stride_table, num_seqs, num_queries_per_kv,
                           BLOCK_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_S: gl.constexpr,
                           STAGES: gl.constexpr, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr,
                           P_LAYOUT: gl.constexpr, ROWS_LAYOUT: gl.constexpr, KV_SMEM: gl.constexpr,
                           num_warps: gl.constexpr):
        TOKENS: gl.constexpr = q_desc.block_type.shape[0]
        TILE_N: gl.constexpr = 128
        # Tiles numbered backwards: a sequence's last tiles see the most keys; starting them
        # first keeps the longest programs out of the last wave (as the Triton kernel).
        tile = gl.num_programs(0) - 1 - gl.program_id(0)
        head = gl.program_id(1)
        seq, m_block = _find_query_tile(cu_seqlens_q_ptr, num_seqs, tile, TOKENS, BLOCK_S, num_warps)
        if seq < num_seqs:
            q_start = gl.load(cu_seqlens_q_ptr + seq)
            num_queries = gl.load(cu_seqlens_q_ptr + seq + 1) - q_start
            seq_len = gl.load(seq_lens_ptr + seq)
            context_len = seq_len - num_queries
            kv_head = head // num_queries_per_kv
            first_row = m_block * TOKENS
            first_pos = context_len + first_row
            num_full = first_pos // TILE_N                         # tiles every row sees whole
            kv_end = gl.minimum(seq_len, first_pos + TOKENS)       # causal: the last row's position + 1
            num_tiles = (kv_end + TILE_N - 1) // TILE_N
            table_row_ptr = block_tables_ptr + seq.to(gl.int64) * stride_table

            q_smem = gl.allocate_shared_memory(q_desc.dtype, [TOKENS, HEAD_DIM], q_desc.layout)
            k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, TILE_N, HEAD_DIM], KV_SMEM)
            v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, TILE_N, HEAD_DIM], KV_SMEM)
            q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            mbarrier.init(q_bar, count=1)
            for s in gl.static_range(STAGES):
                mbarrier.init(ready.index(s), count=1)
                mbarrier.init(empty.index(s), count=2)       # both consumers release a stage
            fence_async_shared()

            gl.warp_specialize([
                (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, table_row_ptr,
                           q_start + first_row, head * HEAD_DIM, kv_head * HEAD_DIM, num_tiles, seq_len,
                           BLOCK_SIZE, STAGES)),
                (_consumer, (q_smem, k_smem, v_smem, q_bar, ready, empty, out_ptr, stride_ot, stride_oh, head,
                             q_start, num_queries, first_row, context_len, seq_len, num_full, num_tiles, qk_scale,
                             0, STAGES, S_LAYOUT, O_LAYOUT, P_LAYOUT, ROWS_LAYOUT)),
                (_consumer, (q_smem, k_smem, v_smem, q_bar, ready, empty, out_ptr, stride_ot, stride_oh, head,
                             q_start, num_queries, first_row, context_len, seq_len, num_full, num_tiles, qk_scale,
                             1, STAGES, S_LAYOUT, O_LAYOUT, P_LAYOUT, ROWS_LAYOUT)),
            ], [_CONSUMER_WARPS, _CONSUMER_WARPS], [_CONSUMER_REGISTERS, _CONSUMER_REGISTERS])


@functools.lru_cache(maxsize=None)   # built once per head size and dtype, not on every launch
def _layouts(head_dim: int, dtype: torch.dtype):
    """(S, O, P, rows, shared) layouts: warpgroup MMAs of 64 rows x 128 keys (S) and x head_dim
    (O), P as O's register A operand, a blocked layout for the V fix-up, the 128-byte swizzle."""
    bits = 16
    s = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1], instr_shape=[16, BLOCK_N, 16])
    o = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1], instr_shape=[16, head_dim, 16])
    p = gl.DotOperandLayout(operand_index=0, parent=o, k_width=32 // bits)
    rows = gl.BlockedLayout([1, 8], [32 * 8 // head_dim, head_dim // 8], [CONSUMER_WARPS, 1], [1, 0])
    smem = gl.NVMMASharedLayout(swizzle_byte_width=min(128, head_dim * bits // 8), element_bitwidth=bits, rank=2)
    return s, o, p, rows, smem


def launch(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, qk_scale, stages: int = 2):
    """Run the kernel (checks done by the caller and by `supported`). qk_scale is in base 2."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    s, o, p, rows, smem = _layouts(head_dim, q.dtype)
    q_desc = TensorDescriptor(q, [num_tokens, num_heads * head_dim], [q.stride(0), 1], [BLOCK_M, head_dim], smem)
    kv_shape = [num_blocks * block_size, num_kv_heads * head_dim]
    k_desc = TensorDescriptor(k_cache, kv_shape, [k_cache.stride(1), 1], [block_size, head_dim], smem)
    v_desc = TensorDescriptor(v_cache, kv_shape, [v_cache.stride(1), 1], [block_size, head_dim], smem)
    grid = (-(-num_tokens // BLOCK_M) + num_seqs, num_heads)
    _prefill_ws_kernel[grid](
        q_desc, k_desc, v_desc, block_tables, cu_seqlens_q, seq_lens, out,
        qk_scale, out.stride(0), out.stride(1), block_tables.stride(0), num_seqs, num_heads // num_kv_heads,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_S=max(32, 1 << (num_seqs - 1).bit_length()),
        STAGES=stages, S_LAYOUT=s, O_LAYOUT=o, P_LAYOUT=p, ROWS_LAYOUT=rows, KV_SMEM=smem,
        num_warps=LOADER_WARPS)
    return out
