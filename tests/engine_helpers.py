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
    assert all(count == 0 for count in engine.block_manager.ref_counts)
    assert not engine.requests
