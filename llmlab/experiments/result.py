"""What an experiment measured: per-request times, and the latency / SLO summary of a run.

Every time is in seconds from the start of the experiment (the workload's t = 0), for a
real run (`run`) and a simulated one (`simulate`) alike, so the two compare directly.

  TTFT  time to first token: arrival -> first token (queueing + prefill);
  TPOT  time per output token after the first: (finish - first token) / (tokens - 1);
  E2E   end-to-end latency: arrival -> last token;
  ITL   inter-token latency: every gap between two consecutive tokens of a request.

With an SLO (limits on TTFT and/or TPOT, in seconds), `slo_attainment` is the fraction of
requests that meet every limit, and `goodput_req_s` the rate of such requests: DistServe's
goodput (§2) is the highest request rate whose attainment stays above a target (e.g. 90%),
found by sweeping the rate and reading `slo_attainment`.
"""
from __future__ import annotations

import gzip
import json
from array import array
from dataclasses import dataclass, field

import numpy as np

from llmlab.hooks import Trace

SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass(slots=True)
class RequestMetrics:
    request_id: str
    arrival: float
    prompt_len: int
    priority: int = 0
    first_scheduled: float | None = None     # start of the first step that computed its prompt
    first_token: float | None = None
    finish: float | None = None
    token_times: array = field(default_factory=lambda: array("d"))   # one per output token
    num_preemptions: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finish is None or self.num_output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.num_output_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    def meets(self, slo: dict) -> bool:
        """Finished, and within every limit of `slo` (a TPOT of a one-token answer is no limit)."""
        if self.finish is None:
            return False
        return all(getattr(self, key) is None or getattr(self, key) <= limit for key, limit in slo.items())


@dataclass(slots=True)
class StepStats:
    """One engine step, as the figures draw it."""
    time: float               # end of the step
    duration: float           # measured (run) or predicted by the cost model (simulate)
    num_prefill_tokens: int
    num_decode_tokens: int
    num_waiting: int          # queued after the step
    num_preempted: int        # preempted or swapped out in the step


