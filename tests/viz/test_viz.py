"""llmlab.viz: every figure shows what the Trace recorded, on small Traces built by hand and
on short real engine runs; the stepper and the block playground drive real engines."""
import math

import pytest
import torch

import llmlab
from llmlab import EngineConfig, LLMEngine, ModelConfig, SamplingParams, viz
from llmlab.cache.block_manager import BlockManager
from llmlab.hooks import RequestAdded, RequestFinished, ScheduledRecord, StepRecord, Trace
from llmlab.model.llama import LlamaModel

from helpers.engine import cpu_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prefill(rid, n, start=0):
    return ScheduledRecord(rid, "prefill", n, start)


def decode(rid, position):
    return ScheduledRecord(rid, "decode", 1, position)


def hand_trace() -> Trace:
    """Three requests (block size 4, 8 device and 4 host blocks): "0" and "1" prefill, "1" is
    swapped out and back in, "2" waits, is preempted by recompute and prefills again;
    "0" and "2" share block 0 for a while."""
    def step(i, scheduled, tables, free, **kw):
        return StepRecord(step=i, scheduled=scheduled, block_tables=tables, free_device_blocks=free,
                          total_device_blocks=8, total_host_blocks=4, free_host_blocks=4 - sum(
                              len(t) for t in kw.get("host_block_tables", {}).values()),
                          token_budget=8, timings={"schedule": 0.001, "forward": 0.01 * (i + 1)},
                          time=100.0 + i, **kw)
    steps = [
        step(0, [prefill("0", 6), prefill("1", 2)], {"0": [0, 1], "1": [2]}, 5, waiting=["2"],
             allocated_blocks={"0": [0, 1], "1": [2]}, sampled={"0": 11}),
        step(1, [prefill("1", 3, 2), decode("0", 6)], {"0": [0, 1], "1": [2, 3]}, 4, waiting=["2"],
             sampled={"0": 12, "1": 21}),
        step(2, [decode("0", 7)], {"0": [0, 1]}, 6, swapped_out=["1"], host_block_tables={"1": [0, 1]},
             waiting=["2"], sampled={"0": 13}),
        step(3, [prefill("2", 1, 4)], {"0": [0, 1], "2": [0, 4]}, 5, host_block_tables={"1": [0, 1]},
             prefix_hit_tokens={"2": 4}, shared_blocks=[0], cached_blocks=[0], sampled={"2": 31}),
        step(4, [decode("0", 8)], {"0": [0, 1, 5]}, 5, preempted=["2"], waiting=["2"],
             host_block_tables={"1": [0, 1]}, cached_blocks=[0], sampled={"0": 14}, finished={"0": "length"}),
        step(5, [decode("1", 5), prefill("2", 6)], {"1": [6, 7], "2": [0, 1]}, 4, swapped_in=["1"],
             cached_blocks=[0], sampled={"1": 22, "2": 32}, finished={"1": "length", "2": "length"}),
    ]
    added = [RequestAdded("0", 6, 99.5), RequestAdded("1", 5, 99.5), RequestAdded("2", 5, 99.8)]
    finished = [RequestFinished("0", "length", 4, 104.0), RequestFinished("1", "length", 2, 105.0),
                RequestFinished("2", "length", 2, 105.0)]
    return Trace(steps=steps, added=added, finished=finished, meta={"block_size": 4})


# ---- figures from hand-built traces ---------------------------------------------------------
def test_batch_composition_bars_equal_the_trace():
    trace = hand_trace()
    fig = viz.batch_composition(trace, current_step=3)
    decode, prefill_bars, budget = fig.data
    assert list(decode.y) == [0, 1, 1, 0, 1, 1]
    assert list(prefill_bars.y) == [8, 3, 0, 1, 0, 6]
    assert list(decode.x) == list(prefill_bars.x) == [0, 1, 2, 3, 4, 5]
    assert list(budget.y) == [8] * 6
    assert fig.layout.barmode == "stack"
    assert fig.layout.shapes[0].x0 == 3
    assert "req 0: prefill 6 @ 0" in decode.customdata[0]


