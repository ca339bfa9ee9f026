"""SamplingParams (what a request asks for) and the Sampler (logits -> next tokens)."""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field

import torch

from llmlab import kernels


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0         # 0 = greedy (so is anything below GREEDY_BELOW)
    top_k: int = -1                  # -1 = all tokens
    top_p: float = 1.0               # nucleus: smallest set of tokens with mass >= top_p
    min_p: float = 0.0               # drop tokens less likely than min_p x the top token
    seed: int | None = None          # same seed -> same text, alone or in any batch
    stop: list[str] = field(default_factory=list)        # never shown in the output text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # log-probabilities: of each sampled token and the `logprobs` most likely tokens at its step
    # (0: the sampled token's only), under the distribution it was drawn from (`token_logprobs`)
    logprobs: int | None = None
    prompt_logprobs: int | None = None   # of each prompt token (the model's own scores) and the k most likely
    n: int = 1     # completions of the prompt: n requests (`fan_out`) that share its cached blocks
    priority: int = 0   # for the `priority` policy: lower = more important (vLLM's request field)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check every field; a ValueError names the first bad one and what it must be. Run
        when the params are built and again when a request is added (LLMEngine.add_request),
        since a dataclass's fields may be set at any time. A bare string `stop` becomes a
        one-element list (OpenAI takes either), and None lists empty ones. Every rule lives
        here: a new field adds its check to this method."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):   # (a bare string or id would iterate oddly, or not at all)
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValueError(f"SamplingParams.{name} must be a list, got {value!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be True or False, got {self.ignore_eos!r}")
        checks = [
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", _is_number(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
             f"a number in [0, {MAX_TEMPERATURE:g}]"),
            ("top_k", _is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "-1 or an integer >= 1"),
            ("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("min_p", _is_number(self.min_p) and 0 <= self.min_p <= 1, "a number in [0, 1]"),
            ("seed", self.seed is None or _is_int(self.seed) and -2**63 <= self.seed < 2**63,
             "None or an integer in [-2**63, 2**63)"),
            ("stop", len(self.stop) <= MAX_STOP and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS
                                                        for s in self.stop),
             f"a list of at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters"),
            ("stop_token_ids", len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
             and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
             f"a list of at most {MAX_STOP_TOKEN_IDS} non-negative integers"),
            ("n", _is_int(self.n) and 1 <= self.n <= MAX_N, f"an integer in [1, {MAX_N}]"),
            ("priority", _is_int(self.priority) and -2**31 <= self.priority < 2**31, "an integer in [-2**31, 2**31)"),
            ("logprobs", self.logprobs is None or _is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS,
             f"None or an integer in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", self.prompt_logprobs is None
             or _is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"None or an integer in [0, {MAX_LOGPROBS}]"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} must be {expected}, got {getattr(self, name)!r}")

    def fan_out(self) -> list["SamplingParams"]:
        """The n requests of `n` completions: copies with n = 1 and, for a seeded request,
        seeds seed, seed + 1, ... (so completion i equals a request with seed + i alone).
        Submitted together, they share the prompt's full KV blocks through the prefix cache
        (the first computes them, the others find them: scheduler.py's cache-aware admission)."""
        seeds = [None] * self.n if self.seed is None else [(self.seed + i + 2**63) % 2**64 - 2**63
                                                          for i in range(self.n)]
        return [dataclasses.replace(self, n=1, seed=seed) for seed in seeds]

    @property
    def greedy(self) -> bool:
        # 1 / temperature of a tiny positive temperature overflows float32 (vLLM's _SAMPLING_EPS)
        return self.temperature < GREEDY_BELOW


