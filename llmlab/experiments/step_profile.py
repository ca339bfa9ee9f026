"""Where a run's time goes, step by step, against a bound: which kinds of step lose most
time to the cost model's prediction (a Roofline: the machine's ceilings; or a fitted
CostModel), and how much of each is the model's forward, sampling, and host work.

    recorder = Recorder(blocks=False); engine.hooks.attach(recorder)   # then run requests
    rows = profile_steps(recorder.trace, Roofline.of_engine(engine, tb_s, tflop_s))  # H200's by default
    print(format_profile(rows))

A trace with block lists (a plain Recorder's, `experiments.run`'s) also times building them,
after each step: milliseconds a step over tens of thousands of blocks, which land in `host`.

Steps fall in buckets by kind and size: steps of decodes only by their batch, steps that
hold a prompt chunk by their prompt tokens (the decodes riding along included). Per bucket:
the steps' wall time (from the end of the step before, as `step_durations`: what the
engine's phases miss is in it; the first step, and one after an idle wait, from the last
request added before it), its `forward` and `sample` phases, the rest (`host`: scheduling,
preparing inputs, swaps, updating requests and outputs, the caller's loop), the bound's time
for the same steps (with a fitted CostModel: its prediction, which may exceed the wall), and
the time lost against it (wall - bound; negative where the bound is above the wall) with its
share of the time the buckets lose. A step with no request added before it and no step
before it has no duration and is counted apart.

The phases are honest on a GPU only while the engine synchronises after each (it does while
a hook is attached, which also runs steps one at a time: no host work overlaps a step in
flight, so `host` is what async scheduling would have to hide).
"""
from __future__ import annotations

import bisect

from llmlab.experiments.cost_model import swapped_blocks
from llmlab.experiments.result import step_durations
from llmlab.hooks import Trace

DECODE_BATCHES = (8, 32, 64, 128, 256)     # a decode-only bucket's largest batch, then "more"
PROMPT_TOKENS = (512, 2048, 8192)          # a prompt bucket's most prompt tokens, then "more"


def bucket_of(step) -> tuple[int, int, str]:
    """(kind, lower edge, label) of a StepRecord's bucket (anything with num_prefill_tokens
    and num_decode_tokens): kind 0 decodes only, by batch; 1 with a prompt, by its tokens."""
    prompt, decodes = step.num_prefill_tokens, step.num_decode_tokens
    kind, count, edges = (1, prompt, PROMPT_TOKENS) if prompt else (0, decodes, DECODE_BATCHES)
    what = "with a prompt, {} tokens" if prompt else "decodes only, batch {}"
    low = 1
    for edge in edges:
        if count <= edge:
            return kind, low, what.format(f"{low}-{edge}")
        low = edge + 1
    return kind, low, what.format(f"> {edges[-1]}")


def durations(trace: Trace) -> list[float | None]:
    """Each step's wall time: `step_durations`, and where that has none (the first step, a
    step after an idle wait) the time from the last request added since the step before,
    which is when the engine had work again. None where neither says."""
    out, added, previous = [], sorted(event.time for event in trace.added), None
    for step, wall in zip(trace.steps, step_durations(trace)):
        if wall is None:
            last = bisect.bisect_right(added, step.time) - 1   # the last request added by the step's end
            if last >= 0 and (previous is None or added[last] > previous):
                wall = step.time - added[last]
        out.append(wall)
        previous = step.time
    return out


def profile_steps(trace: Trace, bound) -> list[dict]:
    """One row per bucket and a last row "all": steps, seconds of wall / forward / sample /
    host / bound, lost (wall - bound), share_of_lost (of the buckets' positive losses; None
    in the "all" row), of_bound (bound / wall), the prompt and decode tokens; the last row's
    `skipped`: steps without a duration (`durations`). `trace`: a Trace (or anything with
    one, a Result); `bound`: a CostModel (Roofline included), its step_time per step."""
    trace = getattr(trace, "trace", None) or trace
    rows, skipped = {}, 0
    for step, wall in zip(trace.steps, durations(trace)):
        if not step.scheduled:
            continue
        if wall is None:
            skipped += 1
            continue
        predicted = bound.step_time(step.scheduled, swapped_blocks(step))
        forward, sample = step.timings.get("forward", 0.0), step.timings.get("sample", 0.0)
        for key in (bucket_of(step), (2, 0, "all")):
            row = rows.setdefault(key, dict(bucket=key[2], steps=0, wall_s=0.0, forward_s=0.0, sample_s=0.0,
                                              host_s=0.0, bound_s=0.0, prompt_tokens=0, decode_tokens=0))
            row["steps"] += 1
            row["wall_s"] += wall
            row["forward_s"] += forward
            row["sample_s"] += sample
            row["host_s"] += wall - forward - sample
            row["bound_s"] += predicted
            row["prompt_tokens"] += step.num_prefill_tokens
            row["decode_tokens"] += step.num_decode_tokens
    lost_total = sum(max(0.0, r["wall_s"] - r["bound_s"]) for key, r in rows.items() if key[0] < 2)
    out = []
    for key in sorted(rows):   # decodes only, then with a prompt, each by size; all last
        row = rows[key]
        row["lost_s"] = row["wall_s"] - row["bound_s"]
        row["of_bound"] = row["bound_s"] / row["wall_s"] if row["wall_s"] > 0 else float("nan")
        row["share_of_lost"] = (None if key[0] == 2 else
                                max(0.0, row["lost_s"]) / lost_total if lost_total > 0 else 0.0)
        out.append(row)
    if out:
        out[-1]["skipped"] = skipped
    return out


def format_profile(rows: list[dict]) -> str:
    """A markdown table of profile_steps' rows (milliseconds)."""
    lines = ["| kind of step | steps | wall ms | forward ms | sample ms | host ms | bound ms | bound / wall | "
             "lost ms | share of lost | prompt tokens | decodes |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = "" if r["share_of_lost"] is None else f"{r['share_of_lost']:.1%}"
        lines.append(f"| {r['bucket']} | {r['steps']} | {r['wall_s'] * 1e3:,.1f} | {r['forward_s'] * 1e3:,.1f} | "
                     f"{r['sample_s'] * 1e3:,.1f} | {r['host_s'] * 1e3:,.1f} | {r['bound_s'] * 1e3:,.1f} | "
                     f"{r['of_bound']:.1%} | {r['lost_s'] * 1e3:,.1f} | {share} | "
                     f"{r['prompt_tokens']:,} | {r['decode_tokens']:,} |")
    if rows and rows[-1].get("skipped"):
        skipped = rows[-1]["skipped"]
        lines.append(f"({skipped} step{'s' if skipped > 1 else ''} without a duration left out: no request added "
                     f"and no step before)")
    return "\n".join(lines)
