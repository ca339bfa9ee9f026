"""calibrate the simulator: fit a cost model on one workload, report its error on another.

Runs one workload on the real engine, fits a CostModel on its trace, then runs a second,
different workload and reports how far `simulate` is from it.

Writes into --out: fit_trace.json.gz and predict_trace.json.gz (the engine Traces, without
block tables: `load_trace`), cost_model.json (`CostModel.load`), predict_measured.json /
predict_simulated.json (`Result.load`) and report.json (the fit, the measured and simulated
summaries, their relative errors).

With --preset cpu (and tiny) the command first profiles the model's matrix products at
every row count (`DenseProfile`, about 20 s for cpu) and fits the cost model's `dense`
term on it: oneDNN's kernels make a CPU step's time jump with its number of rows, which no
straight line fits. report.json then also holds what the model without the profile would
have predicted ("without_profile"), on the same measured run. `--no-dense-profile` turns
it off; `--dense-profile` turns it on for h200.

Presets (any option below overrides its value):
  h200  random bf16 weights in the Llama-3-8B shape, 8B-scale workloads (~4 minutes on an H200)
  cpu   the embedded SmolLM2-135M, small workloads (~3 minutes on a 2-core laptop)
  tiny  a 2-layer random model, a few seconds (a smoke test of this command)
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

from llmlab.bench.common import random_engine, write_json
from llmlab.machine import recorded_on

# The first workload is bursty (gamma arrivals, cv 3), so its steps cover small and large
# batches alike, and then a burst of long requests arrives at once: a few sequences, each
# over thousands of tokens of context. The bursty part alone grows its decodes' context with
# their number (more decodes, more context), so a fit cannot tell the per-token attention
# cost from the per-sequence cost and leaves decode_context at 0 (the H200 model of
# 2026-12-01 did); the long part reads many KV tokens with few sequences, and carries the
# fitted range (fitted_range.py) out to long contexts. The second workload has Poisson
# arrivals at another rate and another length mix.
PRESETS = {
    "h200": dict(model="random-llama3-8b", max_num_seqs=128, max_num_batched_tokens=2048,
                 fit_requests=500, fit_rate=10.0, fit_cv=3.0, fit_prompt_len="32,1536", fit_output_len="16,512",
                 fit_long_requests=48, fit_long_prompt_len="3072,6144", fit_long_output_len="128,512",
                 predict_requests=400, predict_rate=8.0, predict_cv=1.0, predict_prompt_len="16,1024",
                 predict_output_len="32,384"),
    "cpu": dict(model="embedded", threads=1, dense_profile=True, max_num_seqs=16, max_num_batched_tokens=256,
                fit_requests=48, fit_rate=1.0, fit_cv=3.0, fit_prompt_len="16,256", fit_output_len="8,48",
                fit_long_requests=3, fit_long_prompt_len="1536,2048", fit_long_output_len="24,48",
                predict_requests=40, predict_rate=0.7, predict_cv=1.0, predict_prompt_len="8,160",
                predict_output_len="16,64"),
    "tiny": dict(model="random-tiny", dense_profile=True, max_num_seqs=16, max_num_batched_tokens=64,
                 fit_requests=30, fit_rate=200.0, fit_cv=3.0, fit_prompt_len="4,60", fit_output_len="2,24",
                 fit_long_requests=4, fit_long_prompt_len="300,400", fit_long_output_len="40,100",
                 predict_requests=30, predict_rate=150.0, predict_cv=1.0, predict_prompt_len="4,40",
                 predict_output_len="4,32"),
}
REPORTED = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "e2e_p50", "e2e_p90", "output_tok_s")


def add_arguments(parser) -> None:
    parser.add_argument("--out", required=True, help="directory for the trace, cost model and report")
    parser.add_argument("--preset", default="h200", choices=sorted(PRESETS))
    parser.add_argument("--model", default=None, help="random-llama3-8b | random-tiny | embedded | a HF folder")
    parser.add_argument("--layers", type=int, default=None, help="random-llama3-8b with fewer layers (smoke tests)")
    parser.add_argument("--num-gpu-blocks", type=int, default=None)
    for name, kind in (("max-num-seqs", int), ("max-num-batched-tokens", int), ("fit-requests", int),
                       ("fit-rate", float), ("fit-cv", float), ("fit-prompt-len", str), ("fit-output-len", str),
                       ("fit-long-requests", int), ("fit-long-prompt-len", str), ("fit-long-output-len", str),
                       ("predict-requests", int), ("predict-rate", float), ("predict-cv", float),
                       ("predict-prompt-len", str), ("predict-output-len", str)):
        parser.add_argument(f"--{name}", type=kind, default=None,
                            help="lengths are LOW,HIGH (uniform); rates are requests/s" if "len" in name else None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the preset's, "
                        "else torch's)")
    parser.add_argument("--dense-profile", action=argparse.BooleanOptionalAction, default=None,
                        help="profile the matrix products by rows and fit the cost model's dense term on it "
                             "(default: the preset's; on for cpu and tiny)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default="fcfs",
                        help="the scheduling policy of both runs and of the simulation (a name, or module:Name as "
                             "llmlab serve --policy takes it): the report's error is the simulator's for this policy; "
                             "each run gets a fresh one where the name or class makes one (default: %(default)s)")
    parser.add_argument("--repeat", action="store_true",
                        help="run the second workload twice: how far two real runs are apart is the floor "
                             "under the simulator's error on this machine")


def _options(args) -> dict:
    options = dict(PRESETS[args.preset])
    for key in [*options, "threads", "dense_profile"]:
        if getattr(args, key, None) is not None:
            options[key] = getattr(args, key)
    for key in [k for k in options if k.endswith("_len")]:
        from llmlab.cli_flags import int_span

        options[key] = int_span(options[key], "--" + key.replace("_", "-"))
    return options


def build_engine(options: dict, args):
    import torch

    from llmlab import EngineConfig, LLMEngine
    from llmlab.config import ModelConfig
    from llmlab.model.llama import LlamaModel

    sizes = dict(max_num_seqs=options["max_num_seqs"], max_num_batched_tokens=options["max_num_batched_tokens"])
    if options["model"] == "random-llama3-8b":
        return random_engine(args, num_gpu_blocks=args.num_gpu_blocks, **sizes)[0].engine
    if options["model"] == "random-tiny":
        tiny = ModelConfig.from_hf(dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512))
        config = EngineConfig(model="random-tiny", dtype="float32", num_gpu_blocks=args.num_gpu_blocks or 512,
                              **sizes)
        return LLMEngine(config, model=LlamaModel.random(tiny, torch.float32, config.resolved_device()))
    model = None if options["model"] == "embedded" else options["model"]
    return LLMEngine(EngineConfig(model=model, num_gpu_blocks=args.num_gpu_blocks, **sizes))


def calibrate(args) -> dict:
    import torch

    from llmlab.experiments import CostModel, Workload, run, simulate
    from llmlab.experiments.dense_profile import DenseProfile
    from llmlab.experiments.result import step_durations

    from llmlab.policies import resolve_policy

    options = _options(args)
    policy_name = resolve_policy(args.policy).name      # a bad --policy fails before the engine is built
    # a name as it is (run() and simulate() give "priority" the workload's priorities); else a
    # new object a run where module:Name names a class (a policy's state stays in its run)
    policy = lambda: args.policy if ":" not in args.policy else resolve_policy(args.policy)   # noqa: E731
    if options.get("threads"):   # on a shared CPU, 1 thread avoids OpenMP spinning against other jobs
        torch.set_num_threads(options["threads"])
    os.makedirs(args.out, exist_ok=True)
    _progress(f"building the engine ({options['model']})")
    engine = build_engine(options, args)
    vocab = engine.model_config.vocab_size
    fit = fit_workload(options, args.seed, vocab)
    predict = Workload.gamma(options["predict_requests"], options["predict_rate"], options["predict_cv"],
                             options["predict_prompt_len"], options["predict_output_len"], seed=args.seed + 1,
                             vocab_size=vocab)
    load = [os.getloadavg()[0]]     # other jobs on the machine make step times noisy: say how busy it was
    profile, profile_seconds = None, 0.0
    if options.get("dense_profile"):
        _progress("profiling the matrix products by rows")
        start = time.perf_counter()
        profile = DenseProfile.measure(engine.model, options["max_num_batched_tokens"], options["max_num_seqs"])
        profile_seconds = time.perf_counter() - start
    _progress(f"engine ready; running the first workload ({len(fit)} requests over {fit.duration:.0f} s)")
    start = time.perf_counter()
    fitted = run(fit, engine, policy=policy())
    fit_seconds = time.perf_counter() - start
    load.append(os.getloadavg()[0])
    fitted.trace.meta.update(recorded_on=recorded_on(engine.device),
                             date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                             workload=f"gamma (cv {options['fit_cv']}) {options['fit_requests']} requests at "
                                      f"{options['fit_rate']}/s, "
                                      f"prompt {options['fit_prompt_len']}, output {options['fit_output_len']}; "
                                      f"then {options['fit_long_requests']} at once, "
                                      f"prompt {options['fit_long_prompt_len']}, output {options['fit_long_output_len']}")
    save_trace(fitted.trace, os.path.join(args.out, "fit_trace.json.gz"))
    cost_model = CostModel.fit(fitted.trace, profile=profile)
    # the same fit without the profile: what it adds, judged on the same measured run
    linear_model = CostModel.fit(fitted.trace) if profile is not None else None
    for model in (cost_model, linear_model):
        if model is not None:
            model.meta.update(date=fitted.trace.meta["date"],   # recorded_on: fit took it from the trace
                              recorded_with=f"llmlab bench calibrate --preset {args.preset}")
    cost_model.save(os.path.join(args.out, "cost_model.json"))

    _progress(f"cost model fitted: {cost_model}; running the second workload ({len(predict)} requests over "
              f"{predict.duration:.0f} s)")
    start = time.perf_counter()
    measured = run(predict, engine, policy=policy())
    predict_seconds = time.perf_counter() - start
    load.append(os.getloadavg()[0])
    start = time.perf_counter()
    simulated = simulate(predict, engine.config, cost_model, policy=policy())
    simulate_seconds = time.perf_counter() - start
    save_trace(measured.trace, os.path.join(args.out, "predict_trace.json.gz"))
    measured.save(os.path.join(args.out, "predict_measured.json"), trace=False)   # its trace is the file above
    repeat = None
    if args.repeat:
        _progress("running the second workload again")
        repeat = run(predict, engine, policy=policy()).summary()
        load.append(os.getloadavg()[0])
    simulated.save(os.path.join(args.out, "predict_simulated.json"))

    def step_error(model) -> dict:
        """The cost model alone, step by step on the second run: step-time error apart from
        queueing. `bias` is the median signed error: when the machine itself ran faster or
        slower than during the first run (other tenants), every step moves the same way."""
        signed = sorted((model.step_time(s.scheduled) - d) / d
                        for s, d in zip(measured.trace.steps, step_durations(measured.trace)) if d and s.scheduled)
        errors = sorted(abs(e) for e in signed)
        return {"median": errors[len(errors) // 2], "p90": errors[int(len(errors) * 0.9)],
                "bias": signed[len(signed) // 2]} if errors else {}

    a, b = measured.summary(), simulated.summary()
    report = {
        "options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
        "recorded_on": fitted.trace.meta["recorded_on"], "date": fitted.trace.meta["date"], "policy": policy_name,
        "cost_model": cost_model.to_dict(),
        "seconds": {"profile": profile_seconds, "fit_run": fit_seconds, "predict_run": predict_seconds,
                    "simulate": simulate_seconds},
        "load_average": {"before_fit": load[0], "after_fit": load[1], "after_predict": load[2]},
        "predict_step_error": step_error(cost_model),
        "measured": a, "simulated": b,
        "relative_error": {k: (b[k] - a[k]) / a[k] for k in REPORTED},
    }
    if linear_model is not None:
        c = simulate(predict, engine.config, linear_model, policy=policy()).summary()
        report["without_profile"] = {"cost_model": linear_model.to_dict(), "simulated": c,
                                     "predict_step_error": step_error(linear_model),
                                     "relative_error": {k: (c[k] - a[k]) / a[k] for k in REPORTED}}
    if repeat is not None:
        report["repeat"] = repeat
        report["repeat_relative_difference"] = {k: (repeat[k] - a[k]) / a[k] for k in REPORTED}
        report["load_average"]["after_repeat"] = load[3]
    write_json(os.path.join(args.out, "report.json"), report)
    return report


def fit_workload(options: dict, seed: int, vocab_size: int):
    """The first workload: the bursty requests, then `fit_long_requests` long ones that all
    arrive one mean gap after the last of them (ids "long-0", ...)."""
    from dataclasses import replace

    from llmlab.experiments import Workload

    bursty = Workload.gamma(options["fit_requests"], options["fit_rate"], options["fit_cv"], options["fit_prompt_len"],
                            options["fit_output_len"], seed=seed, vocab_size=vocab_size)
    if not options.get("fit_long_requests"):
        return bursty
    long = Workload.offline(options["fit_long_requests"], options["fit_long_prompt_len"],
                            options["fit_long_output_len"], seed=seed + 2, vocab_size=vocab_size)
    start = bursty.requests[-1].arrival_time + 1 / options["fit_rate"]
    return Workload(bursty.requests + [replace(r, request_id=f"long-{r.request_id}", arrival_time=start)
                                       for r in long])


def save_trace(trace, path) -> None:
    """The trace without what a cost model and the metrics do not read (block tables, block
    lists: most of its size; `Trace.without_blocks`), gzipped: a GPU run's trace stays a few MB."""
    with gzip.open(path, "wt") as f:
        json.dump(trace.without_blocks().to_dict(), f)


