"""Tensor parallelism: a model sharded over tp ranks computes what the whole model computes.

On CPU the ranks are processes talking through gloo: rank 0 (this test process) and
tp - 1 spawned workers. The embedded model (9 heads, 3 kv heads) at TP=3 must give the
same greedy text as at TP=1; tiny random models the same logits at TP=2 (kv heads split
over the ranks, preemption by swap on every rank's cache) and at TP=4 (2 kv heads
replicated over 4 ranks, q/k/v biases, a tied and padded vocabulary). Sizes that do not
fit the heads are refused with a clear error, a failing worker's traceback reaches rank 0,
and no worker process outlives its engine. Each TP engine spawns processes that import
torch: a few seconds each, so the file runs few of them.
"""
from __future__ import annotations

import multiprocessing
import os
import signal

import pytest
import torch
import torch.distributed as dist

import llmlab
from llmlab import EngineConfig, LLMEngine
from llmlab.config import ModelConfig
from llmlab.engine.parallel import wire
from llmlab.model.llama import LlamaModel
from llmlab.model.tensor_parallel import (check_tensor_parallel_size, kv_heads_of_rank, named_weights,
                                          shard_weight)
from helpers.parallel import ATOL, GREEDY, RTOL, TINY_VOCAB, build_tiny, greedy_run, kill_mid_step, shut_down

# ---- sizes and slices (no processes) -------------------------------------------------------

def small_config(heads, kv_heads, intermediate=96, vocab=TINY_VOCAB, bias=False):
    return ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=64, intermediate_size=intermediate,
                       num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=8,
                       rms_norm_eps=1e-5, rope_theta=10000.0, attention_bias=bias)


@pytest.mark.parametrize("heads, kv_heads, intermediate, tp, match", [
    (9, 3, 1536, 2, "does not divide the model's 9 attention heads; sizes that fit: \\[1, 3\\]"),
    (12, 3, 96, 2, "3 kv heads can neither be split over 2 ranks nor replicated evenly"),
    (8, 4, 90, 4, "intermediate_size 90"),
])
def test_sizes_that_do_not_fit_are_refused(heads, kv_heads, intermediate, tp, match):
    with pytest.raises(ValueError, match=match):
        check_tensor_parallel_size(small_config(heads, kv_heads, intermediate), tp)


def test_engine_refuses_tp2_for_the_embedded_model_before_starting_anything(llm):
    config = EngineConfig(device="cpu", dtype="float32", backend="torch", num_gpu_blocks=16,
                          tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 .* 9 attention heads"):
        LLMEngine(config, model=llm.engine.model, tokenizer=llm.tokenizer)
    assert multiprocessing.active_children() == [] and not dist.is_initialized()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


def test_shards_put_together_are_the_whole_model():
    """8 heads, 2 kv heads over 4 ranks: q heads split 2 a rank, each kv head on 2 ranks."""
    config, tp, d = small_config(8, 2, bias=True), 4, 8
    model = LlamaModel.random(config, torch.float32, "cpu")
    weights = named_weights(model)

    def shards(name):
        return [shard_weight(name, weights[name], config, rank, tp) for rank in range(tp)]

    q_rows, kv_rows = 8 * d, 2 * d
    for name in ("layers.0.qkv", "layers.0.qkv_bias"):
        full = weights[name]
        q, k, v = full[:q_rows], full[q_rows:q_rows + kv_rows], full[q_rows + kv_rows:]
        parts = shards(name)
        assert torch.equal(torch.cat([p[:2 * d] for p in parts]), q)
        for rank, part in enumerate(parts):
            assert list(kv_heads_of_rank(config, rank, tp)) == [rank // 2]
            head = slice(rank // 2 * d, (rank // 2 + 1) * d)
            assert torch.equal(part[2 * d:3 * d], k[head]) and torch.equal(part[3 * d:], v[head])
    assert torch.equal(torch.cat(shards("layers.0.o_proj"), dim=1), weights["layers.0.o_proj"])
    assert torch.equal(torch.cat(shards("layers.0.down"), dim=1), weights["layers.0.down"])
    gate, up = weights["layers.0.gate_up"].chunk(2)
    parts = [p.chunk(2) for p in shards("layers.0.gate_up")]
    assert torch.equal(torch.cat([g for g, _ in parts]), gate) and torch.equal(torch.cat([u for _, u in parts]), up)
    embed = torch.cat(shards("embed"))                       # 252 rows: 2 of padding
    assert embed.shape[0] == 252 and torch.equal(embed[:TINY_VOCAB], weights["embed"])
    assert not embed[TINY_VOCAB:].any()
    assert all(torch.equal(p, weights["norm"]) for p in shards("norm"))


# ---- the sharded engine against the whole model ------------------------------------------------

@pytest.mark.slow
def test_embedded_model_tp3_gives_the_same_greedy_text(llm):
    prompts = ["What is the capital of France?", "Write a short poem about autumn leaves falling."]
    reference = llm.generate(prompts, GREEDY)
    sharded = llmlab.LLM(device="cpu", dtype="float32", backend="torch", num_gpu_blocks=64,
                         swap_space=0.01, tensor_parallel_size=3)
    try:
        assert sharded.engine.model_config.num_heads == 3 and sharded.engine.model_config.num_kv_heads == 1
        outputs = sharded.generate(prompts, GREEDY)
        assert [o.text for o in outputs] == [o.text for o in reference]
        assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    finally:
        shut_down(sharded.engine)


@pytest.mark.parametrize("tp, config_name, model_name, kwargs, engine_kwargs", [
    # kv heads split: 2 a rank; a tight cache, so requests are swapped out and back in on every rank
    (2, "LlamaConfig", "LlamaForCausalLM",
     dict(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False),
     dict(num_gpu_blocks=12, block_size=4, preemption_mode="swap", swap_space=0.001)),
    # kv heads replicated: 2 kv heads over 4 ranks; q/k/v biases; tied, padded vocab
    (4, "Qwen2Config", "Qwen2ForCausalLM",
     dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True),
     dict(num_gpu_blocks=64, block_size=16)),
], ids=["tp2-kv-split-swap", "tp4-kv-replicated-bias-tied"])
@pytest.mark.slow
def test_tiny_models_give_the_same_logits(tmp_path, tp, config_name, model_name, kwargs, engine_kwargs):
    folder = build_tiny(tmp_path / "model", config_name, model_name, **kwargs)
    generator = torch.Generator().manual_seed(tp)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=generator).tolist() for n in (18, 11, 25)]

    def engine(tensor_parallel_size):
        return LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", backend="torch",
                                      tensor_parallel_size=tensor_parallel_size, **engine_kwargs))

    whole, whole_logits, whole_trace = greedy_run(engine(1), prompts)
    sharded_engine = engine(tp)
    try:
        sharded, sharded_logits, _ = greedy_run(sharded_engine, prompts)
    finally:
        shut_down(sharded_engine)
    assert [o.token_ids for o in sharded] == [o.token_ids for o in whole]
    # the same scheduler on the same requests: step i of one run is step i of the other
    assert len(sharded_logits) == len(whole_logits)
    for got, want in zip(sharded_logits, whole_logits):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    if engine_kwargs.get("preemption_mode") == "swap":
        assert any(step.swapped_out for step in whole_trace.steps), "no request was swapped out"


