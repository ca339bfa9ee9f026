"""SamplingParams (what a request asks for) and the Sampler (logits -> next tokens)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0         # 0 = greedy
    top_k: int = -1                  # -1 = all tokens
    top_p: float = 1.0               # nucleus: smallest set of tokens with mass >= top_p
    seed: int | None = None          # per-request generator: same seed -> same text, batched or not
    stop: list[str] = field(default_factory=list)        # never shown in the output text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        checks = [
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", _is_number(self.temperature) and self.temperature >= 0, "a number >= 0"),
            ("top_k", _is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "-1 or an integer >= 1"),
            ("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
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
        return self.temperature == 0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class Sampler:
    """Turns one row of logits per sequence into one token per sequence.

    Greedy rows take the argmax. Other rows are scaled by 1/temperature, filtered to the
    top-k tokens and then to the top-p nucleus, and sampled with the exponential race
    (argmax of p / Exp(1) noise), which needs one random draw per token and lets a
    seeded request use its own generator, so its text does not depend on its batch.
    """

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        # logits [num_seqs, vocab]
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            logits = logits.float()
            rows = torch.tensor(sampled, device=logits.device)
            probs = self.probabilities(logits[rows], [params[i] for i in sampled])
            for j, i in enumerate(sampled):
                gen = generators[i] or self.generator
                noise = torch.empty(probs.shape[-1]).exponential_(generator=gen).to(probs.device)
                tokens[i] = (probs[j] / noise).argmax()
        return tokens.tolist()

    @staticmethod
    def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Softmax of temperature-scaled logits after top-k and top-p filtering. [S, V] -> [S, V]."""
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temperature[:, None]
        vocab = logits.shape[-1]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.clamp(max=vocab)[:, None], float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # keep a token if the mass strictly before it is < top_p (so the top token always stays)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
        filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        return filtered.softmax(dim=-1)
