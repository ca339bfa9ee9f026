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
        now = self.now() if now is None else now
        plan = Plan()
        self.running.sort(key=self.policy_key(now))
        budget = self._schedule_decodes(plan, self.token_budget, now)
        budget = self._prefill_budget(plan, budget, now)
        budget = self._schedule_running_prefills(plan, budget, now)
        if plan.preempted or plan.swapped_out:
            # a victim is not replaced by a newcomer at once: the preempted get back in first
            return plan
        budget = self._schedule_swapped(plan, budget, now)
        self._schedule_waiting(plan, budget, now)
        return plan

    def _schedule_decodes(self, plan: Plan, budget: int, now: float) -> int:
        """1. One token for every decoding request, before any prompt token (Orca)."""
        for request in list(self.running):
            if request.status != RequestStatus.RUNNING or request.is_prefilling:
                continue    # preempted by an earlier request's make_room, or still prefilling
            if request.token_pending and self.at_length_limit(request):
                continue    # its token in flight is its last
            if budget < 1:
                break
            if not self.preemption.make_room(self, request, request.num_tokens, plan, now):
                continue    # the request itself was the victim
            self._allocate(request, request.num_tokens, plan)
            plan.decodes.append(ScheduledItem(request, "decode", 1, request.num_computed_tokens))
            budget -= 1
        return budget

    def _schedule_running_prefills(self, plan: Plan, budget: int, now: float) -> int:
        """2. Running requests still prefilling get their next chunk."""
        for request in list(self.running):
            if request.status != RequestStatus.RUNNING or not request.is_prefilling or budget <= 0:
                continue
            # room for at least one more token, or a victim goes (two half-prefilled requests
            # holding a full cache would otherwise wait for each other forever)
            if self.preemption.make_room(self, request, request.num_computed_tokens + 1, plan, now):
                budget -= self._schedule_prefill(request, budget, plan)
        return budget

    def _schedule_swapped(self, plan: Plan, budget: int, now: float) -> int:
        """3. Swapped-out requests come back when their blocks fit."""
        self.swapped.sort(key=self.policy_key(now))
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            if len(self.blocks.host_tables[request.request_id]) + 1 > self.blocks.num_free_blocks:
                break
            self.preemption.swap_in(self, request, plan)
            if request.is_prefilling:
                budget -= self._schedule_prefill(request, budget, plan)
            else:
                self._allocate(request, request.num_tokens, plan)
                plan.decodes.append(ScheduledItem(request, "decode", 1, request.num_computed_tokens))
                budget -= 1
        return budget

    def _schedule_waiting(self, plan: Plan, budget: int, now: float) -> int:
        """4. Waiting requests are admitted, highest priority first."""
        self.waiting.sort(key=self.policy_key(now))
        in_flight = self.blocks.prefixes_in_flight(self.running)   # None without prefix caching
        i = 0
        while i < len(self.waiting) and budget > 0:
            request = self.waiting[i]
            if self.running and not self.policy.admit(request, now):
                i += 1      # deferred by the policy (never the only work: it is asked only while a request runs)
                continue
            if len(self.running) >= self.config.max_num_seqs:
                given_back = self.preemption.preempt_for(self, request, plan, now)
                if given_back is None:
                    break
                budget += given_back
                continue
            if not request.block_table:
                if in_flight and self.blocks.waits_for_prefix(request, in_flight):
                    i += 1  # its prefix is being computed: next step it is a cache hit
                    continue
                cached = self.blocks.match_prefix(request)
                if cached:
                    request.num_computed_tokens = cached
                    if not request.num_preemptions:   # a re-admission finds its own blocks, output too
                        request.num_cached_prompt_tokens = min(cached, len(request.prompt_token_ids))
                    plan.prefix_hit_tokens[request.request_id] = cached
            used = self._schedule_prefill(request, budget, plan)
            if used == 0:   # no chunk fits: give the matched prefix back, maybe preempt
                self.blocks.free(request)
                request.num_computed_tokens = 0
                plan.prefix_hit_tokens.pop(request.request_id, None)
                given_back = self.preemption.preempt_for(self, request, plan, now)
                if given_back is None:
                    break
                budget += given_back
                continue
            self.waiting.pop(i)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            budget -= used
            if in_flight is not None and request.num_computed_tokens < self.blocks.block_size:
                first = self.blocks.first_block_hash(request)
                if first is not None:
                    in_flight.add(first)
        return budget

    def _schedule_prefill(self, request: Request, budget: int, plan: Plan) -> int:
        """The next prompt chunk of `request`; returns the tokens used (0 = none fit)."""
        remaining = request.num_uncomputed_tokens
        if self.config.enable_chunked_prefill:
            chunk = min(remaining, budget)                      # SARATHI: fill what is left
            if self.config.long_prefill_token_threshold:
                chunk = min(chunk, self.config.long_prefill_token_threshold)   # no head-of-line blocking
            room = (len(request.block_table) + self.blocks.num_free_blocks) * self.blocks.block_size
            chunk = min(chunk, room - request.num_computed_tokens)   # never more than free blocks hold
        else:
            chunk = remaining if remaining <= budget else 0
            if self.blocks.blocks_needed(request, request.num_tokens) > self.blocks.num_free_blocks:
                chunk = 0
        if chunk <= 0:
            return 0
        self._allocate(request, request.num_computed_tokens + chunk, plan)
        plan.prefills.append(ScheduledItem(request, "prefill", chunk, request.num_computed_tokens))
        return chunk
