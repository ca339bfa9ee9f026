"""How long an engine step takes, predicted from its shape: the simulator's clock.

A step's time is linear in a few counts of work (Vidur, MLSys '24, profiles the same
quantities per operator; one linear model per step is the coarse version):

  intercept          fixed cost of a step: kernel launches, Python, reading the weights once
                     (a decode step of a big model on a GPU is mostly this);
  mixed              extra fixed cost of a step that has a prompt chunk (eager forward, no
                     CUDA graph; other kernels);
  prefill_tokens     linear layers over prompt tokens (2 x parameters FLOPs each);
  decode_tokens      linear layers and sampling per decoding sequence;
  decode_context     KV tokens read by decode attention (sum of context lengths);
  prefill_attention  query-key pairs of prefill attention, in thousands (a chunk of n tokens
                     at position p attends to p + (n + 1) / 2 keys on average);
  num_prefills       per-sequence cost of a prompt chunk (metadata, gathers);
  swap_blocks        KV blocks copied between host and device;
  dense              the profiled seconds of the step's matrix products at its number of
                     rows (a DenseProfile, measured once on the engine; 0 without one): on a
                     CPU oneDNN picks kernels by rows, so 3 decodes can cost less than 2 and
                     no straight line in decode_tokens fits 1-16 of them (dense_profile.py).

`CostModel.fit(trace)` solves a least-squares problem on the recorded steps, weighted to
minimise relative error (a 5 ms decode step matters as much as a 200 ms prefill), keeping
every coefficient >= 0, and drops one-off outliers (a Triton compile, a CUDA graph capture:
several times a step) before refitting. The target is each step's wall time from the end of the step before
(`step_durations`), so per-step overhead outside the engine's phases is in the model too.
"""
from __future__ import annotations

import json

import numpy as np
import torch

from llmlab.experiments.dense_profile import DenseProfile
from llmlab.experiments.fitted_range import fitted_range, range_of, step_shape
from llmlab.experiments.result import step_durations
from llmlab.machine import recorded_on

# a model saved before a term existed loads with that term at 0: it predicts as it did
FEATURES = ("intercept", "mixed", "prefill_tokens", "decode_tokens", "decode_context", "prefill_attention",
            "num_prefills", "swap_blocks", "dense")


def step_features(items, swap_blocks: int = 0, profile: DenseProfile | None = None) -> list[float]:
    """The FEATURES of one step. `items` are the step's scheduled items (ScheduledItem of a
    Plan, or ScheduledRecord of a trace): kind, num_tokens, start_position. `dense` is 0
    without a profile."""
    prefill_tokens = decode_tokens = decode_context = num_prefills = 0
    prefill_attention = 0.0
    for item in items:
        if item.kind == "decode":
            decode_tokens += 1
            decode_context += item.start_position + 1
        else:
            num_prefills += 1
            prefill_tokens += item.num_tokens
            prefill_attention += item.num_tokens * (item.start_position + (item.num_tokens + 1) / 2) / 1000
    dense = 0.0 if profile is None else profile.seconds(prefill_tokens + decode_tokens, decode_tokens + num_prefills)
    return [1.0, float(num_prefills > 0), prefill_tokens, decode_tokens, decode_context, prefill_attention,
            num_prefills, swap_blocks, dense]


def swapped_blocks(step) -> int:
    """KV blocks a recorded step copied: those of requests swapped out (now in host tables) and
    swapped in (now in device tables)."""
    return (sum(len(step.host_block_tables.get(r, ())) for r in step.swapped_out)
            + sum(len(step.block_tables.get(r, ())) for r in step.swapped_in))


