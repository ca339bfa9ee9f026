"""Pipeline parallelism: a model cut into stages of layers computes what the whole model does.

Without processes: the stages' layer ranges and weights cover the model once; a step's
batch cut into micro-batches at sequence boundaries, run one micro-batch after another,
gives the whole batch's logits. With processes (gloo on CPU, as the TP tests): PP=2 on a
4-layer tiny model (2 layers a rank, preemption by swap on both stages' caches) and TP=2 x
PP=2 (4 ranks) give TP=1's tokens and logits; PP=2 on the embedded model its greedy text;
a recorded timeline has every rank's micro-batches in causal order; a worker killed
inside a step is reported by rank 0, which does not hang.
"""
from __future__ import annotations

import argparse
import dataclasses
import multiprocessing

import pytest
import torch
import torch.distributed as dist

import llmlab
from llmlab import EngineConfig, LLMEngine
from llmlab.bench import offline
from llmlab.cli_flags import add_engine_arguments, engine_kwargs
from llmlab.config import ModelConfig
from llmlab.engine import batch as batches
from llmlab.engine.parallel.pipeline import StageSpan, micro_batch_cuts, micro_batches
from llmlab.engine.parallel.placement import RankLayout, stage_layers, weights_of_stage
from llmlab.model.llama import LlamaModel
from llmlab.model.tensor_parallel import named_weights
from llmlab.viz import parallel_figures
from helpers.parallel import ATOL, GREEDY, RTOL, TINY_VOCAB, build_tiny, greedy_run, kill_mid_step, shut_down


def tiny_config(num_layers=5, tied=False):
    return ModelConfig(model_type="llama", vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96,
                       num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                       rope_theta=10000.0, tie_word_embeddings=tied)


# ---- stages and micro-batches (no processes) -----------------------------------------------

def test_stages_are_contiguous_and_the_first_ones_get_the_extra_layers():
    assert stage_layers(30, 2) == [range(0, 15), range(15, 30)]
    assert [len(r) for r in stage_layers(30, 4)] == [8, 8, 7, 7]
    assert stage_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 is more than the model's 2 layers"):
        stage_layers(2, 3)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        EngineConfig(pipeline_parallel_size=0)


def test_pp_flag_comes_from_engine_config():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_kwargs(parser.parse_args(["--pp", "2", "--tp", "3"])) == {
        "pipeline_parallel_size": 2, "tensor_parallel_size": 3}


@pytest.mark.parametrize("tied", [False, True])
def test_the_stages_weights_are_the_model_each_weight_once(tied):
    model = LlamaModel.random(tiny_config(tied=tied), torch.float32, "cpu")
    layout = RankLayout(0, tp=1, pp=2, num_layers=5)
    first, last = weights_of_stage(model, layout, 0), weights_of_stage(model, layout, 1)
    # layers 0-2 on stage 0, 3-4 on stage 1, renumbered from 0 on each
    assert first["layers.2.qkv"] is model.layers[2].qkv and last["layers.0.qkv"] is model.layers[3].qkv
    assert "layers.3.qkv" not in first and "layers.2.qkv" not in last
    assert "embed" in first and "norm" not in first and "lm_head" not in first
    assert "embed" not in last and last["norm"] is model.norm and last["lm_head"] is model.lm_head
    # every weight on exactly one stage; a tied embedding on both ends (it is the lm_head too)
    held = sorted(id(t) for t in [*first.values(), *last.values()])
    assert held == sorted([id(t) for t in named_weights(model).values()] + ([id(model.embed)] if tied else []))


def test_cuts_fall_between_sequences_near_equal_token_counts():
    # prefill chunks of 5 (mid-prompt: samples nothing) and 12 tokens, then 4 decodes
    cu, logits_indices = [0, 5, 17], [16, 17, 18, 19, 20]
    # half of 21 tokens is 10.5: the cut comes after the 12-token chunk, at row 17
    assert micro_batch_cuts(cu, 4, logits_indices, 2) == [(0, 0, 0, 0), (17, 2, 0, 1), (21, 2, 4, 5)]
    # 3 micro-batches: a third of 21 tokens is 7 (the cut comes at row 17); the 4 tokens
    # left, shared by 2, put the next cut at row 19
    assert micro_batch_cuts(cu, 4, logits_indices, 3) == [(0, 0, 0, 0), (17, 2, 0, 1), (19, 2, 2, 3),
                                                         (21, 2, 4, 5)]
    # never more micro-batches than sequences, and never an empty one
    cuts = micro_batch_cuts([0, 30], 2, [29, 30, 31], 8)
    assert cuts == [(0, 0, 0, 0), (30, 1, 0, 1), (31, 1, 1, 2), (32, 1, 2, 3)]


