"""A researcher's policy with a bug (#31): every hook that raises, or returns what it may not,
is a PolicyError naming the policy and the hook, never a TypeError deep in the scheduler;
a policy that edits the list it is given loses nothing; a policy whose on_step raises loses
no output and no request. What a careless researcher did (a helper playing one found these)."""
from __future__ import annotations

import pytest

from llmlab import LLMEngine, SamplingParams
from llmlab.policies import PolicyError, SchedulingPolicy, resolve_policy
from helpers.engine import assert_all_blocks_free, cpu_engine_config, tiny_model, tiny_prompt
from test_policy_hooks import add, scheduler_with, step


class Broken(SchedulingPolicy):
    name = "broken"


@pytest.mark.parametrize("hook, body, message", [
    ("key", lambda self, r, now: {}["tenant"], r"'broken': key\(request, now\) raised KeyError: 'tenant'"),
    ("key", lambda self, r, now: None, r"'broken': key\(request, now\) returned values that do not compare"),
    ("admit", lambda self, r, now: None, r"'broken': admit\(request, now\) returned None; it must return True or False"),
    ("admit", lambda self, r, now: 1 / 0, r"'broken': admit\(request, now\) raised ZeroDivisionError"),
    ("prefill_budget", lambda self, d, b, now: 10.5, r"'broken': prefill_budget\(.*\) returned 10.5; it must return an int"),
    ("preempts_on_arrival", lambda self, r, now: "yes", r"preempts_on_arrival\(request, now\) returned 'yes'"),
    ("on_step", lambda self, outcome, now: [][1], r"'broken': on_step\(outcome, now\) raised IndexError"),
])
def test_a_hook_that_raises_or_returns_the_wrong_type_is_named(hook, body, message):
    policy = type("Broken", (Broken,), {hook: body})()
    scheduler = scheduler_with(policy, num_blocks=6, max_num_seqs=1)
    for rid in ("1", "2", "3"):
        add(scheduler, rid, 8, float(rid), max_tokens=2)
    with pytest.raises(PolicyError, match=message):
        for now in range(12):
            step(scheduler, now=float(now))


def engine_with(policy, num_gpu_blocks=12) -> LLMEngine:
    return LLMEngine(cpu_engine_config(num_gpu_blocks=num_gpu_blocks, block_size=16, enable_prefix_caching=False),
                     model=tiny_model(), policy=policy)


def test_a_victim_chosen_from_an_edited_list_loses_nothing():
    """preempt_victim gets a copy of the running queue: a policy that removes the request it
    protects from it (and returns the last of the rest) preempts, and every request finishes."""
    class Protect(SchedulingPolicy):
        calls = 0

        def preempt_victim(self, running, now):
            self.calls += 1
            protected = next((r for r in running if r.request_id == "0"), None)
            if protected is not None and len(running) > 1:
                running.remove(protected)
            return running[-1]

    policy = Protect()
    engine = engine_with(policy)
    ids = [engine.add_request(tiny_prompt(40, seed=i), SamplingParams(max_tokens=24, temperature=0),
                              request_id=str(i)) for i in range(4)]
    finished = set()
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == set(ids) and policy.calls > 0      # 4 x 4 blocks do not fit in 12: it preempted
    assert_all_blocks_free(engine)


def test_an_on_step_that_raises_loses_no_output_and_no_request():
    class FailsOnce(SchedulingPolicy):
        failed = False

        def on_step(self, outcome, now):
            if outcome.finished and not self.failed:
                self.failed = True
                raise RuntimeError("bug in my statistics")

    engine = engine_with(FailsOnce(), num_gpu_blocks=64)
    ids = [engine.add_request(tiny_prompt(20, seed=i), SamplingParams(max_tokens=3 + i, temperature=0))
           for i in range(3)]
    finished, errors = set(), []
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except PolicyError as err:       # the step's outputs come with the error
            errors.append(err)
            outputs = err.outputs
        finished |= {o.request_id for o in outputs if o.finished}
    assert len(errors) == 1 and "on_step(outcome, now) raised RuntimeError: bug in my statistics" in str(errors[0])
    assert finished == set(ids)
    assert_all_blocks_free(engine)


def test_a_policy_class_that_cannot_be_a_policy_is_refused_by_name():
    class DuckTyped:
        def key(self, request, now):
            return 0

    class NeedsArguments(SchedulingPolicy):
        def __init__(self, weight):
            self.weight = weight

    with pytest.raises(ValueError, match="DuckTyped is not a SchedulingPolicy"):
        resolve_policy(DuckTyped)
    with pytest.raises(ValueError, match="NeedsArguments cannot be made without arguments.*pass an instance"):
        resolve_policy(NeedsArguments)
    assert resolve_policy(NeedsArguments(2)).weight == 2
