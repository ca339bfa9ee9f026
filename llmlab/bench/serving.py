"""Online serving: Poisson (or bursty) arrivals against a running OpenAI-compatible server
(TTFT, TPOT, ITL, E2E, goodput).

    llmlab serve &                                   # or any OpenAI-compatible server
    llmlab bench serving --rate 1,4,inf --num-prompts 100 --out serving.json
    llmlab bench serving --request-rate 4 --burstiness 0.5 --max-concurrency 16 --goodput ttft:300 tpot:50

The vLLM / SwiftLLM online benchmark, client side only, with vLLM's `benchmark_serving`
names: requests arrive with gaps drawn from a gamma distribution of mean 1/rate and shape
`--burstiness` (1.0, the default, is a Poisson process; below 1 burstier, above 1 more
even: the gaps' coefficient of variation is 1/sqrt(burstiness)); rate inf sends them all
at once. `--max-concurrency N` keeps at most N requests in flight: an arrival waits on the
client for a free slot, and, as in vLLM, its times count from when it is sent (the wait is
`queued` in the per-request JSON). Each request streams its answer and the client times
every chunk. Per rate it reports request and token throughput and the mean / p50 / p90 /
p99 of
  TTFT  time to first token: sent -> first text (queueing + prefill),
  TPOT  time per output token after the first: (E2E - TTFT) / (output tokens - 1),
  ITL   inter-token latency: the gap between consecutive chunks,
  E2E   end-to-end latency (vLLM's E2EL): sent -> last token;
with `--goodput` / `--slo` (KEY:MILLISECONDS pairs for ttft, tpot, e2el, e.g. `ttft:300
tpot:50` or `ttft:300,tpot:50`) also the goodput, requests/s that met every limit (a
one-token answer has no TPOT and meets any TPOT limit, as vLLM counts it), and the SLO
attainment. It prints vLLM's "Serving Benchmark Result" block per rate (percentiles chosen
by `--percentile-metrics` and `--metric-percentiles`, vLLM's defaults) and a table of the sweep.
Every rate gets the same prompts, so a sweep isolates the effect of load; each rate puts a
first word of its own in front of them (`for_rate`), because a server that caches prefixes
(llmlab's and vLLM's do by default) would otherwise serve a later rate's prompts from the
cache an earlier rate filled.

Prompts are synthetic by default: `Workload.lognormal`'s lengths, drawn from lognormal
distributions with the means of ShareGPT conversations (161 prompt and 338 output tokens,
vLLM paper §6), made of random common words (about one token each), or read from a JSONL file of
{"prompt": ..., "output_len": ...} lines (prompts.py). `ignore_eos` (a vLLM extension llmlab serve
accepts) makes every request generate exactly its output length; greedy. `llmlab bench
offline --dataset serving-synthetic --workload-seed S --num-requests N` runs the first
rate's prompts of `--seed S --num-prompts N` on the offline engine (the same token ids and
output lengths), for the server / offline ratio (BENCHMARKS.md).
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field

from llmlab.bench.common import write_json
from llmlab.bench.prompts import (WORDS, Prompt, add_synthetic_arguments, for_rate, jsonl_prompts,  # noqa: F401
                                  synthetic_prompts, synthetic_prompts_of)
from llmlab.bench.serving_metrics import (VLLM_METRICS, format_result, format_table, meets_slo, parse_slo,  # noqa: F401
                                          summarize, traffic_lines)
from llmlab.experiments.workload import Workload

@dataclass
class RequestResult:
    arrival: float                    # seconds after the run started
    output_len: int                   # requested
    prompt_tokens: int = 0            # from the server's usage
    output_tokens: int = 0
    ttft: float | None = None         # seconds
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None
    text: str = ""                    # what came back (greedy: comparable with the offline engine's)
    queued: float = 0.0               # seconds it waited on the client for a slot (--max-concurrency)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


# ---- arrivals -------------------------------------------------------------------------
def arrival_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival times (s), the first at t = 0: gaps from a gamma distribution with shape
    `burstiness` and mean 1/rate (vLLM's `--burstiness`; `Workload.gamma` with cv =
    1/sqrt(burstiness), its prompts unused). burstiness 1 is a Poisson process."""
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a positive number (1.0: Poisson), got {burstiness!r}")
    workload = Workload.gamma(num, rate, 1 / math.sqrt(burstiness), prompt_len=1, output_len=1, seed=seed)
    return [r.arrival_time for r in workload]


def poisson_arrivals(num: int, rate: float, seed: int = 0) -> list[float]:
    """`arrival_times` at burstiness 1: `Workload.poisson`'s arrivals."""
    return arrival_times(num, rate, 1.0, seed)


