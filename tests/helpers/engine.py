"""Helpers the engine tests share: run prompts to completion, check that no KV block leaked."""
from __future__ import annotations


def run_all(engine, prompts, params, recorder=None):
    """Step the engine until every prompt is done; finished outputs in prompt order.
    `params`: one SamplingParams for all prompts, or a list of one per prompt."""
    if recorder is not None:
        engine.hooks.attach(recorder)
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    return [results[i] for i in ids]


def assert_all_blocks_free(engine):
    stats = engine.kv_stats()
    assert stats["free_device_blocks"] == stats["total_device_blocks"]
    assert stats["free_host_blocks"] == stats["total_host_blocks"]
    blocks = engine.block_manager
    assert all(count == 0 for count in blocks.ref_counts)
    # prefix caching (on by default) keeps freed full blocks cached: every block is free
    # exactly once, on the free list or evictable, and an evictable block is the one its hash names
    assert sorted([*blocks.free_blocks, *blocks.evictable]) == list(range(blocks.num_device_blocks))
    assert all(blocks.cached_blocks[blocks.block_hash[b]] == b for b in blocks.evictable)
    assert len(blocks.cached_blocks) == len(blocks.evictable)
    assert sorted(blocks.free_host_blocks) == list(range(blocks.num_host_blocks)) and not blocks.host_tables
    assert not engine.requests
