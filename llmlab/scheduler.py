"""Iteration-level scheduling (Orca) with chunked prefill piggybacked on decodes (SARATHI).

Every engine step asks `Scheduler.schedule()` for a Plan (plan.py): which requests run this
step and how many tokens each, which are preempted, swapped out or back in, and which KV
blocks were allocated. The engine applies it; the scheduler never touches tensors. Phases,
in order, under a budget of `max_num_batched_tokens` tokens (one method each below):
  1. every decoding request gets its one token; when blocks run out the policy's victim is
     preempted (swap or recompute: preemption.py);
  2. running requests still prefilling get their next prompt chunk, within the policy's
     prefill budget (by default what the decodes left: SARATHI §4);
  3. swapped-out requests come back when their blocks fit;
  4. waiting requests the policy admits are admitted, highest priority first.
A step that had to preempt skips 3-4, so a victim is not replaced by a newcomer at once:
preempted requests are older and get back in first (no starvation).

After the step, `update(plan, sampled)` is the bookkeeping: tokens computed, full blocks
hashed, tokens appended, and requests done by a token (EOS, a stop id, max_tokens, the
context) finished; stop *strings* are the output processor's (engine/output.py).

Every choice left open is the policy's (policies.py), given `now` on the experiment's clock.
"""
from __future__ import annotations

import time

