"""head-of-line blocking: a short request's time to first token while a long prompt is prefilled.

    llmlab bench head-of-line [--long-len 7000] [--short-len 4] [--url URL] [engine flags] [--out F]
    llmlab bench head-of-line --big-prompt-kb 900 [--url URL]
    llmlab bench head-of-line --flood-clients 4,12,16 [--flood-kb 1000] [--samples 20] [--url URL] [--out F]

Through the OpenAI server (its own, in this process, unless --url names one): first the
short request alone, then a long prompt (random token ids), and once the long prompt is
running the short request again. With chunked prefill the short one shares the long one's
steps only if the scheduler leaves it room; otherwise it waits for the whole prefill.

With --big-prompt-kb: instead, the longest gap between a running stream's tokens while a
prompt of that many KB of text is sent (and refused: it is longer than the context), i.e.
whether tokenizing it stalls the engine.

With --flood-clients N,M,...: instead, a tiny request's latency (p50 / p90 / max of
--samples, against its idle p50) while N clients, then M, ... keep sending prompts of
--flood-kb thousand bytes (refused: longer than the context), the flood's answers, and
whether /health answered during it (issue #37; flood.py, which also says why this mode
starts an `llmlab serve` process rather than a server in this process).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from llmlab.bench.common import write_json
from llmlab.cli_flags import positive_int
from llmlab.machine import cpu_name


def client_counts(text: str) -> list[int]:
    """--flood-clients: "4,12,16" -> [4, 12, 16], each at least 1."""
    try:
        return [positive_int(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected client counts such as 4,12,16, got {text!r}") from None


def add_arguments(parser) -> None:
    from llmlab.cli_flags import add_engine_arguments

    parser.add_argument("--url", default=None, help="a running server (default: start one here)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--long-len", type=int, default=7000, help="prompt tokens of the long request")
    parser.add_argument("--short-len", type=int, default=4, help="prompt tokens of the short request")
    parser.add_argument("--short-output-len", type=int, default=4)
    parser.add_argument("--send-at", type=float, default=0.5,
                        help="send the short request once this share of the long prompt is in the KV cache "
                             "(early: it waits longest behind a whole-prompt scheduler; late: the long "
                             "prompt's steps cost the most)")
    parser.add_argument("--big-prompt-kb", type=int, default=0,
                        help="measure the stall a text prompt of this size causes instead (0 = off)")
    parser.add_argument("--flood-clients", type=client_counts, default=None,
                        help="measure a tiny request while this many clients (comma-separated: one run "
                             "each) send huge prompts back to back instead")
    parser.add_argument("--flood-kb", type=positive_int, default=1000,
                        help="the flood's prompts, in thousands of bytes (default 1000: the issue's "
                             "1,000,031-byte bodies; the server takes bodies up to 1 MiB)")
    parser.add_argument("--samples", type=positive_int, default=20,
                        help="tiny requests timed idle and under each flood (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    add_engine_arguments(parser, exclude=("seed",))


async def first_token_seconds(client, prompt: list[int], max_tokens: int) -> float:
    """Seconds from sending a streaming completion to its first token (then reads to the end)."""
    payload = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True}
    start, first = time.perf_counter(), None
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {") and '"text":"' in line and '"text":""' not in line:
                first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


async def measure(url: str, api_key: str | None, args, vocab_size: int) -> dict:
    import httpx

    rng = random.Random(args.seed)

    def prompt(n):
        return [rng.randint(16, vocab_size - 1) for _ in range(n)]

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=3600) as client:
        await first_token_seconds(client, prompt(8), 2)    # warm-up
        alone = await first_token_seconds(client, prompt(args.short_len), args.short_output_len)
        long_task = asyncio.ensure_future(first_token_seconds(client, prompt(args.long_len), 1))
        long_start = time.perf_counter()
        # the long prompt's progress, from the KV blocks it holds; a prompt prefilled in one
        # step may finish (and free them) before any poll sees them
        while not long_task.done():
            stats = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                     for line in (await client.get("/metrics")).text.splitlines() if line and line[0] != "#"}
            used = stats.get('llmlab_kv_blocks_used{location="device"}', 0)
            if used * (args.block_size or 16) >= args.send_at * args.long_len:
                break
            await asyncio.sleep(0.02)
        long_done_first = long_task.done()
        sent_after = time.perf_counter() - long_start
        behind = await first_token_seconds(client, prompt(args.short_len), args.short_output_len)
        long_ttft = await long_task
    return {"long_len": args.long_len, "short_len": args.short_len, "short_ttft_alone_s": alone,
            "short_ttft_behind_long_s": behind, "short_sent_at": args.send_at, "short_sent_after_s": sent_after,
            "long_ttft_s": long_ttft,
            # True: the long prompt was done before the short one went out (it fit in one step,
            # or ran faster than the polls), so "behind_long" measured nothing behind it
            "long_done_before_short_sent": long_done_first}


async def tokenization_stall(url: str, api_key: str | None, args) -> dict:
    """Token gaps of a running stream before and while a big text prompt is tokenized."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    big = "All work and no play makes Jack a dull boy. " * (args.big_prompt_kb * 1024 // 44)
    arrivals, sent = [], {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=3600) as client:
        async def stream():
            payload = {"prompt": [16, 17, 18, 19], "max_tokens": 400, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=payload) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.perf_counter())

        task = asyncio.ensure_future(stream())
        while len(arrivals) < 50:
            await asyncio.sleep(0.01)
        sent["start"] = time.perf_counter()
        refused = await client.post("/v1/completions", json={"prompt": big, "max_tokens": 1})
        sent["end"] = time.perf_counter()
        await task
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= sent["start"] and a <= sent["end"]]
    before = sorted(gaps[:40])
    return {"big_prompt_bytes": len(big), "big_prompt_status": refused.status_code,
            "big_prompt_seconds": sent["end"] - sent["start"], "median_gap_before_s": before[len(before) // 2],
            "max_gap_before_s": max(before), "max_gap_while_tokenizing_s": max(during, default=0.0)}


def main(args) -> dict:
    import os
    import socket
    import threading

    import uvicorn

    from llmlab.cli_flags import engine_kwargs
    from llmlab.config import EngineConfig

    if args.flood_clients and args.big_prompt_kb:
        raise ValueError("--flood-clients and --big-prompt-kb are two measurements: give one")
    if args.flood_clients:
        from llmlab.bench import flood

        return flood.main(args)

    def run(url, api_key, vocab_size):
        if args.big_prompt_kb:
            return asyncio.run(tokenization_stall(url, api_key, args))
        return asyncio.run(measure(url, api_key, args, vocab_size))

    if args.url:
        result = run(args.url, args.api_key, vocab_size=1000)
    else:
        from llmlab.engine.engine import LLMEngine
        from llmlab.server.app import create_app
        config = EngineConfig(**engine_kwargs(args))
        engine = LLMEngine(config)
        app = create_app(engine)
        with socket.socket() as probe:    # a free port on the loopback interface
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        try:
            result = run(f"http://127.0.0.1:{port}", None, engine.model_config.vocab_size)
        finally:
            server.should_exit = True
            thread.join()
        result.update(device=engine.device.type, backend=engine.backend, dtype=str(engine.dtype),
                      max_num_batched_tokens=engine.config.max_num_batched_tokens,
                      config={k: v for k, v in engine_kwargs(args).items()})
    result.update(cpu=cpu_name(), load_average=os.getloadavg())
    print(json.dumps(result, indent=2))
    write_json(args.out, result, indent=2)
    return result
