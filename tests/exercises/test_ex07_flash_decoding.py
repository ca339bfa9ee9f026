"""Exercise 07, flash-decoding: split the context, combine the parts; for any number of
splits the same result as `llmlab.kernels.reference.decode_attention`.

Each case isolates one mistake; a failing case with several splits also says whether the
same inputs pass with one split (then the splitting or the combine is wrong)."""
import pytest

from grading import check_decode_attention, check_end_to_end, ragged

EXERCISE = "ex07_flash_decoding"

# (num_heads, num_kv_heads, head_dim, block_size, seq_lens, num_splits, what the case isolates)
CASES = [
    pytest.param(2, 2, 64, 16, [16, 48], 1, "one split: PagedAttention v1 (exercise 06) inside your kernel",
                 id="one-split"),
    pytest.param(2, 2, 64, 16, [64, 128], 2, "two splits of whole blocks: the split ranges and the combine",
                 id="two-splits-whole-blocks"),
    pytest.param(2, 2, 64, 16, [1, 15, 17, 56], 2, "two splits, the last block partial: the mask in the "
                 "last split", id="two-splits-partial-last-block"),
    pytest.param(2, 2, 64, 16, [100, 37], 3, "three splits whose boundaries fall inside blocks",
                 id="three-splits"),
    pytest.param(9, 3, 64, 16, ragged(16), 2, "SmolLM2's grouped-query attention with splits: which kv head "
                 "each query head reads", id="gqa-9-3-ragged"),
    pytest.param(8, 1, 128, 32, ragged(32), 3, "8 query heads on one kv head, head_dim 128, blocks of 32",
                 id="gqa-8-1-head-dim-128"),
    pytest.param(4, 1, 64, 16, [1, 3, 100], 7, "more splits than keys: empty splits must weigh nothing "
                 "(their log-sum-exp is -inf, not NaN)", id="more-splits-than-keys"),
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,seq_lens,num_splits,checks", CASES)
def test_case(ex, request, num_heads, num_kv_heads, head_dim, block_size, seq_lens, num_splits, checks):
    check_decode_attention(ex, request.node.callspec.id, num_heads, num_kv_heads, head_dim, block_size,
                           seq_lens, num_splits, hint=f"this case checks {checks}")


@pytest.mark.parametrize("scale,scores", [(0.3, "usual"), (None, "large"), (None, "very negative")],
                         ids=["scale-0.3", "large-scores", "very-negative-scores"])
def test_inputs_the_random_cases_miss(ex, scale, scores):
    """The `scale` argument (not head_dim ** -0.5, which every case above passes) and scores
    far from 0 in both directions."""
    check_decode_attention(ex, "unusual scores", 4, 2, 64, 16, [16, 37, 100], num_splits=3, scale=scale,
                           scores=scores)


def test_end_to_end(ex, engine_llm, reference_token_ids):
    """The embedded model's decode steps on your kernel, each context split in two (the
    engine asks for one split on a CPU)."""
    def decode_attention_in_two_splits(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=1):
        return ex.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, 2)

    check_end_to_end(engine_llm, reference_token_ids, "decode_attention", decode_attention_in_two_splits)
