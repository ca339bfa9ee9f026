"""What each SchedulingPolicy method decides, one at a time, on a Scheduler driven by hand
(no model): the policy overrides one method and the Plan shows its decision. Then the ways
a policy is named (resolve_policy)."""
from __future__ import annotations

import pytest

from llmlab import EngineConfig, SamplingParams
from llmlab.cache.block_manager import BlockManager
from llmlab.plan import StepOutcome
from llmlab.policies import (FCFS, POLICIES, KeyFunction, PolicyError, Priority, SchedulingPolicy, fcfs, load_policy,
                             resolve_policy, shortest_prompt_first)
from llmlab.request import Request
from llmlab.scheduler import Scheduler


def scheduler_with(policy, num_blocks=64, block_size=4, **config) -> Scheduler:
    config = EngineConfig(**{"device": "cpu", "block_size": block_size, "max_num_batched_tokens": 64,
                             "enable_prefix_caching": False, **config})
    return Scheduler(config, BlockManager(num_blocks, 0, block_size), num_blocks * block_size, policy)


def add(scheduler, request_id, prompt_len, arrival, max_tokens=8) -> Request:
    request = Request(request_id, None, [5 + int(request_id)] * prompt_len, SamplingParams(max_tokens=max_tokens),
                      arrival_time=arrival)
    scheduler.add(request)
    return request


def step(scheduler, now):
    plan = scheduler.schedule(now=now)
    scheduler.update(plan, [9] * len(plan.sampling_items), now=now + 0.5)
    return plan


def scheduled(plan) -> list[tuple[str, str, int]]:
    return [(i.request.request_id, i.kind, i.num_tokens) for i in plan.items]


# ---- each decision ----------------------------------------------------------------------------------
def test_key_orders_admission_and_is_given_now():
    class OldestWaitFirst(SchedulingPolicy):   # aging: the key changes with now
        def __init__(self):
            self.nows = set()

        def key(self, request, now):
            self.nows.add(now)
            return -(now - request.arrival_time)

    policy = OldestWaitFirst()
    scheduler = scheduler_with(policy, max_num_seqs=1)
    for rid, arrival in (("1", 3.0), ("2", 1.0), ("3", 2.0)):
        add(scheduler, rid, 4, arrival, max_tokens=1)
    assert scheduled(step(scheduler, now=5.0)) == [("2", "prefill", 4)]     # waited longest
    assert policy.nows == {5.0}                                              # one now per step
    assert scheduled(step(scheduler, now=6.0)) == [("3", "prefill", 4)]


def test_admit_defers_a_request_and_the_ones_behind_it_go_first():
    class NoLongPrompts(SchedulingPolicy):
        def admit(self, request, now):
            return len(request.prompt_token_ids) <= 8

    scheduler = scheduler_with(NoLongPrompts())
    add(scheduler, "1", 4, 0.0)
    step(scheduler, now=0.0)
    long, short = add(scheduler, "2", 20, 1.0), add(scheduler, "3", 4, 1.1)
    plan = step(scheduler, now=1.5)
    assert scheduled(plan) == [("3", "prefill", 4), ("1", "decode", 1)]      # batch order: prefills first
    assert long in scheduler.waiting and short in scheduler.running


def test_with_nothing_running_the_first_waiting_request_is_admitted_whatever_admit_says():
    class Never(SchedulingPolicy):
        def admit(self, request, now):
            return False

    scheduler = scheduler_with(Never())
    add(scheduler, "1", 4, 0.0)
    add(scheduler, "2", 4, 0.1)
    # deferring the only work would idle the device (and an engine stops after two empty steps)
    assert scheduled(step(scheduler, now=1.0)) == [("1", "prefill", 4)]
    assert scheduled(step(scheduler, now=2.0)) == [("1", "decode", 1)]      # "2" waits while "1" runs


def test_prefill_budget_caps_the_prompt_tokens_beside_the_decodes():
    class Budget(SchedulingPolicy):
        def __init__(self, tokens):
            self.tokens, self.calls = tokens, []

        def prefill_budget(self, num_decode_tokens, token_budget, now):
            self.calls.append((num_decode_tokens, token_budget, now))
            return self.tokens

    policy = Budget(6)
    scheduler = scheduler_with(policy)
    add(scheduler, "1", 4, 0.0)
    step(scheduler, now=0.0)
    add(scheduler, "2", 30, 1.0)
    assert scheduled(step(scheduler, now=1.0)) == [("2", "prefill", 6), ("1", "decode", 1)]
    assert policy.calls[-1] == (1, 64, 1.0)
    policy.tokens = 0          # a decode-only step
    assert scheduled(step(scheduler, now=2.0)) == [("1", "decode", 1)]
    policy.tokens = 1000       # never more than the decodes left of the engine's budget
    assert scheduled(step(scheduler, now=3.0)) == [("2", "prefill", 24), ("1", "decode", 1)]


