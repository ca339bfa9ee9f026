"""Iteration-level scheduling (Orca) with chunked prefill piggybacked on decodes (SARATHI).

Every engine step asks `Scheduler.schedule()` for a Plan: which requests run this step and
how many tokens each, which are preempted, swapped out or swapped back in, and which new
KV blocks were allocated. The engine applies the plan; the scheduler never touches tensors.

The phases, in order of priority, under a budget of `max_num_batched_tokens` tokens:
  1. every running request that is decoding gets its one token; when blocks run out the
     policy's victim (by default the lowest-priority running request) is preempted (swap
     or recompute);
  2. running requests still prefilling get the next chunk of their prompt (preempting as
     in 1 when not one more token fits), within the policy's prefill budget (by default
     what the decodes left: SARATHI §4, chunk = token budget - decodes);
  3. swapped-out requests come back when their blocks fit;
  4. waiting requests the policy admits are admitted, highest priority first, with a
     prompt chunk of at most the remaining budget.
Steps 3-4 are skipped in a step that had to preempt, so a victim is not immediately
replaced by a newcomer: preempted requests are older and get back in first (no starvation).
Each step is one method below (`_schedule_decodes` ... `_schedule_waiting`).

After the step's forward and sampling, `Scheduler.update(plan, sampled)` does the
bookkeeping: every scheduled request's computed tokens advance and its newly full blocks
are hashed for the prefix cache; each request that sampled gets its token, and those done
(EOS, a stop token, max_tokens, the context length) are finished and their blocks freed.
Stop *strings* need text: the output processor (engine/output.py) checks them after
detokenizing, as vLLM's does.
With async scheduling the tokens are still on the device when the next step is planned:
`update(plan, None)` gives each sampling request a placeholder (`request.token_pending`),
so it decodes next step with the token fed on the device, and `resolve` fills the tokens in
a step later. A request whose pending token surely ends it (max_tokens, the context) is not
scheduled again; one that a pending EOS or stop ends has decoded one token too many, which
`resolve` drops (its blocks are freed then).

Every choice left open is the policy's (a SchedulingPolicy, llmlab/policies.py; FCFS by
default): the order of the queues (`key`), whether a waiting request is admitted (`admit`),
the step's prompt-token budget (`prefill_budget`), who is preempted (`preempt_victim`,
`preempts_on_arrival`), and it sees each step's outcome (`on_step`). Each is given `now`,
seconds on the experiment's clock: `schedule(now)` and `update(..., now)` take it (the
simulator passes its simulated time); without it, `now()` reads the wall clock from
`clock_origin`, which `experiments.run` sets to the workload's t = 0.
"""
from __future__ import annotations

import time

from llmlab.cache.block_manager import BlockManager
from llmlab.config import EngineConfig
from llmlab.plan import Plan, ScheduledItem, StepOutcome
from llmlab.policies import SchedulingPolicy, fcfs, resolve_policy
from llmlab.request import Request, RequestStatus

