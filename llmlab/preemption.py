"""Preemption: taking a running request's KV blocks away when they run out, and giving them back.

The scheduler decides *when* (a decode or prefill that cannot get a block, an arrival the
policy lets preempt); these functions do the rest, given the scheduler whose queues and
block manager they change and the step's Plan they record the change in:
  make_room(s, request, n, plan, now)  preempt the policy's victims until `request` can hold n tokens
  preempt_for(s, request, plan, now)   an arrival preempts the policy's victim, if it outranks it
  preempt(s, request, plan)            the bookkeeping of one preemption, in either mode:
      swap       its blocks are copied to host blocks (plan.swap_out_copies) and it waits in
                 `swapped`; `swap_in` brings it back to fresh device blocks (vLLM's swap);
      recompute  its blocks are freed and it waits again with its prompt and output so far,
                 computed anew when re-admitted (vLLM's recompute; the default).
Either way every block comes back: a swapped request's host blocks when it returns or is
aborted, a recomputed one's device blocks at once.
"""
from __future__ import annotations

from llmlab.plan import Plan
from llmlab.policies import PolicyError, _short, ask
from llmlab.request import Request, RequestStatus


def make_room(scheduler, request: Request, num_tokens: int, plan: Plan, now: float) -> bool:
    """Preempt the policy's victims (by default the lowest-priority running requests) until
    `request` can hold `num_tokens`. Returns False when `request` itself had to be preempted."""
    blocks = scheduler.blocks
    while blocks.blocks_needed(request, num_tokens) > blocks.num_free_blocks:
        victim = choose_victim(scheduler, list(scheduler.running), now)   # sorted at the step's start; a copy
        preempt(scheduler, victim, plan)
        if victim is request:
            return False
    return True


def preempt_for(scheduler, request: Request, plan: Plan, now: float) -> int | None:
    """If the policy lets the waiting `request` preempt on arrival: preempt its victim, provided
    `request` outranks it (a smaller key: otherwise two requests could take turns preempting
    each other forever); returns the tokens the victim's items gave back to the step's budget
    (None: nobody was preempted)."""
    if not scheduler.running or not ask(scheduler.policy, "preempts_on_arrival", request, now):
        return None
    key = scheduler.policy_key(now)
    victim = choose_victim(scheduler, sorted(scheduler.running, key=key), now)   # admitted this step: not sorted
    if not key(request) < key(victim):
        return None
    given_back = sum(item.num_tokens for item in plan.items if item.request is victim)
    preempt(scheduler, victim, plan)
    return given_back


def choose_victim(scheduler, running: list[Request], now: float) -> Request:
    """The policy's choice among `running` (ordered by key, most important first)."""
    victim = ask(scheduler.policy, "preempt_victim", running, now)
    if not any(victim is r for r in scheduler.running):
        what = f"request {victim.request_id!r}" if isinstance(victim, Request) else _short(victim)
        raise PolicyError(f"policy {scheduler.policy.name!r}: preempt_victim(running, now) returned {what}, "
                          f"which is not one of the running requests (return an element of `running`, and "
                          f"leave the list as it is)")
    return victim


def preempt(scheduler, request: Request, plan: Plan) -> None:
    """Take `request` off the running queue and out of this step's plan; swap it out when the
    config asks for swapping and host blocks can hold it, otherwise free its blocks to recompute."""
    scheduler.running.remove(request)
    for items in (plan.prefills, plan.decodes):   # a victim may already be in this plan
        items[:] = [item for item in items if item.request is not request]
    request.num_preemptions += 1
    blocks = scheduler.blocks
    if scheduler.config.preemption_mode == "swap" and blocks.can_swap_out(request):
        plan.swap_out_copies += blocks.swap_out(request)
        plan.swapped_out.append(request.request_id)
        request.status = RequestStatus.SWAPPED
        scheduler.swapped.append(request)
    else:   # recompute: drop the KV, redo the prompt and the output so far later
        blocks.free(request)
        request.num_computed_tokens = 0
        plan.preempted.append(request.request_id)
        request.status = RequestStatus.WAITING
        scheduler.waiting.append(request)


def swap_in(scheduler, request: Request, plan: Plan) -> None:
    """Bring a swapped-out request back (its blocks fit: the caller checked): fresh device
    blocks, the (host, device) copies in the plan, and it runs again."""
    scheduler.swapped.remove(request)
    plan.swap_in_copies += scheduler.blocks.swap_in(request)
    plan.swapped_in.append(request.request_id)
    request.status = RequestStatus.RUNNING
    scheduler.running.append(request)
