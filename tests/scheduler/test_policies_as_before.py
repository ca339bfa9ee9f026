"""Each built-in policy, as a SchedulingPolicy, plans exactly what llmlab planned before the
policy interface (#31): the same Plan (items, preemptions, swaps, block allocations,
prefix-cache hits) at every step, on workloads hypothesis draws, against the scheduler of
that time (scheduler_before_31.py, a verbatim copy, where a policy was a key function and
"priority" set the preempt_for_priority flag)."""
from __future__ import annotations

import random
from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scheduler_before_31 as before
from llmlab import EngineConfig, SamplingParams
from llmlab.cache.block_manager import BlockManager
from llmlab.policies import POLICIES, resolve_policy
from llmlab.request import Request
from llmlab.scheduler import Scheduler

EOS = 2


def key_functions(priorities: dict[str, int]) -> dict:
    """Each built-in as it was: a key function, and whether it preempted on arrival."""
    return {
        "fcfs": (lambda r: r.arrival_time, False),
        "shortest_prompt_first": (lambda r: (len(r.prompt_token_ids), r.arrival_time), False),
        "shortest_output_first": (lambda r: (r.params.max_tokens, r.arrival_time), False),
        "priority": (lambda r: (priorities.get(r.request_id, 0), r.arrival_time), True),
    }


def describe(plan) -> tuple:
    """Everything a Plan decides, as plain values."""
    items = tuple((i.request.request_id, i.kind, i.num_tokens, i.start_position, i.completes_prompt)
                  for i in plan.items)
    return (items, tuple(plan.preempted), tuple(plan.swapped_out), tuple(plan.swapped_in),
            tuple(plan.swap_out_copies), tuple(plan.swap_in_copies),
            tuple(sorted((k, tuple(v)) for k, v in plan.allocated_blocks.items())),
            tuple(sorted(plan.prefix_hit_tokens.items())))


def token(request_id: str, position: int) -> int:
    """A sampled token both schedulers get: a fixed function of the request and position,
    now and then EOS (so some requests stop early)."""
    return random.Random(f"{request_id}:{position}").choice([EOS] + list(range(3, 40)))


def twins(spec) -> tuple[Request, Request]:
    rid, arrival, prompt, output_len, ignore_eos = spec
    return tuple(Request(rid, None, list(prompt), SamplingParams(max_tokens=output_len, ignore_eos=ignore_eos),
                         arrival_time=arrival) for _ in range(2))


def run_both(config: EngineConfig, num_blocks: int, num_host_blocks: int, requests, policy_name: str,
             priorities: dict[str, int]) -> list[tuple]:
    """Drive the old and the new scheduler through the same arrivals and tokens, asserting
    the same plan at every step; returns the plans."""
    max_model_len = num_blocks * config.block_size

    def blocks():
        return BlockManager(num_blocks, num_host_blocks, config.block_size, config.enable_prefix_caching)
    key, preempt_on_arrival = key_functions(priorities)[policy_name]
    old = before.Scheduler(config, blocks(), max_model_len, key, eos_token_ids=[EOS])
    old.preempt_for_priority = preempt_on_arrival
    workload = [SimpleNamespace(request_id=rid, priority=p) for rid, p in priorities.items()]
    new = Scheduler(config, blocks(), max_model_len, resolve_policy(policy_name, workload), eos_token_ids=[EOS])
    plans, step = [], 0
    arrivals = sorted(requests, key=lambda spec: spec[1])
    while arrivals or old.has_unfinished() or new.has_unfinished():
        now = float(step)
        while arrivals and arrivals[0][1] <= now:
            a, b = twins(arrivals.pop(0))
            old.add(a)
            new.add(b)
        old_plan, new_plan = old.schedule(), new.schedule(now=now)
        plans.append(describe(old_plan))
        assert describe(new_plan) == plans[-1], f"step {step}"
        if old_plan.is_empty and not (old_plan.preempted or old_plan.swapped_out or old_plan.swapped_in):
            assert arrivals, "the old scheduler is stuck: a drawn request cannot fit"
        for scheduler, plan in ((old, old_plan), (new, new_plan)):
            scheduler.update(plan, [token(i.request.request_id, len(i.request.output_token_ids))
                                    for i in plan.sampling_items])
        step += 1
        assert step < 2000
    return plans


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([4, 8]))
    num_blocks = draw(st.integers(6, 24))
    max_model_len = num_blocks * block_size
    chunked = draw(st.booleans())
    config = EngineConfig(device="cpu", block_size=block_size, max_num_seqs=draw(st.integers(1, 5)),
                          max_num_batched_tokens=draw(st.integers(8, 48)), enable_chunked_prefill=chunked,
                          enable_prefix_caching=draw(st.booleans()),
                          preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
                          long_prefill_token_threshold=draw(st.sampled_from([0, 6])) if chunked else 0)
    num_host_blocks = draw(st.sampled_from([0, 4, 32]))
    prefixes = [[7 + g] * draw(st.integers(0, 12)) for g in range(2)]   # shared prompt starts: prefix-cache hits
    requests = []
    arrival = 0.0
    for i in range(draw(st.integers(1, 10))):
        arrival += draw(st.sampled_from([0.0, 0.0, 1.0, 3.0])) + 1e-3      # strictly increasing, often in one step
        prefix = draw(st.sampled_from(prefixes))
        prompt = prefix + draw(st.lists(st.integers(3, 40), min_size=1, max_size=30))
        prompt = prompt[:max_model_len - 2]
        output_len = draw(st.integers(1, max(1, min(20, max_model_len - len(prompt) - 1))))
        requests.append((str(i), arrival, prompt, output_len, draw(st.booleans())))
    priorities = {spec[0]: draw(st.integers(0, 2)) for spec in requests}
    return config, num_blocks, num_host_blocks, requests, priorities


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads(), policy_name=st.sampled_from(POLICIES))
def test_each_builtin_plans_as_before_on_drawn_workloads(workload, policy_name):
    config, num_blocks, num_host_blocks, requests, priorities = workload
    run_both(config, num_blocks, num_host_blocks, requests, policy_name, priorities)


