"""Exercise 17, the scheduler's step: the student's Scheduler and llmlab's run the same scripted
workloads in lockstep (no model: every sampled token is a fixed id), and each step's Plan must
be llmlab's; a difference fails with what the student's plan did wrong (over the token budget,
a decode starved, a chunk past the threshold, the wrong victim) and what to check. Then the
real engine on the student's Scheduler, with preemption, writes the default engine's text.

The lockstep driver is shared with exercise 18 (preemption), which plugs in the other way:
llmlab's Scheduler with the student's preemption functions."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

import llmlab
from llmlab import preemption as llmlab_preemption
from llmlab.cache.block_manager import BlockManager
from llmlab.config import EngineConfig
from llmlab.hooks import Recorder
from llmlab.policies import Priority, SchedulingPolicy
from llmlab.request import Request, RequestStatus
from llmlab.scheduler import Scheduler
from diagnose import fail

EXERCISE = "ex17_scheduler_step"
BLOCK = 4       # tokens per block: small, so a few tokens span several blocks and blocks run out
TOKEN = 7       # every sampled token (no EOS: requests end by max_tokens)


@dataclass
class Workload:
    """Requests arriving at given steps: (step, prompt length or token ids, max_tokens)."""
    arrivals: list[tuple]
    config: dict = field(default_factory=dict)   # EngineConfig fields
    num_blocks: int = 64
    num_host_blocks: int = 0
    policy: str | type = "fcfs"     # a name in llmlab.policies.POLICIES, or a SchedulingPolicy class

    def engine_config(self) -> EngineConfig:
        settings = dict(max_num_batched_tokens=16, max_num_seqs=8, enable_prefix_caching=False)
        return EngineConfig(block_size=BLOCK, async_scheduling=False, **{**settings, **self.config})

    def describe(self) -> str:
        c = self.engine_config()
        prompts = [(step, p if isinstance(p, int) else len(p), n) for step, p, n in self.arrivals]
        extra = f", long_prefill_token_threshold {c.long_prefill_token_threshold}" \
            if c.long_prefill_token_threshold else ""
        swap = f", preemption by {c.preemption_mode} ({self.num_host_blocks} host blocks)"
        name = getattr(self.policy, "name", self.policy)
        policy = "" if name == "fcfs" else f"policy {name}, "
        return (f"{policy}token budget {c.max_num_batched_tokens}, max_num_seqs {c.max_num_seqs}{extra}, "
                f"{self.num_blocks} blocks of {BLOCK}{swap}, prefix caching {'on' if c.enable_prefix_caching else 'off'}; "
                f"requests (arrival step, prompt tokens, max_tokens) {prompts}")


class Side:
    """One scheduler (a class and its preemption functions) over its own block manager and requests."""

    def __init__(self, scheduler_class, preemption, workload: Workload):
        config = workload.engine_config()
        self.blocks = BlockManager(workload.num_blocks, workload.num_host_blocks, BLOCK, config.enable_prefix_caching)
        self.scheduler = scheduler_class(config, self.blocks, 1024, workload.policy, (), preemption)
        self.requests: dict[str, Request] = {}

    def arrive(self, step: int, workload: Workload) -> None:
        for k, (at, prompt, max_tokens) in enumerate(workload.arrivals):
            if at == step:
                token_ids = [100 * k + j for j in range(prompt)] if isinstance(prompt, int) else list(prompt)
                request = Request(f"r{k}", None, token_ids, llmlab.SamplingParams(max_tokens=max_tokens),
                                  arrival_time=float(step))
                self.requests[request.request_id] = request
                self.scheduler.add(request)

    def finish_step(self, plan, step: int) -> None:
        self.scheduler.update(plan, [TOKEN] * len(plan.sampling_items), now=float(step))


def summary(plan) -> dict:
    """A plan as plain data, by request id."""
    return {"prefills (id, tokens, start)": [(i.request.request_id, i.num_tokens, i.start_position)
                                             for i in plan.prefills],
            "decodes (id, position)": [(i.request.request_id, i.start_position) for i in plan.decodes],
            "preempted (recompute)": list(plan.preempted), "swapped_out": list(plan.swapped_out),
            "swapped_in": list(plan.swapped_in), "swap_out_copies": list(plan.swap_out_copies),
            "swap_in_copies": list(plan.swap_in_copies), "allocated_blocks": dict(plan.allocated_blocks),
            "prefix_hit_tokens": dict(plan.prefix_hit_tokens)}


def check_plan(case: str, step: int, plan, expected, mine: Side, workload: Workload) -> None:
    """Fail `case` at `step` naming what the student's plan got wrong, most telling first."""
    config = workload.engine_config()
    where = f"step {step}"
    ids = lambda items: [i.request.request_id for i in items]   # noqa: E731
    for rid in plan.preempted + plan.swapped_out:
        if rid in ids(plan.prefills) + ids(plan.decodes):   # its blocks are the re-admission's, not a leak
            fail(case, [f"{where}: request {rid} was preempted and is scheduled again in the same step "
                        f"(prefills {ids(plan.prefills)}, decodes {ids(plan.decodes)})",
                        "-> a victim re-admitted at once: when the step preempted anyone (plan.preempted or "
                        "plan.swapped_out), the plan is done after phase 2: swapped and waiting wait for the next step"])
    for rid in plan.preempted:
        request = mine.requests[rid]
        if request.block_table or request.num_computed_tokens:
            fail(case, [f"{where}: request {rid} was preempted by recompute but still holds blocks "
                        f"{request.block_table} ({request.num_computed_tokens} computed tokens)",
                        "-> a block not freed on recompute: preempt frees the victim's blocks (blocks.free) and sets "
                        "num_computed_tokens = 0, so that it is prefilled again when re-admitted"])
    holding = [(r.request_id, list(r.block_table)) for r in mine.scheduler.waiting if r.block_table]
    if holding:
        fail(case, [f"{where}: waiting request(s) (id, blocks) {holding} hold blocks after the step",
                    "-> a waiting request holds no block: one that fit no chunk gives back the prefix blocks "
                    "match_prefix shared with it (blocks.free(request), num_computed_tokens = 0), or the cached blocks "
                    "stay referenced while it waits, and its next lookup is skipped (its block table is not empty)"])
    for rid in plan.swapped_in:
        if rid in mine.blocks.host_tables or not plan.swap_in_copies:
            fail(case, [f"{where}: request {rid} was swapped in, but its host blocks "
                        f"{mine.blocks.host_tables.get(rid)} were not given back (swap_in_copies "
                        f"{plan.swap_in_copies})",
                        "-> swap_in forgot the CPU blocks: plan.swap_in_copies += blocks.swap_in(request) takes fresh "
                        "device blocks, returns the (host, device) copies the runner makes, and frees the host blocks"])
    if plan.num_tokens > config.max_num_batched_tokens:
        fail(case, [f"{where}: the plan has {plan.num_tokens} tokens, {plan.num_tokens - config.max_num_batched_tokens} "
                    f"over the token budget of {config.max_num_batched_tokens} ({summary(plan)})",
                    "-> the token budget was exceeded: a step's tokens (1 per decode, a chunk's length) never exceed "
                    "max_num_batched_tokens; check the budget arithmetic at the edge (<= against <, a chunk of at "
                    "most the budget left, the budget taken off after each item)"])
    starved = [r for r in ids(expected.decodes) if r not in ids(plan.decodes)]
    if starved and plan.prefills:
        fail(case, [f"{where}: request(s) {starved} were decoding but got no token, while prompt chunks "
                    f"{[(i.request.request_id, i.num_tokens) for i in plan.prefills]} ran",
                    "-> a decode was starved by prefills: phase 1 gives every running decode its one token "
                    "before any prompt chunk takes the budget (Orca; SARATHI's chunks fill what decodes leave)"])
    threshold = config.long_prefill_token_threshold if config.enable_chunked_prefill else 0   # chunks only
    too_long = [(i.request.request_id, i.num_tokens) for i in plan.prefills if threshold and i.num_tokens > threshold]
    if too_long:
        fail(case, [f"{where}: prompt chunk(s) (id, tokens) {too_long} are longer than long_prefill_token_threshold "
                    f"= {threshold}",
                    "-> a chunk ignored the threshold: _schedule_prefill caps each request's chunk at "
                    "config.long_prefill_token_threshold when it is set (0 = no cap)"])
    running = {i.request.request_id for i in plan.items}
    if len(running) > config.max_num_seqs:
        fail(case, [f"{where}: {len(running)} requests run, max_num_seqs is {config.max_num_seqs}",
                    "-> admit a waiting request only while fewer than max_num_seqs run (and swap in likewise)"])
    policy = mine.scheduler.policy
    expected_ids = ids(expected.prefills) + ids(expected.decodes)
    refused = [i.request.request_id for i in plan.prefills
               if i.request.request_id not in expected_ids and not policy.admit(i.request, float(step))]
    if refused:
        fail(case, [f"{where}: request(s) {refused} were admitted, but the policy's admit(request, now) refuses "
                    f"them (llmlab's prefills {ids(expected.prefills)})",
                    "-> ask self.policy.admit(request, now) of each waiting request while some request runs, and "
                    "pass over one it refuses (the next one may still be admitted)"])
    victims, expected_victims = plan.preempted + plan.swapped_out, expected.preempted + expected.swapped_out
    if victims != expected_victims:
        arrival = {rid: r.arrival_time for rid, r in mine.requests.items()}
        order = ", ".join(sorted(arrival, key=arrival.get))
        wrong_end = victims and expected_victims and arrival[victims[0]] < arrival[expected_victims[0]]
        fail(case, [f"{where}: preempted {victims}, llmlab preempts {expected_victims} (arrival order {order})",
                    ("-> a victim chosen from the wrong end: " if wrong_end else "-> ") +
                    "preempt only when a request cannot get its blocks, and then the policy's victim: "
                    "choose_victim(scheduler, scheduler.running, now), by default the last of the running queue "
                    "(the lowest priority, the newest under fcfs), never running[0]"])
    if plan.swapped_in != expected.swapped_in:
        early = [rid for rid in plan.swapped_in if rid not in expected.swapped_in]
        fail(case, [f"{where}: swapped_in is {plan.swapped_in}, llmlab's is {expected.swapped_in}",
                    ("-> swapped in too soon: " if early else "-> ") +
                    "a swapped request comes back (sorted by policy_key) only while budget > 0, fewer than "
                    "max_num_seqs run, and its host blocks + 1 fit in the free device blocks (the + 1: the block its "
                    "next token may need); the first that does not fit ends phase 3"])
    if plan.swapped_out and len(plan.swap_out_copies) < len(plan.swapped_out):
        fail(case, [f"{where}: swapped out {plan.swapped_out} with copies {plan.swap_out_copies}",
                    "-> plan.swap_out_copies += blocks.swap_out(request): without the copies its K/V is lost"])
    got, want = summary(plan), summary(expected)
    differ = {key: (got[key], want[key]) for key in got if got[key] != want[key]}
    if differ:
        lines = [f"{where}: {key} is {g}, llmlab's is {w}" for key, (g, w) in differ.items()]
        fail(case, lines + ["-> a chunk is min(uncomputed tokens, budget left, long_prefill_token_threshold, what the "
                            "request's and the free blocks hold); phases run decodes, running prefills, (no "
                            "preemption:) swapped, waiting, each queue in the policy's order"])