def test_block_table_rows_are_block_tables_and_pool_row_shows_state():
    trace = hand_trace()
    fig = viz.block_table(trace, 3)
    device, host = fig.data[0], fig.data[1]
    assert list(device.y) == ["device pool", "req 0", "req 2"]
    # each request row holds its logical block index at its physical block's column
    assert list(device.text[1][:2]) == ["0", "1"] and device.text[2][0] == "0" and device.text[2][4] == "1"
    assert list(device.text[1][2:]) == [""] * 6
    code_0, code_2 = device.z[1][0], device.z[2][4]       # each request's colour code
    assert code_0 != code_2
    pool = device.z[0]
    assert pool[0] == 2.5                            # block 0 shared by "0" and "2"
    assert pool[1] == code_0 and pool[4] == code_2
    assert pool[5] == pool[6] == pool[7] == 0.5      # free
    # tokens held per block: "0" has 8 tokens (blocks 0, 1 full), "2" has 5 (4 shared + 1)
    assert list(device.text[0][:5]) == ["4", "4", "", "", "1"]
    # host side: "1" is swapped out to host blocks 0 and 1
    assert list(host.y) == ["host pool", "req 1"]
    assert list(host.text[1]) == ["0", "1", "", ""]
    assert host.z[0][0] == host.z[1][0] and host.z[0][3] == 0.5
    # a request keeps its palette colour: code c is drawn with colorscale entry 2c
    color = lambda heatmap, z: heatmap.colorscale[int(z) * 2][1]   # noqa: E731
    assert color(device, code_0) == viz.request_color("0")
    assert color(host, host.z[1][0]) == viz.request_color("1")


def test_block_table_of_a_bare_step_record_has_no_token_counts():
    fig = viz.block_table(hand_trace().steps[3])
    assert all(t == "" for t in fig.data[0].text[0])
    assert list(fig.data[0].y) == ["device pool", "req 0", "req 2"]


def test_block_table_of_a_step_record_with_token_counts():
    record = StepRecord(step=0, block_tables={"a": [3, 1]}, total_device_blocks=4, free_device_blocks=2,
                        cached_blocks=[0])
    fig = viz.block_table(record, num_tokens={"a": 6}, block_size=4)
    assert list(fig.data[0].text[0]) == ["", "2", "", "4"]
    assert fig.data[0].z[0][0] == 1.5 and fig.data[0].z[0][2] == 0.5   # cached-free vs free
    assert list(fig.data[0].text[1]) == ["", "1", "", "0"]


def test_request_states_follow_the_scheduler():
    states = viz.request_states(hand_trace())
    assert states["0"] == ["prefill", "decode", "decode", "idle", "decode", None]
    assert states["1"] == ["prefill", "prefill", "swapped", "swapped", "swapped", "decode"]
    assert states["2"] == ["waiting", "waiting", "waiting", "prefill", "preempted", "prefill"]


def test_request_timeline_bars_cover_each_state_run():
    trace = hand_trace()
    fig = viz.request_timeline(trace)
    bars = {t.name: t for t in fig.data}
    assert list(bars) == ["waiting", "prefill", "decode", "preempted", "swapped", "idle"]
    swapped = bars["swapped"]
    assert list(swapped.y) == ["req 1"] and list(swapped.base) == [1.5] and list(swapped.x) == [3]
    assert list(bars["preempted"].y) == ["req 2"] and list(bars["preempted"].base) == [3.5]
    # every recorded (request, step) with a state is covered exactly once
    covered = sum(sum(t.x) for t in fig.data)
    assert covered == sum(s is not None for per in viz.request_states(trace).values() for s in per)
    in_time = viz.request_timeline(trace, x="time")
    assert in_time.layout.xaxis.title.text.startswith("time")
    assert in_time.data[4].base[0] == pytest.approx(1500.0)   # swapped from step 2's start: 101.0 - 99.5 s
    with pytest.raises(ValueError, match="x must be"):
        viz.request_timeline(trace, x="tokens")


