"""Flash-decoding's shared pieces (Dao et al., "Flash-Decoding"): how many context ranges a
decode step splits into, and the reduce that combines the ranges' partial outputs.

Every decode kernel that splits (bf16 and legacy 8-bit in `decode_attention_bf16.py`, the
Triton 8-bit kernel in `decode_attention_q8.py`, the Gluon one in `kernels/gluon/`) writes
each split's normalized partial output and log-sum-exp (base 2) into `partials(q, splits)`
and calls `combine`. The contract's `decode_num_splits` asks `choose_num_splits`.
See kernels_explained/decode_attention.md.
"""
from __future__ import annotations

import torch

from ..interpreter import enable_interpreter_if_no_cuda

enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from .pdl import launch_options, wait_for_previous_grid  # noqa: E402


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(partial_out_ptr, partial_lse_ptr, out_ptr, stride_os, stride_oh,
                           num_heads, num_splits,
                           HEAD_DIM: tl.constexpr, BLOCK_SPLITS: tl.constexpr, USE_PDL: tl.constexpr = False):
    """out = sum_i exp2(lse_i) * out_i / sum_i exp2(lse_i), for one (sequence, head)."""
    wait_for_previous_grid(USE_PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    split_ok = offs_s < num_splits
    row = (seq * num_heads + head).to(tl.int64) * num_splits + offs_s
    lse = tl.load(partial_lse_ptr + row, mask=split_ok, other=float("-inf"))
    partial = tl.load(partial_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=split_ok[:, None], other=0.0)
    lse_max = tl.maximum(tl.max(lse, axis=0), -1.0e30)  # finite even if every split was empty
    weight = tl.exp2(lse - lse_max)
    total = tl.sum(weight, axis=0)
    out = tl.sum(weight[:, None] * partial, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty))

def choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms=132, programs_per_sm=4, min_split_tokens=128):
    """How many context ranges flash-decoding should use. Memory bandwidth needs about
    four resident (sequence, kv head, split) programs per SM for a bf16 cache (measured on
    an H200), so split until there are that many -- 1 (plain v1) when the batch alone
    provides them -- but keep at least `min_split_tokens` per split (1 for short contexts;
    128 = two 64-row KV tiles), so the partial results and the reduce stay small next to
    the K/V reads. The 8-bit (Gluon, one-warp, 32-token tiles) kernel wants more programs
    and longer ranges (programs_per_sm 8, min_split_tokens 512: at batch 64 it is 2 splits
    at 4k, 0.139 ms against 0.187 with 4, and none at 512, 0.0244 ms against 0.0258 with 2)."""
    num_programs = num_seqs * num_kv_heads
    if num_programs == 0:
        return 1
    return max(1, min((programs_per_sm * num_sms) // num_programs, max_seq_len // min_split_tokens))


def partials(q, num_splits):
    """The split outputs [S, H, splits, D] and log-sum-exps [S, H, splits] (float32) that
    `combine` reduces."""
    num_seqs, num_heads, head_dim = q.shape
    return (torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device),
            torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device))


def combine(partial_out, partial_lse, out, num_splits):
    """out = the splits' partial outputs weighed by their log-sum-exps (flash-decoding's reduce)."""
    # partial_out: [num_seqs, num_heads, num_splits, head_dim] float32
    # partial_lse: [num_seqs, num_heads, num_splits] float32
    # out:         [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = out.shape
    _combine_splits_kernel[(num_seqs, num_heads)](
        partial_out, partial_lse, out, out.stride(0), out.stride(1), num_heads, num_splits,
        HEAD_DIM=head_dim, BLOCK_SPLITS=triton.next_power_of_2(num_splits), num_warps=4, **launch_options(out))
