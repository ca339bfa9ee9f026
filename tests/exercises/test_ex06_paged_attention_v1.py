"""Exercise 06, PagedAttention v1: what `llmlab.kernels.reference.decode_attention` computes.

Each case isolates one mistake, and its failure says which sequences and heads differ and
what that points to. Unowned cache slots are NaN (grading.paged_kv): a kernel that reads
one returns NaN."""
import pytest
import torch

from grading import DEVICE, check_decode_attention, check_end_to_end, paged_kv, ragged

EXERCISE = "ex06_paged_attention_v1"

# (num_heads, num_kv_heads, head_dim, block_size, seq_lens, what the case isolates)
CASES = [
    pytest.param(2, 2, 64, 16, [16, 16], "one full block per sequence, one kv head per query head: "
                 "the scores, the running softmax and the output row", id="one-full-block"),
    pytest.param(2, 2, 64, 16, [32, 48, 64, 16], "whole blocks only, shuffled in the cache: "
                 "the block-table lookup (block_tables[seq, n // block_size], row n % block_size)",
                 id="whole-blocks"),
    pytest.param(2, 2, 64, 16, [1, 15, 16, 17, 56], "lengths that are not a multiple of the block size: "
                 "the mask on the last, partial block", id="partial-last-block"),
    pytest.param(9, 3, 64, 16, [16, 32], "SmolLM2's grouped-query attention, whole blocks: which kv "
                 "head each query head reads", id="gqa-9-3"),
    pytest.param(8, 1, 128, 32, [32, 64], "8 query heads on one kv head, Llama's head_dim, blocks of 32 "
                 "(two key tiles of 16 per block)", id="gqa-8-1-head-dim-128"),
    pytest.param(9, 3, 64, 16, ragged(16), "everything at once: GQA and ragged lengths", id="gqa-ragged"),
    pytest.param(8, 1, 128, 32, ragged(32), "ragged lengths in blocks of 32", id="gqa-ragged-block-32"),
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,seq_lens,checks", CASES)
def test_case(ex, request, num_heads, num_kv_heads, head_dim, block_size, seq_lens, checks):
    check_decode_attention(ex, request.node.callspec.id, num_heads, num_kv_heads, head_dim, block_size,
                           seq_lens, hint=f"this case checks {checks}")


def test_long_context(ex):
    check_decode_attention(ex, "long-context", 4, 2, 64, 16, [200, 37], seed=1,
                           hint="13 blocks of keys: the running max and sum across many tiles")


def test_empty_batch(ex):
    k_cache, v_cache, block_tables = paged_kv([], 16, 2, 64, torch.Generator())
    out = ex.decode_attention(torch.zeros(0, 4, 64, device=DEVICE), k_cache, v_cache, block_tables,
                              torch.zeros(0, dtype=torch.int32, device=DEVICE), 0.125, 1)
    assert out.shape == (0, 4, 64), "no sequences: return an empty [0, num_heads, head_dim] tensor"


@pytest.mark.parametrize("scale,scores", [(0.3, "usual"), (None, "large"), (None, "very negative")],
                         ids=["scale-0.3", "large-scores", "very-negative-scores"])
def test_inputs_the_random_cases_miss(ex, scale, scores):
    """The `scale` argument (not head_dim ** -0.5, which every case above passes) and scores
    far from 0 in both directions."""
    check_decode_attention(ex, "unusual scores", 4, 2, 64, 16, [16, 37, 100], num_splits=1, scale=scale,
                           scores=scores)


def test_end_to_end(ex, engine_llm, reference_token_ids):
    """The embedded model, every decode step's attention on your kernel: the same greedy text."""
    check_end_to_end(engine_llm, reference_token_ids, "decode_attention", ex.decode_attention)