def test_memory_and_timing_figures_sum_the_trace():
    trace = hand_trace()
    used, host = viz.memory_usage(trace).data
    assert list(used.y) == [3, 4, 2, 3, 3, 4]
    assert list(host.y) == [0, 0, 2, 2, 2, 0]
    phases = {t.name: t for t in viz.phase_timings(trace).data}
    assert list(phases["forward"].y) == pytest.approx([10.0 * (i + 1) for i in range(6)])
    assert sum(phases["sample"].y) == 0
    trace.steps[0].kernel_timings = {"rope": 0.002, "rms_norm": 0.001}
    kernels = viz.kernel_timings(trace).data[0]
    assert list(kernels.y) == ["rms_norm", "rope", "forward, outside kernels"]
    assert list(kernels.x) == pytest.approx([1.0, 2.0, 7.0])


def test_latencies_and_prefix_hits():
    trace = hand_trace()
    latencies = viz.request_latencies(trace)
    assert latencies["0"]["ttft"] == pytest.approx(0.5)
    assert latencies["0"]["itl"] == pytest.approx([1.0, 1.0, 2.0])
    assert latencies["2"]["ttft_steps"] == 1 and latencies["1"]["ttft_steps"] == 2
    fig = viz.latency_comparison({"run": trace})
    assert fig.data[0].y[0] == pytest.approx((0.5 + 1.5 + 3.2) / 3 * 1e3)
    assert fig.data[2].y[0] == pytest.approx(4e3)          # worst gap: request 1's 4 s while swapped out
    fig = viz.latency_comparison({"run": trace}, ttft_requests=["2"], itl_requests=["0"])
    assert fig.data[0].y[0] == pytest.approx(3.2e3) and fig.data[2].y[0] == pytest.approx(2e3)
    hits = viz.prefix_hits(trace)
    assert list(hits.data[0].y) == [0, 0, 4] and list(hits.data[1].y) == [6, 5, 1]
    assert "25%" in hits.layout.title.text        # 4 of 16 prompt tokens


def test_trace_saved_and_loaded_draws_the_same(tmp_path):
    trace = hand_trace()
    trace.save(tmp_path / "trace.json")
    again = Trace.load(tmp_path / "trace.json")
    for draw in (viz.batch_composition, viz.request_timeline, viz.memory_usage):
        assert draw(again).to_plotly_json()["data"] == draw(trace).to_plotly_json()["data"]
    assert viz.block_table(again, 2).data[1].z == viz.block_table(trace, 2).data[1].z


# ---- figures from real engine runs ------------------------------------------------------------
TINY = ModelConfig(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0)


@pytest.fixture(scope="module")
def tiny_model():
    return LlamaModel.random(TINY, torch.float32, torch.device("cpu"), seed=0)


def tiny_engine(model, **overrides):
    config = dict(num_gpu_blocks=12, block_size=4, max_num_batched_tokens=16)
    return cpu_engine(model, **{**config, **overrides})


def workload(lengths_and_arrivals, params=GREEDY):
    # each prompt its own tokens: with prefix caching (on by default) prompts that start alike
    # would share blocks, and these tests are about memory pressure and what the figures draw
    return [viz.Arrival(list(range(1 + 20 * i, 1 + 20 * i + n)), params, step)
            for i, (n, step) in enumerate(lengths_and_arrivals)]


def assert_figures_match(trace):
    comp = viz.batch_composition(trace)
    assert list(comp.data[1].y) == [s.num_prefill_tokens for s in trace.steps]
    assert list(comp.data[0].y) == [s.num_decode_tokens for s in trace.steps]
    for index, record in enumerate(trace.steps):
        device, host = viz.block_table(trace, index, max_blocks=1000).data[:2]
        for panel, tables in ((device, record.block_tables), (host, record.host_block_tables)):
            for row, label in enumerate(panel.y[1:], start=1):
                rid = label.removeprefix("req ")
                shown = {int(b): int(t) for b, t in zip(panel.x, panel.text[row]) if t != ""}
                assert shown == {b: i for i, b in enumerate(tables[rid])}
            assert len(panel.y) == 1 + len(tables)
        free = sum(z in (0.5, 1.5) for z in device.z[0])
        assert free == record.free_device_blocks


