"""hooks: what observing the engine costs — the hook points with nothing attached (one
`if` each), and a Recorder attached — against the time of a decode step."""
from __future__ import annotations

import time

from llmlab.bench.common import median_ms, write_json


def add_arguments(parser) -> None:
    from llmlab.cli_flags import positive_int

    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--num-seqs", type=int, default=8)
    parser.add_argument("--steps", type=positive_int, default=40)
    parser.add_argument("--out", default=None)


def _decode_steps(engine, prompts, steps, recorder=None) -> float:
    """Median milliseconds of a pure-decode step (all prompts running), by the wall clock."""
    from llmlab import SamplingParams

    if recorder is not None:
        engine.hooks.attach(recorder)
    ids = [engine.add_request(p, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
           for p in prompts]
    engine.step()   # the prefill
    ms = median_ms(engine.step, repeats=steps, warmup=0, cuda_events=False)
    for rid in ids:
        engine.abort(rid)
    if recorder is not None:
        engine.hooks.detach(recorder)
    return ms


def main(args) -> dict:
    import llmlab

    llm = llmlab.LLM(args.model)
    engine, model = llm.engine, llm.engine.model
    prompts = [f"Tell me a story about the number {i}." for i in range(args.num_seqs)]
    _decode_steps(engine, prompts, 3)   # warm-up
    plain = _decode_steps(engine, prompts, args.steps)
    recorded = _decode_steps(engine, prompts, args.steps, llmlab.Recorder())
    # the hook points with nothing attached: time the check itself, times the points per step
    points_per_step = 3 + 5 * model.config.num_layers
    n = 1_000_000
    start = time.perf_counter()
    for _ in range(n):
        model._tap("layers.0.q", None)
    per_check = (time.perf_counter() - start) / n
    result = {"decode_step_ms": plain, "decode_step_with_recorder_ms": recorded,
              "recorder_overhead_pct": 100 * (recorded - plain) / plain,
              "hook_points_per_step": points_per_step, "hook_point_check_ns": per_check * 1e9,
              "idle_hook_points_pct_of_step": 100 * points_per_step * per_check / (plain / 1e3),
              "num_seqs": args.num_seqs, "device": str(engine.device)}
    for key, value in result.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    write_json(args.out, result, indent=2)
    return result
