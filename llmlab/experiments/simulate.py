"""Replay a workload through the real Scheduler and BlockManager with no model: each step's
forward is replaced by the cost model's prediction on a simulated clock, and every sampled
token is a placeholder. The scheduling decisions (who is admitted, chunked, preempted,
swapped) are the engine's own code, so they are exactly what an engine with this config
would decide given the same step times; only the times are predicted (Vidur's approach).

What it assumes, and where that stops holding:
  * a step's time depends only on its shape (the cost model's terms); contention from other
    processes, clock boosts, a Triton compile or a CUDA-graph capture are not in it;
  * every request generates exactly output_len tokens (EOS ignored), as in the real run;
  * placeholder tokens mean prefix-cache hits on *generated* text (two identical prompts
    recomputed after preemption) are not reproduced; hits on prompts are;
  * the cost model's straight lines hold past the step shapes it was fitted on: they may
    not, so the steps outside its fitted range are counted, warned about once
    (ExtrapolationWarning) and reported by `Result.summary()` as `outside_fitted_range`
    (fitted_range.py).
"""
from __future__ import annotations

import math
import warnings

from llmlab.cache.block_manager import BlockManager
from llmlab.config import EngineConfig
from llmlab.experiments.cost_model import CostModel
from llmlab.experiments.fitted_range import ExtrapolationWarning, outside, step_shape, warning_text
from llmlab.experiments.repeats import Repeats, check_repeats, repeated
from llmlab.experiments.result import RequestMetrics, Result, StepStats
from llmlab.experiments.workload import Workload
from llmlab.hooks import Trace, step_record
from llmlab.policies import resolve_policy
from llmlab.request import Request
from llmlab.sampling import SamplingParams
from llmlab.scheduler import Scheduler

PLACEHOLDER_TOKEN = 0


