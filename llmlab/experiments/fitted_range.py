"""Where a cost model can be trusted: the range of step shapes it was fitted on, and the
steps of a simulation outside it.

A cost model is a straight line through the steps it was fitted on. Inside their range it
interpolates; outside, its lines extrapolate, and nothing measured says they still hold
(attention over contexts it never saw, batches larger than any it timed). `CostModel.fit`
records (`meta["fitted_range"]`), for four dimensions of a step's shape, the lowest and
highest value among the steps it kept:

  num_tokens         tokens in the step (prompt-chunk tokens + one per decode)
  num_seqs           sequences in the step (decodes + prompt chunks)
  decode_context     KV tokens the step's decodes read (the sum of their context lengths:
                     the cost model's decode_context term)
  prefill_attention  the prefill context: query-key pairs of the step's prompt-chunk
                     attention, in thousands (the prefill_attention term)

`simulate()` counts the steps whose shape lies past that range (above its highest value) on
any dimension, warns once (ExtrapolationWarning, naming each dimension and how far out it
went), and keeps the count in `Result.meta["fitted_range"]`; `Result.summary()` reports the
fraction as `outside_fitted_range`. A model saved before ranges were recorded has only the maxima of
its terms (`meta["fit"]["max"]`): its decode_context and prefill_attention maxima are those,
and the rest is unknown (None), not guessed; a model with no fit at all
(`CostModel.constant`, coefficients by hand) has no range, and its fraction is NaN.
"""
from __future__ import annotations

import numpy as np

RANGE_DIMENSIONS = ("num_tokens", "num_seqs", "decode_context", "prefill_attention")
UNITS = {"num_tokens": "tokens", "num_seqs": "sequences", "decode_context": "KV tokens read by decodes",
         "prefill_attention": "thousand query-key pairs of prefill attention"}


class ExtrapolationWarning(UserWarning):
    """A simulation ran steps outside the shapes its cost model was fitted on."""


def step_shape(features) -> tuple[float, float, float, float]:
    """The RANGE_DIMENSIONS of a step, from its cost-model features (cost_model.FEATURES:
    intercept, mixed, prefill_tokens, decode_tokens, decode_context, prefill_attention,
    num_prefills, ...)."""
    prefill_tokens, decode_tokens, decode_context, prefill_attention, num_prefills = features[2:7]
    return (prefill_tokens + decode_tokens, decode_tokens + num_prefills, decode_context, prefill_attention)


def range_of(shapes) -> dict[str, list[float]]:
    """{dimension: [lowest, highest]} over the step shapes a model was fitted on."""
    shapes = np.asarray(shapes, dtype=float).reshape(-1, len(RANGE_DIMENSIONS))
    return {name: [float(shapes[:, i].min()), float(shapes[:, i].max())] for i, name in enumerate(RANGE_DIMENSIONS)}


def fitted_range(meta: dict) -> dict[str, list] | None:
    """The range a cost model's meta records (meta["fitted_range"]: {dimension: [low, high]},
    None where unknown), or None without a fit. A fit saved before ranges existed gives what
    its `meta["fit"]["max"]` holds."""
    if "fitted_range" in meta:
        return meta["fitted_range"]
    fit = meta.get("fit") or {}
    if "max" in fit:     # the maxima of the terms: two of them are dimensions here, the rest unknown
        return {name: [None, fit["max"][name]] if name in fit["max"] else None for name in RANGE_DIMENSIONS}
    return None


def outside(shapes, fitted: dict[str, list] | None) -> dict:
    """How many of a simulation's step shapes lie past `fitted` (fitted_range's dict), in all
    and per dimension, with the highest value seen: a plain dict, kept in
    Result.meta["fitted_range"]. Only the upper ends count: every dimension is a count that
    starts at 0, so a step smaller than any fitted one lies between the fitted steps and the
    intercept (which every fitted step measured), while a larger one is where a straight line
    stops being a measurement (attention over longer contexts, bigger batches)."""
    shapes = np.asarray(shapes, dtype=float).reshape(-1, len(RANGE_DIMENSIONS))
    if fitted is None:
        return {"num_steps": len(shapes), "num_outside": None, "fraction": float("nan"),
                "unknown": list(RANGE_DIMENSIONS), "dimensions": {}}
    any_outside = np.zeros(len(shapes), dtype=bool)
    dimensions, unknown = {}, []
    for i, name in enumerate(RANGE_DIMENSIONS):
        high = (fitted.get(name) or (None, None))[1]
        if high is None:
            unknown.append(name)
            continue
        above = shapes[:, i] > high
        any_outside |= above
        if above.any():
            dimensions[name] = {"fitted_max": high, "num_steps": int(above.sum()), "highest": float(shapes[:, i].max())}
    num_outside = int(any_outside.sum())
    return {"num_steps": len(shapes), "num_outside": num_outside,
            "fraction": num_outside / len(shapes) if len(shapes) else 0.0,
            "unknown": unknown, "dimensions": dimensions}


def warning_text(report: dict) -> str | None:
    """One sentence for ExtrapolationWarning, or None when no step was past the range."""
    if not report["num_outside"]:
        return None
    parts = []
    for name, d in report["dimensions"].items():
        high = d["fitted_max"]
        times = f"{d['highest'] / high:.2g}x" if high > 0 else "past"
        parts.append(f"{name} up to {_number(d['highest'])} {UNITS[name]}, {times} the fitted maximum of "
                     f"{_number(high)} ({d['num_steps']:,} steps)")
    text = (f"{report['num_outside']:,} of {report['num_steps']:,} simulated steps ({report['fraction']:.1%}) lie "
            f"past the step shapes the cost model was fitted on, so their times are extrapolated: "
            + "; ".join(parts))
    if report["unknown"]:
        text += f" ({', '.join(report['unknown'])}: not recorded for this cost model, not checked)"
    return text


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
