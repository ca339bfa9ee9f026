"""simulate a workload with a saved cost model: latencies, and how long simulating took.

No model and no GPU: the latency summary an engine would reach, from `llmlab.experiments`.

    llmlab bench simulate --cost-model notebooks/data/h200_cost_model_llama3_8b.json \\
        --num-requests 10000 --rate 20 --policy fcfs
"""
from __future__ import annotations

import time

from llmlab.bench.common import write_json


def add_arguments(parser) -> None:
    parser.add_argument("--cost-model", required=True, help="a CostModel JSON (llmlab bench calibrate writes one)")
    parser.add_argument("--num-requests", type=int, default=10000)
    parser.add_argument("--rate", type=float, default=20.0, help="requests/s; inf = all at once")
    parser.add_argument("--cv", type=float, default=1.0, help="arrival burstiness: 1 = Poisson, > 1 = gamma")
    parser.add_argument("--prompt-len", default="32,2048", help="LOW,HIGH (uniform)")
    parser.add_argument("--output-len", default="16,512", help="LOW,HIGH (uniform)")
    parser.add_argument("--policy", default="fcfs",
                        help="fcfs, shortest_prompt_first, shortest_output_first, priority, or module:Name "
                             "(a SchedulingPolicy, its class, or a key function; module may be path/to/file.py)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-gpu-blocks", type=int, default=None, help="default: the calibrated engine's")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the summary and timing as JSON here")


def main(args) -> dict:
    from llmlab import EngineConfig
    from llmlab.cli_flags import int_span
    from llmlab.experiments import CostModel, Workload, simulate
    from llmlab.policies import resolve_policy

    spans = int_span(args.prompt_len, "--prompt-len"), int_span(args.output_len, "--output-len")
    policy = resolve_policy(args.policy)   # before the workload: a bad name fails at once (its priorities are all 0)
    cost_model = CostModel.load(args.cost_model)
    start = time.perf_counter()
    workload = Workload.gamma(args.num_requests, args.rate, args.cv, *spans, seed=args.seed, vocab_size=128000)
    built = time.perf_counter() - start
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          num_gpu_blocks=args.num_gpu_blocks, max_model_len=args.max_model_len)
    start = time.perf_counter()
    result = simulate(workload, config, cost_model, policy=policy)
    seconds = time.perf_counter() - start
    summary = result.summary()
    report = {"num_requests": args.num_requests, "policy": result.meta["policy"], "num_steps": len(result.steps),
              "simulate_seconds": seconds, "workload_seconds": built, "simulated_duration_s": summary["duration_s"],
              "summary": summary}
    print(f"{args.num_requests} requests, {len(result.steps)} steps simulated in {seconds:.1f} s "
          f"(workload built in {built:.1f} s); {summary['duration_s']:.0f} s of engine time")
    print(" ".join(f"{k}={summary[k]:.4g}" for k in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "itl_p99",
                                                     "output_tok_s")))
    print(f"{summary['outside_fitted_range']:.1%} of the steps lie past the shapes the cost model was fitted on "
          f"(their times are extrapolated)")
    write_json(args.out, report)
    return report
