"""Convert a GGUF file (llama.cpp's format) into a HF-style folder llmlab loads:
config.json, model.safetensors (dequantized, float32) and the tokenizer files.

Two things need care. GGUF stores Q and K projections with rows permuted for llama.cpp's
interleaved rope layout; HF's (and llmlab's) "rotate half" layout needs them un-permuted.
And the weights stay float32: casting to 16-bit here would break exact parity with HF
transformers loading the same file.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

SUPPORTED_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                  "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleaving: rows (pair i, half h) -> (half h, pair i)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    w = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader) -> dict:
    """A HF config.json dict from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; llmlab converts "
                         f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("this GGUF carries per-frequency rope factors (rope_freqs); "
                         "load the original HF folder instead")

    def meta(key, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata is missing {arch}.{key}")
        return value

    heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return {
        "architectures": [SUPPORTED_GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": meta("rope.dimension_count", hidden // heads),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "max_position_embeddings": meta("context_length"),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }


def read_weights(reader, config: dict) -> dict[str, torch.Tensor]:
    """Dequantized float32 tensors under HF names, Q/K un-permuted for LLaMA."""
    from gguf.quants import dequantize

    kv_heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights = {}
    for tensor in reader.tensors:
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if tensor.name in GLOBAL_TENSORS:
            weights[GLOBAL_TENSORS[tensor.name]] = torch.from_numpy(np.ascontiguousarray(array))
            continue
        parts = tensor.name.split(".")   # blk.N.attn_q.weight
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in LAYER_TENSORS:
            raise ValueError(f"unexpected GGUF tensor {tensor.name!r}")
        # llama.cpp permutes LLaMA's Q/K rows (its converter does this for "llama" only)
        if config["model_type"] == "llama" and parts[2] in kv_heads and parts[3] == "weight":
            array = unpermute_qk(array, kv_heads[parts[2]])
        name = f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{parts[3]}"
        weights[name] = torch.from_numpy(np.ascontiguousarray(array))
    return weights


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the HF-style folder for `gguf_path` to `out_dir` (atomically) and return it."""
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and not (out_dir / "config.json").exists() and (
            not out_dir.is_dir() or any(out_dir.iterdir())):   # checked before the minutes of conversion
        kind = "folder that holds no converted model" if out_dir.is_dir() else "file"
        raise ValueError(f"{out_dir} is an existing {kind}: convert into a new or empty folder")
    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as err:  # the gguf package raises assorted errors on bad files
        raise ValueError(f"{gguf_path} is not a readable GGUF file: {err}") from err
    config = read_config(reader)
    weights = read_weights(reader, config)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".converting-"))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file(weights, tmp / "model.safetensors")
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(out_dir)   # another process may have finished first: keep theirs
        except OSError:
            if not (out_dir / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
