"""A batch of prompts in one request against the same prompts as concurrent requests (issue #40).

    llmlab bench prompt-batch [--batch 8 --prompt-tokens 128 --max-tokens 1 --repeats 10]
                              [--plain] [--base-url URL] [--out F]

Evaluation harnesses send many prompts per /v1/completions request: lm-eval's
`local-completions` sends 8 token-id prompts (--batch_size 8) with `echo`, `logprobs: 1`,
`max_tokens: 1` and temperature 0 to score them. The server answers them together, so the
batch should cost no more than the same prompts sent as --batch concurrent one-prompt
requests. This measures both on one server (started here, embedded model, unless --base-url
names one): each repeat sends one batched request and --batch concurrent requests, in
alternating order (so a drift of the machine's speed weighs on both alike), every time with
fresh random token ids (the prefix cache never serves one from another), and prints the
median wall time of each, from sending to the last answer, and their ratio. --plain drops
`echo` and `logprobs` (a batch of plain completions).
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time

from llmlab.bench.common import served, write_json

# token ids drawn for the prompts: past the special and byte tokens of the usual vocabularies
# (SmolLM2's 49152, Llama-3's 128256), inside every one of them
TOKEN_IDS = range(1000, 30000)


def add_arguments(parser) -> None:
    from llmlab.cli_flags import positive_int

    parser.add_argument("--base-url", default=None, help="a running server (default: start `llmlab serve` here)")
    parser.add_argument("--serve-args", default="", help='flags for the server started here, e.g. "--max-num-seqs 16"')
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--batch", type=positive_int, default=8, help="prompts per batched request")
    parser.add_argument("--prompt-tokens", type=positive_int, default=128)
    parser.add_argument("--max-tokens", type=positive_int, default=1)
    parser.add_argument("--repeats", type=positive_int, default=10)
    parser.add_argument("--plain", action="store_true", help="without echo and logprobs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write every repeat's times as JSON")


def body(args, model: str, prompt) -> dict:
    """A /v1/completions request in lm-eval's shape (`prompt`: token ids, or a list of them)."""
    fields = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0, "seed": args.seed}
    if not args.plain:
        fields.update(echo=True, logprobs=1)
    return fields


async def timed(client, requests: list[dict]) -> float:
    """Seconds from sending every request at once to the last answer; each must answer 200
    with a choice per prompt."""
    async def one(payload):
        response = await client.post("/v1/completions", json=payload)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        prompts = payload["prompt"] if isinstance(payload["prompt"][0], list) else [payload["prompt"]]
        if len(response.json()["choices"]) != len(prompts):
            raise RuntimeError(f"{len(prompts)} prompts got {len(response.json()['choices'])} choices")

    start = time.perf_counter()
    await asyncio.gather(*(one(payload) for payload in requests))
    return time.perf_counter() - start


async def measure(args, url: str, model: str) -> dict:
    import httpx

    rng = random.Random(args.seed)

    def prompts():
        return [[rng.choice(TOKEN_IDS) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]

    times = {"batched": [], "concurrent": []}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        await timed(client, [body(args, model, prompts())])      # warm-up, not counted
        for repeat in range(args.repeats):
            order = ["batched", "concurrent"] if repeat % 2 == 0 else ["concurrent", "batched"]
            for mode in order:
                batch = prompts()
                requests = [body(args, model, batch)] if mode == "batched" else [body(args, model, p) for p in batch]
                times[mode].append(await timed(client, requests))
    return times


def main(args) -> dict:
    import httpx

    from llmlab.machine import machine_info

    with served(args.base_url, args.serve_args) as url:
        model = args.model or httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
        times = asyncio.run(measure(args, url, model))
    medians = {mode: statistics.median(values) for mode, values in times.items()}
    shape = "plain" if args.plain else "echo + logprobs 1"
    print(f"{args.batch} prompts of {args.prompt_tokens} token ids, max_tokens {args.max_tokens}, {shape}; "
          f"median of {args.repeats} repeats (alternating order):")
    for mode, label in (("batched", "one request of all the prompts"), ("concurrent", "one request per prompt, concurrent")):
        print(f"  {label:<36} {medians[mode] * 1000:9.1f} ms   "
              f"(each repeat: {', '.join(f'{t * 1000:.0f}' for t in times[mode])})")
    print(f"  batched / concurrent: {medians['batched'] / medians['concurrent']:.3f}")
    report = {"model": model, "batch": args.batch, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
              "echo_logprobs": not args.plain, "repeats": args.repeats, "seconds": times,
              "median_s": medians, "ratio": medians["batched"] / medians["concurrent"], "machine": machine_info()}
    write_json(args.out, report)
    return report