# ---- the client ----------------------------------------------------------------------------
async def send(session, url: str, model: str, prompt: Prompt, arrival: float, sent: float,
               temperature: float | None = 0.0) -> RequestResult:
    """Stream one completion from `url` (the server's /v1/completions), timing every chunk
    from `sent` (perf_counter when it was sent). `session`: an aiohttp ClientSession.
    `temperature`: greedy by default; None sends none (the server's default, 1.0)."""
    result = RequestResult(arrival=arrival, output_len=prompt.output_len)
    payload = {"model": model, "prompt": prompt.text, "max_tokens": prompt.output_len,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if temperature is not None:
        payload["temperature"] = temperature
    last, texts = None, []
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read()).decode(errors='replace')[:200]}"
                return result
            async for line in response.content:     # one SSE line at a time, as it arrives
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[len(b"data: "):])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    texts.append(chunk["choices"][0]["text"])
                    if result.ttft is None:
                        result.ttft = now - sent
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
        result.latency = (last or time.perf_counter()) - sent
    except Exception as err:   # a failed request is counted, not fatal
        result.error = f"{type(err).__name__}: {err}"
    finally:
        result.text = "".join(texts)
    return result


async def run_rate(base_url: str, model: str, prompts: list[Prompt], rate: float, seed: int = 0,
                   api_key: str | None = None, progress: bool = True, burstiness: float = 1.0,
                   max_concurrency: int | None = None, slo_ms: dict | None = None,
                   percentiles=(50, 90, 99), temperature: float | None = 0.0, arrivals=None) -> dict:
    """All prompts at one arrival rate; returns the summary and every request's timings.
    `arrivals`: their arrival times (s, one per prompt) instead of times drawn for the rate,
    e.g. another client's, so that both send the same load."""
    import asyncio

    import aiohttp
    from tqdm.auto import tqdm

    if arrivals is None:
        arrivals = arrival_times(len(prompts), rate, burstiness, seed)
    elif len(arrivals) != len(prompts):
        raise ValueError(f"{len(arrivals)} arrival times for {len(prompts)} prompts")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    in_flight = {"now": 0, "peak": 0}
    bar = tqdm(total=len(prompts), desc=f"rate {rate:g} req/s", disable=not progress)
    # aiohttp, as vLLM's benchmark: its C parser reads a stream's chunks at about half httpx's
    # CPU cost, and at H200 speed (256 streams, ~16k tokens/s) the client's own time decides
    # what it measures (`client_cpu_share` says how busy it was). No connection limit: a
    # client-side queue would add to TTFT what the server didn't cause.
    url = base_url.rstrip("/") + "/v1/completions"
    session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None),
                                    connector=aiohttp.TCPConnector(limit=0), read_bufsize=1 << 20)
    cpu = time.process_time()
    async with session as client:
        async def one(prompt, arrival):
            scheduled = start + arrival
            await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
            waits = slots is not None and slots.locked()
            if slots is not None:
                await slots.acquire()
            # times count from the arrival; from when a slot freed if it had to wait for one (vLLM's)
            sent = time.perf_counter() if waits else scheduled
            in_flight["now"] += 1
            in_flight["peak"] = max(in_flight["peak"], in_flight["now"])
            try:
                result = await send(client, url, model, prompt, arrival, sent, temperature)
            finally:
                in_flight["now"] -= 1
                if slots is not None:
                    slots.release()
            result.queued = sent - scheduled
            bar.update(1)
            return result

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p, a) for p, a in zip(prompts, arrivals)))
        duration = time.perf_counter() - start
    cpu = time.process_time() - cpu
    bar.close()
    summary = summarize(results, duration, slo_ms, percentiles)
    summary["max_concurrent_requests"] = in_flight["peak"]
    # the client process's CPU seconds per second of the run: near 1, the client (one event
    # loop) set the pace and the numbers understate the server
    summary["client_cpu_share"] = cpu / duration if duration > 0 else 0.0
    return {"rate": rate, "burstiness": burstiness, "max_concurrency": max_concurrency, **summary,
            "requests": [asdict(r) | {"tpot": r.tpot} for r in results]}


