"""Run a workload on a real engine, on the wall clock: each request is added when its
arrival time comes, the engine steps while it has work, and a Recorder keeps every step.
The Result's per-request times come from that trace (`Result.from_trace`). The engine's
clock (`Scheduler.now()`) starts at the workload's t = 0, so the policy's `now` and each
request's arrival_time are seconds on the workload's clock, as in `simulate()`.

    result = run(Workload.poisson(50, rate=2.0), llmlab.LLM().engine, policy="fcfs")
    result.summary(slo={"ttft": 1.0, "tpot": 0.1})
"""
from __future__ import annotations

import time

from llmlab.config import EngineConfig
from llmlab.engine.engine import LLMEngine
from llmlab.experiments.repeats import Repeats, repeated
from llmlab.experiments.result import Result
from llmlab.experiments.workload import Workload
from llmlab.hooks import Recorder
from llmlab.machine import machine_info
from llmlab.policies import resolve_policy
from llmlab.sampling import SamplingParams


def engine_meta(engine: LLMEngine) -> dict:
    """What the simulator needs to know about an engine to replay its scheduling: KV blocks,
    their size in bytes (to turn swap_space into host blocks), context limit, and where it ran."""
    from llmlab.cache.kv_cache import bytes_per_block, kv_cache_dtype

    config = engine.config
    cache_dtype = kv_cache_dtype(config.kv_cache_dtype, engine.dtype)   # 8-bit codes + scales, or the model's
    return {"num_gpu_blocks": engine.block_manager.num_device_blocks,
            "num_host_blocks": engine.block_manager.num_host_blocks,
            "bytes_per_block": bytes_per_block(engine.model_config, config.block_size, cache_dtype),
            "kv_cache_dtype": config.kv_cache_dtype,
            "block_size": config.block_size, "max_model_len": engine.max_model_len,
            "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
            "enable_chunked_prefill": config.enable_chunked_prefill, "model": str(config.model),
            "device": engine.device.type, "dtype": str(engine.dtype).removeprefix("torch."),
            "backend": engine.backend, "num_layers": engine.model_config.num_layers,
            "hidden_size": engine.model_config.hidden_size}


def run(workload: Workload, config_or_engine, policy="fcfs", warmup: bool = True,
        repeats: int | None = None) -> Result | Repeats:
    """Drive a real engine through `workload` (an EngineConfig builds a new engine; an LLM or
    LLMEngine is used as it is, and must be idle). Every request generates exactly its
    output_len tokens (greedy, EOS ignored). `policy`: anything `resolve_policy` takes (a
    name, a SchedulingPolicy, "module:Name", a key function); the engine's own policy and
    clock are put back afterwards. `warmup` first runs one short request, untimed.

    `repeats=k` runs it k times on the same engine and returns a `Repeats` (means and 95%
    intervals, repeats.py); `workload` may then be a function of the repeat's index (0 to
    k - 1) that returns its Workload, e.g. `lambda seed: Workload.poisson(..., seed=seed)`.
    A policy object is reused by every repeat: pass its class for a new one in each."""
    if repeats is not None:    # one engine for every repeat
        engine = _engine(config_or_engine)
        return repeated(lambda w: run(w, engine, policy, warmup), workload, repeats)
    if not isinstance(workload, Workload):
        raise ValueError(f"run() takes a Workload (a function of a seed only with repeats=), got "
                         f"{type(workload).__name__}")
    workload.check()
    engine = _engine(config_or_engine)
    if engine.has_unfinished_requests():
        raise ValueError("run() needs an idle engine; it still has unfinished requests")
    policy = resolve_policy(policy, workload)
    # a cold prefix cache, as simulate() starts with: an earlier run of the same workload on
    # this engine (another policy, say) would otherwise find every prompt already computed
    engine.block_manager.reset_prefix_cache()
    if warmup:   # first-call costs (allocator, oneDNN, Triton) do not belong to any request
        # shorter than a block: it fills none, so the prefix cache keeps nothing of it
        prompt = workload.requests[0].prompt_token_ids[:max(1, min(16, engine.config.block_size - 1))]
        engine.add_request(prompt, SamplingParams(max_tokens=1), request_id="warm-up")
        while engine.has_unfinished_requests():
            engine.step()
    scheduler = engine.scheduler
    previous = scheduler.policy, scheduler.clock_origin
    scheduler.policy = policy
    recorder = Recorder(engine=engine_meta(engine), policy=policy.name, idle_before_steps=[])
    engine.hooks.attach(recorder)
    pending = sorted(workload.requests, key=lambda r: r.arrival_time)
    arrivals, next_index = {}, 0
    start = scheduler.clock_origin = time.perf_counter()    # the workload's t = 0
    try:
        while next_index < len(pending) or engine.has_unfinished_requests():
            now = scheduler.now()
            while next_index < len(pending) and pending[next_index].arrival_time <= now:
                r = pending[next_index]
                engine.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.output_len, temperature=0.0,
                                                                      ignore_eos=True), request_id=r.request_id)
                arrivals[r.request_id] = start + r.arrival_time
                next_index += 1
            if engine.has_unfinished_requests():
                engine.step()
            else:    # idle until the next arrival; the next step's gap is no step's time
                time.sleep(max(0.0, pending[next_index].arrival_time - now))
                recorder.trace.meta["idle_before_steps"].append(engine.step_index)
    finally:
        engine.hooks.detach(recorder)
        scheduler.policy, scheduler.clock_origin = previous
        for request_id in list(engine.requests):   # interrupted: leave the engine idle
            engine.abort(request_id)
    # after the run: its load is the run's; in the trace too, so a cost model fitted on it says where
    recorder.trace.meta["machine"] = machine_info()
    meta = {"kind": "run", "policy": recorder.trace.meta["policy"], "engine": recorder.trace.meta["engine"],
            "machine": recorder.trace.meta["machine"]}
    return Result.from_trace(recorder.trace, arrivals, origin=start,
                             priorities={r.request_id: r.priority for r in workload}, meta=meta)


def _engine(config_or_engine) -> LLMEngine:
    if isinstance(config_or_engine, LLMEngine):
        return config_or_engine
    if isinstance(getattr(config_or_engine, "engine", None), LLMEngine):   # an LLM
        return config_or_engine.engine
    if isinstance(config_or_engine, EngineConfig):
        return LLMEngine(config_or_engine)
    raise ValueError(f"run() takes an EngineConfig, an LLM or an LLMEngine, got {type(config_or_engine).__name__}")