# the value of an output token the host has not read yet (never fed to the model: the
# runner takes that input id from the device, where the sampler left it)
PENDING_TOKEN = -1


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 policy=fcfs, eos_token_ids=()):
        self.config = config
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
        if request.token_pending:   # finished (aborted) while its newest token was in flight
            request.output_token_ids.pop()
            request.token_pending = False
        return freed

    # ---- after the step --------------------------------------------------------------
    def update(self, plan: Plan, sampled=None, now: float | None = None) -> StepOutcome:
        """The bookkeeping after the step ran `plan` (with async scheduling: was launched):
        computed tokens advance and full blocks are hashed for every item, and each of
        plan.sampling_items gets a placeholder for its token. Then, when `sampled` is given
        (token ids in that order: a list, or a tensor, read here), `resolve` fills them in
        (and the policy's on_step sees the outcome at `now`, default `now()`).
        Requests that finished while the step was in flight are skipped: their work is dropped."""
        if sampled is not None and len(sampled) != len(plan.sampling_items):
            raise ValueError(f"{len(sampled)} sampled tokens for the plan's {len(plan.sampling_items)} sampling items")
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
        return self.resolve([item.request for item in plan.sampling_items], sampled, now)

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
        self.policy.on_step(outcome, self.now() if now is None else now)
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
        self.running.sort(key=self._key(now))
        budget = self._schedule_decodes(plan, self.token_budget, now)
        budget = self._prefill_budget(plan, budget, now)
        budget = self._schedule_running_prefills(plan, budget, now)
        if plan.preempted or plan.swapped_out:
            return plan
        budget = self._schedule_swapped(plan, budget, now)
        self._schedule_waiting(plan, budget, now)
        return plan

    def _key(self, now: float):
        """The policy's order at `now`, as a sort key."""
        key = self.policy.key
        return lambda request: key(request, now)

    def _prefill_budget(self, plan: Plan, budget: int, now: float) -> int:
        """The policy's prompt-token budget for the rest of the step, within the `budget` the
        decodes left. A step with no decode that would get less than one token gets all of
        it instead: an empty step changes nothing, so every later one would be empty too."""
        wanted = self.policy.prefill_budget(self.token_budget - budget, self.token_budget, now)
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
            if not self._make_room(request, request.num_tokens, plan, now):
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
            if self._make_room(request, request.num_computed_tokens + 1, plan, now):
                budget -= self._schedule_prefill(request, budget, plan)
        return budget

    def _schedule_swapped(self, plan: Plan, budget: int, now: float) -> int:
        """3. Swapped-out requests come back when their blocks fit (they were running:
        they decode or prefill right away)."""
        self.swapped.sort(key=self._key(now))
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            if len(self.blocks.host_tables[request.request_id]) + 1 > self.blocks.num_free_blocks:
                break
            self.swapped.pop(0)
            plan.swap_in_copies += self.blocks.swap_in(request)
            plan.swapped_in.append(request.request_id)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
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
        self.waiting.sort(key=self._key(now))
        in_flight = self._prefixes_in_flight()
        i = 0
        while i < len(self.waiting) and budget > 0:
            request = self.waiting[i]
            if self.running and not self.policy.admit(request, now):
                i += 1
                continue
            if len(self.running) >= self.config.max_num_seqs:
                given_back = self._preempt_for(request, plan, now)
                if given_back is None:
                    break
                budget += given_back
                continue
            if not request.block_table:
                if in_flight and self._waits_for_prefix(request, in_flight):
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
                given_back = self._preempt_for(request, plan, now)
                if given_back is None:
                    break
                budget += given_back
                continue
            self.waiting.pop(i)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            budget -= used
            if in_flight is not None and request.num_computed_tokens < self.blocks.block_size:
                first = self._first_block(request)
                if first is not None:
                    in_flight.add(first)
        return budget

    def _preempt_for(self, request: Request, plan: Plan, now: float) -> int | None:
        """If the policy lets `request` preempt on arrival: preempt its victim, provided
        `request` outranks it (a smaller key: otherwise two requests could take turns
        preempting each other forever); returns the tokens the victim's items gave back to
        the budget (None: nobody was preempted)."""
        if not self.running or not self.policy.preempts_on_arrival(request, now):
            return None
        key = self._key(now)
        victim = self._victim(sorted(self.running, key=key), now)   # admitted this step: not sorted
        if not key(request) < key(victim):
            return None
        given_back = sum(item.num_tokens for item in plan.items if item.request is victim)
        self._preempt(victim, plan)
        return given_back

    def _first_block(self, request: Request):
        """The hash of the request's first full prompt block (None if it has none)."""
        if request.num_tokens <= self.blocks.block_size:
            return None
        return self.blocks.block_hashes(request, 1)[0]

    def _waits_for_prefix(self, request: Request, in_flight: set) -> bool:
        """Whether a running request is computing `request`'s first block now, which the cache
        does not hold yet (so a lookup would find nothing). Checked before the lookup: a step
        spent waiting is no lookup, and the hit rate counts each request's lookup once."""
        first = self._first_block(request)
        return first in in_flight and first not in self.blocks.cached_blocks

    def _prefixes_in_flight(self) -> set | None:
        """First-block hashes that running requests are computing now (prefix caching only)."""
        if not self.blocks.enable_prefix_caching:
            return None
        return {self._first_block(r) for r in self.running
                if r.num_computed_tokens < self.blocks.block_size and self._first_block(r) is not None}

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

    def _make_room(self, request: Request, num_tokens: int, plan: Plan, now: float) -> bool:
        """Preempt the policy's victims (by default the lowest-priority running requests)
        until `request` can hold `num_tokens`. Returns False when `request` itself had to be
        preempted."""
        while self.blocks.blocks_needed(request, num_tokens) > self.blocks.num_free_blocks:
            victim = self._victim(self.running, now)   # sorted at the step's start, victims removed
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _victim(self, running: list[Request], now: float) -> Request:
        """The policy's choice among `running` (ordered by key, most important first)."""
        victim = self.policy.preempt_victim(running, now)
        if not any(victim is r for r in running):
            raise ValueError(f"policy {self.policy.name!r}: preempt_victim returned {victim!r}, "
                             f"which is not one of the running requests")
        return victim

    def _preempt(self, request: Request, plan: Plan) -> None:
        self.running.remove(request)
        for items in (plan.prefills, plan.decodes):   # a victim may already be in this plan
            items[:] = [item for item in items if item.request is not request]
        request.num_preemptions += 1
        if self.config.preemption_mode == "swap" and self.blocks.can_swap_out(request):
            plan.swap_out_copies += self.blocks.swap_out(request)
            plan.swapped_out.append(request.request_id)
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
        else:   # recompute: drop the KV, redo the prompt and the output so far later
            self.blocks.free(request)
            request.num_computed_tokens = 0
            plan.preempted.append(request.request_id)
            request.status = RequestStatus.WAITING
            self.waiting.append(request)