def run_lockstep(case: str, workload: Workload, scheduler_class=Scheduler, preemption=llmlab_preemption,
                 max_steps: int = 300) -> Side:
    """Both schedulers step by step; the student's (scheduler_class, preemption) must plan llmlab's plans."""
    reference, mine = Side(Scheduler, llmlab_preemption, workload), Side(scheduler_class, preemption, workload)
    last_arrival = max(step for step, _, _ in workload.arrivals)
    case = f"{case} ({workload.describe()})"
    for step in range(max_steps):
        reference.arrive(step, workload)
        mine.arrive(step, workload)
        if step > last_arrival and not reference.scheduler.has_unfinished():
            break
        expected = reference.scheduler.schedule(now=float(step))
        try:
            plan = mine.scheduler.schedule(now=float(step))
        except RuntimeError as error:   # the block manager's allocate: more blocks than are free
            if "out of KV blocks" not in str(error):
                raise
            fail(case, [f"step {step}: the step allocated more blocks than are free ({error})",
                        "-> every allocation must fit the free blocks: a decode calls preemption.make_room(...) "
                        "before _allocate (and make_room preempts until blocks_needed <= num_free_blocks), a "
                        "prompt chunk is at most what the request's blocks plus the free blocks hold (with "
                        "chunked prefill; without it the whole rest or nothing)"])
        check_plan(case, step, plan, expected, mine, workload)
        reference.finish_step(expected, step)
        mine.finish_step(plan, step)
    left = [r.request_id for r in mine.requests.values() if not r.finished]
    if left:
        fail(case, [f"requests {left} never finished", "-> every request must make progress"])
    cached = {rid: r.num_cached_prompt_tokens for rid, r in mine.requests.items()}
    expected_cached = {rid: r.num_cached_prompt_tokens for rid, r in reference.requests.items()}
    if cached != expected_cached:
        differ = {rid: (cached[rid], expected_cached[rid]) for rid in cached if cached[rid] != expected_cached[rid]}
        fail(case, [f"num_cached_prompt_tokens (yours, llmlab's) by request: {differ}",
                    "-> num_cached_prompt_tokens is what the prompt found in the prefix cache when first admitted "
                    "(the server reports it as usage.prompt_tokens_details.cached_tokens): set it from match_prefix "
                    "unless the request was preempted before (its own blocks are not a cache hit)"])
    bm = mine.blocks
    if bm.num_free_blocks != bm.num_device_blocks or bm.num_free_host_blocks != bm.num_host_blocks:
        fail(case, [f"after every request finished: {bm.num_free_blocks} of {bm.num_device_blocks} device blocks and "
                    f"{bm.num_free_host_blocks} of {bm.num_host_blocks} host blocks free",
                    "-> every block comes back: a recomputed request's at once, a swapped one's host blocks at swap_in"])
    return mine


