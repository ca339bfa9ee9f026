"""What `llmlab bench serving` reports: per-rate statistics, goodput under an SLO, and the two
printouts (vLLM's "Serving Benchmark Result" block for one rate, a table for a sweep).

Times are in milliseconds, as vLLM's benchmark_serving reports them. A request meets an SLO
({"ttft": ms, "tpot": ms, "e2el": ms}, any of them) if it is within every limit; a request of
one token has no TPOT and meets any TPOT limit (vLLM counts its TPOT as 0). Goodput is the
rate of requests that met it over the run (DistServe §2).
"""
from __future__ import annotations

import math

def summarize(results: list, duration: float, slo_ms: dict | None = None,
              percentiles=(50, 90, 99)) -> dict:
    """Of `results` (serving.RequestResult): throughputs and per-metric statistics in
    milliseconds (mean, std, median and the percentiles asked, keyed "p50", "p90", ...);
    with `slo_ms` ({"ttft": ms, "tpot": ms, "e2el": ms}, any of them) also the goodput and
    the fraction of requests that met it."""
    import numpy as np

    ok = [r for r in results if r.error is None]
    quantiles = sorted({50, 90, 99, *percentiles})

    def stats(values) -> dict:   # milliseconds
        values = np.array([v for v in values if v is not None]) * 1000
        if not len(values):
            return {}
        return {"mean": float(values.mean()), "std": float(values.std()), "median": float(np.median(values)),
                **{f"p{q:g}": float(np.percentile(values, q)) for q in quantiles}}

    output_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "total_input_tokens": sum(r.prompt_tokens for r in ok), "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "mean_prompt_tokens": float(np.mean([r.prompt_tokens for r in ok])) if ok else 0.0,
        "mean_output_tokens": output_tokens / len(ok) if ok else 0.0,
        "ttft_ms": stats(r.ttft for r in ok), "tpot_ms": stats(r.tpot for r in ok),
        "itl_ms": stats(x for r in ok for x in r.itl), "e2e_ms": stats(r.latency for r in ok),
    }
    if slo_ms:
        good = sum(meets_slo(r, slo_ms) for r in ok)
        summary.update(slo_ms=dict(slo_ms), request_goodput=good / duration,
                       slo_attainment=good / len(results) if results else float("nan"))
    return summary


def meets_slo(result, slo_ms: dict) -> bool:
    """Within every limit of `slo_ms`; a request of one token has no TPOT and meets any TPOT limit."""
    values = {"ttft": result.ttft, "tpot": result.tpot if result.tpot is not None else 0.0, "e2el": result.latency}
    return all(values[key] is not None and values[key] <= limit / 1000 for key, limit in slo_ms.items())


def _cells(stats: dict, scale: float = 1.0, digits: int = 0) -> str:
    return "/".join(f"{stats[k] * scale:.{digits}f}" for k in ("mean", "p50", "p90", "p99")) if stats else "-"


def format_table(report: dict) -> str:
    lines = [f"{report['model']} at {report['base_url']}, {report['num_prompts']} prompts per rate",
             f"{'rate':>6} {'ok':>4} {'req/s':>6} {'out tok/s':>9} | "
             f"{'TTFT ms mean/p50/p90/p99':>26} | {'TPOT ms mean/p50/p90/p99':>26} | {'E2E s mean/p50/p90/p99':>24}"]
    for r in report["results"]:
        lines.append(f"{r['rate']:>6g} {r['completed']:>4} {r['request_throughput']:>6.2f} {r['output_throughput']:>9.1f} | "
                     f"{_cells(r['ttft_ms']):>26} | {_cells(r['tpot_ms']):>26} | {_cells(r['e2e_ms'], 1e-3, 1):>24}")
        if r["failed"]:
            lines.append(f"       {r['failed']} failed, e.g. {r['errors'][0]}")
    return "\n".join(lines)


VLLM_METRICS = (("ttft", "ttft_ms", "TTFT", "Time to First Token"),
                ("tpot", "tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
                ("itl", "itl_ms", "ITL", "Inter-token Latency"),
                ("e2el", "e2e_ms", "E2EL", "End-to-end Latency"))


def format_result(result: dict, percentile_metrics=("ttft", "tpot", "itl"), percentiles=(99,)) -> str:
    """One rate's result as vLLM's benchmark_serving prints it ("Serving Benchmark Result")."""
    label = "{:<40} {:<10}"
    number = "{:<40} {:<10.2f}"
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             label.format("Successful requests:", result["completed"]),
             label.format("Failed requests:", result["failed"])]
    if result.get("max_concurrency") is not None:
        lines.append(label.format("Maximum request concurrency:", result["max_concurrency"]))
    if math.isfinite(result["rate"]):
        lines.append(number.format("Request rate configured (RPS):", result["rate"]))
    lines += [number.format("Benchmark duration (s):", result["duration_s"]),
              label.format("Total input tokens:", result["total_input_tokens"]),
              label.format("Total generated tokens:", result["total_output_tokens"]),
              number.format("Request throughput (req/s):", result["request_throughput"])]
    if "request_goodput" in result:
        lines.append(number.format("Request goodput (req/s):", result["request_goodput"]))
    lines += [number.format("Output token throughput (tok/s):", result["output_throughput"]),
              number.format("Total Token throughput (tok/s):", result["total_token_throughput"])]
    if "max_concurrent_requests" in result:
        lines.append(label.format("Peak concurrent requests:", result["max_concurrent_requests"]))
    if "client_cpu_share" in result:    # llmlab's: how busy the client itself was
        busy = "  (the client set the pace)" if result["client_cpu_share"] > 0.8 else ""
        lines.append(number.format("Client CPU share:", result["client_cpu_share"]) + busy)
    for key, field_name, name, header in VLLM_METRICS:
        stats = result.get(field_name)
        if key not in percentile_metrics or not stats:
            continue
        lines += ["{s:{c}^{n}}".format(s=header, n=50, c="-"),
                  number.format(f"Mean {name} (ms):", stats["mean"]),
                  number.format(f"Median {name} (ms):", stats["median"])]
        lines += [number.format(f"P{q:g} {name} (ms):", stats[f"p{q:g}"]) for q in percentiles]
    lines.append("=" * 50)
    return "\n".join(lines)


def traffic_lines(rate: float, burstiness: float, max_concurrency: int | None) -> str:
    """What vLLM prints before it sends a rate's requests."""
    distribution = "Poisson process" if burstiness == 1.0 else "Gamma distribution"
    return (f"Traffic request rate: {rate}\nBurstiness factor: {burstiness} ({distribution})\n"
            f"Maximum request concurrency: {max_concurrency}")


def parse_slo(values: list[str] | None) -> dict[str, float]:
    """--goodput / --slo: KEY:MILLISECONDS pairs, space- or comma-separated, keys ttft, tpot and
    e2el (vLLM's names; e2e is taken for e2el)."""
    slo = {}
    for value in values or []:
        for pair in value.replace(",", " ").split():
            key, _, milliseconds = pair.partition(":")
            key = "e2el" if key == "e2e" else key
            try:
                limit = float(milliseconds)
            except ValueError:
                raise ValueError(f"--goodput {pair!r}: write KEY:MILLISECONDS, e.g. ttft:300 tpot:50") from None
            if key not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"--goodput {pair!r}: the keys are ttft, tpot, e2el")
            if not limit >= 0:
                raise ValueError(f"--goodput {pair!r}: a limit is a non-negative number of milliseconds")
            slo[key] = limit
    return slo
