"""Pure-torch specification of every llmlab kernel.

Each function here is the readable definition that the "torch" backend and the Triton
kernels are tested against (and the "reference" backend, run as it is). Inputs may be
fp32, fp16 or bf16; math is done in fp32 and the result is cast back to the input dtype.

Shapes: T tokens in the flat batch, H query heads, Hkv kv heads, D head dim,
caches [num_blocks, block_size, Hkv, D], block_tables int32 [S, max_blocks_per_seq].

A quantized cache (int8, or fp8 e4m3) holds codes, and beside each cache a float32
side tensor of scales [num_blocks, block_size, Hkv]: one per token per kv head, laid out
like the blocks, so whatever moves a block moves its scales with the same block id.
store_kv, prefill_attention and decode_attention take them as k_scales / v_scales
(None, the default, for a full-precision cache). See kernels_explained/kv_quantization.md.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F


def linear(x, weight, bias=None):
    """y = x weight^T + bias: every matrix product of the model (qkv, o_proj, gate_up, down,
    lm_head). x [..., in], weight [out, in], bias [out] or None -> [..., out]."""
    return F.linear(x, weight, bias)


def rms_norm(x, weight, eps, residual=None):
    """out = x / sqrt(mean(x^2) + eps) * weight, over the last dim.

    With `residual`, first h = x + residual; returns (rms_norm(h), h) so the caller
    carries h forward as the next residual (the fused "add & norm" of a LLaMA layer).
    """
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)  # HF order: cast back, then scale
    return out if residual is None else (out, x)


@functools.lru_cache(maxsize=32)
def rope_inv_freq(head_dim, theta, scaling_items=None, device="cpu"):
    """Inverse frequencies theta^(-2i/D), with LLaMA-3.1 frequency scaling when given.

    LLaMA-3.1 keeps high frequencies (short wavelengths), divides low frequencies by
    `factor`, and blends smoothly in between (Meta's `apply_scaling`).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling_items:
        s = dict(scaling_items)
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, scaled, inv_freq)
    return inv_freq.to(device)


def scaling_key(scaling):
    """A hashable form of a rope-scaling dict (for caching inverse frequencies)."""
    return None if scaling is None else tuple(sorted(scaling.items()))