# ---- scripted workloads, one mistake each -----------------------------------------------------
BUDGET_EDGE = Workload([(0, 5, 3), (0, 12, 3), (0, 9, 3), (1, 2, 2)])   # 5 + 12 is one over 16
CHUNKED = Workload([(0, 30, 3), (1, 3, 4)], dict(max_num_batched_tokens=8))
DECODES_FIRST = Workload([(0, 3, 8), (0, 3, 8), (2, 40, 2)], dict(max_num_batched_tokens=12))
THRESHOLD = Workload([(0, 10, 2), (0, 10, 2), (0, 3, 2)], dict(long_prefill_token_threshold=4))
MAX_NUM_SEQS = Workload([(0, 3, 3)] * 4 + [(1, 2, 2)], dict(max_num_seqs=2))


def out_of_blocks(mode: str) -> Workload:
    """Three requests that need 4 blocks each at the end, 6 blocks: preemption."""
    return Workload([(0, 6, 8), (0, 6, 8), (1, 6, 8)], dict(preemption_mode=mode), num_blocks=6,
                    num_host_blocks=8 if mode == "swap" else 0)


class LatecomerFirst(Priority):
    """The last request of a workload outranks the others, so its arrival preempts a running
    one when max_num_seqs run (preempts_on_arrival): preempt_for gives its budget back."""
    name = "priority, the last arrival first"

    def __init__(self):
        super().__init__({f"r{k}": -1 for k in range(3, 9)})   # the latecomers of the workloads below


