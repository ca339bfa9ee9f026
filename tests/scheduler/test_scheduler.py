"""The Scheduler on its own, with no model. long_prefill_token_threshold (vLLM's name): a long
prompt takes at most that many tokens per step, so a short request that arrives behind it is
admitted at once; priority preemption; prefills that together outgrow the cache do not
deadlock. Scheduler.update does the post-step bookkeeping (computed tokens, full-block
hashes, tokens, token-level stops, freed blocks)."""
from __future__ import annotations

import zlib

import pytest
import torch

from llmlab import preemption
from llmlab import EngineConfig, SamplingParams
from llmlab.cache.block_manager import BlockManager
from llmlab.request import Request, RequestStatus
from llmlab.scheduler import Scheduler

from helpers.engine import cpu_engine_config, tiny_prompt as prompt


def first_steps(threshold, steps=2):
    config = EngineConfig(device="cpu", max_num_batched_tokens=512, long_prefill_token_threshold=threshold)
    scheduler = Scheduler(config, BlockManager(256, 0, 16), max_model_len=4096)
    long, short = Request("long", None, [5] * 3000, SamplingParams()), Request("short", None, [6] * 4, SamplingParams())
    scheduler.add(long)
    plans = [scheduler.schedule()]
    scheduler.update(plans[0], [9] * len(plans[0].sampling_items))
    scheduler.add(short)
    for _ in range(steps - 1):
        plans.append(scheduler.schedule())
        scheduler.update(plans[-1], [9] * len(plans[-1].sampling_items))
    return [[(i.request.request_id, i.num_tokens) for i in plan.items] for plan in plans]


def test_without_a_cap_the_long_prompt_takes_every_step():
    assert first_steps(0) == [[("long", 512)], [("long", 512)]]


def test_with_a_cap_the_short_request_is_admitted_next_step():
    assert first_steps(64) == [[("long", 64)], [("long", 64), ("short", 4)]]


def test_bad_threshold_is_rejected():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        EngineConfig(long_prefill_token_threshold=-1)


def test_priority_preempts_a_lower_priority_running_request():
    """policy.preempts_on_arrival: a newcomer that outranks a running request takes its slot."""
    from llmlab.policies import Priority, resolve_policy

    config = EngineConfig(device="cpu", max_num_seqs=2, max_num_batched_tokens=512)
    priority = {"low-1": 1, "low-2": 1, "low-3": 1, "high": 0}
    scheduler = Scheduler(config, BlockManager(256, 0, 16), 4096, policy=Priority(priority))
    # prompts of their own: with prefix caching (the default) a second [5] * 40 would wait a
    # step for the first one's blocks, and "high" would find a free slot without preempting
    for rid, token in (("low-1", 5), ("low-2", 7)):
        scheduler.add(Request(rid, None, [token] * 40, SamplingParams(max_tokens=50)))
    plan = scheduler.schedule()
    scheduler.update(plan, [9] * len(plan.sampling_items))
    scheduler.add(Request("high", None, [6] * 8, SamplingParams()))
    plan = scheduler.schedule()
    assert plan.preempted == ["low-2"]                      # the newest of the least important
    assert "high" in [i.request.request_id for i in plan.prefills]
    scheduler.policy = resolve_policy(lambda r: (priority[r.request_id], r.arrival_time))   # a key alone: it waits
    low = Request("low-3", None, [5] * 8, SamplingParams())
    scheduler.add(low)
    assert "low-3" not in [i.request.request_id for i in scheduler.schedule().items]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("caps", [dict(long_prefill_token_threshold=32),
                                  dict(max_num_batched_tokens=64, long_prefill_token_threshold=0)])
def test_prefills_that_together_outgrow_the_cache_do_not_deadlock(caps, mode):
    """Two prompts admitted together in chunks, each alone fitting the cache, both together
    not: once the blocks run out mid-prefill, the lower-priority one is preempted (as a
    decode would be) instead of both waiting forever for a block the other holds."""
    config = EngineConfig(device="cpu", preemption_mode=mode, **caps)
    blocks = BlockManager(8, 8 if mode == "swap" else 0, 16)       # 128 tokens of KV
    scheduler = Scheduler(config, blocks, max_model_len=128)
    requests = [Request(rid, None, [token] * 100, SamplingParams(max_tokens=4)) for rid, token in (("a", 5), ("b", 6))]
    for request in requests:
        scheduler.add(request)
    preempted = []
    for _ in range(100):
        if not scheduler.has_unfinished():
            break
        plan = scheduler.schedule()
        assert not plan.is_empty or plan.preempted or plan.swapped_out, "a step with nothing to run"
        preempted += plan.preempted + plan.swapped_out
        scheduler.update(plan, [9] * len(plan.sampling_items))
    assert not scheduler.has_unfinished()
    assert [len(r.output_token_ids) for r in requests] == [4, 4]
    assert preempted == ["b"]                                        # the newer one gave way
    assert blocks.num_free_blocks == 8


