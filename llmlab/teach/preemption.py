"""Notebook 08, preemption: four requests in a cache too small for them, replayed on the
simulator with the notebook's engine settings."""
from __future__ import annotations

from llmlab.policies import shortest_prompt_first
from llmlab.teach import ground_truth
from llmlab.teach.check import integer, right, text, wrong

PROMPTS = ["Tell me about the moon.", "What is a good name for a dog?", "Describe a rainy day.", "List some fruits:"]
ENGINE = dict(block_size=4, num_gpu_blocks=20, swap_space=0.005, max_num_batched_tokens=64)


def replay(policy="fcfs", **overrides):
    arrivals = [(ground_truth.encode(p), 16, 0) for p in PROMPTS]
    return ground_truth.replay(arrivals, policy=policy, **{**ENGINE, **overrides})


def count(trace, field: str) -> int:
    return sum(len(getattr(step, field)) for step in trace.steps)


def q1(answer):
    """make_engine(preemption_mode="swap", swap_space=0): how many preemptions by recompute (entries of
    s.preempted, over all steps) does the run have?"""
    n = integer(answer)
    trace = replay(preemption_mode="swap", swap_space=0)
    if n == count(trace, "preempted") and count(trace, "swapped_out") == 0:
        return right("no host blocks, so a swap cannot happen: the scheduler falls back to recompute for "
                     "the same victims.")
    if n == 0:
        return wrong("without host memory the victim cannot be swapped out; is it preempted another way?")
    return wrong("record viz.record(make_engine(preemption_mode='swap', swap_space=0), workload) and sum "
                 "len(s.preempted) over its steps.")


def q2(answer):
    """make_engine(preemption_mode="recompute", enable_prefix_caching=False): how many prefill tokens does
    the run compute in all (prompts and recomputation)?"""
    n = integer(answer)
    trace = replay(preemption_mode="recompute", enable_prefix_caching=False)
    expected = sum(step.num_prefill_tokens for step in trace.steps)
    prompts = sum(len(ground_truth.encode(p)) for p in PROMPTS)
    if n == expected:
        return right("the victim computes its prompt and every token it had generated again: none of its "
                     "blocks survive without the prefix cache.")
    if n == sum(step.num_prefill_tokens for step in replay(preemption_mode="recompute").steps):
        return wrong("that is with prefix caching on, where the victim finds some of its blocks again.")
    if n == prompts:
        return wrong("that counts only the prompts, once; the victim's tokens are computed a second time.")
    return wrong("sum s.num_prefill_tokens over the steps of the new run.")


def q3(answer):
    """make_engine(num_gpu_blocks=14) (recompute, the default): how many preemptions does the run have?"""
    n = integer(answer)
    expected = count(replay(num_gpu_blocks=14), "preempted")
    if n == expected:
        return right("14 blocks hold fewer tokens at once, so requests are preempted sooner and more often, "
                     "and the run takes more steps.")
    if n == count(replay(), "preempted"):
        return wrong("that is with 20 blocks; record the run with 14.")
    return wrong("sum len(s.preempted) over the steps of viz.record(make_engine(num_gpu_blocks=14), workload).")


def q4(answer):
    """With policy=llmlab.policies.shortest_prompt_first (LLMEngine(..., policy=...)), which request is
    preempted first? Answer its id, e.g. "2"."""
    rid = text(str(answer)).strip().removeprefix("req ").strip()
    trace = replay(policy=shortest_prompt_first, preemption_mode="recompute")
    first = next(step.preempted[0] for step in trace.steps if step.preempted)
    if rid == first:
        return right("the policy's order decides who goes first: under shortest-prompt-first the request "
                     "with the longest prompt has the lowest priority, so it is the victim.")
    if rid == next(step.preempted[0] for step in replay(preemption_mode="recompute").steps if step.preempted):
        return wrong("that is FCFS's victim (the newest request); which one has the lowest priority when "
                     "the shortest prompt goes first?")
    return wrong("build the engine with policy=llmlab.policies.shortest_prompt_first, record, and look for the "
                 "first step with s.preempted.")


QUESTIONS = {"q1": q1, "q2": q2, "q3": q3, "q4": q4}
