"""The engine's sizes left None follow the device (sizing.py): today's values on a CPU,
vLLM V1's on a GPU (EngineArgs._set_default_args: 1024 sequences and 16384 / 8192 tokens
from ~70 GiB, else 256 and 8192 / 2048), never more sequences than the KV cache has blocks,
and a value the user set is kept. A GPU is mocked by its memory: these run on any machine."""
from __future__ import annotations

import pytest
import torch

from llmlab import sizing
from llmlab.config import EngineConfig

H200 = 141 * 10**9     # bytes, as torch.cuda reports an H200 (~131 GiB)
A10 = 24 * 2**30


@pytest.fixture
def gpu_memory(monkeypatch):
    """Set the memory of the (mocked) CUDA device."""
    def set_memory(total):
        monkeypatch.setattr(sizing, "device_memory", lambda device: total if device.type == "cuda" else 0)
    return set_memory


def test_cpu_defaults_are_todays():
    config, sizes = sizing.resolve(EngineConfig(device="cpu"), kv_cache_blocks=10)
    # 64 and 512 before sizing.py existed; no cap by the cache on a CPU (10 blocks here)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (64, 512)
    assert sizing.resolve(EngineConfig(device="cpu", usage_context="server"), 10)[0].max_num_batched_tokens == 512
    assert "CPU" in sizes.reason and "max_num_seqs 64" in sizes.reason


def test_a_141gb_gpu_runs_more_sequences_than_a_cpu(gpu_memory):
    gpu_memory(H200)
    blocks = 52_000 // 16
    offline, sizes = sizing.resolve(EngineConfig(device="cuda"), blocks)
    server, _ = sizing.resolve(EngineConfig(device="cuda", usage_context="server"), blocks)
    cpu, _ = sizing.resolve(EngineConfig(device="cpu"), blocks)
    assert offline.max_num_seqs == server.max_num_seqs == 1024 > cpu.max_num_seqs
    assert (offline.max_num_batched_tokens, server.max_num_batched_tokens) == (16384, 8192)
    assert sizes.reason.startswith("max_num_seqs 1024, max_num_batched_tokens 16384 (CUDA device with 131 GiB")
    assert "KV cache holds 52,000 tokens" in sizes.reason


def test_a_smaller_gpu_gets_vllms_smaller_defaults(gpu_memory):
    gpu_memory(A10)
    offline, _ = sizing.resolve(EngineConfig(device="cuda"), 10_000)
    server, _ = sizing.resolve(EngineConfig(device="cuda", usage_context="server"), 10_000)
    assert (offline.max_num_seqs, offline.max_num_batched_tokens) == (256, 8192)
    assert (server.max_num_seqs, server.max_num_batched_tokens) == (256, 2048)


@pytest.mark.parametrize("blocks", [1, 37, 1023, 1024, 5000])
def test_the_chosen_sequences_fit_the_kv_cache(gpu_memory, blocks):
    """Every running sequence holds at least one block: never more sequences than blocks."""
    gpu_memory(H200)
    config, sizes = sizing.resolve(EngineConfig(device="cuda"), blocks)
    assert config.max_num_seqs == min(1024, blocks)
    assert config.max_num_seqs * config.block_size <= blocks * config.block_size
    assert ("capped" in sizes.reason) == (blocks < 1024)


def test_explicit_values_are_kept_and_the_callers_config_is_not_changed(gpu_memory):
    gpu_memory(H200)
    mine = EngineConfig(device="cuda", max_num_seqs=2000, max_num_batched_tokens=64)
    config, sizes = sizing.resolve(mine, kv_cache_blocks=100)   # kept even past the cache: the user asked
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (2000, 64)
    assert "set explicitly" in sizes.reason
    one = EngineConfig(device="cuda", max_num_seqs=8)
    assert sizing.resolve(one, 100)[0].max_num_batched_tokens == 16384
    unset = EngineConfig(device="cpu")
    sizing.resolve(unset, 100)
    assert unset.max_num_seqs is None and unset.max_num_batched_tokens is None   # None = sized to the device


def test_graph_batch_sizes_stop_at_512_as_vllms():
    from llmlab.cuda_graphs.decode import batch_size_ladder

    # vLLM: [1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16)
    expected = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))
    assert batch_size_ladder(1024) == expected
    assert batch_size_ladder(256) == expected[:expected.index(256) + 1]
    assert batch_size_ladder(64)[-1] == 64 and batch_size_ladder(3) == [1, 2]
    assert batch_size_ladder(1) == [1]


def test_an_engine_reads_the_sizes_it_chose():
    """The engine, its scheduler and warm-up read one resolved config; the caller's keeps None."""
    from llmlab import LLMEngine
    from llmlab.bench.common import SMALL_LLAMA
    from llmlab.config import ModelConfig
    from llmlab.model.llama import LlamaModel

    hf = dict(SMALL_LLAMA, num_hidden_layers=1)
    model = LlamaModel.random(ModelConfig.from_hf(hf), torch.float32, torch.device("cpu"))
    mine = EngineConfig(device="cpu", num_gpu_blocks=32)
    engine = LLMEngine(mine, model=model)
    assert mine.max_num_seqs is None
    assert engine.config.max_num_seqs == engine.scheduler.config.max_num_seqs == 64
    assert engine.scheduler.token_budget == 512
    assert engine.sizes.reason == "max_num_seqs 64, max_num_batched_tokens 512 (CPU device; KV cache holds 512 tokens)"