def rope(q, k, positions, theta, scaling=None):
    """Rotary position embedding, HF "rotate half" layout: the pair (x[i], x[i + D/2])
    rotates by angle positions * inv_freq[i]. q [T, H, D], k [T, Hkv, D], positions [T]."""
    head_dim = q.shape[-1]
    inv_freq = rope_inv_freq(head_dim, float(theta), scaling_key(scaling), str(q.device))
    freqs = positions.float()[:, None] * inv_freq[None, :]    # [T, D/2]
    angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]     # [T, 1, D]
    cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def silu_mul(x):
    """SwiGLU activation: silu(gate) * up, where x = [gate | up] on the last dim."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ----------------------------------------------------------------------------- KV quantization

# The largest code of each quantized cache dtype: a row's absmax maps onto it.
QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# An all-zero row would divide by zero: its absmax is taken to be at least this.
QUANT_EPS = 1e-12


def is_quantized(cache) -> bool:
    return cache.dtype in QUANT_MAX


def check_scales(k_cache, v_cache, k_scales, v_scales) -> bool:
    """True for a quantized cache with its scales, False for a full-precision cache without;
    anything else is a mistake worth a clear message."""
    quantized = is_quantized(k_cache)
    if not quantized:
        if k_scales is not None or v_scales is not None:
            raise ValueError(f"scales were given for a {k_cache.dtype} cache; only int8/fp8 caches have them")
        return False
    if k_scales is None or v_scales is None:
        raise ValueError(f"a {k_cache.dtype} cache needs k_scales and v_scales")
    for scales in (k_scales, v_scales):
        if scales.shape != k_cache.shape[:3] or scales.dtype != torch.float32:
            raise ValueError(f"scales must be float32 {tuple(k_cache.shape[:3])} "
                             f"(one per token per kv head), got {scales.dtype} {tuple(scales.shape)}")
    return True


def quantize(x, dtype):
    """Symmetric absmax quantization of each row (the last dim, one token's kv head):
    x ~= codes * scales[..., None]. Returns codes [..., D] of `dtype` (int8: round half up,
    in [-127, 127]; fp8 e4m3: the nearest value in [-448, 448]) and scales [...] float32."""
    qmax = QUANT_MAX[dtype]
    x = x.float()
    absmax = x.abs().amax(-1).clamp(min=QUANT_EPS)
    # the row's largest value lands on +-qmax. One true division (torch computes `qmax / t`
    # as reciprocal(t) * qmax, two roundings, which the kernels would not match exactly)
    y = x * (torch.full_like(absmax, qmax) / absmax)[..., None]
    if dtype == torch.int8:
        y = torch.floor(y + 0.5)
    return y.clamp(-qmax, qmax).to(dtype), absmax / qmax


def dequantize(codes, scales):
    """codes [..., D] * scales [...] -> float32 [..., D]."""
    return codes.float() * scales[..., None]


def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scales=None, v_scales=None):
    """Write token t's k/v rows into cache slot slot_mapping[t] (block = slot // block_size,
    offset = slot % block_size); slots < 0 are padding and skipped. In place, returns None.
    A quantized cache stores quantize(row) and the row's scale at the same slot.
    k, v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]; slot_mapping [T];
    k_scales, v_scales [num_blocks, block_size, Hkv] float32 (quantized caches only)."""
    quantized = check_scales(k_cache, v_cache, k_scales, v_scales)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if not quantized:
        k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
        v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)
        return
    for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
        codes, row_scales = quantize(x[keep], cache.dtype)
        cache.view(-1, *cache.shape[2:])[slots] = codes
        scales.view(-1, scales.shape[2])[slots] = row_scales


def rope_store_kv(q, k, v, positions, theta, scaling, k_cache, v_cache, slot_mapping,
                  k_scales=None, v_scales=None):
    """rope, then store_kv of the rotated keys and the values: one step of the layer, one
    kernel on a GPU (kernels_explained/rope_store_kv.md). Returns q rotated [T, H, D]; the
    rotated keys exist only in the cache. q [T, H, D], k and v [T, Hkv, D], positions [T];
    caches, slot_mapping and scales as in store_kv."""
    q, k = rope(q, k, positions, theta, scaling)
    store_kv(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    return q


def rope_store_decode_attention(q, k, v, positions, theta, scaling, k_cache, v_cache, slot_mapping,
                                block_tables, seq_lens, scale, num_splits=1, k_scales=None, v_scales=None):
    """A decode step's rope_store_kv, then its decode_attention: one kernel on a GPU
    (kernels_explained/decode_attention.md, "The new token from registers"). Sequence i's new
    token is row i of q, k, v, at positions[i], stored to slot_mapping[i], the last of its
    seq_lens[i] tokens (so slot_mapping[i] is where block_tables[i] puts that token).
    Shapes as in rope_store_kv and decode_attention; returns the attention output [S, H, D]."""
    q = rope_store_kv(q, k, v, positions, theta, scaling, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, k_scales, v_scales)


def gather_kv(cache, block_table, seq_len, scales=None):
    """The first seq_len cached rows of one sequence, in order: [seq_len, Hkv, D]
    (dequantized to float32 when the cache's scales are given)."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    table = block_table[:num_blocks].long()
    rows = cache.index_select(0, table).reshape(-1, *cache.shape[2:])[:seq_len]   # [n * block_size, Hkv, D]
    if scales is None:
        return rows
    return dequantize(rows, scales.index_select(0, table).reshape(-1, cache.shape[2])[:seq_len])


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                      k_scales=None, v_scales=None):
    """Causal attention of each sequence's new query tokens over its whole cached context.

    Sequence i owns query rows cu_seqlens_q[i]:cu_seqlens_q[i+1] (its newest tokens, whose
    K/V are already stored) and seq_lens[i] cached tokens in total, so its query j sits
    at position seq_lens[i] - num_queries + j and sees keys 0..that position. A chunk of
    a long prompt therefore attends to the chunks before it (chunked prefill), and a
    cached prefix is reused without recomputation (prefix caching).
    A quantized cache is read as dequantize(codes, scales).
    q [T, H, D] -> out [T, H, D].
    """
    check_scales(k_cache, v_cache, k_scales, v_scales)
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        if end == start:
            continue
        k = gather_kv(k_cache, block_tables[i], seq_len, k_scales).float()
        v = gather_kv(v_cache, block_tables[i], seq_len, v_scales).float()
        query_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
        out[start:end] = _attend(q[start:end].float(), k, v, mask, scale).to(q.dtype)
    return out


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=1,
                     k_scales=None, v_scales=None):
    """One query token per sequence attending to its seq_lens[i] cached tokens.
    `num_splits` only changes how a kernel divides the work; the result is the same.
    A quantized cache is read as dequantize(codes, scales). q [S, H, D] -> out [S, H, D].
    A sequence of no tokens attends to nothing: its row is zeros (a prompt graph's rows that
    are not decodes, cuda_graphs/prompt.py)."""
    check_scales(k_cache, v_cache, k_scales, v_scales)
    num_seqs = q.shape[0]
    if num_seqs == 0:
        return torch.empty_like(q)
    lens = seq_lens.tolist()
    max_len = max(lens)
    if max_len == 0:
        return torch.zeros_like(q)
    block_size = k_cache.shape[1]
    num_blocks = (max_len + block_size - 1) // block_size
    tables = block_tables[:, :num_blocks].long().flatten()
    k = k_cache.index_select(0, tables).view(num_seqs, -1, *k_cache.shape[2:])[:, :max_len].float()
    v = v_cache.index_select(0, tables).view(num_seqs, -1, *v_cache.shape[2:])[:, :max_len].float()
    if k_scales is not None:
        k = dequantize(k, k_scales.index_select(0, tables).view(num_seqs, -1, k_cache.shape[2])[:, :max_len])
        v = dequantize(v, v_scales.index_select(0, tables).view(num_seqs, -1, k_cache.shape[2])[:, :max_len])
    mask = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]   # [S, L]
    # rows past a sequence's end are whatever the cache holds there (maybe NaN). Their
    # scores are masked to -inf below, but a NaN value row would still poison the weighted
    # sum (0 * NaN = NaN), so zero those value rows (of our gathered copy)
    for i, n in enumerate(lens):
        v[i, n:] = 0
    q, mask = q[:, None], mask[:, None, :]          # one query per sequence: [S, 1, H, D], [S, 1, L]
    out = _attend_batched(q.float(), k, v, mask, scale)[:, 0]
    return out.masked_fill((seq_lens == 0)[:, None, None], 0).to(q.dtype)   # (a softmax over nothing: NaN)


