"""Exercise 04, writing K/V rows into the paged cache: what `reference.store_kv` does."""
import pytest
import torch

from grading import DEVICE, NAN, assert_same_with_nans, check_end_to_end, randn_view
from llmlab.kernels import reference

EXERCISE = "ex04_store_kv"


@pytest.mark.parametrize("block_size", [16, 32], ids=["block-16", "block-32"])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 64), (2, 128)], ids=["3-kv-heads-dim-64", "2-kv-heads-dim-128"])
def test_matches_reference(ex, block_size, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(block_size + head_dim)
    num_tokens, num_blocks = 9, 5
    k = randn_view(num_tokens, num_kv_heads, head_dim, gen=gen)
    v = randn_view(num_tokens, num_kv_heads, head_dim, gen=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 5]] = -1  # padding tokens write nothing
    slots = slots.to(DEVICE)
    # Every slot starts NaN, and the whole cache is compared: a write to the wrong place,
    # or a padding token's write, shows.
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, NAN, device=DEVICE), torch.full(shape, NAN, device=DEVICE)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    assert ex.store_kv(k, v, k_cache, v_cache, slots) is None, "store_kv writes in place and returns None"
    reference.store_kv(k, v, k_expected, v_expected, slots)
    case = f"k_cache, {num_kv_heads} kv heads, head_dim {head_dim}, block_size {block_size}, slots {slots.tolist()}"
    assert_same_with_nans(k_cache, k_expected, case)  # a copy: bit-exact
    assert_same_with_nans(v_cache, v_expected, case.replace("k_cache", "v_cache"))


def test_one_layer_of_a_stacked_cache(ex):
    """The engine passes kv_cache[layer, 0] and kv_cache[layer, 1]: views into one tensor.
    A padding token (slot -1) written anyway lands in the tensor before the view, and shows."""
    gen = torch.Generator().manual_seed(7)
    kv_cache = torch.full((2, 2, 4, 16, 2, 64), NAN, device=DEVICE)  # [layers, k|v, blocks, block_size, Hkv, D]
    expected = kv_cache.clone()
    k, v = randn_view(4, 2, 64, gen=gen), randn_view(4, 2, 64, gen=gen)
    slots = torch.tensor([5, -1, 16, 63], device=DEVICE)
    ex.store_kv(k, v, kv_cache[1, 0], kv_cache[1, 1], slots)
    reference.store_kv(k, v, expected[1, 0], expected[1, 1], slots)
    assert_same_with_nans(kv_cache.flatten(0, 2), expected.flatten(0, 2),
                          "layer 1 of a stacked [layers, k|v, blocks, ...] cache (blocks of all layers in a row)")


def test_empty(ex):
    cache = torch.zeros(2, 16, 2, 64, device=DEVICE)
    ex.store_kv(torch.zeros(0, 2, 64, device=DEVICE), torch.zeros(0, 2, 64, device=DEVICE), cache, cache.clone(),
                torch.zeros(0, dtype=torch.int64, device=DEVICE))


def test_end_to_end(ex, engine_llm, reference_token_ids):
    """The embedded model, every KV write on your kernel: the same greedy text."""
    check_end_to_end(engine_llm, reference_token_ids, "store_kv", ex.store_kv)