class LongPromptsWaitForIdle(SchedulingPolicy):
    """Admits a prompt of more than 4 tokens only when nothing runs (admit is asked only while
    some request runs): none of the built-in policies refuses anyone."""
    name = "long prompts wait for an idle engine"

    def admit(self, request, now):
        return len(request.prompt_token_ids) <= 4


ADMIT = Workload([(0, 3, 4), (0, 10, 2), (0, 3, 2)], policy=LongPromptsWaitForIdle)
POLICY = Workload([(0, 12, 2), (0, 3, 2), (0, 7, 2), (1, 2, 2)], dict(max_num_batched_tokens=8, max_num_seqs=2),
                  policy="shortest_prompt_first")
SHARED = list(range(1000, 1008))
PREEMPT_ON_ARRIVAL = Workload([(0, 3, 6), (0, 3, 6), (1, 3, 6), (2, 3, 4)], dict(max_num_seqs=2), policy=LatecomerFirst)
PREFIX = Workload([(0, SHARED + [1, 2, 3], 3), (0, SHARED + [4, 5], 3), (2, SHARED + [6], 2)],
                  dict(enable_prefix_caching=True))


def test_budget_edge(ex):
    run_lockstep("two prompts one token over the budget", BUDGET_EDGE, ex.Scheduler)


def test_prefill_chunked_across_steps(ex):
    run_lockstep("a 30-token prompt in chunks of the budget", CHUNKED, ex.Scheduler)


def test_decodes_are_never_starved(ex):
    run_lockstep("two decoding requests, then a long prompt arrives", DECODES_FIRST, ex.Scheduler)


def test_long_prefill_token_threshold(ex):
    run_lockstep("two long prompts under long_prefill_token_threshold", THRESHOLD, ex.Scheduler)


def test_max_num_seqs(ex):
    run_lockstep("more requests than max_num_seqs", MAX_NUM_SEQS, ex.Scheduler)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_when_out_of_blocks(ex, mode):
    run_lockstep("out of blocks", out_of_blocks(mode), ex.Scheduler)


def test_the_policy_orders_the_queues(ex):
    run_lockstep("shortest prompt first", POLICY, ex.Scheduler)


def test_the_policy_admits(ex):
    run_lockstep("a long prompt the policy admits only when nothing runs", ADMIT, ex.Scheduler)


def test_a_latecomer_that_outranks_the_running_preempts_on_arrival(ex):
    run_lockstep("a priority policy whose latecomer preempts a running request", PREEMPT_ON_ARRIVAL, ex.Scheduler)


def test_prefix_caching(ex):
    run_lockstep("prompts sharing an 8-token prefix", PREFIX, ex.Scheduler)