class CostModel:
    def __init__(self, coefficients: dict[str, float], meta: dict | None = None, profile: DenseProfile | None = None):
        unknown = set(coefficients) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown cost-model term(s) {sorted(unknown)}; terms are {FEATURES}")
        if coefficients.get("dense") and profile is None:
            raise ValueError("the cost model has a 'dense' term but no DenseProfile to read it from")
        self.coefficients = {name: float(coefficients.get(name, 0.0)) for name in FEATURES}
        self.meta = dict(meta or {})     # the engine it was fitted on, fit quality
        self.profile = profile
        self._weights = np.array([self.coefficients[name] for name in FEATURES])

    def __repr__(self) -> str:
        terms = ", ".join(f"{k}={v:.3g}" for k, v in self.coefficients.items() if v)
        return f"CostModel({terms})"

    def step_time(self, items, swap_blocks: int = 0) -> float:
        """Predicted seconds for a step that runs `items`."""
        return self.predict(self.features(items, swap_blocks))

    def features(self, items, swap_blocks: int = 0) -> list[float]:
        """The FEATURES of a step that runs `items` (`dense` read from this model's profile)."""
        return step_features(items, swap_blocks, self.profile)

    def predict(self, features) -> float:
        """Predicted seconds for a step with these FEATURES."""
        return float(np.dot(self._weights, features))

    @property
    def fitted_range(self) -> dict[str, list] | None:
        """{dimension: [low, high]} of the step shapes it was fitted on (fitted_range.py;
        None for a dimension not recorded), or None for a model that was not fitted."""
        return fitted_range(self.meta)

    @classmethod
    def constant(cls, seconds: float, meta: dict | None = None) -> "CostModel":
        """Every step takes `seconds` (a toy clock: schedules, not latencies, are what it gets right)."""
        if not seconds > 0:
            raise ValueError(f"a step must take a positive time, got {seconds!r}")
        return cls({"intercept": seconds}, meta)

    # ---- fitting -----------------------------------------------------------------------------
    @classmethod
    def fit(cls, traces, outlier_factor: float = 4.0, profile: DenseProfile | None = None) -> "CostModel":
        """Fit on one Trace or a list of them (recorded by `run` or any Recorder). Steps that
        take over twice their prediction, and over `outlier_factor` times the median relative
        error off, are dropped (one-off work). With a `profile` of the same engine, the
        `dense` term is fitted too, and the profile is kept in the model (and its JSON).
        `meta["recorded_on"]` says where the traces were recorded (figures of a simulation
        name it): as the trace says, else its machine as `run` recorded it, else this one."""
        traces = traces if isinstance(traces, (list, tuple)) else [traces]
        steps = [(step.scheduled, seconds, swapped_blocks(step)) for trace in traces
                 for step, seconds in zip(trace.steps, step_durations(trace)) if seconds is not None and step.scheduled]
        meta = dict(traces[0].meta.get("engine", traces[0].meta))
        meta["recorded_on"] = _where_recorded(traces[0].meta, meta.get("device", "cpu"))
        return cls.fit_steps(steps, meta, outlier_factor, profile)

    @classmethod
    def fit_steps(cls, steps, meta: dict | None = None, outlier_factor: float = 4.0,
                  profile: DenseProfile | None = None) -> "CostModel":
        """Fit on (scheduled items, seconds[, swapped blocks]) of steps timed any other way,
        e.g. single forwards of a benchmark (`llmlab bench single-forward`)."""
        if len(steps) < 2:
            raise ValueError(f"need at least 2 timed steps to fit a cost model, got {len(steps)}")
        X = np.array([step_features(items, *rest[1:], profile=profile) for items, *rest in steps])
        y = np.array([rest[0] for _, *rest in steps], dtype=float)
        keep, scale = np.ones(len(y), dtype=bool), y
        for _ in range(4):
            weights = _nonnegative_lstsq(X[keep], y[keep], scale[keep])
            # weigh each row by its *predicted* time next round: weighing by the measured one
            # favours steps that happened to run fast, and latencies are sums of mean step times
            scale = np.maximum(X @ weights, 1e-9)
            error = np.abs(X @ weights - y) / scale
            # one-off work is many times a step (a 2 s compile); a busy machine's jitter is not
            new_keep = error <= max(outlier_factor * np.median(error[keep]), 1.0)
            if (new_keep == keep).all():
                break
            keep = new_keep
        error = np.abs(X[keep] @ weights - y[keep]) / y[keep]     # as measured, for the record
        meta = dict(meta or {})
        meta["fit"] = {"num_steps": int(len(y)), "num_outliers": int((~keep).sum()),
                       "median_relative_error": float(np.median(error)),
                       "p90_relative_error": float(np.percentile(error, 90)),
                       "max": {name: float(value) for name, value in zip(FEATURES, X[keep].max(axis=0))}}
        # the shapes it has seen: a simulation past them extrapolates (fitted_range.py)
        meta["fitted_range"] = range_of([step_shape(row) for row in X[keep]])
        return cls(dict(zip(FEATURES, weights.tolist())), meta, profile)

    # ---- files -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = {"coefficients": self.coefficients, "meta": self.meta}
        if self.profile is not None:
            data["dense_profile"] = self.profile.to_dict()
        return data

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path) -> "CostModel":
        with open(path) as f:
            data = json.load(f)
        if "coefficients" not in data:
            raise ValueError(f"{path} is not a saved CostModel (no 'coefficients')")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        profile = data.get("dense_profile")
        return cls(data["coefficients"], data.get("meta"), None if profile is None else DenseProfile.from_dict(profile))


def _where_recorded(trace_meta: dict, device: str) -> str:
    """The machine a trace names (`recorded_on`, or the machine_info `run` keeps), else this
    one: a trace with neither was recorded by this process (a Recorder attached by hand)."""
    if trace_meta.get("recorded_on"):
        return trace_meta["recorded_on"]
    if trace_meta.get("machine") or device != "cuda" or torch.cuda.is_available():
        return recorded_on(device, info=trace_meta.get("machine"))
    return "unknown machine"   # a GPU's trace without its machine, read on a machine with none


def _nonnegative_lstsq(X: np.ndarray, y: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """argmin_w sum(((X w - y) / scale)^2) with w >= 0: least squares on rows divided by their
    scale (relative error); a term that comes out negative (noise, or a feature the data never
    varies) is set to 0 and the rest refitted until none is (active set, Lawson-Hanson style)."""
    Xr, yr = X / scale[:, None], y / scale
    active = np.abs(X).sum(axis=0) > 0     # features that are always 0 stay out
    weights = np.zeros(X.shape[1])
    while active.any():
        solution, *_ = np.linalg.lstsq(Xr[:, active], yr, rcond=None)
        weights[:] = 0
        weights[active] = solution
        if (solution >= 0).all():
            break
        active[np.flatnonzero(active)[solution.argmin()]] = False   # drop the most negative term
    return weights