def load_trace(path):
    from llmlab.hooks import Trace

    with gzip.open(path, "rt") as f:
        return Trace.from_dict(json.load(f))


def _progress(message: str) -> None:
    print(f"[calibrate {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def format_report(report: dict) -> str:
    fit = report["cost_model"]["meta"]["fit"]
    lines = [f"{report['recorded_on']}, {report['date']}, policy {report.get('policy', 'fcfs')}",
             f"cost model fitted on {fit['num_steps']} steps ({fit['num_outliers']} outliers dropped): "
             f"median step error {fit['median_relative_error']:.1%}, p90 {fit['p90_relative_error']:.1%}",
             f"on the second workload's steps: median {report['predict_step_error'].get('median', float('nan')):.1%}, "
             f"p90 {report['predict_step_error'].get('p90', float('nan')):.1%}, "
             f"median signed {report['predict_step_error'].get('bias', float('nan')):+.1%}"
             + ("; without the dense profile: median {median:.1%}, p90 {p90:.1%}".format(
                 **report["without_profile"]["predict_step_error"]) if report.get("without_profile", {}).get(
                 "predict_step_error") else ""),
             f"decode context fitted up to {report['cost_model']['meta']['fitted_range']['decode_context'][1]:,.0f} KV tokens a step; "
             f"{report['simulated'].get('outside_fitted_range', float('nan')):.1%} of the second workload's simulated "
             f"steps lie past the fitted range",
             f"runs took {report['seconds']['fit_run']:.1f} s and {report['seconds']['predict_run']:.1f} s; "
             f"the simulation {report['seconds']['simulate']:.2f} s; 1-minute load average "
             + " / ".join(f"{v:.1f}" for v in report["load_average"].values()) + " (before / after each run)",
             f"{'':14} {'measured':>10} {'simulated':>10} {'error':>8}"
             + (f" {'no profile':>10}" if "without_profile" in report else "")
             + (f" {'measured again':>15} {'difference':>10}" if "repeat" in report else "")]
    for key in REPORTED:
        line = (f"{key:14} {report['measured'][key]:>10.4g} {report['simulated'][key]:>10.4g} "
                f"{report['relative_error'][key]:>+8.1%}")
        if "without_profile" in report:
            line += f" {report['without_profile']['relative_error'][key]:>+10.1%}"
        if "repeat" in report:
            line += f" {report['repeat'][key]:>15.4g} {report['repeat_relative_difference'][key]:>+10.1%}"
        lines.append(line)
    return "\n".join(lines)


def main(args) -> None:
    report = calibrate(args)
    print(format_report(report))
    print(f"wrote {args.out}")