def test_figures_of_a_run_under_memory_pressure(tiny_model):
    engine = tiny_engine(tiny_model, preemption_mode="swap", swap_space=0.0001)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    trace = viz.record(engine, workload([(10, 0), (7, 0), (13, 2), (5, 4)], params))
    assert any(s.swapped_out for s in trace.steps), "the workload should force a swap"
    assert trace.meta["block_size"] == 4
    assert_figures_match(trace)
    states = viz.request_states(trace)
    for i, record in enumerate(trace.steps):
        for item in record.scheduled:
            assert states[item.request_id][i] == item.kind
        for rid in record.host_block_tables:
            assert states[rid][i] == "swapped"


def test_recompute_preemption_shows_in_the_timeline(tiny_model):
    engine = tiny_engine(tiny_model, num_gpu_blocks=8)
    trace = viz.record(engine, workload([(10, 0), (9, 0), (8, 1)]))
    preempted = [rid for s in trace.steps for rid in s.preempted]
    assert preempted
    states = viz.request_states(trace)
    assert "preempted" in states[preempted[0]]
    bars = {t.name: t for t in viz.request_timeline(trace).data}
    assert f"req {preempted[0]}" in list(bars["preempted"].y)
    assert_figures_match(trace)


def test_record_adds_requests_at_their_arrival_step(tiny_model):
    engine = tiny_engine(tiny_model, num_gpu_blocks=32)
    trace = viz.record(engine, workload([(5, 0), (5, 3), (5, 20)]))
    first = {}
    for i, s in enumerate(trace.steps):
        for item in s.scheduled:
            first.setdefault(item.request_id, i)
    assert first["0"] == 0 and first["1"] == 3
    assert first["2"] == 9      # idle after request 1 finishes: the driver skips to the next arrival
    assert len(trace.added) == 3 and engine.kv_stats()["free_device_blocks"] == 32


def test_attention_probs_reproduce_the_models_attention(tiny_model):
    engine = tiny_engine(tiny_model, num_gpu_blocks=8)
    tokens = [5, 17, 3, 99, 42, 8, 8, 1, 64]
    with tiny_model.capture(["layers.1.q", "layers.1.k", "layers.1.v", "layers.1.attn"]) as taps:
        engine.add_request(tokens, SamplingParams(max_tokens=1))
        engine.step()
    q, k, v = taps["layers.1.q"][0], taps["layers.1.k"][0], taps["layers.1.v"][0]
    weights = viz.attention_probs(q, k, torch.arange(len(tokens)), TINY)
    assert weights.shape == (4, 9, 9)
    assert torch.allclose(weights.sum(-1), torch.ones(4, 9))
    assert torch.all(weights.triu(diagonal=1) == 0)               # causal
    v = v.repeat_interleave(2, dim=1)                              # GQA: 2 query heads per kv head
    heads = torch.einsum("hts,shd->thd", weights, v).reshape(len(tokens), -1)
    out = heads @ tiny_model.layers[1].o_proj.T
    # fp32 attention computed two ways (softmax then matmul vs the kernel's own order)
    assert torch.allclose(out, taps["layers.1.attn"][0], atol=1e-5)
    fig = viz.attention_heatmap(weights[0], [str(t) for t in tokens])
    assert fig.data[0].z[0][0] == pytest.approx(1.0) and len(fig.data[0].x) == 9


def test_token_distribution_keeps_the_first_settings_order():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    probs = {"t=1": logits.softmax(-1), "t=0.5": (logits / 0.5).softmax(-1)}
    fig = viz.token_distribution(probs, top=3)
    assert list(fig.data[0].x) == ["1", "3", "2"]
    assert list(fig.data[1].y) == pytest.approx(probs["t=0.5"][[1, 3, 2]].tolist())