def test_a_plain_key_function_plans_as_before():
    # longest prompt first, a key function of a Request as llmlab always took it
    longest = lambda r: (-len(r.prompt_token_ids), r.arrival_time)   # noqa: E731
    config = EngineConfig(device="cpu", block_size=4, max_num_seqs=3, max_num_batched_tokens=16)
    rng = random.Random(0)
    requests = [(str(i), i * 0.5 + 1e-3, [rng.randrange(3, 40) for _ in range(rng.randrange(1, 30))],
                 rng.randrange(1, 20), True) for i in range(12)]
    old = before.Scheduler(config, BlockManager(12, 0, 4), 48, longest)
    new = Scheduler(config, BlockManager(12, 0, 4), 48, longest)
    arrivals, step = list(requests), 0
    while arrivals or old.has_unfinished():
        while arrivals and arrivals[0][1] <= step:
            a, b = twins(arrivals.pop(0))
            old.add(a)
            new.add(b)
        old_plan, new_plan = old.schedule(), new.schedule(now=float(step))
        assert describe(new_plan) == describe(old_plan), f"step {step}"
        for scheduler, plan in ((old, old_plan), (new, new_plan)):
            scheduler.update(plan, [9] * len(plan.sampling_items))
        step += 1
    assert new.policy.name == "<lambda>"


def test_the_comparison_sees_preemption_swaps_and_arrival_preemption():
    """A fixed workload under pressure, so that the drawn ones are not all easy: every kind of
    preemption happens, and the plans still agree."""
    rng = random.Random(3)
    requests = [(str(i), (i // 3) * 2.0 + i * 1e-3, [rng.randrange(3, 40) for _ in range(rng.randrange(4, 20))],
                 rng.randrange(8, 20), True) for i in range(9)]
    priorities = {str(i): (0 if i % 3 == 2 else 1) for i in range(9)}
    for mode in ("recompute", "swap"):
        config = EngineConfig(device="cpu", block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                              preemption_mode=mode)
        plans = run_both(config, 10, 16, requests, "priority", priorities)
        assert any(plan[1] for plan in plans) or mode == "swap"      # preempted (recompute)
        assert any(plan[2] for plan in plans) or mode == "recompute"  # swapped out
        # a newcomer (priority 0) took a running request's slot: preempted in a step that admits it
        assert any((plan[1] or plan[2]) and any(item[0] in {"2", "5", "8"} and item[3] == 0 for item in plan[0])
                   for plan in plans)
