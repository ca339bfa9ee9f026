"""Scheduling policies, as the Scheduler takes them: a key function of a Request, smaller
key = higher priority. The key orders three decisions (llmlab/scheduler.py): who is
admitted from the waiting queue first, who comes back from swap first, and who is
preempted when KV blocks run out (the running request with the largest key).

  fcfs                    arrival order (vLLM's default; Orca's iteration-level FCFS)
  shortest_prompt_first   fewest prompt tokens first: short prompts stop queueing behind
                          long prefills, at the price of the long ones' tail latency
  shortest_output_first   fewest output tokens first: shortest-job-first with an oracle
                          that knows output lengths (the best a length predictor could do)
  priority                the workload's `priority` field (lower = more important), then
                          arrival: under memory pressure the least important running
                          request is preempted first, and a newcomer that outranks a
                          running request preempts it when no slot or blocks are free
                          (vLLM's priority scheduling: run() and simulate() set the
                          scheduler's preempt_for_priority)

`resolve_policy` turns one of these names into its key function (llmlab.experiments' run()
and simulate() take a name). Your own key function works the same way:
`Scheduler(..., policy=my_key)`, `LLMEngine(..., policy=my_key)` or
`run(workload, engine, policy=my_key)`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from llmlab.request import Request

if TYPE_CHECKING:   # only the annotation: the scheduler's layer does not import experiments
    from llmlab.experiments.workload import Workload

POLICIES = ("fcfs", "shortest_prompt_first", "shortest_output_first", "priority")


def fcfs(request: Request):
    """First come, first served: earlier arrival = higher priority."""
    return request.arrival_time


def shortest_prompt_first(request: Request):
    return (len(request.prompt_token_ids), request.arrival_time)


def shortest_output_first(request: Request):
    return (request.params.max_tokens, request.arrival_time)


def resolve_policy(policy, workload: Workload):
    """The key function for `policy` (a name in POLICIES or a callable) on this workload."""
    if callable(policy):
        return policy
    if policy == "fcfs":
        return fcfs
    if policy == "shortest_prompt_first":
        return shortest_prompt_first
    if policy == "shortest_output_first":
        return shortest_output_first
    if policy == "priority":
        priorities = {r.request_id: r.priority for r in workload}
        return lambda request: (priorities.get(request.request_id, 0), request.arrival_time)
    raise ValueError(f"unknown policy {policy!r}; use one of {', '.join(POLICIES)} or a key function of a Request")
