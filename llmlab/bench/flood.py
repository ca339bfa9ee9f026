"""A flood of huge prompts beside a tiny request (issue #37): `llmlab bench head-of-line
--flood-clients`, and the flood that tests/server/test_tokenize_flood.py sends.

    llmlab bench head-of-line --flood-clients 4,12,16 [--flood-kb 1000] [--samples 20] [--url URL] [--out F]

A tiny request (/v1/completions, prompt "Hi", `max_tokens` 1, a new connection each time)
is timed on the idle server, then again while N clients each send ~1 MB prompts back to
back. Such a prompt cannot fit in the context, so the server refuses it with a 400
(`context_length_exceeded`); what is measured is whether the refusals delay everyone else.
Before the fix each prompt was tokenized whole on one tokenizer thread, and the tiny
request's median was 3.1 / 9.4 / 13.8 s under 4 / 12 / 16 clients (0.07-0.25 s idle).

The server is an `llmlab serve` process started here (common.py's `served`, with the
engine flags given) unless --url names one: the issue measured `llmlab serve`, and in this
process the flood's client threads would share the server's GIL.
"""
from __future__ import annotations

import collections
import json
import math
import os
import shlex
import statistics
import threading
import time

from llmlab.bench.common import served, write_json

TINY_REQUEST = {"prompt": "Hi", "max_tokens": 1}
FLOOD_TEXT = "hello world "          # ~2 tokens per 12 characters: a 1 MB prompt is ~167k tokens
# seconds a flood client or the tiny request waits for an answer: before the fix a tiny
# request under 16 clients took 13.8 s at the median, so this only catches a hung server
ANSWER_TIMEOUT_S = 600
# seconds for every flood client to get its first answer (the flood is then in full swing)
FLOOD_START_TIMEOUT_S = 120


def flood_prompt(num_bytes: int) -> str:
    """`num_bytes` characters (ASCII: bytes) of plain English-like text."""
    return (FLOOD_TEXT * (num_bytes // len(FLOOD_TEXT) + 1))[:num_bytes]


def completion_body(prompt: str) -> bytes:
    """A /v1/completions body for `prompt`, one new token. A 1,000,000-byte prompt makes the
    issue's 1,000,031-byte body."""
    return json.dumps({"prompt": prompt, "max_tokens": 1}).encode()


def tiny_request_seconds(url: str, headers: dict | None = None) -> float:
    """Seconds from sending the tiny request (on a new connection) to its whole answer; a
    RuntimeError if the answer is not a 200."""
    import httpx

    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=TINY_REQUEST, headers=headers, timeout=ANSWER_TIMEOUT_S)
    if response.status_code != 200:
        raise RuntimeError(f"the tiny request got HTTP {response.status_code}: {response.text[:300]}")
    return time.perf_counter() - start


class Flood:
    """`clients` threads, each posting `body` to /v1/completions back to back on a
    connection of its own until the `with` block ends. Entering returns once every client
    has had an answer (the flood is in full swing). `statuses` holds each answer's HTTP
    status (or the name of the exception a request raised), `errors` its OpenAI error
    object (None when there was none), in the same order."""

    def __init__(self, url: str, body: bytes, clients: int, headers: dict | None = None):
        self.url, self.body = url, body
        self.headers = {**(headers or {}), "Content-Type": "application/json"}
        self.statuses: list[int | str] = []
        self.errors: list[dict | None] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.client, daemon=True) for _ in range(clients)]
        self.started_at = self.stopped_at = 0.0

    def client(self) -> None:
        import httpx

        with httpx.Client(timeout=ANSWER_TIMEOUT_S) as client:
            while not self.stopping.is_set():
                try:
                    response = client.post(f"{self.url}/v1/completions", content=self.body, headers=self.headers)
                except httpx.HTTPError as err:     # counted, and the client goes on flooding
                    self.statuses.append(type(err).__name__)
                    self.errors.append(None)
                    continue
                try:
                    error = response.json().get("error")
                except ValueError:                 # not JSON (a proxy's page, say)
                    error = None
                self.statuses.append(response.status_code)
                self.errors.append(error)

    def __enter__(self) -> Flood:
        self.started_at = time.perf_counter()
        for thread in self.threads:
            thread.start()
        deadline = time.monotonic() + FLOOD_START_TIMEOUT_S
        while len(self.statuses) < len(self.threads):
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"the flood's {len(self.threads)} clients had {len(self.statuses)} answers "
                                   f"after {FLOOD_START_TIMEOUT_S} s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=ANSWER_TIMEOUT_S)
        self.stopped_at = time.perf_counter()

    def status_counts(self) -> dict[str, int]:
        """How many answers of each kind: {"400 context_length_exceeded": 812, ...}."""
        kinds = (f"{status} {error['code']}" if isinstance(error, dict) and error.get("code") else str(status)
                 for status, error in zip(self.statuses, self.errors))
        return dict(collections.Counter(kinds).most_common())


