"""Repeats: one experiment run k times, each summary metric as a mean with a 95% interval.

Two runs of the same workload on a real engine can differ by a fifth or more (other
programs on the machine, the allocator, the OS), which is as big as most policy effects;
a simulation is deterministic, but one draw of Poisson arrivals is one sample of the
traffic. `run(..., repeats=k)` and `simulate(..., repeats=k)` return a `Repeats`; its
`summary()` gives, for every metric of `Result.summary`, an `Interval`: the mean of the k
repeats' values and Student's t interval around it,

    mean ± t(0.975, k - 1) · s / √k        (s: the sample standard deviation, ddof 1)

the usual 95% confidence interval of a mean from k independent, roughly normal samples.
It is an interval for the *mean over repeats* of a metric (say the mean of k p90 TTFTs),
not for single requests; it assumes the k values roughly normal, so for a bounded metric
(SLO attainment) it can reach past the bound with few repeats. One repeat has no interval
(low and high are None, not a zero width); a metric that is NaN in a repeat (no TPOT
without two tokens) is left out of it, and `n` says how many values were used.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from llmlab.experiments.result import Result

CONFIDENCE = 0.95


@dataclass(frozen=True, slots=True)
class Interval:
    mean: float
    low: float | None      # None: fewer than two values, no interval
    high: float | None
    n: int                 # values the mean is over (NaNs left out)

    def __str__(self) -> str:
        if self.low is None:
            return f"{self.mean:.4g} (one repeat: no interval)" if self.n == 1 else f"{self.mean:.4g}"
        return f"{self.mean:.4g} [{self.low:.4g}, {self.high:.4g}]"


def interval(values, confidence: float = CONFIDENCE) -> Interval:
    """The mean of `values` and its Student's t interval (two-sided, `confidence`)."""
    values = np.array([v for v in values if v is not None and not math.isnan(v)], dtype=float)
    n = len(values)
    if n == 0:
        return Interval(float("nan"), None, None, 0)
    mean = float(values.mean())
    if n == 1:
        return Interval(mean, None, None, 1)
    half_width = t_quantile(1 - (1 - confidence) / 2, n - 1) * float(values.std(ddof=1)) / math.sqrt(n)
    return Interval(mean, mean - half_width, mean + half_width, n)


def t_quantile(p: float, df: int) -> float:
    """The p-quantile (p > 0.5) of Student's t with `df` degrees of freedom: where the CDF
    below reaches p, by bisection (scipy is not a dependency)."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    low, high = 0.0, 1.0
    while _t_central(high, df) < 2 * p - 1:
        high *= 2
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_central(mid, df) < 2 * p - 1 else (low, mid)
    return (low + high) / 2


def _t_central(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with integer df >= 1, in closed form (Abramowitz & Stegun
    26.7.3 and 26.7.4: a finite series in cos(theta), theta = atan(t / sqrt(df)))."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    term = total = 1.0
    if df % 2 == 1:
        if df == 1:
            return 2 * theta / math.pi
        for k in range(1, (df - 1) // 2):        # 1 + 2/3 c^2 + (2·4)/(3·5) c^4 + ... up to c^(df-3)
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    for k in range(1, df // 2):                  # 1 + 1/2 c^2 + (1·3)/(2·4) c^4 + ... up to c^(df-2)
        term *= c2 * (2 * k - 1) / (2 * k)
        total += term
    return math.sin(theta) * total


@dataclass
class Repeats:
    """The Results of one experiment repeated (run or simulated k times)."""
    results: list[Result]

    @property
    def meta(self) -> dict:
        """The first repeat's meta (how it was made), with the number of repeats."""
        return {**self.results[0].meta, "repeats": len(self.results)}

    def summary(self, slo: dict | None = None) -> dict[str, Interval]:
        """Every metric of `Result.summary(slo)`, as the mean over the repeats and its 95% t interval."""
        summaries = [result.summary(slo) for result in self.results]
        return {key: interval([s[key] for s in summaries]) for key in summaries[0]}

    def to_rows(self) -> list[dict]:
        """`Result.to_rows()` of every repeat, each row with its `repeat` index."""
        return [{"repeat": i, **row} for i, result in enumerate(self.results) for row in result.to_rows()]


def repeated(experiment, workload, repeats: int) -> Repeats:
    """`experiment(workload_i)` for i in range(repeats): `workload` is a Workload (the same
    each time) or a function of the repeat's index, e.g. a seed (new arrivals each time)."""
    check_repeats(repeats)
    return Repeats([experiment(workload(i) if callable(workload) else workload) for i in range(repeats)])


def check_repeats(repeats) -> int:
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    return repeats
