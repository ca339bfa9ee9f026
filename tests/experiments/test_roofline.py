"""The per-step bound (experiments/roofline.py) against counts taken from the model itself:
the bytes of the matrices `kernels.linear` reads (LlamaModel.matrices) and of one token's K/V
in the engine's cache, and the FLOPs of those products over a step's rows; then a simulation
at the bound takes the sum of its steps' bounds (tests/bench/test_bench_offline.py: `bench
offline --roofline` reports a run's share of it)."""
from __future__ import annotations

import pytest

from llmlab.engine.batch import dummy_plan
from llmlab.experiments import Workload, simulate
from llmlab.experiments.roofline import Roofline

from helpers.engine import cpu_engine, tiny_model


@pytest.fixture(scope="module")
def engine():
    return cpu_engine(tiny_model(), num_gpu_blocks=64)


def counts(engine, prefills, decodes):
    """(bytes, FLOPs) of a step, counted from the model's matrices and the cache's tensors."""
    model, cache, cfg = engine.runner.model, engine.runner.kv_cache.device, engine.model_config
    matrices = model.matrices()
    kv_token = cache[:, :, 0, 0].numel() * cache.element_size()   # every layer's K and V of one token
    tokens = sum(chunk for chunk, _ in prefills) + len(decodes)
    rows = len(prefills) + len(decodes)                            # each samples (dummy plans' items do)
    moved = sum(w.numel() * w.element_size() for w in matrices) + kv_token * (sum(decodes) + tokens)
    layer_flops = 2 * sum(w.numel() for w in matrices[:-1]) * tokens
    logits_flops = 2 * matrices[-1].numel() * rows
    # query-key pairs: each decode sees its whole context; a chunk of n at p attends causally
    pairs = sum(decodes) + sum(chunk * (context - chunk + (chunk + 1) / 2) for chunk, context in prefills)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs
    return moved, layer_flops + logits_flops + attention


@pytest.mark.parametrize("prefills,decodes", [([], [1]), ([], [5, 40, 17]), ([(30, 30)], []), ([(8, 50)], [3, 64])])
def test_a_step_takes_its_bytes_or_its_flops_at_the_ceilings(engine, prefills, decodes):
    moved, flops = counts(engine, prefills, decodes)
    items = dummy_plan(engine.runner.block_size, prefills, decodes).items
    # bandwidth-bound ceilings (a huge peak), then compute-bound ones (a huge bandwidth)
    by_bytes = Roofline.of_engine(engine, tb_s=1e-6, tflop_s=1e9).step_time(items)
    by_flops = Roofline.of_engine(engine, tb_s=1e9, tflop_s=1e-6).step_time(items)
    assert by_bytes == pytest.approx(moved / 1e6, rel=1e-9)
    assert by_flops == pytest.approx(flops / 1e6, rel=1e-9)
    both = Roofline.of_engine(engine, tb_s=1e-6, tflop_s=1e-6).step_time(items)
    assert both == pytest.approx(max(moved, flops) / 1e6, rel=1e-9)


@pytest.mark.parametrize("prefills,decodes", [([], [5, 40, 17]), ([(8, 50)], [3, 64]), ([(30, 30)], [])])
def test_in_sequence_the_products_attention_and_writes_each_take_their_own_max(engine, prefills, decodes):
    """overlapped=False: the step's matrix products, decode attention, prefill attention and
    K/V writes one after another, each at max(bytes / bandwidth, FLOPs / peak); never less
    than the overlapped bound, and equal to it where one ceiling is far away."""
    model, cache, cfg = engine.runner.model, engine.runner.kv_cache.device, engine.model_config
    matrices = model.matrices()
    kv_token = cache[:, :, 0, 0].numel() * cache.element_size()
    tokens = sum(chunk for chunk, _ in prefills) + len(decodes)
    weights = sum(w.numel() * w.element_size() for w in matrices)
    products = 2 * sum(w.numel() for w in matrices[:-1]) * tokens + 2 * matrices[-1].numel() * (
        len(prefills) + len(decodes))
    per_pair = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    decode_flops = per_pair * sum(decodes)
    prefill_flops = per_pair * sum(chunk * (context - chunk + (chunk + 1) / 2) for chunk, context in prefills)
    read, written = kv_token * sum(decodes), kv_token * tokens
    items = dummy_plan(engine.runner.block_size, prefills, decodes).items
    tb_s, tflop_s = 1e-6, 2e-5   # 1 byte per microsecond, 20 FLOPs per microsecond
    expected = (max(weights, products / 20) + max(read, decode_flops / 20) + prefill_flops / 20 + written) / 1e6
    in_sequence = Roofline.of_engine(engine, tb_s, tflop_s, overlapped=False)
    assert in_sequence.step_time(items) == pytest.approx(expected, rel=1e-9)
    assert in_sequence.step_time(items) >= Roofline.of_engine(engine, tb_s, tflop_s).step_time(items)
    for far in (dict(tb_s=1e9, tflop_s=1e-6), dict(tb_s=1e-6, tflop_s=1e9)):
        assert Roofline.of_engine(engine, **far, overlapped=False).step_time(items) == pytest.approx(
            Roofline.of_engine(engine, **far).step_time(items), rel=1e-6)
    assert in_sequence.meta["roofline"]["overlapped"] is False


def test_a_simulation_at_the_bound_takes_the_sum_of_its_steps(engine):
    roofline = Roofline.of_engine(engine, tb_s=0.01, tflop_s=0.1)
    workload = Workload.throughput(12, 8, 40, vocab_size=engine.model_config.vocab_size)
    result = simulate(workload, engine.config, roofline, record_trace=True)
    assert result.summary()["num_finished"] == 12
    steps = [roofline.step_time(step.scheduled) for step in result.trace.steps]
    assert result.steps[-1].time == pytest.approx(sum(steps))
    assert all(t > 0 for t in steps)


def test_the_ceilings_must_be_positive(engine):
    with pytest.raises(ValueError, match="positive"):
        Roofline.of_engine(engine, tb_s=0.0)