# ---- kernel figures ----------------------------------------------------------------------------
def test_rope_rotation_draws_each_pair_across_positions():
    rotated = torch.arange(5 * 8, dtype=torch.float32).view(5, 8)     # 5 positions, head dim 8
    fig = viz.rope_rotation(rotated, pairs=[0, 3])
    points = [t for t in fig.data if t.mode == "markers+text"]
    assert [t.name for t in points] == ["pair (0, 4)", "pair (3, 7)"]
    assert list(points[1].x) == rotated[:, 3].tolist() and list(points[1].y) == rotated[:, 7].tolist()
    assert list(points[0].text) == ["0", "1", "2", "3", "4"]
    circle = fig.data[3]                               # pair 3's circle: radius |(x[0, 3], x[0, 7])|
    assert math.hypot(circle.x[0], circle.y[0]) == pytest.approx(math.hypot(3.0, 7.0))


def test_online_softmax_steps_end_at_the_softmax():
    x = torch.tensor([0.5, -1.0, 2.0, 0.0, 3.0, 1.0, -2.0])
    maxes, sums = [], []
    m, l = -math.inf, 0.0
    for start in range(0, 7, 3):                      # tiles of 3: [0:3], [3:6], [6:7]
        tile = x[start:start + 3]
        new_m = max(m, tile.max().item())
        l = l * math.exp(m - new_m) + torch.exp(tile - new_m).sum().item()
        m = new_m
        maxes.append(m)
        sums.append(l)
    fig = viz.online_softmax_steps(x, maxes, sums, block=3)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [list(b.x) for b in bars] == [[0, 1, 2], [3, 4, 5], [6]]
    running_max = next(t for t in fig.data if t.name == "running max m")
    assert list(running_max.y) == [2.0] * 3 + [3.0] * 4
    last = next(t for t in fig.data if t.name == "after tile 2")
    assert list(last.y) == pytest.approx(x.softmax(-1).tolist(), abs=1e-6)
    first = next(t for t in fig.data if t.name == "after tile 0")
    assert list(first.y) == pytest.approx(x[:3].softmax(-1).tolist(), abs=1e-6)   # exact over what it has seen


@pytest.mark.slow
def test_record_launches_sees_the_launchers_grid():
    from llmlab import kernels
    from llmlab.kernels.triton import rms_norm as triton_rms_norm, silu_mul as triton_silu_mul

    x, weight = torch.randn(3, 40), torch.randn(40)
    with viz.record_launches(triton_rms_norm) as launches:
        out = kernels.rms_norm(x, weight, 1e-5, backend="triton")
    assert torch.allclose(out, kernels.rms_norm(x, weight, 1e-5, backend="torch"), atol=1e-5)
    assert launches == [viz.Launch("rms_norm", (3,), {"HAS_RESIDUAL": False, "BLOCK": 64})]
    assert launches[0].num_programs == 3
    assert type(triton_rms_norm._rms_norm_kernel).__name__ != "Recording"      # put back
    with viz.record_launches(triton_silu_mul) as launches:
        kernels.silu_mul(torch.randn(2, 2 * 2100), backend="triton")
    assert launches[0].grid == (2, 2) and launches[0].constants["BLOCK"] == 2048


def test_program_map_colours_each_program():
    owner = torch.tensor([[0, 0, 1], [2, 2, -1]])
    fig = viz.program_map(owner, ["a", "b", "c"])
    heatmap = fig.data[0]
    assert [list(row) for row in heatmap.z] == [[0, 0, 1], [2, 2, None]]
    assert list(heatmap.customdata[1]) == ["c", "c", "no program"]
    assert heatmap.colorscale[0][1] != heatmap.colorscale[2][1]      # programs 0 and 1 differ


@pytest.mark.parametrize("num_queries, seq_len, block_m, block_n",
                         [(10, 10, 4, 4), (7, 23, 4, 8), (16, 40, 8, 4), (5, 5, 64, 32), (96, 160, 64, 32)])