@dataclass
class Result:
    requests: list[RequestMetrics]
    steps: list[StepStats] = field(default_factory=list)
    meta: dict = field(default_factory=dict)     # how it was made: run or simulate, policy, config
    trace: Trace | None = None                   # the engine's trace (run; simulate(record_trace=True))

    @property
    def duration(self) -> float:
        """First arrival to last finish."""
        finishes = [r.finish for r in self.requests if r.finish is not None]
        return max(finishes) - min(r.arrival for r in self.requests) if finishes else 0.0

    def summary(self, slo: dict | None = None) -> dict:
        """Percentiles of TTFT, TPOT and E2E (seconds) over the finished requests, output tokens
        per second over the whole run, and with `slo` = {"ttft": s, "tpot": s} (either or both,
        "e2e" too) the SLO attainment and goodput. A simulated result also gives
        `outside_fitted_range`: the fraction of its steps outside the shapes its cost model
        was fitted on (fitted_range.py; NaN for a model with no recorded range)."""
        done = [r for r in self.requests if r.finish is not None]
        values = {key: np.array([getattr(r, key) for r in done if getattr(r, key) is not None])
                  for key in SLO_KEYS}

        def percentile(key, q):
            return float(np.percentile(values[key], q)) if len(values[key]) else float("nan")

        duration = self.duration
        output_tokens = sum(r.num_output_tokens for r in done)
        out = {"num_requests": len(self.requests), "num_finished": len(done), "duration_s": duration,
               "ttft_mean": float(values["ttft"].mean()) if len(done) else float("nan")}
        for key in SLO_KEYS:
            for q in (50, 90, 99):
                out[f"{key}_p{q}"] = percentile(key, q)
        # every gap between two tokens of a request (vLLM's ITL, SARATHI's TBT): its tail shows
        # the decodes stalled behind a long prompt chunk, which TPOT's per-request mean hides
        gaps = [np.diff(np.asarray(r.token_times)) for r in done if len(r.token_times) > 1]
        gaps = np.concatenate(gaps) if gaps else np.empty(0)
        for q in (50, 90, 99):
            out[f"itl_p{q}"] = float(np.percentile(gaps, q)) if len(gaps) else float("nan")
        out["output_tok_s"] = output_tokens / duration if duration > 0 else float("nan")
        out["request_s"] = len(done) / duration if duration > 0 else float("nan")
        out["num_preemptions"] = sum(r.num_preemptions for r in self.requests)
        if self.meta.get("kind") == "simulate":   # steps whose time the cost model extrapolated
            out["outside_fitted_range"] = self.meta.get("fitted_range", {}).get("fraction", float("nan"))
        if slo is not None:
            slo = check_slo(slo)
            met = sum(r.meets(slo) for r in self.requests)
            out["slo_attainment"] = met / len(self.requests)
            out["goodput_req_s"] = met / duration if duration > 0 else float("nan")
        return out

    # ---- for your own analysis -------------------------------------------------------------
    def to_rows(self) -> list[dict]:
        """One dict per request: ids, times, ttft / tpot / e2e, tokens, preemptions."""
        return [{"request_id": r.request_id, "arrival": r.arrival, "prompt_len": r.prompt_len,
                 "priority": r.priority, "first_scheduled": r.first_scheduled, "first_token": r.first_token,
                 "finish": r.finish, "num_output_tokens": r.num_output_tokens, "ttft": r.ttft,
                 "tpot": r.tpot, "e2e": r.e2e, "num_preemptions": r.num_preemptions} for r in self.requests]

    def to_frame(self):
        """`to_rows()` as a pandas DataFrame. pandas is optional: llmlab does not install it."""
        try:
            import pandas as pd
        except ImportError as err:
            raise ImportError("Result.to_frame needs pandas, which is optional (llmlab does not install it): "
                              "pip install pandas, or use Result.to_rows() (a list of dicts, the same columns)") from err
        return pd.DataFrame(self.to_rows())

    def to_dict(self, trace: bool = True) -> dict:
        """Plain data for JSON; with `trace`, the engine's trace too, without its block lists
        (`Trace.without_blocks`: what `from_trace` and `CostModel.fit` read)."""
        requests = [{"request_id": r.request_id, "arrival": r.arrival, "prompt_len": r.prompt_len,
                     "priority": r.priority, "first_scheduled": r.first_scheduled, "first_token": r.first_token,
                     "finish": r.finish, "token_times": list(r.token_times), "num_preemptions": r.num_preemptions}
                    for r in self.requests]
        steps = [[s.time, s.duration, s.num_prefill_tokens, s.num_decode_tokens, s.num_waiting, s.num_preempted]
                 for s in self.steps]
        data = {"meta": self.meta, "requests": requests, "steps": steps}
        if trace and self.trace is not None:
            data["trace"] = self.trace.without_blocks().to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Result":
        requests = [RequestMetrics(**{**r, "token_times": array("d", r["token_times"])}) for r in data["requests"]]
        trace = Trace.from_dict(data["trace"]) if data.get("trace") is not None else None
        return cls(requests, [StepStats(*s) for s in data.get("steps", [])], data.get("meta", {}), trace)

    def save(self, path, trace: bool = True) -> None:
        """JSON (gzipped if `path` ends in .gz), with the trace unless `trace=False`: a cost
        model can be refitted from the file (`CostModel.fit(Result.load(path).trace)`)."""
        with _open(path, "wt") as f:
            json.dump(self.to_dict(trace), f)

    @classmethod
    def load(cls, path) -> "Result":
        with _open(path, "rt") as f:
            return cls.from_dict(json.load(f))

    # ---- from what an engine recorded --------------------------------------------------------
    @classmethod
    def from_trace(cls, trace: Trace, arrivals: dict[str, float] | None = None, origin: float | None = None,
                   priorities: dict[str, int] | None = None, meta: dict | None = None) -> "Result":
        """Per-request metrics of a recorded trace. A token's time is the end of the step that
        sampled it (when the engine hands it out). `arrivals` (request id -> time, on the
        trace's clock) overrides when requests were added: a request that arrives while a step
        runs is added after it, but its latency counts from its arrival. Times are shifted so
        that `origin` (default: the first arrival) is 0."""
        arrivals = dict(arrivals or {})
        prompt_lens = {}
        for added in trace.added:
            arrivals.setdefault(added.request_id, added.time)
            prompt_lens[added.request_id] = added.num_prompt_tokens
        if not arrivals:
            raise ValueError("the trace has no requests")
        origin = min(arrivals.values()) if origin is None else origin
        priorities = priorities or {}
        metrics = {rid: RequestMetrics(rid, t - origin, prompt_lens.get(rid, 0), priorities.get(rid, 0))
                   for rid, t in sorted(arrivals.items(), key=lambda item: item[1])}
        steps = []
        for s, duration in zip(trace.steps, step_durations(trace)):
            end = s.time - origin
            busy = sum(s.timings.values())
            start = end - busy
            duration = busy if duration is None else duration
            for item in s.scheduled:
                m = metrics.get(item.request_id)
                if m is not None and m.first_scheduled is None:
                    m.first_scheduled = start
            for rid in s.preempted + s.swapped_out:
                if rid in metrics:
                    metrics[rid].num_preemptions += 1
            for rid in s.sampled:
                m = metrics.get(rid)
                if m is not None:
                    m.token_times.append(end)
                    if m.first_token is None:
                        m.first_token = end
            for rid in s.finished:
                if rid in metrics:
                    metrics[rid].finish = end
            steps.append(StepStats(end, duration, s.num_prefill_tokens, s.num_decode_tokens, len(s.waiting),
                                   len(s.preempted) + len(s.swapped_out)))
        return cls(list(metrics.values()), steps, dict(meta or {}), trace)


