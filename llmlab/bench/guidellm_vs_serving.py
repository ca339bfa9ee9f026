"""GuideLLM and `bench serving` measure one server on the same workload, one after the other.

    make bench-guidellm ARGS="..."                    # builds .venv-clients (GuideLLM) first, then:
    llmlab bench guidellm [--prompt-tokens 128 --output-tokens 128 --max-concurrency 16]
                          [--num-requests 32 --sweep-size 4 --sweep-requests 16] [--base-url URL] [--out F]

GuideLLM is the load generator users bring from vLLM; this shows whether `bench serving`
reports what it reports. One `llmlab serve` (started here, embedded model, unless --base-url
names a running server) is measured:
  * throughput: GuideLLM's `throughput` profile (every request at once, at most
    --max-concurrency in flight), then `bench serving` at rate inf with the same
    --max-concurrency;
  * sweep: GuideLLM's `sweep` profile (synchronous, throughput, then --sweep-size - 2 Poisson
    rates between the two), then `bench serving` at each point it ran: one request at a time,
    rate inf at --max-concurrency, and each Poisson rate at --max-concurrency, its requests
    sent at the times GuideLLM's were (their targeted starts): at a rate the server keeps up
    with, output tok/s follows the span of the arrivals, and the spans of two Poisson draws
    of 16 arrivals differ by 37% (one standard deviation of their ratio).
Both send fixed lengths with ignore_eos and no temperature: GuideLLM's synthetic prompts of
exactly --prompt-tokens tokens, `bench serving`'s synthetic prompts of as many words (about
one token each: the table shows both prompt lengths as the server counted them), every
output exactly --output-tokens long. Each `bench serving` point gets prompts of its own seed,
so the prefix cache never serves one point from another's.

The table puts the two output tok/s side by side (GuideLLM's `output_tokens_per_second`
mean, the figure its console table shows, is its output tokens over its measuring window, as
`bench serving`'s is), with GuideLLM's errored requests and both TTFT and ITL medians (its ITL
is each request's mean gap, `bench serving`'s the median of all gaps), and each client's CPU
seconds per second of its run (GuideLLM's from its process tree, start-up included). GuideLLM
runs from the clients' venv (--clients-venv, default $LLMLAB_CLIENTS_VENV or .venv-clients),
offline, with the embedded model's tokenizer folder.

What made the two disagree on a 2-core CPU (2026-12-04, GuideLLM 0.65-0.80x at the
throughput points), each now handled here:
  * the request: GuideLLM sends no temperature, so the server samples (its default, 1.0);
    `bench serving` asked for greedy, which cost the CPU server 12% less. Here it sends none.
  * the order: the CPU server got 15-20% faster over its first runs, and GuideLLM ran first.
    An untimed `bench serving` pass comes first (--no-warmup: none).
  * the cores: GuideLLM's processes used 0.35-0.48 of a core (`bench serving` 0.01), taken
    from the server. --client-cpus N runs both clients on the last N CPUs and the server
    started here on the others; --guidellm-workers sets GuideLLM's worker processes
    (GUIDELLM__MAX_WORKER_PROCESSES; with 1 on 2 cores it could not feed its synchronous point).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import time
import tempfile
from pathlib import Path

from llmlab.bench.common import served, write_json


def add_arguments(parser) -> None:
    from llmlab.cli_flags import positive_int

    parser.add_argument("--base-url", default=None, help="a running server (default: start `llmlab serve` here)")
    parser.add_argument("--serve-args", default="", help='flags for the server started here, e.g. "--max-num-seqs 16"')
    parser.add_argument("--clients-venv", default=os.environ.get("LLMLAB_CLIENTS_VENV", ".venv-clients"),
                        help="the venv with GuideLLM (make clients builds .venv-clients)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder for GuideLLM (default: the embedded model's)")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=128)
    parser.add_argument("--output-tokens", type=positive_int, default=128)
    parser.add_argument("--max-concurrency", type=positive_int, default=16)
    parser.add_argument("--num-requests", type=positive_int, default=32, help="requests of the throughput run")
    parser.add_argument("--sweep-size", type=int, default=4,
                        help="points of GuideLLM's sweep (at least 2: synchronous and throughput); 0 = no sweep")
    parser.add_argument("--sweep-requests", type=positive_int, default=16, help="requests per sweep point")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--guidellm-workers", type=positive_int, default=None,
                        help="GuideLLM's worker processes (default: its own, up to 10)")
    parser.add_argument("--client-cpus", type=int, default=0,
                        help="the clients run on the last N CPUs, the server started here on the others (0: all share)")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="first an untimed bench serving pass at the throughput point (default: on)")
    parser.add_argument("--out", default=None, help="write every point of both clients as JSON")


# ---- GuideLLM ------------------------------------------------------------------------------
def guidellm(args, url: str, model: str, tokenizer: str, profile: str, num_requests: int) -> tuple[list[dict], float]:
    """Run GuideLLM once (`profile`: its --profile value): its benchmarks, as its JSON has them,
    and the CPU seconds its processes used per second of wall time."""
    binary = Path(args.clients_venv).resolve() / "bin" / "guidellm"    # (it runs in a folder of its own)
    if not binary.exists():
        raise ValueError(f"no GuideLLM at {binary}: `make clients` builds .venv-clients, or pass --clients-venv")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)    # its own packages, not ours
    if args.guidellm_workers is not None:
        env["GUIDELLM__MAX_WORKER_PROCESSES"] = str(args.guidellm_workers)
    if Path(tokenizer).exists():    # a folder here: GuideLLM runs in a folder of its own
        tokenizer = str(Path(tokenizer).resolve())
    with tempfile.TemporaryDirectory() as folder:
        output = Path(folder) / "guidellm.json"
        command = [str(binary), "run",
                   "--backend", f"kind=openai_http,target={url},model={model},request_format=/v1/completions",
                   "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
                   "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
                   "--profile", profile, "--constraint", f"kind=max_requests,count={num_requests}",
                   "--output", f"kind=json,path={output}", "--disable-console-interactive"]
        print("$", " ".join(command), flush=True)
        before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        subprocess.run(command, cwd=folder, env=env, check=True)
        after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - start
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return json.loads(output.read_text())["benchmarks"], cpu / wall


def guidellm_point(benchmark: dict, max_concurrency: int) -> dict:
    """One GuideLLM benchmark: the load it ran (as `bench serving` takes it: rate, concurrency)
    and what it measured."""
    strategy, metrics = benchmark["config"]["strategy"], benchmark["metrics"]
    kind = strategy["type_"]
    rate, concurrency = {"synchronous": (math.inf, 1), "throughput": (math.inf, strategy.get("max_concurrency"))
                         }.get(kind, (strategy.get("rate"), strategy.get("max_concurrency")))
    if kind not in ("synchronous", "throughput", "poisson"):
        raise ValueError(f"GuideLLM ran a {kind!r} point, which `bench serving` has no match for")
    totals = metrics["request_totals"]

    def successful(name, statistic):
        return metrics[name]["successful"][statistic]

    point = {}
    if kind == "poisson":   # when GuideLLM meant to send each request, from the first
        sent = sorted(arrival(r) for group in ("successful", "errored", "incomplete")
                      for r in benchmark["requests"].get(group, ()))
        point["arrivals"] = [t - sent[0] for t in sent]
    return point | {"point": kind if kind != "poisson" else f"poisson {rate:.2f}/s", "rate": rate,
            "max_concurrency": concurrency or max_concurrency,
            "guidellm": {"output_tok_s": successful("output_tokens_per_second", "mean"),
                         "successful": totals["successful"], "errored": totals["errored"],
                         "incomplete": totals["incomplete"],
                         "ttft_p50_ms": successful("time_to_first_token_ms", "median"),
                         "itl_p50_ms": successful("inter_token_latency_ms", "median"),
                         "mean_prompt_tokens": successful("prompt_token_count", "mean")}}


def arrival(request: dict) -> float:
    """When GuideLLM meant to send a request (its Poisson schedule's targeted start), else
    when it did."""
    return ((request.get("info") or {}).get("timings") or {}).get("targeted_start") or request["request_start_time"]


# ---- bench serving on the same point --------------------------------------------------------
def serving_point(args, url: str, model: str, point: dict, num_requests: int, seed: int) -> dict:
    from llmlab.bench import serving

    # sigma 0: every prompt --prompt-tokens words (the one `serving.run` puts in front of each
    # point's prompts included: `for_rate`), every output exactly --output-tokens
    words = max(args.prompt_tokens - 1, 1)
    arrivals = point.get("arrivals")
    num_requests = len(arrivals) if arrivals else num_requests
    prompts = serving.synthetic_prompts(num_requests, seed, words, args.output_tokens, sigma=0.0,
                                        max_input_len=words, max_output_len=args.output_tokens)
    # no temperature, as GuideLLM sends its requests: the server's default (1.0), sampled
    report = serving.run(url, [point["rate"]], prompts, model, seed=seed, progress=False,
                         max_concurrency=point["max_concurrency"], temperature=None, arrivals=arrivals)
    result = report["results"][0]
    return {"output_tok_s": result["output_throughput"], "completed": result["completed"],
            "failed": result["failed"], "ttft_p50_ms": result["ttft_ms"].get("median") if result["ttft_ms"] else None,
            "itl_p50_ms": result["itl_ms"].get("median") if result["itl_ms"] else None,
            "mean_prompt_tokens": result["mean_prompt_tokens"], "client_cpu_share": result["client_cpu_share"]}


def format_rows(rows: list[dict]) -> str:
    def ms(x):
        return "-" if x is None else f"{x:.0f}"

    lines = [f"{'run':<11}{'point':<18}{'conc':>5} | {'out tok/s GuideLLM':>18}{'bench serving':>14}{'ratio':>7} | "
             f"{'errored':>7} | {'TTFT p50 ms G/b':>16} | {'ITL p50 ms G/b':>15} | {'prompt tok G/b':>15}"]
    for row in rows:
        g, b = row["guidellm"], row["serving"]
        ratio = g["output_tok_s"] / b["output_tok_s"] if b["output_tok_s"] else math.nan
        lines.append(f"{row['run']:<11}{row['point']:<18}{row['max_concurrency']:>5} | {g['output_tok_s']:>18.1f}"
                     f"{b['output_tok_s']:>14.1f}{ratio:>7.2f} | {g['errored']:>7} | "
                     f"{ms(g['ttft_p50_ms']) + ' / ' + ms(b['ttft_p50_ms']):>16} | "
                     f"{ms(g['itl_p50_ms']) + ' / ' + ms(b['itl_p50_ms']):>15} | "
                     f"{g['mean_prompt_tokens']:>7.1f} / {b['mean_prompt_tokens']:<5.1f} | "
                     f"{g['client_cpu_share']:>6.2f} / {b['client_cpu_share']:<5.2f}")
    return "\n".join(lines)


def main(args) -> dict:
    import httpx

    from llmlab.machine import machine_info
    from llmlab.model.loader import resolve_model

    if args.sweep_size and args.sweep_size < 2:
        raise ValueError(f"--sweep-size must be 0 (no sweep) or at least 2, got {args.sweep_size}")
    tokenizer = args.tokenizer or str(resolve_model(None))
    rows = []
    cpus = sorted(os.sched_getaffinity(0))
    if not 0 <= args.client_cpus < len(cpus) or (args.client_cpus and args.base_url):
        raise ValueError(f"--client-cpus must leave the server started here at least one of the {len(cpus)} CPUs "
                         f"(and needs no --base-url), got {args.client_cpus}")
    server_cpus = set(cpus[:len(cpus) - args.client_cpus]) if args.client_cpus else None
    with served(args.base_url, args.serve_args, cpus=server_cpus) as url:
        if args.client_cpus:    # this process (bench serving) and GuideLLM, which inherits it
            os.sched_setaffinity(0, cpus[len(cpus) - args.client_cpus:])
        model = args.model or httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
        runs = [("throughput", f"kind=throughput,max_concurrency={args.max_concurrency}", args.num_requests)]
        if args.sweep_size:
            runs.append(("sweep", f"kind=sweep,sweep_size={args.sweep_size},strategy_type=poisson,"
                                  f"max_concurrency={args.max_concurrency}",
                         args.sweep_requests))
        if args.warmup:   # untimed: neither client may meet a cold server
            serving_point(args, url, model, {"rate": math.inf, "max_concurrency": args.max_concurrency},
                          args.num_requests, args.seed + 10_000)
        for run, profile, num_requests in runs:
            benchmarks, cpu_share = guidellm(args, url, model, tokenizer, profile, num_requests)
            for benchmark in benchmarks:
                rows.append({"run": run, **guidellm_point(benchmark, args.max_concurrency)})
                rows[-1]["guidellm"]["client_cpu_share"] = cpu_share    # the whole run's, every point alike
                rows[-1]["serving"] = serving_point(args, url, model, rows[-1], num_requests, args.seed + len(rows))
    print(format_rows(rows))
    report = {"model": model, "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
              "max_concurrency": args.max_concurrency, "serve_args": args.serve_args,
              "guidellm_workers": args.guidellm_workers,
              "server_cpus": sorted(server_cpus) if server_cpus else None, "rows": rows,
              "machine": machine_info()}
    write_json(args.out, report)
    return report
