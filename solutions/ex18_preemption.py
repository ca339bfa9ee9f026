"""Exercise 18 -- preemption bookkeeping: when KV blocks run out, take a running request's
blocks away (swap them out to host memory, or free them to recompute later) and give them
back, with every block coming back. Difficulty: ** (no Triton; Python only; about 45 minutes)

Read first: notebooks/08_preemption.ipynb; exercise 13 (the block manager these functions
call). Use: the scheduler you are given (its `running`, `waiting`, `swapped` queues, its
`blocks` -- llmlab's BlockManager: blocks_needed, num_free_blocks, free, can_swap_out,
swap_out, swap_in -- and `config.preemption_mode`), the step's `Plan` (llmlab/plan.py) and
`Request` / `RequestStatus` (llmlab/request.py). `choose_victim` and `preempt_for` are
written for you. Nothing else of llmlab/ is needed.

Task
    The scheduler (llmlab/scheduler.py) decides *when* to preempt; these functions do the
    rest (llmlab/preemption.py has the same functions, and is this exercise's answer: read it
    after yours passes). Write:
      make_room(scheduler, request, num_tokens, plan, now)   preempt the policy's victims,
              one at a time, until `request` can hold num_tokens (blocks_needed <= free
              blocks). The victim is choose_victim(scheduler, scheduler.running, now) (the
              running queue is sorted, most important first: by default the victim is the
              last). Returns False as soon as the victim was `request` itself, else True.
      preempt(scheduler, request, plan)   take `request` off `running` and out of this
              step's plan (plan.prefills and plan.decodes: it may already be there), count
              request.num_preemptions, then
                swap       (config.preemption_mode == "swap" and blocks.can_swap_out(request)):
                           plan.swap_out_copies += blocks.swap_out(request), its id in
                           plan.swapped_out, status SWAPPED, appended to scheduler.swapped;
                recompute  (otherwise): free its blocks, num_computed_tokens = 0 (its prompt
                           and output so far are computed again), its id in plan.preempted,
                           status WAITING, appended to scheduler.waiting.
      swap_in(scheduler, request, plan)   bring a swapped request back (the caller checked its
              blocks fit): off `swapped`, plan.swap_in_copies += blocks.swap_in(request) (fresh
              device blocks; its host blocks free again), its id in plan.swapped_in, status
              RUNNING, appended to scheduler.running.

Hints
    - Every block comes back: a recomputed request's device blocks at once (free), a swapped
      one's host blocks when it returns (swap_in) or is aborted (the scheduler's remove).
    - The plan is what the engine applies: the runner copies plan.swap_out_copies before the
      step and plan.swap_in_copies back; a copy missing from the plan is K/V lost.
    - Preempt from the right end: the victim is the policy's choice, never running[0].

What you will have built: the preemption side of a paged engine (vLLM's swap and
recompute); the grader runs the real engine with yours
(LLMEngine(config, preemption=ex18_preemption): a module with these functions).

Grade: `make grade EX=ex18`, or `pytest tests/exercises/test_ex18_preemption.py --impl=exercises`.
"""
from __future__ import annotations

from llmlab.plan import Plan
from llmlab.request import Request, RequestStatus


def choose_victim(scheduler, running: list[Request], now: float) -> Request:
    """The policy's choice among `running` (ordered by key, most important first). Given."""
    victim = scheduler.policy.preempt_victim(running, now)
    if not any(victim is r for r in running):
        raise ValueError(f"policy {scheduler.policy.name!r}: preempt_victim returned {victim!r}, "
                         f"which is not one of the running requests")
    return victim


def preempt_for(scheduler, request: Request, plan: Plan, now: float) -> int | None:
    """If the policy lets the waiting `request` preempt on arrival: preempt its victim, provided
    `request` outranks it (a smaller key); returns the tokens the victim's items gave back to
    the step's budget (None: nobody was preempted). Given."""
    if not scheduler.running or not scheduler.policy.preempts_on_arrival(request, now):
        return None
    key = scheduler.policy_key(now)
    victim = choose_victim(scheduler, sorted(scheduler.running, key=key), now)
    if not key(request) < key(victim):
        return None
    given_back = sum(item.num_tokens for item in plan.items if item.request is victim)
    preempt(scheduler, victim, plan)
    return given_back


def make_room(scheduler, request: Request, num_tokens: int, plan: Plan, now: float) -> bool:
    """Preempt the policy's victims until `request` can hold `num_tokens`. Returns False when
    `request` itself had to be preempted."""
    blocks = scheduler.blocks
    while blocks.blocks_needed(request, num_tokens) > blocks.num_free_blocks:
        # the running queue was sorted at the step's start: the policy picks from its end
        victim = choose_victim(scheduler, scheduler.running, now)
        preempt(scheduler, victim, plan)
        if victim is request:
            return False
    return True


def preempt(scheduler, request: Request, plan: Plan) -> None:
    """Take `request` off the running queue and out of this step's plan; swap it out or free
    its blocks to recompute."""
    scheduler.running.remove(request)
    for items in (plan.prefills, plan.decodes):   # a victim may already be in this plan
        items[:] = [item for item in items if item.request is not request]
    request.num_preemptions += 1
    blocks = scheduler.blocks
    if scheduler.config.preemption_mode == "swap" and blocks.can_swap_out(request):
        # the runner copies these (device, host) pairs before the step: the K/V survives
        plan.swap_out_copies += blocks.swap_out(request)
        plan.swapped_out.append(request.request_id)
        request.status = RequestStatus.SWAPPED
        scheduler.swapped.append(request)
    else:
        # recompute: the K/V is dropped; prompt and output so far are prefilled again
        blocks.free(request)
        request.num_computed_tokens = 0
        plan.preempted.append(request.request_id)
        request.status = RequestStatus.WAITING
        scheduler.waiting.append(request)


def swap_in(scheduler, request: Request, plan: Plan) -> None:
    """Bring a swapped-out request back to fresh device blocks; it runs again."""
    scheduler.swapped.remove(request)
    # fresh device blocks, the host blocks free again; the runner copies (host, device) back
    plan.swap_in_copies += scheduler.blocks.swap_in(request)
    plan.swapped_in.append(request.request_id)
    request.status = RequestStatus.RUNNING
    scheduler.running.append(request)