def test_micro_batches_one_after_another_give_the_whole_batch_logits():
    """Sequences only meet in the matrix products, so running the micro-batches in turn
    (each through every layer) is the whole batch's forward, row for row."""
    model = LlamaModel.random(tiny_config(num_layers=2), torch.float32, "cpu")
    plan = batches.dummy_plan(4, prefills=[(5, 9), (12, 12)], decodes=[3, 20, 7, 1])
    input_ids, positions, batch = batches.prepare(plan, 4, torch.device("cpu"), backend="torch")
    input_ids = torch.randint(0, TINY_VOCAB, input_ids.shape, generator=torch.Generator().manual_seed(0))
    num_blocks = batches.num_blocks_of(plan, 4)

    def fresh_cache():
        return torch.zeros(2, 2, num_blocks, 4, 2, 16)

    whole = model.forward(input_ids, positions, batch, fresh_cache())
    cache = fresh_cache()
    cuts = micro_batch_cuts(batch.prefill_cu_seqlens_q.tolist(), 4, batch.logits_indices.tolist(), 3)
    parts = [model.forward(m.input_ids, m.positions, m.batch, cache)
             for m in micro_batches(input_ids, positions, batch, cuts)]
    assert len(parts) == 3 and sum(p.shape[0] for p in parts) == whole.shape[0] == 6
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=1e-5)


def test_placement_figures_draw_what_each_rank_holds():
    config = dataclasses.replace(tiny_config(num_layers=5), num_heads=9, num_kv_heads=3)
    z = parallel_figures.tensor_parallel_placement(config, tp=3).data[0].z    # rank + 1 where held
    for rank in range(3):
        assert z[rank][:9] == [rank + 1 if h // 3 == rank else 0 for h in range(9)]        # its 3 q heads
        assert z[rank][9:12] == [rank + 1 if h == rank else 0 for h in range(3)]          # their kv head
        assert z[rank][-1] == rank + 1                                                    # norms: everyone
    z = parallel_figures.pipeline_placement(config, tp=2, pp=2).data[0].z
    # columns: embedding, layers 0-4, final norm, lm_head; ranks 0, 1 are stage 0 (layers 0-2)
    assert z[1] == [2, 2, 2, 2, 0, 0, 0, 0] and z[3] == [0, 0, 0, 0, 4, 4, 4, 4]


def test_timeline_figure_has_a_bar_per_rank_and_micro_batch():
    spans = [StageSpan(0, rank, rank, m, 5, 1.0 + 0.1 * (rank + m), 1.1 + 0.1 * (rank + m))
             for rank in range(2) for m in range(2)]
    fig = parallel_figures.pipeline_timeline(spans, note="test")
    assert [trace.name for trace in fig.data] == ["micro-batch 0", "micro-batch 1"]
    assert [round(b) for b in fig.data[1].base] == [100, 200]           # ms from the first start
    # 4 spans of 0.1 s on 2 ranks over 0.3 s: busy 2/3 of the time
    assert parallel_figures.busy_fraction(spans) == pytest.approx(2 / 3)


# ---- the pipelined engine against the whole model -----------------------------------------------

def engines(folder, **engine_kwargs):
    def engine(**parallel):
        return LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", backend="torch",
                                      **engine_kwargs, **parallel))
    return engine


@pytest.mark.parametrize("parallel, engine_kwargs", [
    # 2 layers a rank; a tight cache: requests are swapped out and back in on both stages
    (dict(pipeline_parallel_size=2),
     dict(num_gpu_blocks=12, block_size=4, preemption_mode="swap", swap_space=0.001)),
    # 4 ranks: 2 stages of 2 tensor-parallel ranks each (kv heads split 1 a rank)
    (dict(pipeline_parallel_size=2, tensor_parallel_size=2), dict(num_gpu_blocks=64, block_size=16)),
], ids=["pp2-swap", "tp2xpp2"])
@pytest.mark.slow
def test_tiny_model_gives_the_same_logits(tmp_path, parallel, engine_kwargs):
    folder = build_tiny(tmp_path / "model", "LlamaConfig", "LlamaForCausalLM", num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=generator).tolist() for n in (18, 11, 25)]
    engine = engines(folder, **engine_kwargs)
    whole, whole_logits, whole_trace = greedy_run(engine(), prompts)
    pipelined = engine(**parallel)
    try:
        assert pipelined.model_config.num_layers == 2               # rank 0 holds half the layers
        assert pipelined.kv_cache.device.shape[0] == 2              # and only their KV cache
        out, logits, _ = greedy_run(pipelined, prompts)
    finally:
        shut_down(pipelined)
    assert [o.token_ids for o in out] == [o.token_ids for o in whole]
    assert len(logits) == len(whole_logits)
    for got, want in zip(logits, whole_logits):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    if engine_kwargs.get("preemption_mode") == "swap":
        assert any(step.swapped_out for step in whole_trace.steps), "no request was swapped out"


@pytest.mark.slow
def test_embedded_model_pp2_gives_the_same_greedy_text(llm):
    prompts = ["What is the capital of France?", "Write a short poem about autumn leaves falling."]
    reference = llm.generate(prompts, GREEDY)
    pipelined = llmlab.LLM(device="cpu", dtype="float32", backend="torch", num_gpu_blocks=64,
                           swap_space=0.01, pipeline_parallel_size=2)
    try:
        assert pipelined.engine.model_config.num_layers == 15
        outputs = pipelined.generate(prompts, GREEDY)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
        assert [o.text for o in outputs] == [o.text for o in reference]
    finally:
        shut_down(pipelined.engine)



