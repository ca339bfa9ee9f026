"""A workload: requests with arrival times, prompts and output lengths, to run or simulate.

Arrivals (seconds from the start of the experiment):
  * Poisson: independent exponential gaps of mean 1/rate (the vLLM / SwiftLLM benchmarks);
  * gamma: gaps drawn from a gamma distribution with the same mean and a coefficient of
    variation `cv` (cv = 1 is Poisson, cv > 1 is burstier: AlpaServe §6, DistServe §6);
  * offline: everything at t = 0 (a batch job, nano-vllm's throughput benchmark);
  * shared prefix: groups of requests that start with the same tokens (a system prompt,
    few-shot examples), to exercise prefix caching.

Lengths are given as an int (fixed), a (low, high) pair (uniform, inclusive), or a list of
lengths to draw from (an empirical distribution, e.g. `read_lengths("sharegpt.jsonl")`).
Two constructors draw lengths their own way, as the benchmarks that measure with them do:
`lognormal` (vLLM's synthetic ShareGPT-like lengths, `llmlab bench serving`) and
`throughput` (nano-vllm's offline benchmark, `llmlab bench offline`).
Prompts are random token ids (what a scheduler sees is only lengths and shared prefixes);
ids start at 16 to stay clear of special tokens. Everything is seeded: the same arguments
give the same workload. `save_jsonl` / `from_jsonl` round-trip a workload exactly.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field, replace

import numpy as np

FIRST_TOKEN_ID = 16     # ids below this are often special tokens (bos, eos, pad, ...)
# mean prompt and output lengths of ShareGPT conversations, in tokens (vLLM paper §6)
SHAREGPT_MEAN_PROMPT_LEN = 161
SHAREGPT_MEAN_OUTPUT_LEN = 338


@dataclass
class WorkloadRequest:
    request_id: str
    arrival_time: float              # seconds from the start of the experiment
    prompt_token_ids: list[int]
    output_len: int                  # tokens to generate (EOS is ignored, as in vLLM's benchmarks)
    priority: int = 0                # for policy="priority": lower = more important (vLLM's convention)
    prompt: str | None = None        # the text, when the prompt came from one


@dataclass
class Workload:
    requests: list[WorkloadRequest] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):
        return iter(self.requests)

    @property
    def duration(self) -> float:
        """Seconds from the first arrival to the last."""
        return self.requests[-1].arrival_time - self.requests[0].arrival_time if self.requests else 0.0

    @property
    def rate(self) -> float:
        """Measured arrival rate (requests per second); inf for an offline workload."""
        return (len(self) - 1) / self.duration if self.duration > 0 else math.inf

    def check(self) -> None:
        """Raise ValueError if this workload cannot be run."""
        if not self.requests:
            raise ValueError("the workload is empty: give it at least one request")
        for r in self.requests:
            if not r.prompt_token_ids or r.output_len < 1 or r.arrival_time < 0 or math.isnan(r.arrival_time):
                raise ValueError(f"request {r.request_id!r}: needs a non-empty prompt, output_len >= 1 "
                                 f"and an arrival time >= 0")
        if len({r.request_id for r in self.requests}) != len(self.requests):
            raise ValueError("request ids in a workload must be unique")

    def with_priorities(self, priorities) -> "Workload":
        """A copy with request i given priorities[i] (lower = more important)."""
        priorities = list(priorities)
        if len(priorities) != len(self):
            raise ValueError(f"got {len(priorities)} priorities for {len(self)} requests")
        return Workload([replace(r, priority=int(p)) for r, p in zip(self.requests, priorities)])

    # ---- generators --------------------------------------------------------------------
    @classmethod
    def poisson(cls, num_requests: int, rate: float, prompt_len=128, output_len=64, seed: int = 0,
                vocab_size: int = 32000) -> "Workload":
        """Poisson arrivals at `rate` requests per second (inf = all at once)."""
        return cls.gamma(num_requests, rate, 1.0, prompt_len, output_len, seed, vocab_size)

    @classmethod
    def gamma(cls, num_requests: int, rate: float, cv: float = 2.0, prompt_len=128, output_len=64,
              seed: int = 0, vocab_size: int = 32000) -> "Workload":
        """Bursty arrivals: gamma-distributed gaps with mean 1/rate and coefficient of variation cv."""
        rng = np.random.default_rng(seed)
        arrivals = _arrivals(rng, num_requests, rate, cv)
        prompt_lens = _lengths(rng, num_requests, prompt_len, "prompt_len")
        output_lens = _lengths(rng, num_requests, output_len, "output_len")
        return cls([WorkloadRequest(str(i), float(t), _random_ids(rng, n, vocab_size), int(m))
                    for i, (t, n, m) in enumerate(zip(arrivals, prompt_lens, output_lens))])

    @classmethod
    def offline(cls, num_requests: int, prompt_len=128, output_len=64, seed: int = 0,
                vocab_size: int = 32000) -> "Workload":
        """Every request arrives at t = 0."""
        return cls.gamma(num_requests, math.inf, 1.0, prompt_len, output_len, seed, vocab_size)

    @classmethod
    def shared_prefix(cls, num_groups: int, requests_per_group: int, prefix_len: int, suffix_len=32,
                      output_len=64, rate: float = math.inf, seed: int = 0, vocab_size: int = 32000) -> "Workload":
        """`num_groups` prefixes of `prefix_len` tokens; each request is its group's prefix plus
        its own suffix. Groups are interleaved in random order, arrivals Poisson at `rate`."""
        if num_groups < 1 or requests_per_group < 1 or prefix_len < 1:
            raise ValueError("num_groups, requests_per_group and prefix_len must be >= 1")
        rng = np.random.default_rng(seed)
        num = num_groups * requests_per_group
        prefixes = [_random_ids(rng, prefix_len, vocab_size) for _ in range(num_groups)]
        groups = rng.permutation(np.repeat(np.arange(num_groups), requests_per_group))
        arrivals = _arrivals(rng, num, rate, 1.0)
        suffix_lens = _lengths(rng, num, suffix_len, "suffix_len", minimum=0)
        output_lens = _lengths(rng, num, output_len, "output_len")
        return cls([WorkloadRequest(str(i), float(t), prefixes[g] + _random_ids(rng, n, vocab_size), int(m))
                    for i, (t, g, n, m) in enumerate(zip(arrivals, groups, suffix_lens, output_lens))])

    @classmethod
    def lognormal(cls, num_requests: int, mean_prompt_len: float = SHAREGPT_MEAN_PROMPT_LEN,
                  mean_output_len: float = SHAREGPT_MEAN_OUTPUT_LEN, sigma: float = 1.0, max_prompt_len: int = 1024,
                  max_output_len: int = 1024, rate: float = math.inf, seed: int = 0,
                  vocab_size: int = 32000) -> "Workload":
        """Prompt and output lengths from lognormal distributions with the given means (before
        clipping to [4, max_prompt_len] and [1, max_output_len]): vLLM's synthetic stand-in
        for ShareGPT conversations. Arrivals Poisson at `rate`."""
        rng = np.random.default_rng(seed)
        arrivals = _arrivals(rng, num_requests, rate, 1.0)
        prompt_lens = lognormal_lengths(rng, num_requests, mean_prompt_len, sigma, 4, max_prompt_len)
        output_lens = lognormal_lengths(rng, num_requests, mean_output_len, sigma, 1, max_output_len)
        return cls([WorkloadRequest(str(i), float(t), _random_ids(rng, n, vocab_size), int(m))
                    for i, (t, n, m) in enumerate(zip(arrivals, prompt_lens, output_lens))])

    @classmethod
    def throughput(cls, num_requests: int, min_len: int = 100, max_len: int = 1024, prompt_len: int | None = None,
                   output_len: int | None = None, prefix_len: int = 0, num_prefixes: int = 1, seed: int = 0,
                   vocab_size: int = 32000) -> "Workload":
        """nano-vllm's throughput benchmark: every request at t = 0, prompt and output
        lengths each uniform in [min_len, max_len] unless fixed by prompt_len / output_len.
        With prefix_len, request i's prompt starts with shared prefix i % num_prefixes of
        that many tokens. Drawn with Python's `random`, not numpy as the others are: a seed
        gives the requests `llmlab bench offline` has always measured with."""
        if not (prompt_len and output_len) and not 0 < min_len <= max_len:
            raise ValueError(f"min_len {min_len} and max_len {max_len}: need 0 < min_len <= max_len")
        rng = random.Random(seed)
        prefixes = [[rng.randint(FIRST_TOKEN_ID, vocab_size - 1) for _ in range(prefix_len)]
                    for _ in range(num_prefixes if prefix_len else 0)]
        requests = []
        for i in range(num_requests):
            n_in = prompt_len or rng.randint(min_len, max_len)
            n_out = output_len or rng.randint(min_len, max_len)
            prefix = prefixes[i % len(prefixes)] if prefixes else []
            ids = prefix + [rng.randint(FIRST_TOKEN_ID, vocab_size - 1) for _ in range(n_in)]
            requests.append(WorkloadRequest(str(i), 0.0, ids, n_out))
        return cls(requests)

    # ---- files -----------------------------------------------------------------------------
    def save_jsonl(self, path) -> None:
        with open(path, "w") as f:
            for r in self.requests:
                f.write(json.dumps(asdict(r)) + "\n")

    @classmethod
    def from_jsonl(cls, path, tokenizer=None) -> "Workload":
        """One JSON object per line: output_len, and prompt_token_ids or prompt (text, needs a
        `tokenizer` with .encode) or prompt_len (random ids); optionally request_id,
        arrival_time (default 0: offline) and priority."""
        requests = []
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                ids = row.get("prompt_token_ids")
                if ids is None and row.get("prompt") is not None:
                    if tokenizer is None:
                        raise ValueError(f"{path}:{number}: a text prompt needs from_jsonl(path, tokenizer=...)")
                    ids = tokenizer.encode(row["prompt"])
                if ids is None and "prompt_len" in row:
                    ids = _random_ids(np.random.default_rng(number), int(row["prompt_len"]), 32000)
                if ids is None or "output_len" not in row:
                    raise ValueError(f"{path}:{number}: needs output_len and one of prompt_token_ids, "
                                     f"prompt, prompt_len")
                requests.append(WorkloadRequest(str(row.get("request_id", len(requests))),
                                                float(row.get("arrival_time", 0.0)), list(ids),
                                                int(row["output_len"]), int(row.get("priority", 0)),
                                                row.get("prompt")))
        requests.sort(key=lambda r: r.arrival_time)    # stable: equal times keep file order
        workload = cls(requests)
        workload.check()
        return workload


def read_lengths(path, key: str = "output_len") -> list[int]:
    """The `key` field of every line of a JSONL file, e.g. output lengths of a ShareGPT-style
    dump, to pass as a length distribution."""
    with open(path) as f:
        lengths = [int(json.loads(line)[key]) for line in f if line.strip()]
    if not lengths:
        raise ValueError(f"{path}: no lines with {key!r}")
    return lengths


def lognormal_lengths(rng, n: int, mean: float, sigma: float, low: int, high: int) -> list[int]:
    """n lengths with the given mean before clipping to [low, high] (mu = ln(mean) - sigma^2/2)."""
    mu = math.log(mean) - sigma ** 2 / 2
    return [int(min(high, max(low, round(x)))) for x in rng.lognormal(mu, sigma, n)]


def _arrivals(rng, num: int, rate: float, cv: float) -> np.ndarray:
    if not isinstance(num, (int, np.integer)) or num < 1:
        raise ValueError(f"num_requests must be a positive integer (an empty workload cannot run), got {num!r}")
    if not rate > 0:    # also catches NaN
        raise ValueError(f"rate must be positive requests per second (or inf), got {rate!r}")
    if not cv > 0 or math.isinf(cv):
        raise ValueError(f"cv must be positive and finite, got {cv!r}")
    if math.isinf(rate):
        return np.zeros(num)
    shape = 1.0 / cv ** 2                                  # gamma: mean = shape * scale, cv = 1/sqrt(shape)
    gaps = rng.gamma(shape, 1.0 / (rate * shape), num)
    return np.cumsum(gaps) - gaps[0]                       # the first request arrives at t = 0


def _lengths(rng, num: int, spec, name: str, minimum: int = 1) -> np.ndarray:
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        lengths = np.full(num, int(spec))
    elif isinstance(spec, tuple) and len(spec) == 2:
        low, high = spec
        if low > high:
            raise ValueError(f"{name}: the range {spec} has low > high")
        lengths = rng.integers(low, high + 1, num)
    elif isinstance(spec, (list, np.ndarray)) and len(spec):
        lengths = rng.choice(np.asarray(spec, dtype=int), num)
    else:
        raise ValueError(f"{name} must be an int, a (low, high) tuple or a non-empty list of lengths, got {spec!r}")
    if lengths.min() < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {int(lengths.min())}")
    return lengths


def _random_ids(rng, num: int, vocab_size: int) -> list[int]:
    if vocab_size <= FIRST_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID}, got {vocab_size}")
    return rng.integers(FIRST_TOKEN_ID, vocab_size, num).tolist()
