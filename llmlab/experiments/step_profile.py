"""Where a run's time goes, step by step, against a bound: which kinds of step lose most
time to the cost model's prediction (a Roofline: the machine's ceilings; or a fitted
CostModel), and how much of each is the model's forward, sampling, and host work.

    trace = experiments.run(workload, engine).trace           # or a Recorder's trace
    rows = profile_steps(trace, Roofline.of_engine(engine))
    print(format_profile(rows))

Steps fall in buckets by kind and size: steps of decodes only by their batch, steps that
hold a prompt chunk by their prompt tokens (the decodes riding along included). Per bucket:
the steps' wall time (from the end of the step before, as `step_durations`: what the
engine's phases miss is in it), its `forward` and `sample` phases, the rest (`host`:
scheduling, preparing inputs, swaps, updating requests and outputs, the caller's loop), the
bound's time for the same steps, and the time lost against it (wall - bound) with its share
of all time lost. The first step, and steps after an idle wait, have no duration and are
counted apart.

The phases are honest on a GPU only while the engine synchronises after each (it does while
a hook is attached, which also runs steps one at a time: no host work overlaps a step in
flight, so `host` is what async scheduling would have to hide).
"""
from __future__ import annotations

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


def profile_steps(trace: Trace, bound) -> list[dict]:
    """One row per bucket and a last row "all": steps, seconds of wall / forward / sample /
    host / bound, lost (wall - bound), share_of_lost, of_bound (bound / wall), the prompt
    and decode tokens; the last row's `skipped`: steps without a duration (the first one,
    those after an idle wait).
    `bound`: a CostModel (Roofline included), its step_time per step."""
    rows, skipped = {}, 0
    for step, wall in zip(trace.steps, step_durations(trace)):
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
        row["share_of_lost"] = max(0.0, row["lost_s"]) / lost_total if lost_total > 0 else 0.0
        out.append(row)
    if out:
        out[-1]["skipped"] = skipped
    return out


def format_profile(rows: list[dict]) -> str:
    """A markdown table of profile_steps' rows (milliseconds)."""
    lines = ["| steps | count | wall ms | forward ms | sample ms | host ms | bound ms | bound / wall | "
             "lost ms | share of lost | prompt tokens | decodes |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['bucket']} | {r['steps']} | {r['wall_s'] * 1e3:,.1f} | {r['forward_s'] * 1e3:,.1f} | "
                     f"{r['sample_s'] * 1e3:,.1f} | {r['host_s'] * 1e3:,.1f} | {r['bound_s'] * 1e3:,.1f} | "
                     f"{r['of_bound']:.1%} | {r['lost_s'] * 1e3:,.1f} | {r['share_of_lost']:.1%} | "
                     f"{r['prompt_tokens']:,} | {r['decode_tokens']:,} |")
    if rows and rows[-1].get("skipped"):
        lines.append(f"({rows[-1]['skipped']} steps have no duration, the first one or after an idle wait: left out)")
    return "\n".join(lines)
