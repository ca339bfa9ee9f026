"""Prefix hashing is incremental: a block is hashed once, when it fills, chained from the
previous block's hash, and the chain equals the one computed from scratch."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from llmlab.cache.block_manager import BlockManager
from llmlab.request import Request
from llmlab.sampling import SamplingParams

from helpers.engine import assert_all_blocks_free, cpu_engine, run_all, tiny_model, tiny_prompt


def hashes_from_scratch(token_ids, block_size):
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        hashes.append(parent)
    return hashes


@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(0, 50), min_size=1, max_size=80),
       outputs=st.lists(st.integers(0, 50), max_size=80),
       block_size=st.sampled_from([1, 2, 4, 16]),
       chunks=st.lists(st.integers(1, 20), min_size=1, max_size=30))
def test_incremental_hashes_equal_hashes_from_scratch(prompt, outputs, block_size, chunks):
    """Tokens arrive in random chunks (prefill chunks, then one output token at a time);
    after every step the cached chain is the chain of the tokens so far."""
    manager = BlockManager(64, 0, block_size, enable_prefix_caching=True)
    request = Request("r", None, list(prompt), SamplingParams())
    pending = list(outputs)
    for chunk in chunks:
        for _ in range(chunk):
            if pending:
                request.output_token_ids.append(pending.pop(0))
        num_full = request.num_tokens // block_size
        assert manager.block_hashes(request, num_full) == hashes_from_scratch(request.all_token_ids, block_size)
    assert len(request.block_hashes) == request.num_tokens // block_size


def test_each_block_is_hashed_once():
    """Across a whole run with prefix caching on, the number of blocks hashed equals the
    number of full blocks the requests ever had: nothing is re-hashed step after step.
    (Hashing sees token ids only: the tiny model runs the same schedule in milliseconds.)"""
    engine = cpu_engine(tiny_model(), num_gpu_blocks=64, enable_prefix_caching=True)
    manager = engine.block_manager
    hashed = []
    original = BlockManager.block_hashes

    def counting(self, request, num_blocks):
        before = len(request.block_hashes)
        result = original(self, request, num_blocks)
        hashed.append(len(request.block_hashes) - before)
        return result

    BlockManager.block_hashes = counting
    try:
        prompts = [tiny_prompt(30, seed=1), tiny_prompt(37, seed=2)]
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in prompts]
        requests = [engine.requests[i] for i in ids]
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        BlockManager.block_hashes = original
    bs = manager.block_size
    full_blocks = sum((r.num_tokens - 1) // bs for r in requests)   # the last token is never computed
    assert full_blocks >= 8
    assert sum(hashed) <= full_blocks + len(requests)
    assert sum(hashed) >= full_blocks


def test_requests_sharing_a_prefix_admitted_together_compute_it_once():
    """Two prompts with the same 3-block prefix arrive in the same step: the second waits a
    step and then finds the prefix in the cache, instead of computing it alongside the first.
    Greedy outputs are the same as with prefix caching off."""
    model = tiny_model()
    engines = {caching: cpu_engine(model, num_gpu_blocks=64, enable_prefix_caching=caching)
               for caching in (False, True)}
    block_size = engines[True].block_manager.block_size
    prefix = tiny_prompt(3 * block_size, seed=3)
    prompts = [prefix + [7, 8, 9], prefix + [10, 11]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    without = [o.token_ids for o in run_all(engines[False], prompts, params)]
    outputs = run_all(engines[True], prompts, params)
    assert [o.token_ids for o in outputs] == without
    assert outputs[0].num_cached_prompt_tokens == 0
    assert outputs[1].num_cached_prompt_tokens == 3 * block_size
    assert_all_blocks_free(engines[True])
