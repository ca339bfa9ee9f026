"""Exercise 08, FlashAttention prefill over a paged cache: what
`llmlab.kernels.reference.prefill_attention` computes.

Each case isolates one mistake, and its failure says which sequences and heads differ and
what that points to. Unowned cache slots are NaN (grading.paged_kv), so a kernel that reads
past a sequence's end returns NaN."""
import contextlib

import pytest
import torch

from diagnose import check_attention, fail
from grading import DEVICE, SCORES, check_end_to_end, paged_kv, randn_view, shape_scores
from llmlab.kernels import reference

EXERCISE = "ex08_prefill_attention"


@contextlib.contextmanager
def guarded_out(q, case, guard_rows=64):
    """While the launcher runs, its `torch.empty_like(q)` (the output) is a view of a longer
    buffer whose rows past the end are NaN, and must still be NaN afterwards: a tile's
    padding rows stored past the last sequence's queries are then a clear failure, not a
    write into whatever memory follows `out` (which crashes the interpreter, or not)."""
    buffers, empty_like = [], torch.empty_like

    def guarded(tensor, *args, **kwargs):
        if tensor.shape != q.shape:   # the output is shaped like q (the launcher may pass a copy)
            return empty_like(tensor, *args, **kwargs)
        buffer = torch.full((tensor.shape[0] + guard_rows,) + tuple(tensor.shape[1:]), float("nan"),
                            dtype=tensor.dtype, device=tensor.device)
        buffers.append(buffer)
        return buffer[:tensor.shape[0]]

    torch.empty_like = guarded
    try:
        yield
    finally:
        torch.empty_like = empty_like
    for buffer in buffers:
        stored = (~torch.isnan(buffer[q.shape[0]:])).flatten(1).any(dim=1).nonzero().flatten()
        if stored.numel():
            fail(case, [f"the kernel stored row {q.shape[0] + stored[0].item()}, past the end of out "
                        f"({q.shape[0]} rows): a tile's rows past its sequence's queries must not be stored "
                        "(mask the store with the rows that exist)"])


def check_prefill_attention(ex, case, num_heads, num_kv_heads, head_dim, block_size, seq_lens, query_lens,
                            seed=0, hint="", scale=None, scores="usual"):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = paged_kv(seq_lens, block_size, num_kv_heads, head_dim, gen)
    cu_seqlens_q = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32).to(DEVICE)
    q = randn_view(sum(query_lens), num_heads, head_dim, gen=gen)
    tol = shape_scores(q, k_cache, scores)
    hint = " ".join(filter(None, [hint, SCORES[scores]]))
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5 if scale is None else scale
    case = (f"{case!r} ({num_heads} query / {num_kv_heads} kv heads, head_dim {head_dim}, block_size "
            f"{block_size}, seq_lens {seq_lens}, new query tokens {query_lens}, scale {scale:.4g}, {scores} scores)")
    with guarded_out(q, case):
        actual = ex.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, lens, scale)
    expected = reference.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, lens, scale)
    check_attention(actual, expected, case=case, tol=tol, seq_lens=seq_lens, block_size=block_size,
                    num_kv_heads=num_kv_heads, query_lens=query_lens, hint=hint)


# (heads, kv heads, head_dim, block_size, seq_lens, query_lens, what the case isolates).
# query_len == seq_len is a whole prompt; shorter is a later chunk of a prompt (chunked
# prefill) or a prompt with a cached prefix; 0 is a sequence with nothing to compute.
CASES = [
    pytest.param(2, 2, 64, 16, [16, 16], [16, 16], "one block per prompt, one kv head per query head: "
                 "scores, causal mask and softmax inside one tile", id="one-block-prompts"),
    pytest.param(2, 2, 64, 16, [32, 48, 64], [32, 48, 64], "prompts of whole blocks, shuffled in the cache, "
                 "and more than one query tile (BLOCK_M = 32): the block-table lookup and the query offsets",
                 id="whole-blocks"),
    pytest.param(2, 2, 64, 16, [1, 15, 16, 17, 56], [1, 15, 16, 17, 56], "lengths that are not a multiple "
                 "of the block size: the mask on the last, partial block of keys", id="partial-last-block"),
    pytest.param(9, 3, 64, 16, [16, 32], [16, 32], "SmolLM2's grouped-query attention, whole blocks: which kv "
                 "head each query head reads", id="gqa-9-3"),
    pytest.param(8, 1, 128, 16, [32, 48], [32, 48], "8 query heads on one kv head, Llama's head_dim",
                 id="gqa-8-1-head-dim-128"),
    pytest.param(2, 2, 64, 16, [19, 103, 32, 5], [3, 70, 0, 5], "chunks after cached tokens (70 queries "
                 "after 33 cached ones) and a sequence with nothing new: each query's position in its "
                 "sequence", id="chunked"),
    pytest.param(9, 3, 64, 16, [19, 103, 32, 5], [3, 70, 0, 5], "chunks with grouped-query attention",
                 id="chunked-gqa"),
    pytest.param(4, 2, 64, 32, [40, 70], [40, 30], "blocks of 32 (two key tiles per block), one chunk",
                 id="block-size-32"),
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,seq_lens,query_lens,checks", CASES)
def test_case(ex, request, num_heads, num_kv_heads, head_dim, block_size, seq_lens, query_lens, checks):
    check_prefill_attention(ex, request.node.callspec.id, num_heads, num_kv_heads, head_dim, block_size,
                            seq_lens, query_lens, seed=1, hint=f"this case checks {checks}")


@pytest.mark.parametrize("scale,scores", [(0.3, "usual"), (None, "large"), (None, "very negative")],
                         ids=["scale-0.3", "large-scores", "very-negative-scores"])
def test_inputs_the_random_cases_miss(ex, scale, scores):
    """The `scale` argument (not head_dim ** -0.5, which every case above passes) and scores
    far from 0 in both directions, with a chunk after cached tokens."""
    check_prefill_attention(ex, "unusual scores", 4, 2, 64, 16, [16, 37], [16, 20], seed=1, scale=scale,
                            scores=scores)


def test_stores_no_row_past_its_sequence(ex):
    """Both sequences' last tiles end in padding rows: rows of the next sequence, or past the
    end of `out` (which check_prefill_attention follows with NaN rows that must stay NaN)."""
    check_prefill_attention(ex, "padding rows", 4, 2, 64, 16, [21, 37], [5, 20], seed=3,
                            hint="a tile's rows past its sequence's queries overwrite the next sequence's "
                                 "rows unless their store is masked")


def test_empty_batch(ex):
    k_cache, v_cache, block_tables = paged_kv([], 16, 2, 64, torch.Generator())
    out = ex.prefill_attention(torch.zeros(0, 4, 64, device=DEVICE), k_cache, v_cache, block_tables,
                               torch.zeros(1, dtype=torch.int32, device=DEVICE),
                               torch.zeros(0, dtype=torch.int32, device=DEVICE), 0.125)
    assert out.shape == (0, 4, 64), "no tokens: return an empty [0, num_heads, head_dim] tensor"


def test_end_to_end(ex, engine_llm, reference_token_ids):
    """The embedded model, every prompt's attention on your kernel: the same greedy text."""
    check_end_to_end(engine_llm, reference_token_ids, "prefill_attention", ex.prefill_attention)
