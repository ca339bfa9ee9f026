"""Models of random weights, by name: a real model's shape and speed without its weights
(no model hub needed), for benchmarks and for running the server on a GPU.

    llmlab serve --model random-llama3-8b --tokenizer embedded      # a CUDA device
    llmlab serve --model random-llama3-tiny --tokenizer embedded    # the same layout in a few MB: a CPU

With a tokenizer (`EngineConfig.tokenizer`: a folder, or "embedded" for the embedded
SmolLM2's 49,152 tokens) the vocabulary is cut to the tokenizer's size and the BOS / EOS ids
are its own, so text prompts work end to end (the text that comes back is noise: the
weights are random). Without one, the model runs on token ids, with Llama-3's 128,256.
"""
from __future__ import annotations

import torch

from llmlab.config import ModelConfig

# Llama-3-8B's config.json: the shape the GPU benchmarks measure
LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                 tie_word_embeddings=False, hidden_act="silu", bos_token_id=128000, eos_token_id=128001)
# the same layout at a few MB (GQA 4, head_dim a power of two): a CPU runs it in seconds
SMALL_LLAMA = dict(LLAMA3_8B, vocab_size=1024, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=32)

RANDOM_MODELS = {"random-llama3-8b": LLAMA3_8B,
                 "random-llama3-tiny": dict(SMALL_LLAMA, num_hidden_layers=2)}
# 8B parameters: 32 GB of float32 on a CPU, and minutes per token
CUDA_ONLY = ("random-llama3-8b",)


def is_random_model(name) -> bool:
    return isinstance(name, str) and name in RANDOM_MODELS


def random_shape(name: str, tokenizer=None, num_layers: int | None = None) -> dict:
    """The config.json (a dict) of the random model `name`: its vocabulary cut to the
    tokenizer's size, with its BOS / EOS ids, when one is given; `num_layers` fewer layers."""
    hf = dict(RANDOM_MODELS[name])
    if tokenizer is not None:
        hf.update(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.hf.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    if num_layers:
        hf["num_hidden_layers"] = num_layers
    return hf


def check_random_device(name: str, device: torch.device) -> None:
    if name in CUDA_ONLY and device.type != "cuda":
        raise ValueError(f"--model {name} (random weights in the Llama-3-8B shape) needs a CUDA device, not "
                         f"{device.type}; on a CPU use random-llama3-tiny (the same layout in a few MB) or "
                         "leave --model out (the embedded model)")


def random_model(name: str, dtype: torch.dtype, device: torch.device, tokenizer=None, num_layers: int | None = None):
    """A LlamaModel of random weights in the shape of `name` (random_shape), on `device`."""
    from llmlab.model.llama import LlamaModel

    check_random_device(name, device)
    return LlamaModel.random(ModelConfig.from_hf(random_shape(name, tokenizer, num_layers)), dtype, device)
