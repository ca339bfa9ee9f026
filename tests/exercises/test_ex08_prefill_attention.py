"""Exercise 08, FlashAttention prefill over a paged cache: what
`llmlab.kernels.reference.prefill_attention` computes. Unowned cache slots are NaN
(grading.paged_kv), so a kernel that reads past a sequence's end returns NaN."""
import pytest
import torch

from grading import DEVICE, FP32_TOL, generate_token_ids, paged_kv, randn_view
from llmlab.kernels import reference

EXERCISE = "ex08_prefill_attention"


def check_prefill_attention(ex, num_heads, num_kv_heads, head_dim, block_size, seq_lens, query_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = paged_kv(seq_lens, block_size, num_kv_heads, head_dim, gen)
    cu_seqlens_q = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32).to(DEVICE)
    q = randn_view(sum(query_lens), num_heads, head_dim, gen=gen)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    actual = ex.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    expected = reference.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    torch.testing.assert_close(actual, expected, **FP32_TOL)


# (seq_lens, query_lens): query_len == seq_len is a whole prompt; shorter is a later chunk
# of a prompt (chunked prefill) or a prompt with a cached prefix; 0 is a sequence with
# nothing to compute this step.
WHOLE_PROMPTS = ([1, 15, 16, 17, 56], [1, 15, 16, 17, 56])   # around block edges; several query tiles
CHUNKS = ([19, 103, 32, 5], [3, 70, 0, 5])                    # 70 queries after 33 cached tokens


@pytest.mark.parametrize("lengths", [WHOLE_PROMPTS, CHUNKS], ids=["whole", "chunked"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [
    (2, 2, 64),    # multi-head attention
    (9, 3, 64),    # SmolLM2's grouped-query attention
    (8, 1, 128),   # 8 query heads share one kv head; Llama's head_dim
])
def test_matches_reference(ex, num_heads, num_kv_heads, head_dim, lengths):
    check_prefill_attention(ex, num_heads, num_kv_heads, head_dim, 16, *lengths)


def test_block_size_32(ex):
    check_prefill_attention(ex, 4, 2, 64, 32, [40, 70], [40, 30], seed=1)


def test_empty_batch(ex):
    k_cache, v_cache, block_tables = paged_kv([], 16, 2, 64, torch.Generator())
    out = ex.prefill_attention(torch.zeros(0, 4, 64, device=DEVICE), k_cache, v_cache, block_tables,
                               torch.zeros(1, dtype=torch.int32, device=DEVICE),
                               torch.zeros(0, dtype=torch.int32, device=DEVICE), 0.125)
    assert out.shape == (0, 4, 64)


def test_end_to_end(ex, engine_llm, reference_token_ids):
    """The embedded model, every prompt's attention on your kernel: the same greedy tokens."""
    assert generate_token_ids(engine_llm, prefill_attention=ex.prefill_attention) == reference_token_ids