from llmlab import preemption, sizing
from llmlab.cache.block_manager import BlockManager
from llmlab.config import EngineConfig
from llmlab.plan import Plan, ScheduledItem, StepOutcome
from llmlab.policies import SchedulerView, SchedulingPolicy, ask, fcfs, observe, resolve_policy, sort_by_policy
from llmlab.request import PENDING_TOKEN, Request, RequestStatus


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 policy=fcfs, eos_token_ids=(), preemption=preemption):
        if config.max_num_seqs is None or config.max_num_batched_tokens is None:
            # a config no engine sized (tests, the simulator): the same rule, for this cache
            config, _ = sizing.resolve(config, block_manager.num_device_blocks)
        self.config = config
        # preemption bookkeeping: a module or object with preemption.py's functions (a plug-in point)
        self.preemption = preemption
        self.blocks = block_manager
        self.policy: SchedulingPolicy = resolve_policy(policy)   # a name, an object or a key function
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)   # a request stops on these unless it ignores EOS
        self.clock_origin = time.perf_counter()    # now() = 0 here
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        # without chunking a whole prompt (plus any output to recompute) must fit in one step
        self.token_budget = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            self.token_budget = max(self.token_budget, max_model_len)

    def now(self) -> float:
        """Seconds since `clock_origin` on the wall clock: the engine's `now` for the policy,
        and the clock of the requests' arrival_time (the engine stamps them with it)."""
        return time.perf_counter() - self.clock_origin

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def remove(self, request: Request) -> list[int]:
        """Forget a request (finished or aborted) and release all its blocks; returns the
        device blocks that became free."""
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)
        if request.status == RequestStatus.SWAPPED:
            self.blocks.free_host(request)
        return self.blocks.free(request)

    def finish(self, request: Request, reason: str) -> list[int]:
        """Mark `request` finished ("stop" | "length" | "abort") and release its blocks;
        returns the device blocks that became free."""
        freed = self.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.drop_pending_token()   # finished (aborted) while its newest token was in flight
        return freed

    # ---- after the step --------------------------------------------------------------
    def update(self, plan: Plan, sampled=None, now: float | None = None) -> StepOutcome:
        """The bookkeeping after the step ran `plan` (with async scheduling: was launched):
        computed tokens advance and full blocks are hashed for every item, and each of
        plan.sampling_items gets a placeholder for its token. Then, when `sampled` is given
        (token ids in that order: a list, or a tensor, read here), `resolve` fills them in
        (and the policy's on_step sees the outcome at `now`, default `now()`).
        Requests that finished while the step was in flight are skipped: their work is dropped."""
        for item in plan.items:
            request = item.request
            if request.finished:
                continue
            request.num_computed_tokens += item.num_tokens
            self.blocks.cache_full_blocks(request)
            if item.completes_prompt:
                request.output_token_ids.append(PENDING_TOKEN)
                request.token_pending = True
        if sampled is None:
            return StepOutcome()
        return self.resolve([item.request for item in plan.sampling_items], sampled, now).checked()

    def resolve(self, requests: list[Request], sampled, now: float | None = None) -> StepOutcome:
        """The tokens of a step whose update had none: requests[i] (plan.sampling_items'
        requests, in order) sampled sampled[i]. Each pending placeholder becomes its token and
        the request is finished if done; a request finished meanwhile drops its token. The
        policy's on_step sees the outcome: once per step, when its tokens are known (with
        async scheduling, after the next step was planned)."""
        tokens = sampled.tolist() if hasattr(sampled, "tolist") else list(sampled)
        if len(tokens) != len(requests):
            raise ValueError(f"{len(tokens)} sampled tokens for the plan's {len(requests)} sampling items")
        outcome = StepOutcome()
        for request, token in zip(requests, tokens):
            if not request.token_pending:
                outcome.num_dropped += 1
                continue
            request.output_token_ids[-1] = token
            request.token_pending = False
            outcome.advanced.append(request)
            reason = self.stop_reason(request, token)
            if reason is not None:
                outcome.freed_blocks += self.finish(request, reason)
                outcome.finished.append(request)
        outcome.policy_error = observe(self.policy, outcome, self.now() if now is None else now)   # raised later
        return outcome

    def stop_reason(self, request: Request, token: int) -> str | None:
        """Why `request` is done after its newest `token`, if it is: "stop" (EOS unless
        ignored, or one of its stop token ids) or "length" (max_tokens, or the context)."""
        params = request.params
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            return "stop"
        return "length" if self.at_length_limit(request) else None

    def at_length_limit(self, request: Request) -> bool:
        """Whether the request's newest token is its last by length: max_tokens, or the context."""
        return len(request.output_token_ids) >= request.params.max_tokens or request.num_tokens >= self.max_model_len

    # ---- the plan --------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> Plan:
        """This step's Plan: the four phases of the module docstring, in order, under one
        token budget (each phase returns what is left of it). Every policy decision of the
        step is given `now` (default: `now()`, the wall clock)."""
        now = self.now() if now is None else now
        plan = Plan()
        self.policy.view = SchedulerView(self)    # what the policy may read of the load this step
        sort_by_policy(self.policy, self.running, now)
        budget = self._schedule_decodes(plan, self.token_budget, now)
        budget = self._prefill_budget(plan, budget, now)
        budget = self._schedule_running_prefills(plan, budget, now)
        if plan.preempted or plan.swapped_out:
            return plan
        budget = self._schedule_swapped(plan, budget, now)
        self._schedule_waiting(plan, budget, now)
        return plan

    def policy_key(self, now: float):
        """The policy's order at `now`, as a sort key (a PolicyError names a key that raises)."""
        policy = self.policy
        return lambda request: ask(policy, "key", request, now)

    def _prefill_budget(self, plan: Plan, budget: int, now: float) -> int:
        """The policy's prompt-token budget for the rest of the step, within the `budget` the
        decodes left. A step with no decode that would get less than one token gets all of
        it instead: an empty step changes nothing, so every later one would be empty too."""
        wanted = ask(self.policy, "prefill_budget", self.token_budget - budget, self.token_budget, now)
        if wanted < 1 and not plan.decodes:
            return budget
        return max(0, min(budget, wanted))

    def _schedule_decodes(self, plan: Plan, budget: int, now: float) -> int:
        """1. One token for every decoding request, preempting the lowest-priority running
        request when out of blocks."""
        for request in list(self.running):
            # a request preempted by an earlier one's _make_room is no longer RUNNING (the
            # status, not `in self.running`: O(1), and this loop runs every step)
            if request.status != RequestStatus.RUNNING or request.is_prefilling:
                continue
            if request.token_pending and self.at_length_limit(request):
                continue    # its token in flight is its last: resolve() finishes it
            if budget < 1:
                break
            if not self.preemption.make_room(self, request, request.num_tokens, plan, now):
                continue    # the request itself was preempted
            self._allocate(request, request.num_tokens, plan)
            plan.decodes.append(ScheduledItem(request, "decode", 1, request.num_computed_tokens))
            budget -= 1
        return budget

    def _schedule_running_prefills(self, plan: Plan, budget: int, now: float) -> int:
        """2. Running requests still prefilling continue with their next chunk. One that finds
        no room for even one more token preempts the lowest-priority running request (itself,
        if it is that one), as a decode does: two prefills that each hold part of a full cache
        would otherwise wait for each other's blocks forever."""
        for request in list(self.running):
            if request.status != RequestStatus.RUNNING or not request.is_prefilling or budget <= 0:
                continue
            if self.preemption.make_room(self, request, request.num_computed_tokens + 1, plan, now):
                budget -= self._schedule_prefill(request, budget, plan)
        return budget

    def _schedule_swapped(self, plan: Plan, budget: int, now: float) -> int:
        """3. Swapped-out requests come back when their blocks fit (they were running:
        they decode or prefill right away)."""
        sort_by_policy(self.policy, self.swapped, now)
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
        """4. Waiting requests are admitted, highest priority first, each with a prompt chunk
        of at most the budget left (after a prefix-cache lookup), unless the policy defers
        them (`admit`: asked only while a request runs; deferring the only work would idle
        the device). With prefix caching, a request whose first block another running
        request is still computing waits a step: admitted together, both would compute the
        shared prefix (SGLang's cache-aware admission); a step later it finds the prefix in
        the cache."""
        sort_by_policy(self.policy, self.waiting, now)
        in_flight = self.blocks.prefixes_in_flight(self.running)
        i = 0
        while i < len(self.waiting) and budget > 0:
            request = self.waiting[i]
            if self.running and not ask(self.policy, "admit", request, now):
                i += 1
                continue
            if len(self.running) >= self.config.max_num_seqs:
                given_back = self.preemption.preempt_for(self, request, plan, now)
                if given_back is None:
                    break
                budget += given_back
                continue
            if not request.block_table:
                if in_flight and self.blocks.waits_for_prefix(request, in_flight):
                    i += 1
                    continue
                cached = self.blocks.match_prefix(request)
                if cached:
                    request.num_computed_tokens = cached
                    if not request.num_preemptions:   # a re-admission finds its own blocks, output too
                        request.num_cached_prompt_tokens = min(cached, len(request.prompt_token_ids))
                    plan.prefix_hit_tokens[request.request_id] = cached
            used = self._schedule_prefill(request, budget, plan)
            if used == 0:
                self.blocks.free(request)    # give back any shared prefix blocks
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
        """Schedule the next prompt chunk of `request`; returns the tokens used (0 = none fit)."""
        remaining = request.num_uncomputed_tokens
        if self.config.enable_chunked_prefill:
            chunk = min(remaining, budget)
            if self.config.long_prefill_token_threshold:
                # vLLM's long_prefill_token_threshold: a long prompt cannot take a whole step's
                # budget, so requests behind it are admitted (no head-of-line blocking)
                chunk = min(chunk, self.config.long_prefill_token_threshold)
            # never more tokens than free blocks can hold
            room = (len(request.block_table) + self.blocks.num_free_blocks) * self.blocks.block_size
            chunk = min(chunk, room - request.num_computed_tokens)
        else:
            chunk = remaining if remaining <= budget else 0
            if self.blocks.blocks_needed(request, request.num_tokens) > self.blocks.num_free_blocks:
                chunk = 0
        if chunk <= 0:
            return 0
        self._allocate(request, request.num_computed_tokens + chunk, plan)
        plan.prefills.append(ScheduledItem(request, "prefill", chunk, request.num_computed_tokens))
        return chunk

    def _allocate(self, request: Request, num_tokens: int, plan: Plan) -> None:
        new = self.blocks.allocate(request, num_tokens)
        if new:
            plan.allocated_blocks.setdefault(request.request_id, []).extend(new)