def simulate(workload: Workload, config: EngineConfig, cost_model: CostModel, policy="fcfs",
             record_trace: bool = False, repeats: int | None = None) -> Result | Repeats:
    """The Result `run(workload, config, policy)` would give if every step took the time
    `cost_model` predicts. `policy`: anything `resolve_policy` takes; it is given the
    simulated clock as `now`, the clock of the workload's arrival times. KV blocks come from
    `config.num_gpu_blocks`, or else from the engine the cost model was fitted on
    (cost_model.meta). `record_trace` also keeps a Trace of every step (what was scheduled,
    preempted, swapped) for the viz figures.

    `repeats=k` with `workload` a function of the repeat's index (0 to k - 1), e.g.
    `lambda seed: Workload.poisson(1000, 5.0, seed=seed)`, simulates k draws of the traffic
    and returns a `Repeats` (means and 95% intervals, repeats.py). A simulation is
    deterministic: k repeats of one Workload would be k copies, so that is refused."""
    if repeats is not None:
        if isinstance(workload, Workload) and check_repeats(repeats) > 1:
            raise ValueError("simulate() is deterministic: repeats of the same Workload are the same every time. "
                             "Pass a function of a seed for new arrivals in each repeat, e.g. "
                             "lambda seed: Workload.poisson(1000, 5.0, seed=seed)")
        return repeated(lambda w: simulate(w, config, cost_model, policy, record_trace), workload, repeats)
    if not isinstance(workload, Workload):
        raise ValueError(f"simulate() takes a Workload (a function of a seed only with repeats=), got "
                         f"{type(workload).__name__}")
    workload.check()
    if not isinstance(config, EngineConfig):
        raise ValueError(f"simulate() takes an EngineConfig, got {type(config).__name__}")
    policy = resolve_policy(policy, workload)
    meta = cost_model.meta
    num_device = config.num_gpu_blocks or meta.get("num_gpu_blocks")
    if not num_device:
        raise ValueError("set config.num_gpu_blocks: the cost model does not say how many KV blocks "
                         "its engine had (meta['num_gpu_blocks'])")
    if "bytes_per_block" in meta:
        num_host = int(config.swap_space * 2**30) // meta["bytes_per_block"]
    else:
        num_host = meta.get("num_host_blocks", 0)
    max_model_len = min(config.max_model_len or meta.get("max_model_len") or math.inf,
                        num_device * config.block_size)
    for r in workload:
        if len(r.prompt_token_ids) >= max_model_len:
            raise ValueError(f"request {r.request_id!r} has {len(r.prompt_token_ids)} prompt tokens, but "
                             f"max_model_len is {max_model_len}")
    scheduler = Scheduler(config, BlockManager(num_device, num_host, config.block_size,
                                               config.enable_prefix_caching), max_model_len, policy)
    pending = sorted(workload.requests, key=lambda r: r.arrival_time)
    metrics = {r.request_id: RequestMetrics(r.request_id, r.arrival_time, len(r.prompt_token_ids), r.priority)
               for r in pending}
    trace = Trace(meta={"engine": dict(meta), "simulated": True}) if record_trace else None
    steps: list[StepStats] = []
    shapes = []      # each step's shape, against the range the cost model was fitted on
    clock, next_index, last_arrival = 0.0, 0, -math.inf
    while next_index < len(pending) or scheduler.has_unfinished():
        while next_index < len(pending) and pending[next_index].arrival_time <= clock:
            r = pending[next_index]
            # strictly increasing, as the engine's add-time clock is: FCFS ties follow the workload order
            last_arrival = max(r.arrival_time, math.nextafter(last_arrival, math.inf))
            scheduler.add(Request(r.request_id, None, r.prompt_token_ids,
                                  SamplingParams(max_tokens=r.output_len, ignore_eos=True), last_arrival))
            next_index += 1
        if not scheduler.has_unfinished():    # idle until the next arrival
            clock = pending[next_index].arrival_time
            continue
        plan = scheduler.schedule(now=clock)
        if plan.is_empty and not (plan.preempted or plan.swapped_out or plan.swapped_in):
            if next_index == len(pending):
                raise RuntimeError("the simulated engine cannot schedule anything and no request is left to "
                                   "arrive: a request needs more KV blocks than the cache has")
            clock = pending[next_index].arrival_time   # nothing changes before then
            continue
        swap_blocks = len(plan.swap_in_copies) + len(plan.swap_out_copies)
        if plan.items:
            features = cost_model.features(plan.items, swap_blocks)
            duration = cost_model.predict(features)
            shapes.append(step_shape(features))
        else:
            duration = 0.0
        start, clock = clock, clock + duration
        for item in plan.prefills:
            m = metrics[item.request.request_id]
            if m.first_scheduled is None:
                m.first_scheduled = start
        for request_id in plan.preempted + plan.swapped_out:
            metrics[request_id].num_preemptions += 1
        # the engine's own post-step bookkeeping, with a placeholder for every sampled token
        outcome = scheduler.update(plan, [PLACEHOLDER_TOKEN] * len(plan.sampling_items), now=clock)
        sampled, finished = outcome.advanced, outcome.finished
        for request in sampled:
            m = metrics[request.request_id]
            m.token_times.append(clock)
            if m.first_token is None:
                m.first_token = clock
        for request in finished:
            metrics[request.request_id].finish = clock
        steps.append(StepStats(clock, duration, sum(i.num_tokens for i in plan.prefills), len(plan.decodes),
                               len(scheduler.waiting), len(plan.preempted) + len(plan.swapped_out)))
        if trace is not None:   # the engine's record of a step (hooks.step_record), the schedule only
            trace.steps.append(step_record(len(steps) - 1, plan, scheduler, sampled, blocks=False,
                                           timings={"forward": duration}, time=clock))
    extrapolated = outside(shapes, cost_model.fitted_range)
    if warning_text(extrapolated):    # one warning per simulation, whatever it ran
        warnings.warn(warning_text(extrapolated), ExtrapolationWarning, stacklevel=2)
    result_meta = {"kind": "simulate", "policy": policy.name, "engine": dict(meta),
                   "cost_model": cost_model.to_dict(), "fitted_range": extrapolated}
    return Result(list(metrics.values()), steps, result_meta, trace)
