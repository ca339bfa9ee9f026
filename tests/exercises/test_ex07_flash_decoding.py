"""Exercise 07, flash-decoding: split the context, combine the parts; for any number of
splits the same result as `llmlab.kernels.reference.decode_attention`."""
import pytest

from grading import check_decode_attention, generate_token_ids, ragged

EXERCISE = "ex07_flash_decoding"


@pytest.mark.parametrize("num_splits", [1, 2, 3])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),    # SmolLM2's grouped-query attention
    (8, 1, 128, 32),   # 8 query heads share one kv head; Llama's head_dim
])
def test_matches_reference(ex, num_heads, num_kv_heads, head_dim, block_size, num_splits):
    check_decode_attention(ex, num_heads, num_kv_heads, head_dim, block_size, ragged(block_size), num_splits)


def test_more_splits_than_keys(ex):
    """Splits past the end of a short context are empty and must weigh nothing."""
    check_decode_attention(ex, 4, 1, 64, 16, [1, 3, 100], num_splits=7, seed=1)


def test_end_to_end(ex, engine_llm, reference_token_ids):
    """The embedded model's decode steps on your kernel, each context split in two (the
    engine asks for one split on a CPU)."""
    def decode_attention_in_two_splits(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=1):
        return ex.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, 2)

    assert generate_token_ids(engine_llm, decode_attention=decode_attention_in_two_splits) == reference_token_ids
