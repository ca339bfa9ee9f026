"""What the engine-level tests share: the one tiny random-weight model, an engine on a CPU
(float32, torch kernels), running prompts to completion, and the leak check (every KV block
comes back)."""
from __future__ import annotations

import torch

from llmlab.config import EngineConfig, ModelConfig
from llmlab.engine.engine import LLMEngine
from llmlab.model.llama import LlamaModel

# The tiny model of the engine, scheduler, experiments and server tests: LLaMA's layout with
# grouped-query attention (4 heads, 2 kv heads), 2 layers, hidden 64, a 128-token vocabulary.
# A step takes about a millisecond on a laptop CPU.
TINY_HF_CONFIG = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512)
# A Llama-3-shaped model (head_dim 128, GQA 8/2, vocab 32000) with few layers: real kernel
# shapes for the GPU tests at a fraction of the weights.
SMALL_LLAMA3 = dict(model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                    rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=4096)


def tiny_config(**overrides) -> ModelConfig:
    """The tiny model's ModelConfig; `overrides` change fields of its HF config.json."""
    return ModelConfig.from_hf({**TINY_HF_CONFIG, **overrides})


TINY = tiny_config()


def tiny_model(seed: int = 0, config: ModelConfig = TINY) -> LlamaModel:
    """Random float32 weights on the CPU, reproducible from the seed."""
    return LlamaModel.random(config, torch.float32, "cpu", seed=seed)


def tiny_prompt(length: int, seed: int) -> list[int]:
    """`length` random token ids of the tiny model's vocabulary, reproducible from the seed."""
    return torch.randint(0, TINY.vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def cpu_engine_config(**overrides) -> EngineConfig:
    """An EngineConfig for a CPU run in float32 with the torch kernels; `overrides` win."""
    return EngineConfig(**{**dict(device="cpu", dtype="float32", backend="torch"), **overrides})


def cpu_engine(model, tokenizer=None, /, **overrides) -> LLMEngine:
    """An engine on `model` (a model already built: random weights, or the loaded embedded one);
    `overrides` are EngineConfig fields (its `model` too: the name a server reports)."""
    return LLMEngine(cpu_engine_config(**overrides), model=model, tokenizer=tokenizer)


def embedded_engine(llm, **overrides) -> LLMEngine:
    """A fresh engine sharing the loaded embedded model and tokenizer (loading it again is slow)."""
    return cpu_engine(llm.engine.model, llm.tokenizer, **overrides)


def run_all(engine, prompts, params, recorder=None):
    """Step the engine until every prompt is done; finished outputs in prompt order.
    `params`: one SamplingParams for all prompts, or a list of one per prompt."""
    if recorder is not None:
        engine.hooks.attach(recorder)
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    return [results[i] for i in ids]


def assert_all_blocks_free(engine):
    stats = engine.kv_stats()
    assert stats["free_device_blocks"] == stats["total_device_blocks"]
    assert stats["free_host_blocks"] == stats["total_host_blocks"]
    blocks = engine.block_manager
    assert all(count == 0 for count in blocks.ref_counts)
    # prefix caching (on by default) keeps freed full blocks cached: every block is free
    # exactly once, on the free list or evictable, and an evictable block is the one its hash names
    assert sorted([*blocks.free_blocks, *blocks.evictable]) == list(range(blocks.num_device_blocks))
    assert all(blocks.cached_blocks[blocks.block_hash[b]] == b for b in blocks.evictable)
    assert len(blocks.cached_blocks) == len(blocks.evictable)
    assert sorted(blocks.free_host_blocks) == list(range(blocks.num_host_blocks)) and not blocks.host_tables
    assert not engine.requests
