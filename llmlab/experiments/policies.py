"""Scheduling policies by name, as the Scheduler takes them: a key function of a Request,
smaller key = higher priority. The key orders three decisions (llmlab/scheduler.py):
who is admitted from the waiting queue first, who comes back from swap first, and who is
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

Your own key function works the same way: `run(workload, engine, policy=my_key)`.
"""
from __future__ import annotations

from llmlab.experiments.workload import Workload
from llmlab.scheduler import fcfs, shortest_prompt_first

POLICIES = ("fcfs", "shortest_prompt_first", "shortest_output_first", "priority")


def resolve_policy(policy, workload: Workload):
    """The key function for `policy` (a name in POLICIES or a callable) on this workload."""
    if callable(policy):
        return policy
    if policy == "fcfs":
        return fcfs
    if policy == "shortest_prompt_first":
        return shortest_prompt_first
    if policy == "shortest_output_first":
        return lambda request: (request.params.max_tokens, request.arrival_time)
    if policy == "priority":
        priorities = {r.request_id: r.priority for r in workload}
        return lambda request: (priorities.get(request.request_id, 0), request.arrival_time)
    raise ValueError(f"unknown policy {policy!r}; use one of {', '.join(POLICIES)} or a key function of a Request")
