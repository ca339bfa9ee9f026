"""Exercise 18, preemption bookkeeping: the student's make_room / preempt / swap_in under llmlab's
Scheduler. First one call each on a scheduler whose blocks are all taken; then scripted
out-of-blocks workloads in lockstep with llmlab (exercise 17's driver: the same plans, every
block back at the end), in both preemption modes; then the real engine with the student's
functions plugged in (LLMEngine(config, preemption=module)) writes the text of a run that
never preempts."""
from __future__ import annotations

import pytest

from llmlab.plan import Plan, ScheduledItem
from llmlab.policies import SchedulingPolicy
from llmlab.request import RequestStatus
from llmlab.scheduler import Scheduler
from diagnose import fail
from test_ex17_scheduler_step import Side, Workload, engine_texts, out_of_blocks, random_workload, run_lockstep

EXERCISE = "ex18_preemption"


def expect(ok, case: str, what: str, hint: str) -> None:
    if not ok:
        fail(case, [what, f"-> {hint}"])


def full_scheduler(ex, mode: str, policy="fcfs") -> Side:
    """llmlab's Scheduler with `ex`'s preemption functions, after one step that prefilled three
    6-token requests into all 6 blocks (2 each); each has sampled one token."""
    workload = Workload([(0, 6, 8)] * 3, dict(preemption_mode=mode, max_num_batched_tokens=32), num_blocks=6,
                        num_host_blocks=8, policy=policy)
    side = Side(Scheduler, ex, workload)
    side.arrive(0, workload)
    plan = side.scheduler.schedule(now=0.0)
    side.finish_step(plan, 0)
    assert side.blocks.num_free_blocks == 0 and len(side.scheduler.running) == 3, "the grader's setup changed"
    return side


def test_preempt_by_recompute_frees_every_block(ex):
    case = "preempt a running request of 2 blocks by recompute (it is in this step's plan as a decode)"
    side = full_scheduler(ex, "recompute")
    s, victim = side.scheduler, side.scheduler.running[-1]
    plan = Plan(decodes=[ScheduledItem(victim, "decode", 1, victim.num_computed_tokens)])
    ex.preempt(s, victim, plan)
    expect(not victim.block_table and side.blocks.num_free_blocks == 2, case,
           f"after preempt: its table {victim.block_table}, {side.blocks.num_free_blocks} of 6 blocks free",
           "a block not freed on recompute: preempt frees the victim's blocks (blocks.free(request))")
    expect(victim.num_computed_tokens == 0, case, f"num_computed_tokens is {victim.num_computed_tokens}",
           "recompute drops the K/V: num_computed_tokens = 0, so its prompt and output are computed again")
    expect(victim not in s.running and victim in s.waiting and victim.status == RequestStatus.WAITING, case,
           f"status {victim.status.name}, in running: {victim in s.running}, in waiting: {victim in s.waiting}",
           "a recomputed request leaves `running` and waits again in `waiting` with status WAITING")
    expect(plan.preempted == [victim.request_id] and not plan.decodes and not plan.swapped_out, case,
           f"plan.preempted {plan.preempted}, plan.decodes {[i.request.request_id for i in plan.decodes]}",
           "its id goes to plan.preempted, and its items leave plan.prefills and plan.decodes (it no longer runs)")
    expect(victim.num_preemptions == 1, case, f"num_preemptions is {victim.num_preemptions}",
           "count the preemption: request.num_preemptions += 1")


def test_swap_out_and_back_in(ex):
    case = "preempt a running request of 2 blocks by swap, then swap it back in"
    side = full_scheduler(ex, "swap")
    s, victim = side.scheduler, side.scheduler.running[-1]
    device, computed = list(victim.block_table), victim.num_computed_tokens
    plan = Plan()
    ex.preempt(s, victim, plan)
    expect([d for d, _ in plan.swap_out_copies] == device and side.blocks.num_free_host_blocks == 6, case,
           f"plan.swap_out_copies {plan.swap_out_copies} (its device blocks were {device}), "
           f"{side.blocks.num_free_host_blocks} of 8 host blocks free",
           "swap: plan.swap_out_copies += blocks.swap_out(request): the runner copies these (device, host) pairs")
    expect(victim in s.swapped and victim not in s.running and victim.status == RequestStatus.SWAPPED
           and plan.swapped_out == [victim.request_id] and not plan.preempted, case,
           f"status {victim.status.name}, in swapped: {victim in s.swapped}, plan.swapped_out {plan.swapped_out}, "
           f"plan.preempted {plan.preempted}",
           "a swapped request waits in scheduler.swapped with status SWAPPED, its id in plan.swapped_out "
           "(preemption_mode 'swap', when blocks.can_swap_out(request))")
    hosts = [h for _, h in plan.swap_out_copies]
    back = Plan()
    ex.swap_in(s, victim, back)
    expect([h for h, _ in back.swap_in_copies] == hosts and side.blocks.num_free_host_blocks == 8
           and victim.request_id not in side.blocks.host_tables, case,
           f"plan.swap_in_copies {back.swap_in_copies} (the host blocks were {hosts}), "
           f"{side.blocks.num_free_host_blocks} of 8 host blocks free",
           "swap_in forgot the CPU blocks: plan.swap_in_copies += blocks.swap_in(request) copies each host block "
           "back to a fresh device block and frees the host blocks")
    expect(victim in s.running and victim not in s.swapped and victim.status == RequestStatus.RUNNING
           and back.swapped_in == [victim.request_id], case,
           f"status {victim.status.name}, in running: {victim in s.running}, plan.swapped_in {back.swapped_in}",
           "swap_in: off `swapped`, into `running` with status RUNNING, its id in plan.swapped_in")
    expect(victim.num_computed_tokens == computed, case,
           f"num_computed_tokens is {victim.num_computed_tokens} after swap_in, {computed} before the swap",
           "a swapped request keeps its K/V (the copies bring it back): swap out and swap in leave "
           "num_computed_tokens alone (set to 0, its tokens would be computed again, as after recompute)")


