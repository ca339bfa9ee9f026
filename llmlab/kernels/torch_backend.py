"""The "torch" backend: the reference's math in fewer, larger torch ops.

`reference.py` is written to be read; this file is written to run a step on a CPU (or
anywhere without Triton) with as little per-op overhead as torch allows, and is tested
against the reference like the Triton kernels are. What changes:

- rope computes its cos/sin table once per forward (every layer passes the same
  `positions` tensor) and rotates with one `roll` instead of slicing and concatenating;
- store_kv is one `index_copy_` per cache when no slot is padding (for a quantized cache,
  after quantizing the rows, and one more for their scales);
- attention gathers each sequence's blocks with one `index_select` and hands them to
  `F.scaled_dot_product_attention` (FlashAttention's CPU kernel); decode treats the G query
  heads that share a kv head as G queries of that head, so no kv head is repeated, and
  gathers sequences of similar length together, so short ones are not padded to the longest.
  A quantized cache is dequantized as it is gathered, into those same per-step copies.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from .reference import rms_norm, rope_inv_freq, scaling_key, silu_mul  # noqa: F401  (already lean)
from . import reference
from .dense.onednn import linear  # noqa: F401  (oneDNN with packed weights on a CPU, F.linear elsewhere)

# What the 30 layers of one forward would each recompute from the same inputs (rope's
# cos/sin from `positions`; decode's gather indices and mask from the block tables and
# lengths): name -> (weak refs to the input tensors, their versions, key, value).
_per_forward: dict = {}


def per_forward(name, inputs, key, compute):
    """compute(), or its value from the last call with these very tensors, unmodified since
    (a new step passes new tensors; an in-place change bumps a tensor's version). Inference
    tensors have no version counter, so their values are never reused."""
    versions = tuple(None if t.is_inference() else t._version for t in inputs)
    cached = _per_forward.get(name)
    if (cached is not None and None not in versions and cached[1] == versions and cached[2] == key
            and all(ref() is t for ref, t in zip(cached[0], inputs))):
        return cached[3]
    value = compute()
    if None not in versions:
        _per_forward[name] = (tuple(weakref.ref(t) for t in inputs), versions, key, value)
    return value


def rope_table(positions, head_dim, theta, scaling, dtype):
    """cos [T, 1, D] and sign-folded sin [T, 1, D] for `positions`."""
    def compute():
        inv_freq = rope_inv_freq(head_dim, float(theta), scaling_key(scaling), str(positions.device))
        freqs = positions.float()[:, None] * inv_freq[None, :]                   # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        # rotate_half(x) * sin == roll(x, D/2) * [-sin | sin]
        return (torch.cat([cos, cos], dim=-1)[:, None, :].to(dtype),
                torch.cat([-sin, sin], dim=-1)[:, None, :].to(dtype))

    return per_forward("rope", (positions,), (head_dim, float(theta), scaling_key(scaling), dtype), compute)


def rope(q, k, positions, theta, scaling=None):
    half = q.shape[-1] // 2
    cos, sin = rope_table(positions, q.shape[-1], theta, scaling, q.dtype)
    return q * cos + q.roll(half, -1) * sin, k * cos + k.roll(half, -1) * sin


def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scales=None, v_scales=None):
    quantized = reference.check_scales(k_cache, v_cache, k_scales, v_scales)
    if slot_mapping.numel() == 0:
        return
    if int(slot_mapping.min()) < 0:   # padding tokens: the reference skips them
        return reference.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    slots = slot_mapping.long()
    if not quantized:
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))
        return
    for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
        codes, row_scales = reference.quantize(x, cache.dtype)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, codes)
        scales.view(-1, scales.shape[2]).index_copy_(0, slots, row_scales)


def rope_store_kv(q, k, v, positions, theta, scaling, k_cache, v_cache, slot_mapping,
                  k_scales=None, v_scales=None):
    # On a CPU there is no launch to save: the pair, each half already lean
    q, k = rope(q, k, positions, theta, scaling)
    store_kv(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    return q


def rope_store_decode_attention(q, k, v, positions, theta, scaling, k_cache, v_cache, slot_mapping,
                                block_tables, seq_lens, scale, num_splits=1, k_scales=None, v_scales=None):
    # the pair again: on a CPU a launch costs nothing worth fusing for
    q = rope_store_kv(q, k, v, positions, theta, scaling, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, k_scales, v_scales)


def gather_blocks(cache, tables, scales, dtype):
    """cache[tables] as `dtype` ([len(tables), block_size, Hkv, D]), dequantized when the
    cache's scales are given."""
    blocks = cache.index_select(0, tables)
    if scales is None:
        return blocks
    return reference.dequantize(blocks, scales.index_select(0, tables)).to(dtype)


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                      k_scales=None, v_scales=None):
    reference.check_scales(k_cache, v_cache, k_scales, v_scales)
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    grouped = q.shape[1] != k_cache.shape[2]
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = cu[i], cu[i + 1]
        if end == start:
            continue
        k = reference.gather_kv(k_cache, block_tables[i], seq_len, k_scales).to(q.dtype).transpose(0, 1)  # [Hkv, L, D]
        v = reference.gather_kv(v_cache, block_tables[i], seq_len, v_scales).to(q.dtype).transpose(0, 1)
        num_queries = end - start
        mask = None
        if num_queries < seq_len:   # a chunk after cached context: causal, bottom-right aligned
            query_pos = torch.arange(seq_len - num_queries, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k, v, attn_mask=mask, is_causal=mask is None,
            scale=scale, enable_gqa=grouped).transpose(0, 1)
    return out


