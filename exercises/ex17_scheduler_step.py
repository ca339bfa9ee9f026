"""Exercise 17 -- the scheduler's step (continuous batching): which requests run this step and
how many tokens each, under a token budget and a sequence budget, with decodes first,
chunked prefill, and preemption when KV blocks run out.
Difficulty: *** (no Triton; Python only; about 90 minutes)

Read first: notebooks/06_iteration_level_scheduling.ipynb, notebooks/07_chunked_prefill.ipynb
and notebooks/08_preemption.ipynb; exercise 10 (the chunking policy alone). Use: what your
Scheduler inherits from llmlab's (llmlab/scheduler.py: __init__, the queues `waiting`,
`running`, `swapped`, `blocks` (the block manager), `config`, `token_budget`, `policy`
(`policy.admit(request, now)`), `policy_key(now)`, `_prefill_budget`, `_allocate`,
`at_length_limit`, and the bookkeeping after the step: update, resolve, finish; read only
those: that file's schedule and _schedule_* are this exercise's answer); `self.preemption`
(make_room, preempt_for, swap_in: exercise 18, llmlab's by default); the `Plan` and
`ScheduledItem` of llmlab/plan.py; `Request` (llmlab/request.py: num_tokens,
num_computed_tokens, num_uncomputed_tokens, is_prefilling, status). Nothing else of
llmlab/ is needed.

Task
    Every engine step calls schedule(now) and runs the Plan it returns. Write it in four
    phases, under one budget of self.token_budget tokens (each phase returns what is left):
      1. _schedule_decodes: every RUNNING request that is decoding (not is_prefilling) gets
         one token, in the running queue's order (sorted by the policy at the step's start),
         before any prompt token: a decode is never starved by prefills. First
         self.preemption.make_room(self, request, request.num_tokens, plan, now): False means
         the request itself was preempted (skip it). Then self._allocate(request,
         request.num_tokens, plan) and plan.decodes.append(ScheduledItem(request, "decode", 1,
         request.num_computed_tokens)). Skip a request whose in-flight token is its last
         (request.token_pending and self.at_length_limit(request)).
      2. budget = self._prefill_budget(plan, budget, now) (given); then
         _schedule_running_prefills: each RUNNING request still prefilling gets its next
         chunk (_schedule_prefill), once make_room(self, request,
         request.num_computed_tokens + 1, plan, now) is True.
      3. if the step preempted anyone (plan.preempted or plan.swapped_out), stop here: the
         plan is done. Else _schedule_swapped: swapped requests (sorted by policy_key), while
         budget > 0 and fewer than config.max_num_seqs run and its host blocks + 1 fit in the
         free device blocks: self.preemption.swap_in(self, request, plan), then its prefill
         chunk, or its decode (allocate + one decode item, as in phase 1).
      4. _schedule_waiting: waiting requests, sorted by policy_key, while budget > 0: a request
         the policy does not admit (self.policy.admit(request, now) is False; only asked
         while some request runs) is passed over; at max_num_seqs running, or when no chunk
         fits, preempt_for may make room (it returns the budget its victim gave back: add it
         to the budget and try the same request again; None: stop admitting); a request with no block table first looks its prefix up
         (blocks.match_prefix fills its block table and returns the tokens found: set
         num_computed_tokens to them; record plan.prefix_hit_tokens and, unless it was
         preempted before, num_cached_prompt_tokens); then its chunk; admitted: status
         RUNNING, into `running`.
    _schedule_prefill(request, budget, plan) -> tokens used (0: none fit): with chunked
    prefill, min(uncomputed tokens, budget, config.long_prefill_token_threshold when set,
    what the request's blocks plus the free blocks can hold); without it, the whole rest or
    nothing. Allocate, then plan.prefills.append(ScheduledItem(request, "prefill", chunk,
    request.num_computed_tokens)).

Hints
    - The budget counts tokens: a decode is 1, a chunk its length; the plan's tokens never
      exceed token_budget (check your <= against < at the edge).
    - long_prefill_token_threshold (vLLM's name) caps one request's chunk so a long prompt
      cannot take a whole step; 0 means no cap.
    - Iterate over list(self.running): make_room may preempt (remove) running requests, and a
      preempted one is no longer RUNNING (check the status).
    - With prefix caching, a waiting request whose first block another running request is
      still computing waits a step (blocks.prefixes_in_flight(self.running) once per step,
      blocks.waits_for_prefix(request, in_flight); an admitted request with fewer than
      block_size computed tokens adds blocks.first_block_hash(request) to in_flight): else
      both compute the shared prefix. A request that fit no chunk gives back the prefix
      blocks it matched (blocks.free, num_computed_tokens = 0, no prefix hit recorded).

What you will have built: the continuous-batching scheduler of a paged engine (Orca's
iteration-level scheduling with SARATHI's chunked prefill and vLLM's preemption); the grader
runs the real engine on it (LLMEngine(config, scheduler=Scheduler)).

Grade: `make grade EX=ex17`, or `pytest tests/exercises/test_ex17_scheduler_step.py --impl=exercises`.
"""
from __future__ import annotations

from llmlab.plan import Plan, ScheduledItem
from llmlab.request import Request, RequestStatus
from llmlab.scheduler import Scheduler as BookkeepingScheduler


class Scheduler(BookkeepingScheduler):
    """llmlab's Scheduler with the step (schedule and its phases) written here; the
    constructor, queues and the bookkeeping after the step are inherited."""

    def schedule(self, now: float | None = None) -> Plan:
        """This step's Plan: the four phases, in order, under one token budget."""
        raise NotImplementedError("ex17: write schedule")

    def _schedule_decodes(self, plan: Plan, budget: int, now: float) -> int:
        raise NotImplementedError("ex17: write _schedule_decodes")

    def _schedule_running_prefills(self, plan: Plan, budget: int, now: float) -> int:
        raise NotImplementedError("ex17: write _schedule_running_prefills")

    def _schedule_swapped(self, plan: Plan, budget: int, now: float) -> int:
        raise NotImplementedError("ex17: write _schedule_swapped")

    def _schedule_waiting(self, plan: Plan, budget: int, now: float) -> int:
        raise NotImplementedError("ex17: write _schedule_waiting")

    def _schedule_prefill(self, request: Request, budget: int, plan: Plan) -> int:
        raise NotImplementedError("ex17: write _schedule_prefill")