GREEDY_BELOW = 1e-5
# Past it the sampler's 1 / temperature nears float32's smallest numbers: logits scaled by it
# tie (1e39 is inf in float32, and every token then ties), and top-k / top-p keep everything.
MAX_TEMPERATURE = 1e6
# Every new piece of text is searched for every stop string (engine/output.py), and the text
# held back is the longest one: bounded, so one request cannot slow every step of the engine
# (90,000 stop strings cost 70 ms a sequence a step on a CPU).
MAX_STOP, MAX_STOP_CHARS = 64, 1024
MAX_STOP_TOKEN_IDS = 1024   # each sampled token is looked up in them (scheduler.stop_reason)
MAX_LOGPROBS = 20    # alternatives per token, as OpenAI's top_logprobs allows
MAX_N = 128          # completions per prompt


def request_params(params: SamplingParams | None) -> SamplingParams:
    """The params of one request (LLMEngine.add_request): SamplingParams() for None, checked
    again (its fields may have been changed since it was built), with n = 1: LLM.generate and
    the server fan n > 1 out first (SamplingParams.fan_out)."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    params.validate()
    if params.n != 1:
        raise ValueError("a request is one sequence: fan SamplingParams.n > 1 out first (SamplingParams.fan_out)")
    return params


def _top_k(k: int, vocab: int) -> int:
    """top_k as the kernels take it: -1 (every token) when it keeps the whole vocabulary,
    so a huge value neither overflows a tensor nor costs a sort."""
    return k if 0 < k < vocab else -1


def _to_device(columns: list, device, dtype=torch.float32) -> torch.Tensor:
    """Per-row numbers (a list, or a list of columns) as a `dtype` tensor on `device`. On a GPU
    through pinned memory and a non-blocking copy: `torch.tensor(..., device="cuda")` waits for the device
    to finish its queue, and in an overlapped step that queue holds the next step's forward
    (a wait per step cost sampled requests with logprobs a fifth of their throughput)."""
    host = torch.tensor(columns, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _cuts(p: SamplingParams, vocab: int) -> bool:
    """Whether a filter (top-k, top-p, min-p) can cut tokens from p's distribution."""
    return not p.greedy and (_top_k(p.top_k, vocab) != -1 or p.top_p < 1 or p.min_p > 0)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class Sampler:
    """Turns one row of logits per sequence into one token per sequence, in one batched
    kernel call on the logits' device (`kernels.sample`; kernels_explained/sampling.md).

    Greedy rows take the argmax. Other rows are scaled by 1/temperature, cut by top-k,
    top-p and min-p (`kernels.filter_logits`, the spec's), and drawn by the Gumbel-max trick
    with counter-based noise: the noise for token t is a hash of (the request's seed, the
    output position, t). So a seeded request gives the same text alone or in any batch,
    with no per-request generator, and the host sends only a few numbers per row.
    Requests without a seed get one from the engine's generator (`new_seed`), so a run
    is reproducible from `EngineConfig.seed` too.
    """

    def __init__(self, seed: int = 0, backend: str | None = None):
        self.generator = random.Random(seed)
        self.backend = backend

    def new_seed(self) -> int:
        """A seed for a request that did not ask for one."""
        return self.generator.getrandbits(63)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                 positions: list[int]) -> torch.Tensor:
        """logits [S, vocab]; each row's SamplingParams, seed and output position (how many
        tokens its request has generated) -> int64 [S] token ids, on the logits' device."""
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1)
        # a few numbers per row, built on the host: the kernel moves them to the device (the
        # Triton one also reads them there to skip the passes no row needs)
        vocab = logits.shape[-1]
        floats = torch.tensor([(0.0 if p.greedy else p.temperature, p.top_p, p.min_p, _top_k(p.top_k, vocab))
                               for p in params],
                              dtype=torch.float32)
        temperature, top_p, min_p, top_k = floats.unbind(dim=1)
        return kernels.sample(logits, temperature, top_k.int(), top_p, min_p,
                              torch.tensor(seeds, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                              backend=self.backend)

    def sample_requests(self, logits: torch.Tensor, requests: list) -> tuple[torch.Tensor, "TokenLogprobs | None"]:
        """One token per request (row i of logits is requests[i]'s: its params, seed and
        output position), and the logprobs the requests ask for (`logprobs`)."""
        params = [r.params for r in requests]
        sampled = self(logits, params, [r.sampling_seed for r in requests], [len(r.output_token_ids) for r in requests])
        return sampled, self.logprobs(logits, params, sampled)

    def warm_up(self, vocab_size: int, device, dtype, max_rows: int = 3) -> None:
        """Compile the sampling kernels now, not inside a request's step (called by the
        engine's warm-up, engine/warm_up.py): for every row count up to `max_rows` (the
        kernel's chunking and its graphs follow the batch), one call that takes every branch
        (top-k, top-p, min-p, and rows without top-k, which the Triton sampler draws by
        rejection rounds)."""
        sampled = [SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01),
                   SamplingParams(temperature=0.7, top_p=0.9, min_p=0.01)]
        for rows in range(1, max(max_rows, 3) + 1):
            logits = torch.zeros(rows, vocab_size, device=device, dtype=dtype)
            # with and without greedy rows: on a GPU, the two graphs of this batch size
            for params in ((sampled * rows)[:rows], (sampled * rows)[:rows - 1] + [SamplingParams()]):
                self(logits, params, list(range(rows)), [0] * rows).tolist()

    def processed_logits(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The logits the sampler draws from, float32 [S, V]: scaled by 1/temperature and cut
        by top-k, top-p and min-p (-inf where cut). A greedy row keeps its raw logits (its
        one-hot distribution has no use as scores: vLLM's logprobs of a greedy request are
        the model's own too)."""
        x = logits.float()
        if all(p.greedy or (p.temperature == 1 and p.top_k == -1 and p.top_p == 1 and p.min_p == 0) for p in params):
            return x   # nothing to scale or cut: skip the vocabulary-wide filter
        temperature, top_k, top_p, min_p = _to_device(
            [[1.0 if p.greedy else p.temperature for p in params],
             [-1 if p.greedy else _top_k(p.top_k, x.shape[-1]) for p in params],
             [1.0 if p.greedy else p.top_p for p in params],
             [0.0 if p.greedy else p.min_p for p in params]], logits.device)
        return kernels.filter_logits(x * (1.0 / temperature)[:, None], top_k.int(), top_p, min_p, backend=self.backend)

    def logprobs(self, logits: torch.Tensor, params: list[SamplingParams], sampled: torch.Tensor):
        """The sampled tokens' log-probabilities for the rows whose params ask for them
        (`SamplingParams.logprobs`), under the processed logits they were drawn from, with
        the k most likely tokens: a TokenLogprobs on the device, or None when no row asks."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return None
        picked = rows if len(rows) < len(params) else slice(None)
        asking = [params[i] for i in rows]
        ks = [p.logprobs for p in asking]
        vocab = logits.shape[-1]
        if not any(_cuts(p, vocab) for p in asking):
            # no filter cuts a token: the processed logits are the raw ones times 1/temperature,
            # which the kernel applies as it reads them (no float copy, no sort)
            scale = None
            if not all(p.greedy or p.temperature == 1 for p in asking):
                scale = 1.0 / _to_device([[1.0 if p.greedy else p.temperature for p in asking]], logits.device)[0]
            return token_logprobs(logits[picked], sampled[picked], rows, ks, scale, backend=self.backend)
        x = self.processed_logits(logits[picked], asking)
        return token_logprobs(x, sampled[picked], rows, ks, backend=self.backend)

    @staticmethod
    def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The exact distribution the sampler draws from: softmax of temperature-scaled logits
        after top-k, top-p and min-p. [S, V] -> [S, V] (greedy rows: all mass on the argmax)."""
        temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=logits.device)
        top_k = torch.tensor([_top_k(p.top_k, logits.shape[-1]) for p in params], device=logits.device)
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        min_p = torch.tensor([p.min_p for p in params], device=logits.device)
        x = kernels.filter_logits(logits.float() * (1.0 / temperature)[:, None], top_k, top_p, min_p, backend="reference")
        probs = x.softmax(dim=-1)
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        one_hot = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
        return torch.where(greedy[:, None], one_hot, probs)


@dataclass(slots=True)
class TokenLogprob:
    """A token's log-probability at its position, and the k most likely tokens there
    (`SamplingParams.logprobs` / `prompt_logprobs` = k), most likely first."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]]     # (token id, logprob)


class TokenLogprobs:
    """Log-probabilities of some tokens (one per row), and the k most likely tokens of each
    row, computed on the device from a batch of logits: only [R] and [R, k] numbers cross
    to the host, never a vocabulary-sized row. `entries()` reads them as TokenLogprobs."""

    def __init__(self, rows: list, chosen_ids: torch.Tensor, chosen: torch.Tensor, top_ids: torch.Tensor,
                 top: torch.Tensor, ks: list[int]):
        self.rows, self.ks = rows, ks      # what each row belongs to (a row index, a position), its k
        self.tensors = [chosen_ids, chosen, top_ids, top]   # [R] int64, [R], [R, k] int64, [R, k]

    def entries(self, tensors=None) -> list:
        """One TokenLogprob per row (from `tensors`: host copies of self.tensors)."""
        chosen_ids, chosen, top_ids, top = (t.tolist() for t in (tensors or self.tensors))
        width = len(top_ids[0]) if top_ids else 0
        if all(k == width for k in self.ks):   # the common case, built without a Python loop: 2x faster
            return list(map(TokenLogprob, chosen_ids, chosen, map(list, map(zip, top_ids, top))))
        return [TokenLogprob(t, lp, list(zip(ids[:k], lps[:k])))
                for t, lp, ids, lps, k in zip(chosen_ids, chosen, top_ids, top, self.ks)]


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, rows: list, ks: list[int],
                   scale: torch.Tensor | None = None, backend: str | None = None) -> TokenLogprobs:
    """logits [R, V], token_ids [R] -> the tokens' log-probabilities under
    log_softmax(logits * scale) and each row's `ks[i]` most likely tokens, most likely first
    (`kernels.token_logprobs`: only the gathered and top-k entries are ever computed, the
    [R, V] log-probabilities are never written out)."""
    token_ids = token_ids.to(device=logits.device, dtype=torch.int64)
    chosen, top_ids, top = kernels.token_logprobs(logits, token_ids, max(ks, default=0), scale, backend=backend)
    return TokenLogprobs(rows, token_ids, chosen, top_ids, top, ks)


# ---- prompt logprobs: extra logits rows of a step (`plan`: the scheduler's Plan, plan.py) ----
def prompt_logprob_positions(plan) -> list[tuple]:
    """(prefill item index, request, first, end) for each prompt chunk whose request asks for
    prompt logprobs: the logits at positions first .. end - 1 score prompt tokens first + 1 ..
    end. `engine.batch.prepare` asks for those rows after the sampling rows, in this order.
    (The prompt's last position predicts the first output token: that is a sampling row.)"""
    found = []
    for j, item in enumerate(plan.prefills):
        request = item.request
        if request.prompt_logprobs is not None:
            first = item.start_position
            end = min(first + item.num_tokens, len(request.prompt_token_ids) - 1)
            if end > first:
                found.append((j, request, first, end))
    return found


def prompt_token_logprobs(logits: torch.Tensor, plan) -> TokenLogprobs | None:
    """The prompt tokens' log-probabilities (the model's own: log_softmax of the raw logits)
    from the logits of the rows `prompt_logprob_positions` asked for, [R, vocab]; a
    TokenLogprobs whose rows are (request, prompt position), or None when no request asks."""
    rows, targets, ks = [], [], []
    for _, request, first, end in prompt_logprob_positions(plan):
        rows += [(request, p + 1) for p in range(first, end)]
        targets += request.prompt_token_ids[first + 1:end + 1]
        ks += [request.params.prompt_logprobs] * (end - first)
    if not rows:
        return None
    return token_logprobs(logits, _to_device(targets, logits.device, torch.int64), rows, ks)