def _attend_batched(q, k, v, mask, scale):
    """softmax(q k^T * scale, masked) v for a batch, query head h reading kv head h // G.
    q [B, N, H, D], k/v [B, L, Hkv, D], mask bool [B, N, L] -> [B, N, H, D]."""
    batch, num_queries, heads, head_dim = q.shape
    length, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(q)
    for h in range(kv_heads):   # the G query heads h*G .. h*G + G - 1 all read kv head h
        heads_h = slice(h * group, (h + 1) * group)
        q_h = q[:, :, heads_h].reshape(batch, num_queries * group, head_dim)
        # k[:, :, h] is a strided view [B, L, D]: the matmul reads it in place, no copy
        scores = (q_h @ k[:, :, h].transpose(1, 2)) * scale                 # [B, N G, L]
        scores = scores.view(batch, num_queries, group, length)
        scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).view(batch, num_queries * group, length)
        out[:, :, heads_h] = (probs @ v[:, :, h]).view(batch, num_queries, group, head_dim)
    return out


def _attend(q, k, v, mask, scale):
    """One sequence: q [N, H, D], k/v [L, Hkv, D], mask bool [N, L] -> [N, H, D]."""
    return _attend_batched(q[None], k[None], v[None], mask[None], scale)[0]


# ---- sampling ----------------------------------------------------------------------------
# Randomness is counter-based: the noise a request sees for token t at output position p is
# a hash of (its seed, p, t), the same whatever else runs in the batch and in any order, with
# no generator state to carry. The hash is 32-bit integer mixing (two rounds of xorshift-
# multiply), computed here in int64 tensors that hold uint32 values; every product stays
# below 2**63, so no step relies on integer overflow, and the Triton kernel's uint32
# arithmetic gives the same bits.
_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B        # < 2**27: (x < 2**32) * _MIX < 2**59
_GOLDEN = 0x9E3779B1    # Weyl-sequence step between token ids
# The noise takes 2**23 values, so a Gumbel draw lies in [-2.82, 16.64]: a token whose scaled
# logit is more than 19.45 below the row's maximum can never win the race. Fast samplers may
# skip those tokens without changing any result; the margin covers float rounding.
GUMBEL_SPAN = 20.0


def mix32(x):
    """A 32-bit integer hash (x: int64 tensor of uint32 values)."""
    x = ((x >> 16) ^ x) * _MIX & _M32
    x = ((x >> 16) ^ x) * _MIX & _M32
    return (x >> 16) ^ x