def run(base_url: str, rates: list[float], prompts: list[Prompt], model: str | None = None,
        api_key: str | None = None, seed: int = 0, progress: bool = True, burstiness: float = 1.0,
        max_concurrency: int | None = None, slo_ms: dict | None = None, percentiles=(50, 90, 99),
        temperature: float | None = 0.0, arrivals=None) -> dict:
    """A sweep over `rates` (one warm-up request first); returns the plot-ready results.
    Works from a script and from a notebook cell alike. Requests are greedy unless
    `temperature` says otherwise (None: sent without one, as GuideLLM sends them).
    `arrivals`: with one rate, the prompts' arrival times instead of drawn ones (run_rate)."""
    import httpx

    if arrivals is not None and len(rates) != 1:
        raise ValueError(f"arrival times are one rate's: give one rate, not {len(rates)}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be a positive number of requests, got {max_concurrency}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base_url, headers=headers, timeout=600) as client:
        models = client.get("/v1/models")
        models.raise_for_status()
        model = model or models.json()["data"][0]["id"]
        warm_up = client.post("/v1/completions", json={"model": model, "prompt": prompts[0].text, "max_tokens": 4})
        warm_up.raise_for_status()
    results = [_run_coroutine(run_rate(base_url, model, for_rate(prompts, i), rate, seed, api_key, progress,
                                       burstiness, max_concurrency, slo_ms, percentiles, temperature, arrivals))
               for i, rate in enumerate(rates)]
    return {"base_url": base_url, "model": model, "num_prompts": len(prompts), "seed": seed,
            "burstiness": burstiness, "max_concurrency": max_concurrency, "slo_ms": slo_ms,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": results}


def _run_coroutine(coroutine):
    """asyncio.run, also where an event loop is already running in this thread (Jupyter):
    then the coroutine gets its own loop in a worker thread."""
    import asyncio
    import concurrent.futures

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


# ---- `llmlab bench serving` --------------------------------------------------------------
def parse_rates(values: list[str]) -> list[float]:
    try:
        rates = [float(x) for value in values for x in value.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(not rate > 0 for rate in rates):
        raise ValueError(f"--rate must be positive numbers or inf, got {values}")
    return rates


def add_arguments(parser) -> None:
    from llmlab.cli_flags import positive_int

    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", default=os.environ.get("LLMLAB_API_KEY"))
    parser.add_argument("--rate", "--request-rate", dest="rate", action="append", default=None,
                        help="requests/s; repeat or comma-separate for a sweep; inf = all at once")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="shape of the gamma-distributed gaps between arrivals (vLLM's): 1.0 = Poisson, "
                             "< 1 burstier, > 1 more even; the gaps' cv is 1/sqrt(burstiness)")
    parser.add_argument("--max-concurrency", type=positive_int, default=None,
                        help="at most this many requests in flight; the others wait on the client, and their "
                             "times start when they are sent (as vLLM's)")
    parser.add_argument("--goodput", "--slo", dest="slo", nargs="+", default=None, metavar="KEY:MS",
                        help="SLO for goodput, e.g. ttft:300 tpot:50 (or ttft:300,tpot:50); keys ttft, tpot, e2el")
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                        help="metrics whose percentiles vLLM's block prints: ttft, tpot, itl, e2el")
    parser.add_argument("--metric-percentiles", default="99", help="percentiles to print, e.g. 50,90,99")
    parser.add_argument("--num-prompts", type=positive_int, default=100)
    parser.add_argument("--dataset", default=None, help='JSONL: {"prompt": str, "output_len": int (optional)}')
    add_synthetic_arguments(parser)   # (prompts.py: bench offline --dataset serving-synthetic has them too)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results (every request's timings too) as JSON")


def main(args) -> None:
    rates = parse_rates(args.rate or ["inf"])
    slo_ms = parse_slo(args.slo)
    if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        raise ValueError(f"--burstiness must be a positive number (1.0: Poisson), got {args.burstiness}")
    percentile_metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = set(percentile_metrics) - {key for key, *_ in VLLM_METRICS}
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        percentiles = []
    if unknown or not percentiles or not all(0 < p < 100 for p in percentiles):
        raise ValueError(f"--percentile-metrics takes ttft, tpot, itl, e2el and --metric-percentiles numbers in "
                         f"(0, 100), got {args.percentile_metrics!r}, {args.metric_percentiles!r}")
    if args.dataset:
        prompts = jsonl_prompts(args.dataset, args.num_prompts, args.seed, args.mean_output_len, args.max_output_len)
    else:
        prompts = synthetic_prompts_of(args, args.num_prompts, args.seed)
    report = run(args.base_url, rates, prompts, args.model, args.api_key, args.seed, burstiness=args.burstiness,
                 max_concurrency=args.max_concurrency, slo_ms=slo_ms or None, percentiles=percentiles)
    for result in report["results"]:
        print(traffic_lines(result["rate"], args.burstiness, args.max_concurrency))
        print(format_result(result, percentile_metrics, percentiles))
    print(format_table(report))
    if args.out:
        write_json(args.out, report)
        print(f"wrote {args.out}")
