"""Randomized workloads (hypothesis): whatever the scheduler does — chunked prefill, swap or
recompute preemption, prefix caching, aborts — greedy outputs equal those of a roomy,
unchunked engine, and every block comes back."""
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import llmlab
from llmlab import LLMEngine, SamplingParams

from helpers.engine import assert_all_blocks_free as assert_no_leaks, cpu_engine, tiny_model

# larger-than-default weights make the tiny model's logits spread out, so greedy choices
# are far from ties and a wrong attention row would change tokens
MODEL = tiny_model(seed=3)
for layer in MODEL.layers:
    layer.qkv.mul_(10)
    layer.gate_up.mul_(10)
MODEL.embed.mul_(20)


def engine_with(**overrides) -> LLMEngine:
    config = dict(block_size=4, num_gpu_blocks=256, max_num_batched_tokens=512, enable_chunked_prefill=False)
    config.update(overrides)
    return cpu_engine(MODEL, **config)


def run(engine, prompts, max_tokens, abort_at=None, recorder=None):
    """Run all prompts; `abort_at` = {step: request index} aborts requests along the way."""
    if recorder is not None:
        engine.hooks.attach(recorder)
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
           for p, n in zip(prompts, max_tokens)]
    outputs, step = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        step += 1
        if abort_at and step in abort_at:
            engine.abort(ids[abort_at[step]])
        assert step < 5000, "engine made no progress"
    return [outputs.get(i) for i in ids]


workloads = st.lists(
    st.tuples(st.lists(st.integers(1, 127), min_size=1, max_size=40), st.integers(1, 12)),
    min_size=1, max_size=6)
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference(prompts, max_tokens):
    return [run(engine_with(), [p], [n])[0] for p, n in zip(prompts, max_tokens)]


@SETTINGS
@given(workload=workloads, budget=st.integers(2, 24))
@pytest.mark.slow
def test_chunked_prefill_keeps_greedy_output(workload, budget):
    prompts, max_tokens = map(list, zip(*workload))
    engine = engine_with(enable_chunked_prefill=True, max_num_batched_tokens=budget)
    recorder = llmlab.Recorder()
    assert run(engine, prompts, max_tokens, recorder=recorder) == reference(prompts, max_tokens)
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= budget for s in recorder.trace.steps)
    assert_no_leaks(engine)


@SETTINGS
@given(workload=workloads, mode=st.sampled_from(["swap", "recompute"]),
       chunked=st.booleans(), extra_blocks=st.integers(0, 6))
@pytest.mark.slow
def test_preemption_keeps_greedy_output(workload, mode, chunked, extra_blocks):
    prompts, max_tokens = map(list, zip(*workload))
    # just enough blocks for the longest request alone, plus a few: forces preemption
    longest = max(len(p) + n for p, n in workload)
    engine = engine_with(num_gpu_blocks=-(-longest // 4) + extra_blocks, preemption_mode=mode,
                         enable_chunked_prefill=chunked, max_num_batched_tokens=64 if chunked else 512,
                         swap_space=0.0005)
    assert run(engine, prompts, max_tokens) == reference(prompts, max_tokens)
    assert_no_leaks(engine)


@SETTINGS
@given(prefix=st.lists(st.integers(1, 127), min_size=0, max_size=20), workload=workloads,
       blocks=st.integers(12, 64))
@pytest.mark.slow
def test_prefix_caching_keeps_greedy_output(prefix, workload, blocks):
    prompts = [prefix + p for p, _ in workload]
    max_tokens = [n for _, n in workload]
    longest = max(len(p) + n for p, n in zip(prompts, max_tokens))
    engine = engine_with(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16,
                         num_gpu_blocks=max(blocks, -(-longest // 4) + 1))
    expected = reference(prompts, max_tokens)
    assert run(engine, prompts, max_tokens) == expected
    assert run(engine, prompts, max_tokens) == expected     # second round hits the cache
    assert_no_leaks(engine)


@SETTINGS
@given(workload=workloads, abort_step=st.integers(1, 8), victim=st.integers(0, 5),
       mode=st.sampled_from(["swap", "recompute"]))
@pytest.mark.slow
def test_aborts_free_everything(workload, abort_step, victim, mode):
    prompts, max_tokens = map(list, zip(*workload))
    longest = max(len(p) + n for p, n in workload)
    engine = engine_with(num_gpu_blocks=-(-longest // 4) + 2, preemption_mode=mode, swap_space=0.0005,
                         enable_chunked_prefill=True, max_num_batched_tokens=6)
    victim %= len(prompts)
    outputs = run(engine, prompts, max_tokens, abort_at={abort_step: victim})
    expected = reference(prompts, max_tokens)
    for i, (got, want) in enumerate(zip(outputs, expected)):
        if i != victim:
            assert got == want
    assert_no_leaks(engine)


def test_abort_while_swapped_out():
    prompts = [[5] * 30, [7] * 30, [9] * 30]
    engine = engine_with(num_gpu_blocks=12, preemption_mode="swap", swap_space=0.001,
                         enable_chunked_prefill=True, max_num_batched_tokens=64)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    for _ in range(200):
        engine.step()
        if engine.scheduler.swapped:
            break
    assert engine.scheduler.swapped, "no request was swapped out"
    engine.abort(engine.scheduler.swapped[0].request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(engine)


def test_trace_round_trips_through_json(tmp_path):
    engine = engine_with(enable_chunked_prefill=True, max_num_batched_tokens=8)
    recorder = llmlab.Recorder(note="tiny")
    run(engine, [[1, 2, 3] * 5, [4, 5] * 3], [4, 6], recorder=recorder)
    recorder.trace.save(tmp_path / "trace.json")
    loaded = llmlab.Trace.load(tmp_path / "trace.json")
    assert loaded == recorder.trace
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in loaded.steps)
    assert loaded.meta == {"note": "tiny"}


def test_kernel_timings_recorded_when_on():
    engine = engine_with()
    engine.kernel_timing = True
    recorder = llmlab.Recorder()
    run(engine, [[1, 2, 3]], [2], recorder=recorder)
    step = recorder.trace.steps[0]
    assert set(step.kernel_timings) >= {"rms_norm", "rope_store_kv", "prefill_attention", "silu_mul"}
    assert all(t > 0 for t in step.kernel_timings.values())
    assert {"schedule", "prepare", "forward", "sample"} <= set(step.timings)
