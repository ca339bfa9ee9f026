"""Scheduling experiments: workloads with arrivals over time, runs on a real engine or a
simulator, latency and SLO metrics, figures.

    from llmlab.experiments import Workload, run, simulate, CostModel
    workload = Workload.poisson(100, rate=4.0, prompt_len=(16, 256), output_len=(8, 64))
    measured = run(workload, llmlab.LLM().engine, policy="fcfs")
    cost = CostModel.fit(measured.trace)                          # step time from step shape
    predicted = simulate(workload, EngineConfig(), cost, policy="shortest_prompt_first")
    measured.summary(slo={"ttft": 1.0, "tpot": 0.1}); compare([measured, predicted])
    run(workload, engine, repeats=5).summary()            # means and 95% intervals
    max_rate(dict(num_requests=500), "fcfs", {"ttft": 0.5}, config=..., cost_model=cost).rate

workload.py builds workloads, run.py drives an engine on the wall clock, simulate.py the
same Scheduler on a simulated clock, cost_model.py predicts step times (one of its terms
reads dense_profile.py's table of matrix-product times by rows), result.py holds
per-request metrics and summaries, figures.py draws them (plotly is imported only there);
repeats.py repeats an experiment (means, t intervals), fitted_range.py says where a cost
model extrapolates, max_rate.py finds the highest rate that meets an SLO, roofline.py is the
cost model of a machine's ceilings (each step at max(bytes / bandwidth, FLOPs / peak)),
step_profile.py says which kinds of step lose a run's time against a cost model.
The scheduling policies, by name, are in llmlab/policies.py (POLICIES, resolve_policy).
"""
from llmlab.experiments.cost_model import FEATURES, CostModel, step_features
from llmlab.experiments.dense_profile import DenseProfile
from llmlab.experiments.fitted_range import ExtrapolationWarning
from llmlab.experiments.max_rate import RateSearch, max_rate
from llmlab.experiments.repeats import Interval, Repeats
from llmlab.experiments.result import RequestMetrics, Result, StepStats
from llmlab.experiments.roofline import Roofline
from llmlab.experiments.run import engine_meta, run
from llmlab.experiments.simulate import simulate
from llmlab.experiments.step_profile import format_profile, profile_steps
from llmlab.experiments.workload import Workload, WorkloadRequest, read_lengths
from llmlab.policies import POLICIES, resolve_policy


FIGURES = ("compare", "latency_cdf", "prediction_error", "rate_search", "request_timeline", "step_predictions",
           "step_timeline", "sweep", "workload_figure")


def __getattr__(name):   # figures need plotly, which a GPU box may not have: import on first use
    if name in FIGURES:
        from llmlab.experiments import figures

        return getattr(figures, name)
    raise AttributeError(f"module 'llmlab.experiments' has no attribute {name!r}")


__all__ = ["FEATURES", "POLICIES", "CostModel", "DenseProfile", "ExtrapolationWarning", "Interval", "RateSearch",
           "Repeats", "RequestMetrics", "Result", "Roofline", "StepStats", "max_rate",
           "Workload", "WorkloadRequest", "engine_meta", "format_profile", "profile_steps", "read_lengths",
           "resolve_policy", "run", "simulate", "step_features",
           *FIGURES]