def random_workload(seed: int) -> Workload:
    rng = random.Random(seed)
    mode = rng.choice(["recompute", "swap"])
    config = dict(max_num_batched_tokens=rng.choice([6, 8, 16, 32]), max_num_seqs=rng.choice([2, 3, 8]),
                  long_prefill_token_threshold=rng.choice([0, 0, 5]), preemption_mode=mode,
                  enable_chunked_prefill=rng.random() < 0.8, enable_prefix_caching=rng.random() < 0.5)
    arrivals = []
    for k in range(rng.randint(3, 8)):
        length = rng.randint(1, 20)
        prompt = length if rng.random() < 0.5 else [1000 + j for j in range(length)]   # some share a prefix
        arrivals.append((rng.randint(0, 6), prompt, rng.randint(1, 10)))
    if not config["enable_chunked_prefill"]:
        config["max_num_batched_tokens"] = 32     # a whole prompt fits in one step
    # enough blocks for the longest request alone, rarely for all: preemption happens
    return Workload(arrivals, config, num_blocks=rng.randint(8, 14), num_host_blocks=rng.choice([0, 16]),
                    policy=rng.choice(["fcfs", "fcfs", "shortest_prompt_first", "shortest_output_first", LatecomerFirst]))


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads(ex, seed):
    """Random mixes (budgets, thresholds, chunking, prefix caching, policies, preemption by swap
    and by recompute): under `make test` this keeps solutions/ and llmlab/scheduler.py from drifting."""
    run_lockstep(f"random workload {seed}", random_workload(seed), ex.Scheduler)


# ---- the real engine on your Scheduler ---------------------------------------------------------
_default_runs: dict = {}   # (num_gpu_blocks, preemption_mode) -> the default engine's run: the same every time


def engine_texts(llm, num_gpu_blocks: int, preemption_mode: str = "swap", case: str = "", **plugged):
    """Greedy token ids of exercise 13's four prompts (7 blocks: they do not fit at once) and
    how many preemptions the run had, on the default engine or with `plugged` components; an
    exception in the engine's run fails `case` with it."""
    import test_ex13_block_manager as ex13

    key = (num_gpu_blocks, preemption_mode)
    if not plugged and key in _default_runs:
        return _default_runs[key]
    config = llmlab.EngineConfig(device="cpu", dtype="float32", backend="torch", num_gpu_blocks=num_gpu_blocks,
                                 swap_space=0.01, preemption_mode=preemption_mode, enable_prefix_caching=True,
                                 async_scheduling=False)
    engine = llmlab.LLMEngine(config, model=llm.engine.model, tokenizer=llm.tokenizer, **plugged)
    recorder = Recorder()
    engine.hooks.attach(recorder)
    try:
        outputs = llmlab.LLM.from_engine(engine).generate(ex13.e2e_prompts(llm.tokenizer), ex13.E2E_PARAMS)
    except Exception as error:   # noqa: BLE001 -- the engine stopped on the student's component: say how
        fail(case, [f"the engine stopped: {type(error).__name__}: {error}", "-> the scripted cases above isolate "
                                                                            "the mistake: make them pass first"])
    preemptions = sum(len(s.preempted) + len(s.swapped_out) for s in recorder.trace.steps)
    run = engine, [o.token_ids for o in outputs], preemptions
    if not plugged:
        _default_runs[key] = run
    return run


@pytest.mark.slow   # the 30-layer model, two engine runs
def test_end_to_end(ex, llm):
    case = "the engine on your Scheduler (7 blocks, preemption by swap, prefix caching on)"
    _, expected, _ = engine_texts(llm, 64)
    engine, actual, preemptions = engine_texts(llm, 7, case=case, scheduler=ex.Scheduler)
    if actual != expected:
        differ = [i for i, (a, e) in enumerate(zip(actual, expected)) if a != e]
        fail(case, [f"prompts {differ} generate {[llm.tokenizer.decode(actual[i]) for i in differ]!r}, the default "
                    f"engine {[llm.tokenizer.decode(expected[i]) for i in differ]!r}",
                    "-> the scripted cases above pass on the same plans: check what the engine adds (a request "
                    "whose token is in flight, prefix hits, swapped requests coming back)"])
    if not preemptions:
        fail(case, ["no request was preempted", "-> with 7 blocks the four requests do not fit at once: "
                                                "make_room must preempt when a decode finds no block"])
    bm = engine.block_manager
    if bm.num_free_blocks != bm.num_device_blocks:
        fail(case, [f"{bm.num_free_blocks} of {bm.num_device_blocks} blocks free at the end", "-> see the cases above"])