def test_a_step_with_no_decode_gets_the_whole_budget_when_the_policy_gives_none():
    class Zero(SchedulingPolicy):
        def prefill_budget(self, num_decode_tokens, token_budget, now):
            return 0

    scheduler = scheduler_with(Zero())
    add(scheduler, "1", 30, 0.0)
    assert scheduled(step(scheduler, now=0.0)) == [("1", "prefill", 30)]    # else no step would ever move


def test_preempt_victim_chooses_who_is_preempted():
    class MostImportantGoes(SchedulingPolicy):   # the opposite of the default (running[-1])
        def preempt_victim(self, running, now):
            assert [r.request_id for r in running] == sorted(r.request_id for r in running)   # by key
            return running[0]

    for policy, victim in ((FCFS(), "3"), (MostImportantGoes(), "1")):
        # 6 blocks of 4 tokens: three prompts of 8 tokens fill them; the first decode needs one more
        scheduler = scheduler_with(policy, num_blocks=6)
        for rid, arrival in (("1", 0.0), ("2", 0.1), ("3", 0.2)):
            add(scheduler, rid, 8, arrival)
        step(scheduler, now=0.0)
        plan = step(scheduler, now=1.0)
        assert plan.preempted[0] == victim, type(policy).__name__


def test_a_victim_that_is_not_running_is_an_error():
    class Stranger(SchedulingPolicy):
        def preempt_victim(self, running, now):
            return Request("x", None, [1], SamplingParams())

    scheduler = scheduler_with(Stranger(), num_blocks=4)
    for rid in ("1", "2"):
        add(scheduler, rid, 8, float(rid))
    step(scheduler, now=0.0)
    with pytest.raises(PolicyError, match="'Stranger': preempt_victim.* returned request 'x', which is not one of the "
                                          "running requests"):
        step(scheduler, now=1.0)


def test_preempts_on_arrival_lets_a_newcomer_that_outranks_a_running_request_take_its_slot():
    class NewestFirst(SchedulingPolicy):
        def __init__(self, preempts):
            self.preempts = preempts

        def key(self, request, now):
            return -request.arrival_time

        def preempts_on_arrival(self, request, now):
            return self.preempts

    for preempts, expected in ((True, ["1"]), (False, [])):
        scheduler = scheduler_with(NewestFirst(preempts), max_num_seqs=1)
        add(scheduler, "1", 4, 0.0)
        step(scheduler, now=0.0)
        add(scheduler, "2", 4, 1.0)
        plan = step(scheduler, now=1.0)
        assert plan.preempted == expected
        assert ("2", "prefill", 4) in scheduled(plan) if preempts else scheduled(plan) == [("1", "decode", 1)]
    # a request that does not outrank the victim never preempts it (else the two could take turns)
    scheduler = scheduler_with(NewestFirst(True), max_num_seqs=1)
    add(scheduler, "1", 4, 5.0)
    step(scheduler, now=5.0)
    add(scheduler, "2", 4, 1.0)      # older: a larger key
    assert step(scheduler, now=6.0).preempted == []


def test_on_step_sees_every_outcome_once_with_its_now():
    class Watcher(SchedulingPolicy):
        def __init__(self):
            self.seen = []

        def on_step(self, outcome, now):
            self.seen.append((now, [r.request_id for r in outcome.advanced], [r.request_id for r in outcome.finished]))

    policy = Watcher()
    scheduler = scheduler_with(policy)
    add(scheduler, "1", 4, 0.0, max_tokens=2)
    step(scheduler, now=0.0)
    step(scheduler, now=1.0)
    assert policy.seen == [(0.5, ["1"], []), (1.5, ["1"], ["1"])]
    # async scheduling: update without tokens plans ahead; the outcome comes with resolve
    add(scheduler, "2", 4, 2.0, max_tokens=1)
    plan = scheduler.schedule(now=2.0)
    assert isinstance(scheduler.update(plan, None, now=2.5), StepOutcome) and len(policy.seen) == 2
    scheduler.resolve([i.request for i in plan.sampling_items], [9], now=3.0)
    assert policy.seen[-1] == (3.0, ["2"], ["2"])


def test_the_wall_clock_counts_from_clock_origin():
    scheduler = scheduler_with(fcfs)
    scheduler.clock_origin -= 100.0
    assert 100.0 <= scheduler.now() < 101.0


# ---- naming a policy -------------------------------------------------------------------------------------------
def test_builtins_by_name_are_policies_with_that_name():
    for name in POLICIES:
        policy = resolve_policy(name)
        assert isinstance(policy, SchedulingPolicy) and policy.name == name and policy.__name__ == name
    assert resolve_policy(shortest_prompt_first) is shortest_prompt_first
    ranked = resolve_policy("priority", [type("R", (), {"request_id": "a", "priority": 2})()])
    assert isinstance(ranked, Priority) and ranked.priorities == {"a": 2} and ranked.preempts_on_arrival(None, 0.0)
    assert scheduler_with("shortest_output_first").policy.name == "shortest_output_first"