# ---- failures ----------------------------------------------------------------------------------

@pytest.fixture
def tiny_tp2_engine(tmp_path):
    folder = build_tiny(tmp_path / "model", "LlamaConfig", "LlamaForCausalLM",
                        num_attention_heads=4, num_key_value_heads=2)
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", backend="torch",
                                    num_gpu_blocks=16, tensor_parallel_size=2))
    yield engine
    engine.executor.shutdown()
    assert multiprocessing.active_children() == [] and not dist.is_initialized()


@pytest.mark.slow
def test_a_worker_error_reaches_rank_0_with_its_traceback(tiny_tp2_engine):
    engine = tiny_tp2_engine
    wire.broadcast_header(engine.executor.groups, [99])    # no such message: the worker raises on it
    engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(RuntimeError, match="(?s)worker 1 failed:.*Traceback.*unknown message 99 from rank 0"):
        engine.step()
    with pytest.raises(RuntimeError, match="worker 1 failed"):    # and keeps saying so
        engine.step()
    assert not engine.executor.workers[0].process.is_alive()


@pytest.mark.slow
def test_a_killed_worker_is_reported_by_rank_0(tiny_tp2_engine):
    engine = tiny_tp2_engine
    engine.add_request([1, 2, 3], GREEDY)
    engine.step()
    worker = engine.executor.workers[0].process
    os.kill(worker.pid, signal.SIGKILL)
    worker.join()
    with pytest.raises(RuntimeError, match="worker 1 .* died with exit code -9"):
        engine.step()


@pytest.mark.slow
def test_a_worker_killed_inside_a_step_is_reported_and_nothing_hangs(tiny_tp2_engine):
    engine = tiny_tp2_engine
    engine.add_request([1, 2, 3], GREEDY)
    errors = kill_mid_step(engine, rank=1)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "worker 1" in str(errors[0]) and "died with exit code -9" in str(errors[0])


# ---- on GPUs (NCCL): the same check, run on the lent multi-GPU machine -------------------------

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_on_two_gpus_matches_one_gpu_with_and_without_cuda_graphs(tmp_path):
    # head_dim 64, as real models have (the Triton kernels' tiles want at least 16)
    folder = build_tiny(tmp_path / "model", "LlamaConfig", "LlamaForCausalLM", hidden_size=256,
                        intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=generator).tolist() for n in (18, 11, 25, 40)]

    def engine(tp, enforce_eager=False):
        return LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype="float32", backend="triton",
                                      num_gpu_blocks=64, max_num_seqs=8, tensor_parallel_size=tp,
                                      enforce_eager=enforce_eager))

    whole_engine = engine(1)
    whole, whole_logits, _ = greedy_run(whole_engine, prompts)
    for enforce_eager in (False, True):
        sharded_engine = engine(2, enforce_eager)
        try:
            graphs = sharded_engine.runner.graphs
            if enforce_eager:
                assert graphs is None
            else:   # every rank captured its decode graphs, on TP=1's batch-size ladder
                assert graphs.sizes == whole_engine.runner.graphs.sizes
                assert {size for size, _ in graphs.graphs} == {size for size, _ in whole_engine.runner.graphs.graphs}
            sharded, sharded_logits, _ = greedy_run(sharded_engine, prompts)
        finally:
            shut_down(sharded_engine)
        assert [o.token_ids for o in sharded] == [o.token_ids for o in whole]
        # fp32 on both sides (the Triton kernels accumulate in fp32, matmuls without TF32), so
        # only the order of the sums differs, as on CPU; GPU reductions reorder a little more
        for got, want in zip(sharded_logits, whole_logits):
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)

