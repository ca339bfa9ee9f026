"""The highest request rate a policy can take while meeting an SLO (DistServe's goodput, §2).

    search = max_rate(dict(num_requests=500, prompt_len=(32, 2048), output_len=(16, 512)),
                      "fcfs", slo={"ttft": 0.5, "tpot": 0.05}, target=0.9,
                      config=EngineConfig(...), cost_model=CostModel.load(...))
    search.rate       # requests/s: the highest rate tried at which >= 90% met the SLO

The workload at a rate is a function of the rate, or Workload.gamma's keyword arguments
(num_requests, prompt_len, output_len, cv = 1.0: Poisson; vLLM's burstiness b is cv = 1/√b;
seed, vocab_size). The same seed at every rate gives the same requests with every arrival
time scaled by 1/rate, so attainment falls with the rate as the load alone changes.

The search evaluates SLO attainment (`Result.summary(slo)["slo_attainment"]`) at a rate:
first it brackets the answer (doubling from `start_rate` while the target is met, halving
while it is not), then bisects the bracket until high / low - 1 <= rel_tol. It assumes
attainment falls as the rate rises; on a noisy real engine it may not, near the answer,
and the bracket is then only as good as one run at each rate. Each evaluation is a
`simulate()` (cost_model=: fast) or a `run()` on a real engine (engine=: as slow as the
workload is long). A policy object keeps its state across evaluations: pass a name or a
class for a fresh one each time.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from llmlab.config import EngineConfig
from llmlab.engine.engine import LLMEngine
from llmlab.experiments.fitted_range import ExtrapolationWarning
from llmlab.experiments.result import check_slo
from llmlab.experiments.workload import Workload


@dataclass
class RateSearch:
    rate: float                 # the answer: the highest rate tried that met the target (0 if none did)
    low: float                  # = rate
    high: float                 # the lowest rate tried that missed it (inf if none did)
    target: float
    slo: dict
    points: list[dict] = field(default_factory=list)   # every rate tried, in order: rate, slo_attainment, ...

    @property
    def bracketed(self) -> bool:
        """Whether the answer lies between two rates tried (else it is below or above every one)."""
        return 0 < self.low and math.isfinite(self.high)


def max_rate(workload, policy, slo: dict, target: float = 0.9, *, config=None, cost_model=None, engine=None,
             start_rate: float = 1.0, rel_tol: float = 0.05, max_evaluations: int = 30) -> RateSearch:
    """The highest arrival rate (requests/s) at which at least `target` of the requests meet
    `slo` ({"ttft": s, "tpot": s, "e2e": s}) under `policy`: simulated with `cost_model` on
    `config` (an EngineConfig), or run on `engine` (an LLM, LLMEngine or EngineConfig).
    `workload`: a function rate -> Workload, or a dict of Workload.gamma's arguments."""
    from llmlab.experiments.run import run
    from llmlab.experiments.simulate import simulate

    slo = check_slo(slo)
    if not 0 < target <= 1:
        raise ValueError(f"target is a fraction of requests in (0, 1], got {target!r}")
    if (cost_model is None) == (engine is None):
        raise ValueError("max_rate needs a cost_model (and a config) to simulate, or an engine to run on: one of them")
    if cost_model is not None and config is None:
        raise ValueError("max_rate with a cost_model needs the config to simulate (an EngineConfig)")
    if not (start_rate > 0 and math.isfinite(start_rate)) or not rel_tol > 0:
        raise ValueError(f"start_rate must be a positive finite rate and rel_tol positive, got {start_rate}, {rel_tol}")
    workload_at = _workload_function(workload)
    if isinstance(engine, EngineConfig):     # one engine for every rate: building one is slow
        engine = LLMEngine(engine)
    points: list[dict] = []

    def meets(rate: float) -> bool:
        with warnings.catch_warnings(record=True) as caught:    # one warning for the search, not one per rate
            warnings.simplefilter("always", ExtrapolationWarning)
            if cost_model is not None:
                result = simulate(workload_at(rate), config, cost_model, policy)
            else:
                result = run(workload_at(rate), engine, policy)
        for w in caught:
            if not issubclass(w.category, ExtrapolationWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        summary = result.summary(slo)
        points.append({"rate": rate, "slo_attainment": summary["slo_attainment"], "kind": result.meta.get("kind"),
                       "outside_fitted_range": summary.get("outside_fitted_range"), "summary": summary})
        return summary["slo_attainment"] >= target

    low, high = 0.0, math.inf
    rate = start_rate
    if meets(rate):               # bracket: double while the target is met...
        low = rate
        while len(points) < max_evaluations:
            rate *= 2
            if not meets(rate):
                high = rate
                break
            low = rate
    else:                         # ...or halve until it is
        high = rate
        while len(points) < max_evaluations:
            rate /= 2
            if meets(rate):
                low = rate
                break
            high = rate
    while low > 0 and math.isfinite(high) and high / low - 1 > rel_tol and len(points) < max_evaluations:
        middle = (low + high) / 2
        low, high = (middle, high) if meets(middle) else (low, middle)
    extrapolated = [p for p in points if (p["outside_fitted_range"] or 0) > 0]    # NaN: no range recorded
    if extrapolated:
        worst = max(extrapolated, key=lambda p: p["outside_fitted_range"])
        warnings.warn(f"{len(extrapolated)} of the {len(points)} simulations of max_rate ran steps past the cost "
                      f"model's fitted range (up to {worst['outside_fitted_range']:.1%} of the steps, at "
                      f"{worst['rate']:.3g} requests/s): their times are extrapolated", ExtrapolationWarning,
                      stacklevel=2)
    return RateSearch(low, low, high, target, slo, points)


def _workload_function(workload):
    if callable(workload):
        return workload
    if isinstance(workload, dict):
        if "rate" in workload:
            raise ValueError("max_rate chooses the rate: leave 'rate' out of the workload's parameters")
        return lambda rate: Workload.gamma(rate=rate, **workload)
    raise ValueError(f"max_rate takes a function rate -> Workload or a dict of Workload.gamma's arguments, "
                     f"got {type(workload).__name__}")