def test_prefill_tile_schedule_covers_exactly_the_causal_mask(num_queries, seq_len, block_m, block_n):
    context_len = seq_len - num_queries
    schedule = viz.prefill_tile_schedule(num_queries, seq_len, block_m, block_n)
    assert [t["rows"][0] for t in schedule] == list(range(0, num_queries, block_m))
    for tile in schedule:
        assert sorted(tile["unmasked"] + tile["masked"] + tile["skipped"]) == list(range(0, seq_len, block_n))
        rows = range(*tile["rows"])
        for start in range(0, seq_len, block_n):
            keys = range(start, min(seq_len, start + block_n))
            visible = [key <= context_len + row for row in rows for key in keys]
            if start in tile["unmasked"]:
                assert all(visible)
            if start in tile["skipped"]:
                assert not any(visible)
    fig = viz.prefill_tiles(num_queries, seq_len, block_m, block_n, block_size=4)
    z = fig.data[0].z
    for row in range(num_queries):
        for key in range(seq_len):
            if key <= context_len + row:
                assert z[row][key] in (1, 2)         # every visible pair is computed ...
            else:
                assert z[row][key] in (0, 3)         # ... every hidden one skipped or masked


def test_decode_split_ranges_partition_the_context():
    for seq_len, num_splits, block_n in [(100, 4, 32), (256, 4, 32), (33, 8, 32), (32768, 66, 64)]:
        ranges = viz.decode_split_ranges(seq_len, num_splits, block_n)
        assert len(ranges) == num_splits
        covered = [k for start, end in ranges for k in range(start, end)]
        assert covered == list(range(seq_len))                # each key read by exactly one split
        assert all(start % block_n == 0 for start, _ in ranges)
    assert viz.decode_split_ranges(33, 8, 32)[2:] == [(64, 33), (96, 33), (128, 33), (160, 33), (192, 33),
                                                      (224, 33)]   # empty: past a short sequence
    fig = viz.decode_splits([40, 16], 2, block_n=16, block_tables=[[7, 3, 9], [5]], block_size=16)
    heatmap = fig.data[0]
    assert [list(row) for row in heatmap.z] == [[0, 0, 1], [0, None, None]]   # 3 tiles of 16: 2 per split
    assert [list(row) for row in heatmap.text] == [["7", "3", "9"], ["5", "", ""]]


def test_kernel_benchmark_and_serving_latency_draw_their_numbers():
    rows = [{"shape": "a", "impl": "v1", "ms": 2.0}, {"shape": "a", "impl": "v2", "ms": 0.5},
            {"shape": "b", "impl": "v1", "ms": 1.0}]
    fig = viz.kernel_benchmark(rows, "test")
    assert [t.name for t in fig.data] == ["v1", "v2"]
    assert list(fig.data[0].y) == [2.0, 1.0] and list(fig.data[1].y) == [0.5, None]
    stats = lambda base: {"mean": base, "p50": base, "p90": base + 1, "p99": base + 2}   # noqa: E731
    report = {"results": [{"rate": 1.0, "ttft_ms": stats(10), "tpot_ms": stats(5), "e2e_ms": stats(50)},
                          {"rate": float("inf"), "ttft_ms": stats(20), "tpot_ms": stats(6), "e2e_ms": stats(90)}]}
    fig = viz.serving_latency(report)
    assert len(fig.data) == 9
    p99_e2e = [t for t in fig.data if t.name == "p99"][2]
    assert list(p99_e2e.x) == ["1 req/s", "inf req/s"] and list(p99_e2e.y) == [52, 92]


@pytest.mark.slow
def test_figures_of_the_embedded_model(llm):
    """A short real run of SmolLM2 with prefix caching: the figures show what happened."""
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", backend="torch", num_gpu_blocks=64,
                                    block_size=4, enable_prefix_caching=True, max_num_batched_tokens=32),
                       model=llm.engine.model, tokenizer=llm.tokenizer)
    engine.kernel_timing = True
    system = "You are a helpful assistant. Answer briefly."
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    trace = viz.record(engine, [viz.Arrival(system + " Hi!", params, 0),
                                viz.Arrival(system + " What is 2+2?", params, 2)])
    assert_figures_match(trace)
    hits = viz.prefix_hits(trace).data[0].y
    assert hits[0] == 0 and hits[1] >= 8
    shared = [s for s in trace.steps if s.shared_blocks]
    assert shared, "the second request should share the first one's prompt blocks"
    pool = viz.block_table(trace, trace.steps.index(shared[0])).data[0].z[0]
    assert all(pool[b] == 2.5 for b in shared[0].shared_blocks)
    names = list(viz.kernel_timings(trace).data[0].y)
    assert {"rms_norm", "rope_store_kv", "prefill_attention"} <= set(names)