def test_a_key_function_is_wrapped_and_ignores_now():
    def longest_prompt_first(request):
        return -len(request.prompt_token_ids)

    policy = resolve_policy(longest_prompt_first)
    assert isinstance(policy, KeyFunction) and policy.name == "longest_prompt_first"
    request = Request("1", None, [1, 2, 3], SamplingParams())
    assert policy.key(request, 0.0) == policy.key(request, 99.0) == -3
    assert policy.admit(request, 0.0) and not policy.preempts_on_arrival(request, 0.0)


def test_module_colon_name_loads_a_class_an_instance_or_a_function(tmp_path, monkeypatch):
    assert isinstance(resolve_policy("llmlab.policies:ShortestPromptFirst"), SchedulingPolicy)
    assert resolve_policy("llmlab.policies:fcfs") is fcfs
    (tmp_path / "my_policies.py").write_text(
        "from dataclasses import dataclass\n"
        "from llmlab.policies import SchedulingPolicy\n\n"
        "@dataclass\n"
        "class Lifo(SchedulingPolicy):\n"
        "    def key(self, request, now):\n"
        "        return -request.arrival_time\n\n"
        "def by_length(request):\n"
        "    return len(request.prompt_token_ids)\n")
    lifo = resolve_policy(f"{tmp_path / 'my_policies.py'}:Lifo")     # a file, no PYTHONPATH needed
    assert lifo.name == "Lifo" and lifo.key(Request("1", None, [1], SamplingParams(), arrival_time=2.0), 0.0) == -2.0
    assert type(resolve_policy(f"{tmp_path / 'my_policies.py'}:Lifo")) is type(lifo)   # the file runs once
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_policy("my_policies:by_length").name == "by_length"


@pytest.mark.parametrize("spec, message", [
    ("lifo", "unknown policy 'lifo'"),
    ("no_such_module_here:X", "no module 'no_such_module_here'"),
    ("llmlab.policies:Nope", "has no 'Nope'"),
    ("llmlab.policies:POLICIES", "is a tuple, not a SchedulingPolicy"),
    ("missing/file.py:X", "no file"),
    (":X", "write module:Name"),
])
def test_a_bad_policy_is_a_clear_error(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_policy(spec)


def test_load_policy_returns_the_object_itself():
    assert load_policy("llmlab.policies:Priority") is Priority


def test_a_policy_reads_the_load_from_its_view():
    """policy.view (a SchedulerView, set every step): a load-aware admission decision. A long
    prompt waits while two requests run; the view shows the queues and blocks as they are."""
    class FewAtOnce(SchedulingPolicy):
        def __init__(self):
            self.seen = []

        def admit(self, request, now):
            view = self.view
            self.seen.append((request.request_id, view.num_running, view.num_waiting, view.num_free_blocks))
            assert view.running == tuple(view._scheduler.running) and view.token_budget == 64
            assert view.num_device_blocks == 32 and view.block_size == 4
            return len(request.prompt_token_ids) <= 8 or view.num_running < 2

    policy = FewAtOnce()
    scheduler = scheduler_with(policy, num_blocks=32)
    for rid, length in (("1", 4), ("2", 4), ("3", 20), ("4", 4)):
        add(scheduler, rid, length, float(rid), max_tokens=3)
    assert policy.view is None
    plans = [scheduled(step(scheduler, now=float(t))) for t in range(4)]
    assert plans[0] == [("1", "prefill", 4), ("2", "prefill", 4), ("4", "prefill", 4)]   # 3 waits: two run
    assert plans[3] == [("3", "prefill", 20)]                                             # once they are done
    # (asked while some request runs; each admitted request holds its one block)
    assert policy.seen[:3] == [("2", 1, 3, 31), ("3", 2, 2, 30), ("4", 2, 2, 30)]


def test_priority_reads_a_requests_own_priority():
    """The `priority` policy: a request's SamplingParams.priority (a server request's `priority`
    field) where the policy's table does not list it; lower first, then arrival."""
    scheduler = scheduler_with(Priority({"3": 5}), max_num_seqs=1)
    for rid, priority in (("1", 0), ("2", -1), ("3", -9)):
        scheduler.add(Request(rid, None, [5] * 4, SamplingParams(max_tokens=1, priority=priority),
                              arrival_time=float(rid)))
    order = [scheduled(step(scheduler, now=float(t)))[0][0] for t in range(3)]
    assert order == ["2", "1", "3"]      # 3's table entry (5) wins over its own -9
    with pytest.raises(ValueError, match="SamplingParams.priority must be an integer"):
        SamplingParams(priority=1.5)
