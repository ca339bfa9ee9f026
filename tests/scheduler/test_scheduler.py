"""long_prefill_token_threshold (vLLM's name): a long prompt takes at most that many tokens
per step, so a short request that arrives behind it is admitted at once."""
from __future__ import annotations

import pytest

from llmlab import EngineConfig, SamplingParams
from llmlab.cache.block_manager import BlockManager
from llmlab.request import Request
from llmlab.scheduler import Scheduler


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
    """preempt_for_priority: a newcomer that outranks a running request takes its slot."""
    config = EngineConfig(device="cpu", max_num_seqs=2, max_num_batched_tokens=512)
    priority = {"low-1": 1, "low-2": 1, "low-3": 1, "high": 0}
    scheduler = Scheduler(config, BlockManager(256, 0, 16), 4096,
                          policy=lambda r: (priority[r.request_id], r.arrival_time))
    scheduler.preempt_for_priority = True
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
    scheduler.preempt_for_priority = False                  # off: the newcomer waits
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
    scheduler._preempt(request, scheduler.schedule())
    plan = scheduler.schedule()
    assert plan.prefix_hit_tokens["r"] == 64              # its own 4 full blocks, output included
    assert request.num_cached_prompt_tokens == 0