# ---- widgets -------------------------------------------------------------------------------
def test_no_widget_frontend_outside_jupyterlab(monkeypatch):
    monkeypatch.delenv("LLMLAB_WIDGETS", raising=False)
    assert not viz.has_widget_frontend()
    monkeypatch.setenv("LLMLAB_WIDGETS", "1")
    assert viz.has_widget_frontend()


def test_stepper_steps_scrubs_and_resets(tiny_model):
    engine = tiny_engine(tiny_model, num_gpu_blocks=16)
    stepper = viz.Stepper(engine, workload([(6, 0), (9, 1)]))
    assert stepper.figures["block_table"].layout.title.text == "KV block table (no step yet)"
    stepper.step(2)
    assert len(stepper.trace.steps) == 2
    assert list(stepper.figures["batch_composition"].data[1].y) == [6, 9]
    assert stepper.figures["block_table"].layout.title.text.endswith(f"step {len(stepper.trace.steps) - 1}")
    stepper.show_step(0)
    assert list(stepper.figures["block_table"].data[0].y) == ["device pool", "req 0"]
    assert stepper.figures["request_timeline"].layout.shapes[0].x0 == 0
    stepper.add([7, 7, 7], GREEDY)
    stepper.run()
    assert stepper.done and len(stepper.outputs) == 3
    assert all(o.finished for o in stepper.outputs.values())
    stepper.reset()
    assert not stepper.trace.steps and len(stepper.pending) == 2
    assert engine.kv_stats()["free_device_blocks"] == 16


def test_stepper_widget_updates_its_figures_in_place(tiny_model):
    pytest.importorskip("ipywidgets")
    engine = tiny_engine(tiny_model, num_gpu_blocks=16)
    stepper = viz.Stepper(engine, workload([(6, 0), (9, 1)]))
    ui = stepper.widget
    buttons = {b.description: b for box in ui.children[:2] for b in box.children if hasattr(b, "on_click")}
    assert {"Step", "Run N", "Reset", "Add request"} <= set(buttons)
    views = stepper._views
    buttons["Step"].click()
    buttons["Step"].click()
    assert len(stepper.trace.steps) == 2 and stepper._slider.max == 1
    view = views["block_table"]       # the same Output widget, showing the newest figure
    assert list(view.figure.data[0].y) == list(stepper.figures["block_table"].data[0].y)
    assert view.figure.layout.title.text == stepper.figures["block_table"].layout.title.text
    assert list(views["batch_composition"].figure.data[1].y) == [6, 9]
    stepper._slider.value = 0
    assert stepper.position == 0
    assert stepper.figures["block_table"].layout.title.text.endswith("step 0")
    buttons["Reset"].click()
    assert not stepper.trace.steps


def test_block_playground_drives_a_block_manager():
    playground = viz.BlockPlayground(BlockManager(8, 4, block_size=4, enable_prefix_caching=True))
    a = playground.allocate("a", 6)
    assert a.block_table == [0, 1]
    playground.append("a", 3)                       # 9 tokens: a third block
    assert a.block_table == [0, 1, 2]
    b = playground.fork("a", "b")                   # full blocks shared, the partial one not
    assert b.block_table[:2] == [0, 1] and b.block_table[2] not in a.block_table
    fig = playground.figure()
    pool = fig.data[0].z[0]
    assert pool[0] == pool[1] == 2.5 and list(fig.data[0].text[0][:4]) == ["4", "4", "1", "1"]
    playground.swap_out("a")
    assert list(playground.figure().data[1].y) == ["host pool", "req a"]
    playground.swap_in("a")
    playground.free("a")
    held = list(b.block_table)
    assert sorted(playground.free("b")) == sorted(held)
    assert playground.block_manager.num_free_blocks == 8
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        playground.allocate("big", 100)