@pytest.mark.slow
def test_pp2_under_async_scheduling_gives_the_same_tokens(tmp_path):
    """Async scheduling (on by default on GPUs) feeds a step's sampled tokens to the next
    step on the device, before the host sees them: the broadcast must carry them."""
    folder = build_tiny(tmp_path / "model", "LlamaConfig", "LlamaForCausalLM", num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=generator).tolist() for n in (18, 11, 25)]
    engine = engines(folder, num_gpu_blocks=64)
    whole = llmlab.LLM.from_engine(engine()).generate(prompts, GREEDY)
    pipelined = engine(pipeline_parallel_size=2, async_scheduling=True)
    try:
        out = llmlab.LLM.from_engine(pipelined).generate(prompts, GREEDY)
    finally:
        shut_down(pipelined)
    assert [o.token_ids for o in out] == [o.token_ids for o in whole]

@pytest.fixture
def tiny_pp2_engine(tmp_path):
    folder = build_tiny(tmp_path / "model", "LlamaConfig", "LlamaForCausalLM", num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2)
    engine = engines(folder, num_gpu_blocks=16)(pipeline_parallel_size=2)
    yield engine
    engine.executor.shutdown()
    assert multiprocessing.active_children() == [] and not dist.is_initialized()


@pytest.mark.slow
def test_a_timeline_holds_every_rank_s_micro_batches_in_causal_order(tiny_pp2_engine):
    engine = tiny_pp2_engine
    for n in (9, 14, 6):
        engine.add_request(list(range(1, n + 1)), GREEDY)
    engine.executor.record_timeline = True
    engine.step()                           # one prefill step of 3 sequences: 2 micro-batches
    spans = {(s.rank, s.micro_batch): s for s in engine.executor.timeline}
    assert sorted(spans) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # 29 tokens: the cut nearest half of them comes after the second prompt
    assert [spans[0, m].num_tokens for m in (0, 1)] == [23, 6]
    for m in (0, 1):
        assert spans[1, m].num_tokens == spans[0, m].num_tokens and spans[1, m].stage == 1
        assert spans[0, m].start < spans[0, m].end <= spans[1, m].start < spans[1, m].end   # activations flow on
    assert spans[0, 0].end <= spans[0, 1].start and spans[1, 0].end <= spans[1, 1].start   # one at a time
    engine.executor.record_timeline = False
    engine.step()
    assert len(engine.executor.timeline) == 4


@pytest.mark.slow
def test_a_worker_killed_inside_a_step_is_reported_and_nothing_hangs(tiny_pp2_engine):
    engine = tiny_pp2_engine
    engine.add_request([1, 2, 3], GREEDY)
    engine.step()
    errors = kill_mid_step(engine, rank=1)     # rank 0 then waits for stage 1's logits
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "worker 1" in str(errors[0]) and "died with exit code -9" in str(errors[0])
    with pytest.raises(RuntimeError, match="worker 1 .* died"):    # and keeps saying so
        engine.step()


def test_pipeline_larger_than_the_model_is_refused_before_starting_anything(tmp_path):
    folder = build_tiny(tmp_path / "model", "LlamaConfig", "LlamaForCausalLM", num_attention_heads=4,
                        num_key_value_heads=2)   # 2 layers
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 is more than the model's 2 layers"):
        engines(folder, num_gpu_blocks=16)(pipeline_parallel_size=3)
    assert multiprocessing.active_children() == [] and not dist.is_initialized()


@pytest.mark.slow
def test_offline_benchmark_smoke_run_at_pp2_with_2_layers_a_rank(tmp_path):
    folder = build_tiny(tmp_path / "model", "LlamaConfig", "LlamaForCausalLM", num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2)
    parser = argparse.ArgumentParser()
    offline.add_arguments(parser)
    args = parser.parse_args(["--model", str(folder), "--pp", "2", "--num-requests", "6", "--min-len", "4",
                              "--max-len", "12", "--warmup", "light", "--num-gpu-blocks", "64",
                              "--device", "cpu", "--out", str(tmp_path / "r.json")])
    results = offline.main(args)
    assert results[0]["output_tokens"] > 0 and (tmp_path / "r.json").exists()
    assert multiprocessing.active_children() == [] and not dist.is_initialized()


# ---- on GPUs (NCCL): run on the lent multi-GPU machine ----------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_pp2_on_two_gpus_matches_one_gpu(tmp_path):
    folder = build_tiny(tmp_path / "model", "LlamaConfig", "LlamaForCausalLM", hidden_size=256,
                        intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=generator).tolist() for n in (18, 11, 25, 40)]

    def engine(**parallel):
        return LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype="float32", backend="triton",
                                      num_gpu_blocks=64, max_num_seqs=8, **parallel))

    whole, whole_logits, _ = greedy_run(engine(), prompts)
    pipelined = engine(pipeline_parallel_size=2)
    try:
        out, logits, _ = greedy_run(pipelined, prompts)
    finally:
        shut_down(pipelined)
    assert [o.token_ids for o in out] == [o.token_ids for o in whole]
    for got, want in zip(logits, whole_logits):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