def latencies(seconds: list[float]) -> dict:
    """p50 (the median), p90 (nearest rank: with few samples, close to the max) and max."""
    ranked = sorted(seconds)
    return {"p50_s": statistics.median(ranked), "p90_s": ranked[math.ceil(0.9 * len(ranked)) - 1],
            "max_s": ranked[-1], "seconds": seconds}


def health(url: str, headers: dict | None = None) -> dict:
    """Whether /health answered, with what and how fast."""
    import httpx

    start = time.perf_counter()
    try:
        status = httpx.get(f"{url}/health", headers=headers, timeout=60).status_code
    except httpx.HTTPError as err:
        return {"status": None, "error": type(err).__name__, "seconds": time.perf_counter() - start}
    return {"status": status, "seconds": time.perf_counter() - start}


def measure(url: str, clients: list[int], samples: int, prompt_bytes: int, headers: dict | None = None) -> dict:
    """The tiny request's latencies alone, then under a flood of each size in `clients`."""
    body = completion_body(flood_prompt(prompt_bytes))
    tiny_request_seconds(url, headers)        # warm-up: the first request pays for imports and buffers
    idle = latencies([tiny_request_seconds(url, headers) for _ in range(samples)])
    settings = []
    for count in clients:
        with Flood(url, body, count, headers) as flood:
            busy = latencies([tiny_request_seconds(url, headers) for _ in range(samples)])
            answered = health(url, headers)
        settings.append({"clients": count, **busy, "ratio_to_idle_p50": busy["p50_s"] / idle["p50_s"],
                         "flood_requests": len(flood.statuses), "flood_seconds": flood.stopped_at - flood.started_at,
                         "flood_statuses": flood.status_counts(), "health": answered,
                         "load_average_1m": os.getloadavg()[0]})
    return {"tiny_request": TINY_REQUEST, "flood_body_bytes": len(body), "samples": samples, "idle": idle,
            "settings": settings}


def format_table(result: dict) -> str:
    """The result as the lines the command prints."""
    idle = result["idle"]
    lines = [f"tiny request ({json.dumps(result['tiny_request'])}) while N clients send "
             f"{result['flood_body_bytes']:,}-byte prompts back to back; {result['samples']} samples each",
             f"server: {result['server']}", result["machine_note"],
             f"idle: p50 {idle['p50_s']:.3f} s, p90 {idle['p90_s']:.3f} s, max {idle['max_s']:.3f} s",
             f"{'clients':>7} | {'p50 s':>7} {'p90 s':>7} {'max s':>7} | {'p50/idle':>8} | {'flood requests':>16} | "
             f"{'load':>5} | {'/health':<13} | answers"]
    for row in result["settings"]:
        answered = row["health"]
        health_cell = (f"{answered['status']} in {answered['seconds']:.2f} s" if answered["status"] is not None
                       else answered["error"])
        rate = row["flood_requests"] / row["flood_seconds"] if row["flood_seconds"] else 0.0
        answers = ", ".join(f"{kind}: {n}" for kind, n in row["flood_statuses"].items())
        lines.append(f"{row['clients']:>7} | {row['p50_s']:>7.3f} {row['p90_s']:>7.3f} {row['max_s']:>7.3f} | "
                     f"{row['ratio_to_idle_p50']:>7.1f}x | {row['flood_requests']:>6} ({rate:>5.1f}/s) | "
                     f"{row['load_average_1m']:>5.1f} | {health_cell:<13} | {answers}")
    return "\n".join(lines)


def main(args) -> dict:
    """head-of-line's flood mode: measure, print the table, write --out."""
    from llmlab.cli_flags import engine_argv
    from llmlab.machine import machine_info, machine_note

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    serve_args = shlex.join(engine_argv(args))
    info = machine_info()          # before the flood adds its own load
    with served(args.url, serve_args) as url:
        result = measure(url, args.flood_clients, args.samples, args.flood_kb * 1000, headers)
    result = {"server": args.url or f"llmlab serve {serve_args}".strip(), **result, "machine": info,
              "machine_note": machine_note(info)}
    print(format_table(result))
    write_json(args.out, result, indent=2)
    return result
