"""Tiny random-weight checkpoints written by HF transformers' own classes, one per model
family llmlab supports, in each weight format a hub folder can hold.

Every model is float32, hidden 64, 2 layers, vocab 256, so building, saving and running
one costs well under a second on a laptop CPU.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

VOCAB_SIZE = 256
COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=512, rms_norm_eps=1e-5)

# LLaMA-3.1 frequency scaling with a tiny original context: wavelengths above 64 tokens are
# divided by `factor`, those between 16 and 64 blended, so positions 0..70 that the tests
# use already rotate differently than without scaling.
LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# name -> (transformers class names, config kwargs); each row is a real model's layout
VARIANTS = {
    # LLaMA-2: multi-head attention (as many kv heads as heads), separate lm_head
    "llama2": ("LlamaConfig", "LlamaForCausalLM",
               dict(num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0,
                    tie_word_embeddings=False)),
    # LLaMA-3.1/3.2: grouped-query attention, llama3 rope scaling, tied embeddings (3.2 1B/3B)
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                    rope_scaling=LLAMA3_ROPE_SCALING, tie_word_embeddings=True)),
    # Mistral: GQA; head_dim 32 != hidden / heads = 16, as Mistral-Nemo sets it explicitly;
    # no sliding window (v0.2 onwards), so HF attends over the whole context as llmlab does
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                     rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False)),
    # Qwen2: GQA with q/k/v biases
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0,
                   tie_word_embeddings=False, rms_norm_eps=1e-6)),
}

WEIGHT_FORMATS = ("safetensors", "sharded_safetensors", "bin", "sharded_bin")


def build_hf_model(variant: str, seed: int = 0):
    """A transformers model of the variant with every parameter random (fixed seed).

    HF initializes norms to 1 and biases to 0; those would hide a loader that swaps the two
    norms of a layer or drops Qwen2's biases, so they get random values too. Weights use
    std 0.1 (not HF's 0.02) so logits spread enough for greedy argmaxes to be clear-cut.
    """
    config_name, model_name, kwargs = VARIANTS[variant]
    config = getattr(transformers, config_name)(**{**COMMON, **kwargs})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():   # a tied lm_head is listed once
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
            else:
                param.normal_(0.0, 0.1)
    return model


def save(model, folder: Path, weight_format: str) -> Path:
    """Write `model` to `folder` as transformers does: config.json plus the weights in
    `weight_format`. transformers 5 only writes safetensors, so the PyTorch .bin layouts
    (what transformers 4 wrote with safe_serialization=False) are written here by hand."""
    folder.mkdir(parents=True, exist_ok=True)
    if weight_format == "safetensors":
        model.save_pretrained(folder)
    elif weight_format == "sharded_safetensors":
        model.save_pretrained(folder, max_shard_size="20KB")
    elif weight_format in ("bin", "sharded_bin"):
        model.config.save_pretrained(folder)
        state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
        # LLaMA-2 .bin checkpoints converted by older transformers carry these buffers;
        # they are not weights, and a loader must skip them
        for i in range(model.config.num_hidden_layers):
            state[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.rand(8)
        if weight_format == "bin":
            torch.save(state, folder / "pytorch_model.bin")
        else:
            names = sorted(state)
            shards = {"pytorch_model-00001-of-00002.bin": names[::2],
                      "pytorch_model-00002-of-00002.bin": names[1::2]}
            weight_map = {}
            for file, shard_names in shards.items():
                torch.save({n: state[n] for n in shard_names}, folder / file)
                weight_map.update({n: file for n in shard_names})
            (folder / "pytorch_model.bin.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    else:
        raise ValueError(f"unknown weight format {weight_format!r}")
    return folder
