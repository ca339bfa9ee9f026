"""Exercise 15 -- the LLaMA decoder layer's forward over one flat batch and the paged KV
cache, built from llmlab's kernels.
Difficulty: *** (no Triton; Python and torch; about 60 minutes)

Read first: notebooks/01_tokens_to_logits.ipynb (one layer's tensors, hook points) and
notebooks/02_rmsnorm_rope_swiglu.ipynb; notebooks/04_paged_kv_cache.ipynb for the slot
mapping and block tables. Use: `llmlab.kernels` (rms_norm, linear, rope, store_kv,
prefill_attention, decode_attention, silu_mul: each one's spec is the function of the same
name in llmlab/kernels/reference.py), the `ForwardBatch` fields below and `LayerWeights`
(llmlab/model/llama.py: read the two dataclasses, not the model's own forward), and of
`ModelConfig` (self.config) num_heads, num_kv_heads, head_dim, rms_norm_eps (both norms'
eps), rope_theta and rope_scaling (rope's `theta` and `scaling`).

Task
    One decoder layer of a LLaMA model (SmolLM2, Llama 3, ...), as HF transformers'
    LlamaDecoderLayer computes it:

        h   = x + o_proj(attention(rope(q_proj(rms_norm(x))), rope(k_proj(..)), v_proj(..)))
        out = h + down(silu(gate(rms_norm(h))) * up(rms_norm(h)))

    but on the engine's batch: the new tokens of several sequences back to back, first
    every prefill chunk (batch.num_prefill_tokens tokens), then one token per decoding
    sequence; keys and values of every earlier token are in the paged cache, not in the
    batch. And with the residual carried apart, as llmlab's kernels fuse it: the layer gets
    (hidden, residual) and returns (hidden, residual), the true hidden state being their sum
    (residual is None before the first layer: then the input itself is the residual).
    `kernels.rms_norm(x, w, eps, residual)` returns (rms_norm(x + residual), x + residual);
    with residual None it returns rms_norm(x) alone, not a pair.
    Write:
      mlp(x, backend)        SwiGLU: weights.gate_up holds the gate rows, then the up rows
                             ([2 I, hidden]); silu_mul takes [T, 2 I] -> [T, I]; then down.
      attention(x, positions, batch, k_cache, v_cache, k_scales, v_scales)
                             q, k, v from one product with weights.qkv (+ qkv_bias: None for
                             LLaMA) split as [H D | Hkv D | Hkv D] columns; rope on q and k
                             at `positions`; store the rotated k and v into the cache at
                             batch.slot_mapping; attention: rows [:num_prefill_tokens] with
                             prefill_attention (prefill_block_tables, prefill_cu_seqlens_q,
                             prefill_seq_lens), the rest with decode_attention
                             (decode_block_tables, decode_seq_lens, batch.num_splits); scale
                             1/sqrt(head_dim); then o_proj. [T, hidden] -> [T, hidden].
      __call__(hidden, residual, positions, batch, k_cache, v_cache, k_scales, v_scales)
                             input norm (with the residual), attention, post-attention norm
                             (adding the attention output to the residual), mlp.
    Pass backend=batch.backend to every kernel, and k_scales, v_scales to store_kv and both
    attentions (they are None unless the cache is int8/fp8).

Shapes
    hidden, residual [T, hidden]; positions [T] int64; k_cache, v_cache
    [num_blocks, block_size, Hkv, D]; q [T, H, D], k and v [T, Hkv, D] (H = config.num_heads,
    Hkv = config.num_kv_heads: grouped-query attention, the attention kernels handle it).

Hints
    - Store before attending: the attention kernels read every key, the new tokens' too,
      from the cache.
    - Store the keys after rope, not before: later tokens read them from the cache.
    - A batch may hold no prefill token, or no decode: call only the attention that has rows.
    - Attention's output [T, H, D] goes into o_proj as [T, H * D].

What you will have built: the model's forward, layer by layer, from the kernels; the grader
checks it against HF transformers and runs the real engine on it
(LLMEngine(config, decoder_layer=DecoderLayer)).

Grade: `make grade EX=ex15`, or `pytest tests/exercises/test_ex15_decoder_layer.py --impl=exercises`.
"""
from __future__ import annotations

import math

import torch

from llmlab import kernels
from llmlab.config import ModelConfig
from llmlab.model.llama import ForwardBatch, LayerWeights


class DecoderLayer:
    def __init__(self, config: ModelConfig, weights: LayerWeights):
        self.config = config
        self.weights = weights
        self.scale = 1.0 / math.sqrt(config.head_dim)

    def __call__(self, hidden, residual, positions, batch: ForwardBatch, k_cache, v_cache,
                 k_scales=None, v_scales=None):
        """(hidden, residual) [T, hidden] each -> (hidden, residual) after this layer."""
        raise NotImplementedError("ex15: write DecoderLayer.__call__ (norm, attention, norm, mlp)")

    def attention(self, x, positions, batch: ForwardBatch, k_cache, v_cache, k_scales=None, v_scales=None):
        """x [T, hidden] (after the input norm) -> o_proj(attention) [T, hidden]."""
        raise NotImplementedError("ex15: write DecoderLayer.attention (qkv, rope, store_kv, attention, o_proj)")

    def mlp(self, x, backend=None):
        """x [T, hidden] (after the post-attention norm) -> down(silu(gate) * up) [T, hidden]."""
        raise NotImplementedError("ex15: write DecoderLayer.mlp (gate_up, silu_mul, down)")
