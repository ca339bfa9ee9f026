"""experiments.step_profile: a run's steps by kind and size against a bound. Checked on a
hand-built trace whose sums are known, and through `llmlab bench offline --profile-steps`
on the embedded model against the Roofline computed independently."""
from __future__ import annotations

import pytest

from llmlab.experiments.step_profile import bucket_of, format_profile, profile_steps
from llmlab.hooks import ScheduledRecord, StepRecord, Trace


class PerToken:
    """A bound of 1 ms per scheduled token."""

    def step_time(self, items, swap_blocks=0):
        return 1e-3 * sum(item.num_tokens for item in items)


def step(index, end, decodes=0, prompt=0, forward=0.0, sample=0.0):
    scheduled = [ScheduledRecord(f"d{i}", "decode", 1, 10) for i in range(decodes)]
    if prompt:
        scheduled.append(ScheduledRecord("p", "prefill", prompt, 0))
    return StepRecord(index, scheduled=scheduled, time=end,
                      timings={"schedule": 1e-4, "forward": forward, "sample": sample})


def test_buckets_by_kind_and_size():
    labels = [bucket_of(step(0, 0.0, decodes=n))[2] for n in (1, 8, 9, 256, 257)]
    assert labels == ["decodes only, batch 1-8", "decodes only, batch 1-8", "decodes only, batch 9-32",
                      "decodes only, batch 129-256", "decodes only, batch > 256"]
    assert bucket_of(step(0, 0.0, decodes=300, prompt=512))[2] == "with a prompt, 1-512 tokens"
    assert bucket_of(step(0, 0.0, prompt=9000))[2] == "with a prompt, > 8192 tokens"


def test_sums_losses_and_shares_per_bucket():
    trace = Trace(steps=[
        step(0, 1.000, decodes=1),                             # the first: no duration
        step(1, 1.010, decodes=4, forward=0.006, sample=0.001),   # 10 ms, bound 4
        step(2, 1.020, decodes=4, forward=0.006, sample=0.001),   # 10 ms, bound 4
        step(3, 1.120, decodes=2, prompt=40, forward=0.080),      # 100 ms, bound 42
        step(4, 1.121),                                        # nothing scheduled: not a step of work
    ], meta={"idle_before_steps": []})
    rows = profile_steps(trace, PerToken())
    assert [r["bucket"] for r in rows] == ["decodes only, batch 1-8", "with a prompt, 1-512 tokens", "all"]
    decode, prompt, total = rows
    assert decode["steps"] == 2 and decode["wall_s"] == pytest.approx(0.020)
    assert decode["forward_s"] == pytest.approx(0.012) and decode["host_s"] == pytest.approx(0.006)
    assert decode["bound_s"] == pytest.approx(0.008) and decode["lost_s"] == pytest.approx(0.012)
    assert prompt["lost_s"] == pytest.approx(0.058) and prompt["of_bound"] == pytest.approx(0.42)
    assert decode["share_of_lost"] == pytest.approx(12 / 70) and prompt["share_of_lost"] == pytest.approx(58 / 70)
    assert total["steps"] == 3 and total["wall_s"] == pytest.approx(0.120) and total["skipped"] == 1
    assert (total["prompt_tokens"], total["decode_tokens"]) == (40, 10)   # the skipped step's not counted
    assert total["share_of_lost"] is None and total["lost_s"] == pytest.approx(0.070)
    table = format_profile(rows)
    assert "| decodes only, batch 1-8 | 2 | 20.0 | 12.0 | 2.0 | 6.0 | 8.0 | 40.0% | 12.0 | 17.1% |" in table
    assert "(1 step without a duration left out" in table


def test_a_step_after_requests_were_added_counts_from_the_last_one():
    """The first step, and one after an idle wait (experiments.run writes those down), start
    when the last request before them was added: that is when the engine had work again."""
    from llmlab.hooks import RequestAdded

    trace = Trace(steps=[step(0, 1.050, prompt=40, forward=0.040), step(1, 1.060, decodes=1, forward=0.008),
                         step(2, 3.100, prompt=30, forward=0.030)],
                  added=[RequestAdded("a", 40, 0.990), RequestAdded("b", 40, 1.000),
                         RequestAdded("c", 30, 3.060)],
                  meta={"idle_before_steps": [2]})
    rows = profile_steps(trace, PerToken())
    prompt, total = rows[1], rows[-1]
    assert prompt["bucket"] == "with a prompt, 1-512 tokens" and prompt["steps"] == 2
    assert prompt["wall_s"] == pytest.approx(0.050 + 0.040)   # from b's and c's arrivals, not from 1.060
    assert total["skipped"] == 0 and total["wall_s"] == pytest.approx(0.100)


@pytest.mark.slow
def test_bench_offline_profiles_its_steps_against_the_roofline(capsys):
    import argparse

    from llmlab.bench import offline

    parser = argparse.ArgumentParser()
    offline.add_arguments(parser)
    argv = ["--num-requests", "4", "--input-len", "20", "--output-len", "3", "--num-gpu-blocks", "64",
            "--warmup", "light", "--max-num-batched-tokens", "32"]
    with pytest.raises(ValueError, match="--profile-steps compares each step with the bound"):
        offline.main(parser.parse_args(argv + ["--profile-steps"]))
    results = offline.main(parser.parse_args(argv + ["--profile-steps", "--roofline", "0.02,0.5"]))
    rows = results[0]["step_profile"]
    total = rows[-1]
    assert total["bucket"] == "all" and sum(r["steps"] for r in rows[:-1]) == total["steps"] > 0
    assert sum(r["wall_s"] for r in rows[:-1]) == pytest.approx(total["wall_s"])
    # the same requests through the same scheduler, simulated: the same steps, whose bound
    # the profile must have summed (the first one too: timed from the last request added)
    import dataclasses

    from llmlab.experiments import simulate
    from llmlab.experiments.roofline import Roofline

    args = parser.parse_args(argv)
    llm = offline.build_llm(args)
    roofline = Roofline.of_engine(llm.engine, 0.02, 0.5)
    config = dataclasses.replace(llm.engine.config, num_gpu_blocks=llm.engine.runner.num_device_blocks)
    workload = offline.build_workload(args, llm.engine.model_config.vocab_size)
    steps = [s for s in simulate(workload, config, roofline, record_trace=True).trace.steps if s.scheduled]
    assert total["steps"] == len(steps) and total["skipped"] == 0
    assert total["bound_s"] == pytest.approx(sum(roofline.step_time(s.scheduled) for s in steps))
    assert total["prompt_tokens"] == sum(s.num_prefill_tokens for s in steps)
    assert "where the first row's steps lose time (greedy, prefix caching on)" in capsys.readouterr().out