def row_keys(seeds, positions):
    """One 32-bit key per row from its request's 64-bit seed and the output position being
    sampled. seeds, positions: int64 [S] -> int64 [S]."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    key = mix32(lo ^ mix32(hi ^ 0x632BE5AB))
    return mix32(key ^ mix32((positions & _M32) ^ 0x85EBCA6B))


def gumbel_noise(keys, token_ids):
    """Standard Gumbel noise for (row key, token id): -log(-log(u)), u uniform on 2**23 points
    strictly inside (0, 1). keys and token_ids broadcast against each other (int64)."""
    h = mix32((keys + token_ids * _GOLDEN) & _M32)
    u = ((h >> 9).float() + 0.5) * 2.0 ** -23
    return -torch.log(-torch.log(u))


def filter_logits(x, top_k, top_p, min_p):
    """Temperature-scaled logits [S, V] with every token outside the kept set at -inf.

    top-k keeps the tokens at or above the k-th largest logit (top_k <= 0 or >= V: all);
    top-p then keeps, of those, the smallest most-likely set whose probability (renormalized
    over the top-k set) reaches top_p: sorted most likely first, a token stays if the mass
    strictly before it is < top_p (top_p = 1: all); min-p keeps tokens whose probability is at
    least min_p times the top one's. Each rule is a cut on the logit value, so tokens tied
    with the last one kept are kept too. top_k int [S], top_p and min_p float [S].
    """
    S, V = x.shape
    sorted_x = x.sort(dim=-1, descending=True).values
    k = torch.where((top_k <= 0) | (top_k > V), V, top_k).long()
    kth = sorted_x.gather(1, k[:, None] - 1)                      # [S, 1]
    in_top_k = sorted_x >= kth
    probs = sorted_x.masked_fill(~in_top_k, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1))
    num_kept = keep.sum(dim=-1, keepdim=True)                     # >= 1: the top token stays
    cut = sorted_x.gather(1, num_kept - 1)
    min_p_cut = sorted_x[:, :1] + torch.log(min_p[:, None])       # log(0) = -inf: no cut
    cut = torch.maximum(cut, min_p_cut)
    return x.masked_fill(x < cut, float("-inf"))


def token_logprobs(logits, token_ids, num_top, scale=None):
    """Log-probabilities under log_softmax(logits * scale): each row's `token_ids` entry, and its
    `num_top` most likely tokens, most likely first (what `SamplingParams.logprobs` returns).

    logits [R, V] (any float dtype; -inf where a filter cut a token); token_ids int64 [R];
    scale float32 [R] or None (1: the model's own scores; 1 / temperature: a temperature-only
    sampler's). Returns (chosen float32 [R], top_ids int64 [R, num_top], top float32 [R, num_top]).
    Among tied values the order of `top_ids` is unspecified. See kernels_explained/sampling.md.
    """
    x = logits.float()
    if scale is not None:
        x = x * scale.to(x.device)[:, None]
    log_z = x.logsumexp(dim=-1, keepdim=True)
    chosen = (x.gather(1, token_ids.to(x.device)[:, None]) - log_z)[:, 0]
    top, top_ids = x.topk(num_top, dim=-1)
    return chosen, top_ids, top - log_z


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions):
    """One token per row: the argmax where temperature is 0, else a draw from the softmax of
    logits / temperature restricted by `filter_logits`, by the Gumbel-max trick
    (argmax of scaled logit + Gumbel noise keyed on (seed, position, token)).

    logits [S, V] (any float dtype); temperature, top_p, min_p float32 [S]; top_k int32 [S];
    seeds, positions int64 [S]. Returns int64 [S]. See kernels_explained/sampling.md.
    """
    temperature, top_k, top_p, min_p, seeds, positions = (
        t.to(logits.device) for t in (temperature, top_k, top_p, min_p, seeds, positions))
    greedy = logits.argmax(dim=-1)
    # times the reciprocal, as every backend computes it (a division per token is slower on a GPU)
    x = logits.float() * (1.0 / torch.where(temperature > 0, temperature, 1.0))[:, None]
    x = filter_logits(x, top_k, top_p, min_p)
    token_ids = torch.arange(x.shape[-1], device=x.device)
    noise = gumbel_noise(row_keys(seeds, positions)[:, None], token_ids[None, :])
    return torch.where(temperature > 0, (x + noise).argmax(dim=-1), greedy)
