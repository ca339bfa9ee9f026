"""token_logprobs in Triton: log-probabilities of the sampled (or prompt) tokens and each row's
k most likely tokens, in one read of the logits and no [R, V] tensor written.

Two launches. The first cuts every row into chunks of BLOCK tokens, one program per (row,
chunk): the chunk's max and its sum of exp(x - max) (the online softmax's two numbers,
kernels_explained/online_softmax.md), and its K largest values with their token ids (K rounds
of max-with-index, each winner masked out). The second, one program per row, folds the
chunks' (max, sum) into log Z and picks the K largest of the C * K candidates: a token in the
row's top K is in its own chunk's top K, so nothing is missed. The row's chosen token is read
back from the logits (one element). The spec is `reference.token_logprobs`.

Against the torch ops it replaces (a float32 copy of the logits, logsumexp, topk, gather:
several passes over [R, V] and a sort-based top-k), this reads the bf16 logits once."""
from __future__ import annotations

import torch

from ..interpreter import enable_interpreter_if_no_cuda

enable_interpreter_if_no_cuda()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _chunk_kernel(x_ptr, scale_ptr, max_ptr, sum_ptr, cand_ptr, cand_id_ptr, stride_x, V, C,
                  HAS_SCALE: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    offs = chunk * BLOCK + lanes
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    if HAS_SCALE:
        x = x * tl.load(scale_ptr + row)
    m = tl.max(x, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)      # a chunk cut entirely: its sum is 0
    out = row * C + chunk
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, tl.sum(tl.exp(x - m_safe), axis=0))
    for i in tl.static_range(K):
        value, index = tl.max(x, axis=0, return_indices=True)
        tl.store(cand_ptr + out * K + i, value)
        tl.store(cand_id_ptr + out * K + i, (chunk * BLOCK + index).to(tl.int64))
        x = tl.where(lanes == index, float("-inf"), x)


@triton.jit
def _row_kernel(x_ptr, scale_ptr, token_ptr, max_ptr, sum_ptr, cand_ptr, cand_id_ptr,
                chosen_ptr, top_ptr, top_id_ptr, stride_x, C,
                HAS_SCALE: tl.constexpr, K: tl.constexpr, NUM_TOP: tl.constexpr,
                C_BLOCK: tl.constexpr, CAND_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, C_BLOCK)
    m = tl.load(max_ptr + row * C + chunks, mask=chunks < C, other=float("-inf"))
    s = tl.load(sum_ptr + row * C + chunks, mask=chunks < C, other=0.0)
    big = tl.max(m, axis=0)
    log_z = big + tl.log(tl.sum(s * tl.exp(m - big), axis=0))
    token = tl.load(token_ptr + row)
    chosen = tl.load(x_ptr + row * stride_x + token).to(tl.float32)
    if HAS_SCALE:
        chosen = chosen * tl.load(scale_ptr + row)
    tl.store(chosen_ptr + row, chosen - log_z)
    if NUM_TOP > 0:
        lanes = tl.arange(0, CAND_BLOCK)
        inside = lanes < C * K
        cand = tl.load(cand_ptr + row * C * K + lanes, mask=inside, other=float("-inf"))
        for i in tl.static_range(NUM_TOP):
            value, index = tl.max(cand, axis=0, return_indices=True)
            tl.store(top_ptr + row * NUM_TOP + i, value - log_z)
            tl.store(top_id_ptr + row * NUM_TOP + i, tl.load(cand_id_ptr + row * C * K + index))
            cand = tl.where(lanes == index, float("-inf"), cand)


def token_logprobs(logits, token_ids, num_top, scale=None):
    """Same contract as reference.token_logprobs."""
    R, V = logits.shape
    device = logits.device
    chosen = torch.empty(R, dtype=torch.float32, device=device)
    top = torch.empty(R, num_top, dtype=torch.float32, device=device)
    top_ids = torch.empty(R, num_top, dtype=torch.int64, device=device)
    if R == 0:
        return chosen, top_ids, top
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block = min(4096, triton.next_power_of_2(V))
    C = triton.cdiv(V, block)
    K = num_top
    maxes = torch.empty(R, C, dtype=torch.float32, device=device)
    sums = torch.empty(R, C, dtype=torch.float32, device=device)
    cand = torch.empty(R, C, max(K, 1), dtype=torch.float32, device=device)
    cand_ids = torch.empty(R, C, max(K, 1), dtype=torch.int64, device=device)
    token_ids = token_ids.to(device=device, dtype=torch.int64)
    has_scale = scale is not None
    scale = scale.to(device=device, dtype=torch.float32) if has_scale else chosen   # unread without a scale
    _chunk_kernel[(R, C)](logits, scale, maxes, sums, cand, cand_ids, logits.stride(0), V, C,
                          HAS_SCALE=has_scale, K=K, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    _row_kernel[(R,)](logits, scale, token_ids, maxes, sums, cand, cand_ids, chosen, top, top_ids,
                      logits.stride(0), C, HAS_SCALE=has_scale, K=K, NUM_TOP=num_top,
                      C_BLOCK=triton.next_power_of_2(C), CAND_BLOCK=triton.next_power_of_2(max(C * K, 1)),
                      num_warps=4)
    return chosen, top_ids, top