def test_a_readmitted_request_keeps_its_first_cached_token_count():
    """After a recompute preemption the prefix cache holds the request's own blocks, output
    included: re-admitting it computes less, but its usage (cached prompt tokens) still says
    what the first admission found, never more than the prompt."""
    config = EngineConfig(device="cpu", max_num_batched_tokens=512)
    scheduler = Scheduler(config, BlockManager(64, 0, 16), max_model_len=1024)
    request = Request("r", None, [5] * 40, SamplingParams(max_tokens=100))
    scheduler.add(request)
    for _ in range(30):
        plan = scheduler.schedule()
        scheduler.update(plan, [9] * len(plan.sampling_items))
    assert request.num_cached_prompt_tokens == 0 and request.num_tokens == 70
    preemption.preempt(scheduler, request, scheduler.schedule())
    plan = scheduler.schedule()
    assert plan.prefix_hit_tokens["r"] == 64              # its own 4 full blocks, output included
    assert request.num_cached_prompt_tokens == 0


# ---- Scheduler.update ------------------------------------------------------------------------

def scheduler_with(num_blocks=32, eos=(), **overrides):
    # blocks of 4 tokens, a 32-token budget (as the engine loop's tests run)
    config = cpu_engine_config(**{**dict(block_size=4, max_num_batched_tokens=32, num_gpu_blocks=num_blocks),
                                  **overrides})
    blocks = BlockManager(num_blocks, 0, config.block_size, config.enable_prefix_caching)
    return Scheduler(config, blocks, max_model_len=num_blocks * config.block_size, eos_token_ids=eos)


def add(scheduler, request_id, length, **params):
    # a prompt of its own per id: with prefix caching (on by default) two requests with one
    # prompt would share blocks, and the second would wait a step for the first's
    request = Request(request_id, None, prompt(length, zlib.crc32(request_id.encode())), SamplingParams(**params))
    scheduler.add(request)
    return request


def test_update_advances_computed_tokens_and_gives_tokens_only_to_completed_prompts():
    scheduler = scheduler_with(max_num_batched_tokens=8)
    long, short = add(scheduler, "long", 13, max_tokens=3), add(scheduler, "s", 3, max_tokens=3)
    plan = scheduler.schedule()                                     # 8 tokens of the long prompt
    assert [(i.request, i.num_tokens) for i in plan.items] == [(long, 8)] and not plan.sampling_items
    outcome = scheduler.update(plan, [])
    assert long.num_computed_tokens == 8 and not long.output_token_ids and outcome.advanced == []
    plan = scheduler.schedule()                                     # the long prompt's last 5, the short's 3
    assert [i.request for i in plan.sampling_items] == [long, short]
    outcome = scheduler.update(plan, torch.tensor([7, 9]))          # a device tensor is read too
    assert outcome.advanced == [long, short] and outcome.finished == []
    assert (long.output_token_ids, short.output_token_ids) == ([7], [9])
    assert (long.num_computed_tokens, short.num_computed_tokens) == (13, 3)
    with pytest.raises(ValueError, match="1 sampled tokens for the plan's 2 sampling items"):
        scheduler.update(scheduler.schedule(), [1])


def test_update_finishes_requests_and_frees_their_blocks():
    scheduler = scheduler_with(eos=[5])
    eos, ignores_eos = add(scheduler, "eos", 6, max_tokens=9), add(scheduler, "ignore", 6, max_tokens=9, ignore_eos=True)
    stop_id, length = add(scheduler, "stop-id", 6, max_tokens=9, stop_token_ids=[11]), add(scheduler, "len", 6, max_tokens=1)
    plan = scheduler.schedule()
    blocks = {i.request.request_id: list(i.request.block_table) for i in plan.items}
    outcome = scheduler.update(plan, [5, 5, 11, 3])
    assert [(r.request_id, r.finish_reason) for r in outcome.finished] == [("eos", "stop"), ("stop-id", "stop"),
                                                                           ("len", "length")]
    assert all(r.status == RequestStatus.FINISHED and not r.block_table for r in outcome.finished)
    assert sorted(outcome.freed_blocks) == sorted(blocks["eos"] + blocks["stop-id"] + blocks["len"])
    assert scheduler.running == [ignores_eos] and not ignores_eos.finished
    # each finished prompt's full block stays in the prefix cache, and still counts as free
    assert len(scheduler.blocks.evictable) == 3
    assert scheduler.blocks.num_free_blocks == 32 - len(ignores_eos.block_table)


def test_update_hashes_blocks_as_they_fill():
    scheduler = scheduler_with(enable_prefix_caching=True, max_num_batched_tokens=6)
    request = add(scheduler, "r", 11, max_tokens=4)
    for full_blocks in (1, 2, 3, 3):          # computed tokens 6, 11, 12, 13; blocks of 4
        plan = scheduler.schedule()
        scheduler.update(plan, [1] * len(plan.sampling_items))
        assert request.num_cached_blocks == full_blocks
        assert sorted(scheduler.blocks.cached_blocks.values()) == request.block_table[:full_blocks]
