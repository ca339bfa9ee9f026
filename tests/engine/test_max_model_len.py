"""max_model_len (issue #37, row 5): a value past the model's context is refused with both
numbers, before the weights load; a value past what the KV cache holds is refused too; left
at None it is the model's context, or what the KV cache holds if that is less, and the KV
cache's own size in tokens is reported beside it, never passed off as the model's limit."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import llmlab
from helpers.engine import cpu_engine, tiny_config, tiny_model

# the tiny model's context: max_position_embeddings 512 (helpers.engine.TINY_HF_CONFIG)
CONTEXT = 512
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def engine(config=None, **overrides):
    model = tiny_model(config=config) if config is not None else tiny_model()
    return cpu_engine(model, **{**dict(num_gpu_blocks=64), **overrides})     # 64 x 16 = 1,024 tokens of KV


@pytest.mark.parametrize("max_model_len", [CONTEXT + 1, 100_000])
def test_past_the_model_context_is_refused_with_both_numbers(max_model_len):
    with pytest.raises(ValueError, match=rf"max_model_len is {max_model_len}, more than the model's context of "
                                         rf"{CONTEXT} tokens \(max_position_embeddings"):
        engine(max_model_len=max_model_len)
    assert engine(max_model_len=CONTEXT).max_model_len == CONTEXT      # the context itself is fine


def test_llama3_rope_scaling_is_already_counted_in_max_position_embeddings():
    """Llama 3.1's config says 131,072 positions with factor 8 over the original 8,192: the
    factor stretches the rotary frequencies to reach max_position_embeddings, which is the
    context (as HF and vLLM read it), not a number to multiply by the factor again."""
    config = tiny_config(rope_scaling=LLAMA3_SCALING)
    assert engine(config).max_model_len == CONTEXT
    with pytest.raises(ValueError, match=rf"max_model_len is {CONTEXT * 8}, more than the model's context of {CONTEXT}"):
        engine(config, max_model_len=CONTEXT * 8)


def test_a_sliding_window_caps_the_context():
    """llmlab runs full attention, which equals a sliding-window model's only within its window."""
    config = tiny_config(model_type="mistral", sliding_window=128)
    assert engine(config).max_model_len == 128
    with pytest.raises(ValueError, match=r"max_model_len is 200, more than the model's context of 128 tokens "
                                         r"\(its sliding window"):
        engine(config, max_model_len=200)


def test_past_the_kv_cache_is_refused_and_its_size_is_reported_apart():
    small = engine(num_gpu_blocks=8)                     # 8 blocks x 16 = 128 tokens of KV
    assert small.max_model_len == 128 and small.kv_cache_tokens == 128      # None: what the cache holds
    with pytest.raises(ValueError, match=r"max_model_len is 256, more than the KV cache holds: 128 tokens "
                                         r"\(8 blocks of 16\)"):
        engine(num_gpu_blocks=8, max_model_len=256)
    roomy = engine(num_gpu_blocks=64)
    assert roomy.max_model_len == CONTEXT and roomy.kv_cache_tokens == 1024   # not the KV size


@pytest.mark.parametrize("max_model_len", [8400, 100_000])
def test_llm_refuses_past_the_embedded_model_context(max_model_len):
    """The embedded SmolLM2 has 8,192 positions: 8,400 used to generate past position 8,192,
    and 100,000 silently became the KV cache's size."""
    with pytest.raises(ValueError, match=rf"max_model_len is {max_model_len}, more than the model's context of 8192"):
        llmlab.LLM(device="cpu", max_model_len=max_model_len)


@pytest.mark.slow     # a `llmlab serve` process
def test_serve_refuses_past_the_model_context_with_one_line_and_status_2():
    result = subprocess.run([sys.executable, "-m", "llmlab.cli", "serve", "--device", "cpu", "--max-model-len", "20000"],
                            capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if k != "LLMLAB_API_KEY"})
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("llmlab: error: EngineConfig.max_model_len is 20000, more than the model's context of "
                           "8192 tokens"), line
