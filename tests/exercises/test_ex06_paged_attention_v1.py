"""Exercise 06, PagedAttention v1: what `llmlab.kernels.reference.decode_attention` computes.
Unowned cache slots are NaN (grading.paged_kv): a kernel that reads one returns NaN."""
import pytest
import torch

from grading import DEVICE, check_decode_attention, generate_token_ids, paged_kv, ragged

EXERCISE = "ex06_paged_attention_v1"


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (2, 2, 64, 16),    # multi-head attention
    (9, 3, 64, 16),    # SmolLM2's grouped-query attention: 3 query heads per kv head
    (8, 1, 128, 32),   # 8 query heads share one kv head; Llama's head_dim
])
def test_matches_reference(ex, num_heads, num_kv_heads, head_dim, block_size):
    check_decode_attention(ex, num_heads, num_kv_heads, head_dim, block_size, ragged(block_size))


def test_long_context(ex):
    check_decode_attention(ex, 4, 2, 64, 16, [200, 37], seed=1)


def test_empty_batch(ex):
    k_cache, v_cache, block_tables = paged_kv([], 16, 2, 64, torch.Generator())
    out = ex.decode_attention(torch.zeros(0, 4, 64, device=DEVICE), k_cache, v_cache, block_tables,
                              torch.zeros(0, dtype=torch.int32, device=DEVICE), 0.125, 1)
    assert out.shape == (0, 4, 64)


def test_end_to_end(ex, engine_llm, reference_token_ids):
    """The embedded model, every decode step's attention on your kernel: the same greedy tokens."""
    assert generate_token_ids(engine_llm, decode_attention=ex.decode_attention) == reference_token_ids