# A group of decode sequences costs a few ops of fixed overhead plus work per gathered row;
# one group pads every sequence to the longest. Measured on a 2-core CPU: the fixed part is
# worth about this many rows.
GROUP_OVERHEAD_ROWS = 256


def decode_groups(seq_lens: list[int], block_size: int) -> list[list[int]]:
    """Batch positions split into 1, 2, 4 or 8 groups of similar length (by sorted length,
    equal counts): whichever gathers the fewest rows, fixed costs included."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    best, best_cost = [list(range(len(seq_lens)))], None   # one group: the batch as it is
    for num_groups in (1, 2, 4, 8):
        if num_groups > len(order):
            break
        size = -(-len(order) // num_groups)
        groups = [order[i:i + size] for i in range(0, len(order), size)]
        rows = sum(len(g) * -(-seq_lens[g[-1]] // block_size) * block_size for g in groups)
        cost = rows + GROUP_OVERHEAD_ROWS * len(groups)
        if best_cost is None or cost < best_cost:
            best, best_cost = (best if num_groups == 1 else groups), cost
    return best


def decode_layout(block_tables, seq_lens, block_size):
    """How decode reads the cache, the same for every layer of a forward: per group of
    similar-length sequences, (their batch positions or None for the whole batch in order,
    block ids to gather [S_g * n], padded length L = n * block_size, valid rows [S_g, L],
    flat indices of the rows past each sequence's end). Sequences of no tokens are in no
    group (their rows stay zeros)."""
    def compute():
        lens = seq_lens.tolist()
        groups = decode_groups(lens, block_size)
        if 0 in lens:
            groups = [kept for kept in ([i for i in group if lens[i] > 0] for group in groups) if kept]
        layout = []
        for group in groups:
            whole = len(groups) == 1 and len(group) == len(lens)   # in batch order: no reordering
            index = None if whole else torch.tensor(group, device=seq_lens.device)
            group_lens = seq_lens if whole else seq_lens[index]
            num_blocks = -(-max(lens[i] for i in group) // block_size)
            length = num_blocks * block_size
            tables = (block_tables if whole else block_tables[index])[:, :num_blocks].reshape(-1)
            valid = torch.arange(length, device=seq_lens.device)[None, :] < group_lens[:, None]
            stale = (~valid).view(-1).nonzero().squeeze(1)
            layout.append((index, tables, length, valid, stale))
        return layout

    return per_forward("decode", (block_tables, seq_lens), block_size, compute)


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=1,
                     k_scales=None, v_scales=None):
    reference.check_scales(k_cache, v_cache, k_scales, v_scales)
    num_seqs, heads, head_dim = q.shape
    if num_seqs == 0:
        return torch.empty_like(q)
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out = None
    for index, tables, length, valid, stale in decode_layout(block_tables, seq_lens, block_size):
        rows = valid.shape[0]
        k = gather_blocks(k_cache, tables, k_scales, q.dtype).view(rows, length, kv_heads, head_dim)
        v = gather_blocks(v_cache, tables, v_scales, q.dtype).view(rows, length, kv_heads, head_dim)
        # rows past a sequence's end hold whatever the cache has there, maybe NaN, which the
        # mask cannot hide (NaN * 0 = NaN): zero them in the gathered copies
        k.view(rows * length, -1).index_fill_(0, stale, 0)
        v.view(rows * length, -1).index_fill_(0, stale, 0)
        q_group = q if index is None else q.index_select(0, index)
        # the G query heads of kv head h act as G queries against h's keys: [S, Hkv, G, D]
        result = F.scaled_dot_product_attention(
            q_group.reshape(rows, kv_heads, group, head_dim), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=valid[:, None, None, :], scale=scale).reshape(rows, heads, head_dim)
        if index is None:
            return result
        if out is None:
            out = torch.zeros_like(q)    # the rows of sequences of no tokens stay zeros
        out.index_copy_(0, index, result)
    return torch.zeros_like(q) if out is None else out


# ---- sampling ----------------------------------------------------------------------------
# The reference sorts every row and draws noise for every token. Here the work follows the
# tokens that can matter: the top-k / top-p cut is found in a `topk` of K candidates (K grows
# only for the rows whose cut lies deeper), and noise is drawn only for tokens above the cut
# and within GUMBEL_SPAN of the row's maximum (the others can never win). Same tokens as
# the reference: the same noise per (seed, position, token) and the same cut.
_FIRST_CANDIDATES = 64


def _rank_cut(x, top_k, top_p):
    """Per row, the logit value of the last token kept by top-k then top-p ([S] -> [S])."""
    S, V = x.shape
    cut = torch.empty(S, dtype=x.dtype, device=x.device)
    log_z = x.logsumexp(dim=-1)             # normalizer when top-k is off
    rows, K = torch.arange(S, device=x.device), min(_FIRST_CANDIDATES, V)
    while rows.numel():
        xs = x if rows.numel() == S else x[rows]
        k, p = top_k[rows], top_p[rows]
        values = xs.topk(K, dim=-1).values if K < V else xs.sort(dim=-1, descending=True).values
        k_seen = k <= K
        kth = values.gather(1, (k.clamp(max=K) - 1)[:, None])
        in_top_k = torch.where(k_seen[:, None], values >= kth, True)
        masked = values.masked_fill(~in_top_k, float("-inf"))
        log_zk = torch.where(k_seen, masked.logsumexp(dim=-1), log_z[rows])
        probs = (masked - log_zk[:, None]).exp()
        mass_before = probs.cumsum(dim=-1) - probs
        keep = in_top_k & ((mass_before < p[:, None]) | (p[:, None] >= 1))
        num_kept = keep.sum(dim=-1)
        # the cut is known when every top-k token is a candidate, or (top-k off) when the
        # top-p cut falls inside the candidates; a top-k beyond K needs more candidates
        done = k_seen | ((k == V) & (num_kept < K)) | (K == V)
        found = values.gather(1, (num_kept.clamp(min=1) - 1)[:, None])[:, 0]
        cut[rows[done]] = found[done]
        if done.all():
            break
        # next K: 8x as many candidates, or the deepest top-k left; only the rows still
        # unresolved go on, so one flat row does not make every row pay for a full sort
        left = ~done
        deepest_top_k = torch.where(k[left] < V, k[left], 0).max().item()   # k = V: top-k is off
        K = int(min(V, max(8 * K, deepest_top_k)))
        K = V if K > V // 4 else K
        rows = rows[left]
    return cut


def filter_logits(x, top_k, top_p, min_p):
    """reference.filter_logits with the top-k / top-p cut found among candidates (`_rank_cut`)
    instead of a sort of every row: the same cut, so the same kept set. x [S, V] float."""
    S, V = x.shape
    top_k, top_p, min_p = (t.to(x.device) for t in (top_k, top_p, min_p))
    k = torch.where((top_k <= 0) | (top_k > V), V, top_k).long()
    cut = x.amax(dim=-1) + torch.log(min_p)            # min-p (log 0 = -inf: no cut)
    ranked = ((k < V) | (top_p < 1)).nonzero()[:, 0]
    if ranked.numel() == S:
        cut = torch.maximum(cut, _rank_cut(x, k, top_p))
    elif ranked.numel():
        cut[ranked] = torch.maximum(cut[ranked], _rank_cut(x[ranked], k[ranked], top_p[ranked]))
    return x.masked_fill(x < cut[:, None], float("-inf"))


def _gumbel_noise(keys, token_ids, chunk=32768):
    """reference.gumbel_noise, bit for bit, in place and in cache-sized chunks (a flat row
    at temperature alone needs noise for most of the vocabulary)."""
    out = torch.empty(token_ids.shape, dtype=torch.float32, device=token_ids.device)
    for i in range(0, token_ids.numel(), chunk):
        h = token_ids[i:i + chunk] * reference._GOLDEN
        h += keys[i:i + chunk]
        h &= reference._M32
        for _ in range(2):
            h ^= h >> 16
            h *= reference._MIX
            h &= reference._M32
        h ^= h >> 16
        h >>= 9
        u = out[i:i + chunk]
        u.copy_(h).add_(0.5).mul_(2.0 ** -23)
        u.log_().neg_().log_().neg_()
    return out


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions):
    temperature, top_k, top_p, min_p, seeds, positions = (
        t.to(logits.device) for t in (temperature, top_k, top_p, min_p, seeds, positions))
    tokens = logits.argmax(dim=-1)
    rows = (temperature > 0).nonzero()[:, 0]
    if rows.numel() == 0:
        return tokens
    every_row = rows.numel() == logits.shape[0]          # the usual case: no [S, V] gathers then
    x = (logits if every_row else logits[rows]).float() * (1.0 / temperature[rows])[:, None]
    V = x.shape[-1]
    m = x.amax(dim=-1)
    cut = torch.maximum(m - reference.GUMBEL_SPAN, m + torch.log(min_p[rows]))
    k = torch.where((top_k[rows] <= 0) | (top_k[rows] > V), V, top_k[rows]).long()
    p = top_p[rows]
    ranked = ((k < V) | (p < 1)).nonzero()[:, 0]
    if ranked.numel() == x.shape[0]:
        cut = torch.maximum(cut, _rank_cut(x, k, p))
    elif ranked.numel():
        cut[ranked] = torch.maximum(cut[ranked], _rank_cut(x[ranked], k[ranked], p[ranked]))
    r, t = (x >= cut[:, None]).nonzero(as_tuple=True)      # the candidates, row-major
    keys = reference.row_keys(seeds[rows], positions[rows])
    score = x[r, t] + _gumbel_noise(keys[r], t)
    best = torch.full((rows.numel(),), float("-inf"), device=x.device).scatter_reduce(0, r, score, "amax")
    win = score == best[r]
    choice = torch.zeros(rows.numel(), dtype=torch.int64, device=x.device).scatter_(0, r[win], t[win])
    tokens[rows] = choice
    return tokens