def test_make_room_preempts_from_the_right_end(ex):
    case = "make room for one more block for the first of 3 running requests (all blocks taken)"
    side = full_scheduler(ex, "recompute")
    s = side.scheduler
    first, last = s.running[0], s.running[-1]
    order = [r.request_id for r in s.running]
    plan = Plan()
    ok = ex.make_room(s, first, first.num_tokens + 4, plan, 1.0)
    expect(plan.preempted == [last.request_id], case,
           f"preempted {plan.preempted}; the running queue was {order} (most important first)",
           "a victim chosen from the wrong end: the victim is choose_victim(scheduler, scheduler.running, now), "
           "by default running[-1] (the lowest priority), one at a time until the request fits")
    expect(ok is True, case, f"make_room returned {ok!r}", "True: the request itself was not preempted")
    side = full_scheduler(ex, "recompute")
    s = side.scheduler
    last = s.running[-1]
    plan = Plan()
    ok = ex.make_room(s, last, last.num_tokens + 4, plan, 1.0)
    expect(ok is False and plan.preempted == [last.request_id], "make room for the last running request itself",
           f"make_room returned {ok!r}, preempted {plan.preempted}",
           "when the victim is the request itself, stop and return False (it cannot run this step)")


class PreemptsTheMiddle(SchedulingPolicy):
    """A policy whose victim is not running[-1]: the built-in policies all leave preempt_victim
    at its default (the last of the running queue), so a make_room that takes running[-1]
    itself passes with them and ignores every policy that chooses otherwise."""
    name = "preempts the middle of the running queue"

    def preempt_victim(self, running, now):
        return running[len(running) // 2]


def test_make_room_asks_the_policy(ex):
    case = "make room for the last of 3 running requests under a policy whose victim is the middle one"
    side = full_scheduler(ex, "recompute", PreemptsTheMiddle)
    s = side.scheduler
    last, middle = s.running[-1], s.running[1]
    order = [r.request_id for r in s.running]
    plan = Plan()
    ok = ex.make_room(s, last, last.num_tokens + 4, plan, 1.0)
    expect(plan.preempted == [middle.request_id] and ok is True, case,
           f"preempted {plan.preempted}, make_room returned {ok!r}; the running queue was {order}, the policy's "
           f"victim {middle.request_id}",
           "the victim is the policy's: choose_victim(scheduler, scheduler.running, now) (it asks "
           "scheduler.policy.preempt_victim), not running[-1] taken by hand: running[-1] is only the default policy's "
           "choice")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_out_of_blocks(ex, mode):
    run_lockstep("out of blocks", out_of_blocks(mode), Scheduler, ex)


def test_swap_without_host_room_recomputes(ex):
    workload = Workload([(0, 6, 8), (0, 6, 8), (1, 6, 8)], dict(preemption_mode="swap"), num_blocks=6,
                        num_host_blocks=1)
    run_lockstep("preemption by swap with 1 host block (too few: recompute)", workload, Scheduler, ex)


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads(ex, seed):
    run_lockstep(f"random workload {seed}", random_workload(seed), Scheduler, ex)


@pytest.mark.slow   # the 30-layer model, three engine runs
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_end_to_end(ex, llm, preemption_mode):
    case = f"the engine with your preemption functions (7 blocks, preemption by {preemption_mode})"
    _, expected, _ = engine_texts(llm, 64, preemption_mode)     # 64 blocks: nobody is preempted
    _, _, llmlab_preemptions = engine_texts(llm, 7, preemption_mode)
    engine, actual, preemptions = engine_texts(llm, 7, preemption_mode, case=case, preemption=ex)
    differ = [i for i, (a, e) in enumerate(zip(actual, expected)) if a != e]
    expect(not differ, case, f"prompts {differ} generate {[llm.tokenizer.decode(actual[i]) for i in differ]!r}, "
                             f"without preemption {[llm.tokenizer.decode(expected[i]) for i in differ]!r}",
           "a preempted request lost K/V: recompute sets num_computed_tokens = 0; swap puts every copy in the plan")
    expect(preemptions == llmlab_preemptions, case,
           f"{preemptions} preemptions, llmlab's functions preempt {llmlab_preemptions} times in the same run",
           "more preemptions than needed: a preempted request's blocks did not come back (a block not freed on "
           "recompute), so make_room went on preempting; or it preempted before blocks ran out"
           if preemptions > llmlab_preemptions else "make_room preempts (one victim at a time) until the request fits")
    bm = engine.block_manager
    expect(bm.num_free_blocks == bm.num_device_blocks and bm.num_free_host_blocks == bm.num_host_blocks, case,
           f"after every request finished: {bm.num_free_blocks} of {bm.num_device_blocks} device blocks and "
           f"{bm.num_free_host_blocks} of {bm.num_host_blocks} host blocks free",
           "every block comes back: free on recompute, the host blocks at swap_in")
