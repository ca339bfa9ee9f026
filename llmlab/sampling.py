"""SamplingParams (what a request asks for) and the Sampler (logits -> next tokens)."""
from __future__ import annotations

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

    def __post_init__(self):
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
            ("temperature", _is_number(self.temperature) and 0 <= self.temperature < math.inf,
             "a finite number >= 0"),
            ("top_k", _is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "-1 or an integer >= 1"),
            ("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("min_p", _is_number(self.min_p) and 0 <= self.min_p <= 1, "a number in [0, 1]"),
            ("seed", self.seed is None or _is_int(self.seed) and -2**63 <= self.seed < 2**63,
             "None or an integer in [-2**63, 2**63)"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "a list of non-empty strings"),
            ("stop_token_ids", all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
             "a list of non-negative integers"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} must be {expected}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        # 1 / temperature of a tiny positive temperature overflows float32 (vLLM's _SAMPLING_EPS)
        return self.temperature < GREEDY_BELOW


GREEDY_BELOW = 1e-5


def _top_k(k: int, vocab: int) -> int:
    """top_k as the kernels take it: -1 (every token) when it keeps the whole vocabulary,
    so a huge value neither overflows a tensor nor costs a sort."""
    return k if 0 < k < vocab else -1


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

    @staticmethod
    def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The exact distribution the sampler draws from: softmax of temperature-scaled logits
        after top-k, top-p and min-p. [S, V] -> [S, V] (greedy rows: all mass on the argmax)."""
        temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=logits.device)
        top_k = torch.tensor([_top_k(p.top_k, logits.shape[-1]) for p in params], device=logits.device)
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        min_p = torch.tensor([p.min_p for p in params], device=logits.device)
        x = kernels.filter_logits(logits.float() * (1.0 / temperature)[:, None], top_k, top_p, min_p)
        probs = x.softmax(dim=-1)
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        one_hot = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
        return torch.where(greedy[:, None], one_hot, probs)