def step_durations(trace: Trace) -> list[float | None]:
    """Wall time of each step: from the end of the step before to the end of this one, which
    includes what the phase timings miss (updating requests, detokenizing, the caller's loop).
    None where the engine sat idle before the step (waiting for an arrival), which `run`
    writes down in trace.meta["idle_before_steps"]. A trace recorded some other way gets a
    guess: a gap much longer than the step's own phases was idle time."""
    idle = trace.meta.get("idle_before_steps")
    idle = set(idle) if idle is not None else None
    durations, previous = [], None
    for s in trace.steps:
        gap = None if previous is None else s.time - previous
        if gap is not None and idle is None:
            # 1.5x + 2 ms: post-step work is a small fraction of a step; an idle wait is not
            busy = gap <= 1.5 * sum(s.timings.values()) + 0.002
        else:
            busy = idle is not None and s.step not in idle
        durations.append(gap if gap is not None and gap > 0 and busy else None)
        previous = s.time
    return durations


def _open(path, mode: str):
    return gzip.open(path, mode) if str(path).endswith(".gz") else open(path, mode[0])


def check_slo(slo: dict) -> dict:
    """{"ttft": seconds, "tpot": seconds, "e2e": seconds}, any subset, positive limits."""
    if not isinstance(slo, dict) or not slo:
        raise ValueError(f"slo must be a dict such as {{'ttft': 0.5, 'tpot': 0.05}} (seconds), got {slo!r}")
    unknown = set(slo) - set(SLO_KEYS)
    if unknown:
        raise ValueError(f"unknown SLO key(s) {sorted(unknown)}; use {', '.join(SLO_KEYS)}")
    for key, limit in slo.items():
        if not (isinstance(limit, (int, float)) and limit > 0):
            raise ValueError(f"SLO limit {key} must be a positive number of seconds, got {limit!r}")
    return dict(slo)
