"""The LLaMA-family forward pass over one flat batch and a paged KV cache.

A batch holds the new tokens of several sequences back to back: first every prefill
chunk, then one token per decoding sequence. Each layer is

    rms_norm(+residual) -> qkv -> rope + store_kv (one kernel, `rope_store_kv`) -> attention
                        -> o_proj -> rms_norm(+residual) -> gate_up -> silu_mul -> down

(a decode-only batch without flash-decoding splits runs rope, store_kv and decode attention
as one kernel, `rope_store_decode_attention`; with `knobs.fold_norms` a GPU decode step of
1 or 33-64 sequences runs each rms_norm inside the product after it and each residual add
inside the product before it, `folded_decoder_layers`)

built from `llmlab.kernels`, so swapping the backend (reference, torch or Triton: the
batch's `backend`, chosen by the engine's runner) or a single kernel changes what runs
here; the matrix products go through `kernels.linear` too. Logits are computed only for the
last token of each sequence that samples (`batch.logits_indices`).

Hook points: inside `with model.capture() as taps:` every forward records the tensors
named "embed", "layers.{i}.q|k|v" (after projection, before rope), "layers.{i}.attn"
(attention block output, after o_proj), "layers.{i}.mlp", "norm" and "logits".
With no capture active the cost is one `if` per point.
"""
from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmlab import kernels
from llmlab.config import ModelConfig

# Logits leave the model in float32, whatever the weights' dtype: the sampler's softmax and
# top-p cut read them, and the engine warms the sampler up on this dtype.
LOGITS_DTYPE = torch.float32


@dataclass
class ForwardBatch:
    """Everything the forward needs besides token ids and positions (built by engine/batch.py)."""
    num_prefill_tokens: int              # the first tokens of the batch belong to prefill chunks
    slot_mapping: torch.Tensor           # [T] cache slot of each new token
    prefill_cu_seqlens_q: torch.Tensor   # [P + 1] start of each prefill chunk in the batch
    prefill_seq_lens: torch.Tensor       # [P] context length after this step
    prefill_block_tables: torch.Tensor   # [P, max_blocks]
    decode_seq_lens: torch.Tensor        # [S_decode]
    decode_block_tables: torch.Tensor    # [S_decode, max_blocks]
    logits_indices: torch.Tensor         # [S] row of the last token of each sequence that samples
    num_splits: int = 1                  # flash-decoding splits (1 = PagedAttention v1)
    backend: str | None = None           # kernels: "reference" | "torch" | "triton"; None = llmlab.kernels' default
    # a prompt graph's batch (cuda_graphs/prompt.py): [T] bool, the rows that take decode
    # attention; both attentions then run over all T rows, the decode one's tables and seq_lens
    # [T] (1 on the other rows), the prefill one's padded with sequences of no tokens
    decode_rows: torch.Tensor | None = None


@dataclass
class LayerWeights:
    input_norm: torch.Tensor    # [hidden]
    qkv: torch.Tensor           # [(H + 2 Hkv) D, hidden]  q, k, v projections fused
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor        # [hidden, H D]
    post_norm: torch.Tensor     # [hidden]
    gate_up: torch.Tensor       # [2 intermediate, hidden]  gate and up fused
    down: torch.Tensor          # [hidden, intermediate]


class LlamaModel:
    # whether a GPU decode step may run folded_decoder_layers (a tensor-parallel shard: no)
    fold_add_norm = True

    def __init__(self, config: ModelConfig, embed, layers, norm, lm_head):
        self.config = config
        self.embed = embed          # [vocab, hidden]
        self.layers = layers        # list[LayerWeights]
        self.norm = norm            # [hidden]
        self.lm_head = lm_head      # [vocab, hidden] (the embedding itself when tied)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.taps: dict | None = None
        self.plugged_layers: list | None = None   # with_decoder_layer's: one object per layer

    # ---- forward -------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids, positions, batch: ForwardBatch, kv_cache, kv_scales=None) -> torch.Tensor:
        """input_ids, positions [T]; kv_cache [num_layers, 2, num_blocks, block_size, Hkv, D];
        kv_scales [num_layers, 2, num_blocks, block_size, Hkv] for an int8/fp8 cache, else None.
        Returns logits [S, vocab] (float32) for each sequence's last token."""
        hidden = self.embedding(input_ids)
        self._tap("embed", hidden)
        hidden, residual = self.decoder_layers(hidden, None, positions, batch, kv_cache, kv_scales)
        return self.final_logits(hidden, residual, batch)

    def decoder_layers(self, hidden, residual, positions, batch: ForwardBatch, kv_cache, kv_scales=None):
        """Every layer of this model over the batch: (hidden, residual) in and out, residual
        None before the first layer. A pipeline stage (engine/parallel/pipeline.py) is a model of
        a few layers, and passes this pair on to the next stage."""
        if self.plugged_layers is not None:
            return self._plugged_decoder_layers(hidden, residual, positions, batch, kv_cache, kv_scales)
        if self._folds(hidden, batch):
            return self.folded_decoder_layers(hidden, residual, positions, batch, kv_cache, kv_scales)
        cfg, b = self.config, batch.backend
        for i, layer in enumerate(self.layers):
            x, residual = self.input_norm(layer, hidden, residual, b)
            scales = (None, None) if kv_scales is None else (kv_scales[i, 0], kv_scales[i, 1])
            hidden = self.attention(i, layer, x, positions, batch, kv_cache[i, 0], kv_cache[i, 1], *scales)
            self._tap(f"layers.{i}.attn", hidden)
            x, residual = kernels.rms_norm(hidden, layer.post_norm, cfg.rms_norm_eps, residual, backend=b)
            hidden = self.mlp(layer, x, b)
            self._tap(f"layers.{i}.mlp", hidden)
        return hidden, residual

    def folded_decoder_layers(self, hidden, residual, positions, batch: ForwardBatch, kv_cache, kv_scales=None):
        """The same layers with each rms_norm folded into the product after it (qkv, gate_up)
        and each residual add into the product before it (o_proj, down; at one row silu_mul
        too): what a GPU decode step of 1 or 33-64 sequences runs where `kernels.folds_add_norm`
        (knobs.fold_norms), 66 launches fewer (98 at one row). The residual stream h is the
        whole state between the products: (h, None) out, and final_logits folds the last norm
        into lm_head."""
        b, eps = batch.backend, self.config.rms_norm_eps
        h = hidden if residual is None else hidden + residual
        for i, layer in enumerate(self.layers):
            scales = (None, None) if kv_scales is None else (kv_scales[i, 0], kv_scales[i, 1])
            qkv = kernels.norm_linear(h, layer.input_norm, eps, layer.qkv, layer.qkv_bias, backend=b)
            out = self.attend(i, qkv, positions, batch, kv_cache[i, 0], kv_cache[i, 1], *scales)
            h = kernels.linear_residual(out, layer.o_proj, h, backend=b)
            gate_up = kernels.norm_linear(h, layer.post_norm, eps, layer.gate_up, backend=b)
            h = kernels.linear_residual(gate_up, layer.down, h, silu_mul_first=True, backend=b)
        return h, None

    def _folds(self, x, batch: ForwardBatch) -> bool:
        """Whether this forward folds its norms and residual adds (folded_decoder_layers): a
        decode step whose rows the kernels fold, not while hook points record (the folded path
        has no normalized x to show) nor in a tensor-parallel shard (an all-reduce stands
        between o_proj and the add)."""
        return (self.fold_add_norm and self.taps is None and batch.num_prefill_tokens == 0
                and batch.decode_rows is None and kernels.folds_add_norm(x, backend=batch.backend))

    def with_decoder_layer(self, decoder_layer) -> "LlamaModel":
        """This model, its layers run by `decoder_layer` (the plug-in point of exercise 15:
        `LLMEngine(config, decoder_layer=DecoderLayer)`): a class built once per layer as
        decoder_layer(config, weights) (weights: that layer's LayerWeights, the same tensors,
        not copies) whose objects are called as layer(hidden, residual, positions, batch,
        k_cache, v_cache, k_scales, v_scales) -> (hidden, residual), the body of the loop in
        `decoder_layers`. A new model object: this one is unchanged. The layer hook points
        ("layers.{i}...") are the plugged layer's to record, so they stay empty."""
        model = copy.copy(self)
        model.plugged_layers = [decoder_layer(self.config, weights) for weights in self.layers]
        return model

    def _plugged_decoder_layers(self, hidden, residual, positions, batch, kv_cache, kv_scales):
        for i, layer in enumerate(self.plugged_layers):
            scales = (None, None) if kv_scales is None else (kv_scales[i, 0], kv_scales[i, 1])
            hidden, residual = layer(hidden, residual, positions, batch, kv_cache[i, 0], kv_cache[i, 1], *scales)
        return hidden, residual

    def final_logits(self, hidden, residual, batch: ForwardBatch) -> torch.Tensor:
        """Only the last token of each sequence that samples needs the final norm and the
        vocab projection: logits [S, vocab], float32."""
        idx, eps = batch.logits_indices, self.config.rms_norm_eps
        if residual is None:   # a folded step's residual stream
            last = hidden[idx]
            if self._folds(last, batch):
                return kernels.norm_linear(last, self.norm, eps, self.lm_head, out_dtype=LOGITS_DTYPE,
                                           backend=batch.backend)
            last = kernels.rms_norm(last, self.norm, eps, backend=batch.backend)
        elif idx.shape[0] == hidden.shape[0]:
            # every row samples (a decode step): normalizing them all costs the same, and
            # one gather of the result replaces a gather of hidden and one of the residual
            last = kernels.rms_norm(hidden, self.norm, eps, residual, backend=batch.backend)[0][idx]
        else:
            last, _ = kernels.rms_norm(hidden[idx], self.norm, eps, residual[idx], backend=batch.backend)
        self._tap("norm", last)
        logits = self.logits(last, batch.backend).to(LOGITS_DTYPE)
        self._tap("logits", logits)
        return logits

    # The forward's parts. A tensor-parallel shard (model/tensor_parallel.py) is this model
    # with a collective after four of them; the forward itself has no parallelism in it.
    def embedding(self, input_ids) -> torch.Tensor:
        return F.embedding(input_ids, self.embed)

    def mlp(self, layer: LayerWeights, x, backend=None) -> torch.Tensor:
        # silu_mul(linear(x, gate_up)) first
        return kernels.linear(kernels.swiglu(x, layer.gate_up, backend=backend), layer.down, backend=backend)

    def logits(self, last, backend=None) -> torch.Tensor:
        return kernels.linear(last, self.lm_head, backend=backend)

    def attention(self, i, layer, x, positions, batch: ForwardBatch, k_cache, v_cache, k_scales=None, v_scales=None):
        qkv = kernels.linear(x, layer.qkv, layer.qkv_bias, backend=batch.backend)
        out = self.attend(i, qkv, positions, batch, k_cache, v_cache, k_scales, v_scales)
        return kernels.linear(out, layer.o_proj, backend=batch.backend)

    def attend(self, i, qkv, positions, batch: ForwardBatch, k_cache, v_cache, k_scales=None, v_scales=None):
        """From the qkv projection [T, (H + 2 Hkv) D] to the attention output [T, H D] that
        o_proj takes: rope, store_kv, then prefill and decode attention."""
        cfg, b = self.config, batch.backend
        q, k, v = self.heads(qkv)
        self._tap(f"layers.{i}.q", q)
        self._tap(f"layers.{i}.k", k)
        self._tap(f"layers.{i}.v", v)
        num_tokens = q.shape[0]
        if batch.num_prefill_tokens == 0 and num_tokens > 0 and batch.num_splits == 1:
            # a decode-only step without flash-decoding splits (batch 64 at 512 or 4k tokens):
            # rope, store_kv and decode attention in one kernel on a GPU, the new tokens' keys
            # and values attended to from registers. On the H200 a batch-64 step took 0.1-0.27 ms
            # less; with splits (batch 1: 4) it took 0.01-0.04 ms more, so split steps run the pair.
            out = kernels.rope_store_decode_attention(
                q, k, v, positions, cfg.rope_theta, cfg.rope_scaling, k_cache, v_cache, batch.slot_mapping,
                batch.decode_block_tables, batch.decode_seq_lens, self.scale, batch.num_splits, k_scales, v_scales,
                backend=b)
            return out.reshape(num_tokens, cfg.num_heads * cfg.head_dim)
        q = self.store(q, k, v, positions, batch.slot_mapping, k_cache, v_cache, k_scales, v_scales, b)
        return self.attend_stored(q, batch, k_cache, v_cache, k_scales, v_scales)

    def heads(self, qkv):
        """q [T, H, D], k and v [T, Hkv, D] of the qkv projection: strided views, not copies
        (the kernels take any token stride)."""
        cfg = self.config
        num_tokens, heads, kv_heads, head_dim = qkv.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return (q.view(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim),
                v.view(num_tokens, kv_heads, head_dim))

    def store(self, q, k, v, positions, slot_mapping, k_cache, v_cache, k_scales=None, v_scales=None, backend=None):
        """rope, then store_kv of the rotated keys and the values (one kernel on a GPU): the
        rotated queries [T, H, D]."""
        cfg = self.config
        return kernels.rope_store_kv(q, k, v, positions, cfg.rope_theta, cfg.rope_scaling, k_cache, v_cache,
                                     slot_mapping, k_scales, v_scales, backend=backend)

    def attend_stored(self, q, batch: ForwardBatch, k_cache, v_cache, k_scales=None, v_scales=None):
        """Attention of rotated queries [T, H, D] whose keys and values are in the cache: the
        prefill chunks' first, then the decoding tokens' (a prompt graph's batch: both over
        every row, each row taking the one `decode_rows` says). [T, H D]."""
        num_tokens, p, b = q.shape[0], batch.num_prefill_tokens, batch.backend

        def prefill(rows):
            return kernels.prefill_attention(rows, k_cache, v_cache, batch.prefill_block_tables,
                                             batch.prefill_cu_seqlens_q, batch.prefill_seq_lens, self.scale,
                                             k_scales, v_scales, backend=b)

        def decode(rows):
            return kernels.decode_attention(rows, k_cache, v_cache, batch.decode_block_tables, batch.decode_seq_lens,
                                            self.scale, batch.num_splits, k_scales, v_scales, backend=b)

        if batch.decode_rows is not None:
            out = torch.where(batch.decode_rows[:, None, None], decode(q), prefill(q))
        elif p == num_tokens or p == 0:
            out = prefill(q) if p else decode(q)
        else:
            out = torch.cat([prefill(q[:p]), decode(q[p:])])
        return out.reshape(num_tokens, self.config.num_heads * self.config.head_dim)

    def input_norm(self, layer: LayerWeights, hidden, residual, backend=None):
        """(x, residual) entering a layer: rms_norm(hidden + residual); before the first
        layer the residual is the hidden state itself."""
        if residual is None:
            return kernels.rms_norm(hidden, layer.input_norm, self.config.rms_norm_eps, backend=backend), hidden
        return kernels.rms_norm(hidden, layer.input_norm, self.config.rms_norm_eps, residual, backend=backend)

    # ---- hook points ---------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self, names=None):
        """Record hook-point tensors (all, or those in `names`) of every forward inside the
        block: yields a dict name -> list of tensors, one per forward."""
        wanted = None if names is None else set(names)
        self.taps, self._wanted = {}, wanted
        try:
            yield self.taps
        finally:
            self.taps = None

    def _tap(self, name, tensor):
        if self.taps is not None and (self._wanted is None or name in self._wanted):
            self.taps.setdefault(name, []).append(tensor.detach().clone())

    # ---- weights -------------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, config: ModelConfig, named_tensors, dtype, device):
        """Build from HF-named tensors (an iterable of (name, tensor)); fuses q/k/v and gate/up."""
        state = {}
        for name, tensor in named_tensors:
            state[name] = tensor.to(device=device, dtype=dtype)
        return cls._from_hf_names(config, state)

    @classmethod
    def _from_hf_names(cls, config, state):
        def take(name, shape):
            if name not in state:
                raise ValueError(f"weight {name!r} is missing from the checkpoint")
            tensor = state.pop(name)
            if tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, config expects {tuple(shape)}")
            return tensor

        c = config
        h, q_size, kv_size = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        embed = take("model.embed_tokens.weight", (c.vocab_size, h))
        layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([take(p + "self_attn.q_proj.weight", (q_size, h)),
                             take(p + "self_attn.k_proj.weight", (kv_size, h)),
                             take(p + "self_attn.v_proj.weight", (kv_size, h))])
            bias = None
            if c.attention_bias:
                bias = torch.cat([take(p + "self_attn.q_proj.bias", (q_size,)),
                                  take(p + "self_attn.k_proj.bias", (kv_size,)),
                                  take(p + "self_attn.v_proj.bias", (kv_size,))])
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight", (c.intermediate_size, h)),
                                 take(p + "mlp.up_proj.weight", (c.intermediate_size, h))])
            layers.append(LayerWeights(
                input_norm=take(p + "input_layernorm.weight", (h,)), qkv=qkv, qkv_bias=bias,
                o_proj=take(p + "self_attn.o_proj.weight", (h, q_size)),
                post_norm=take(p + "post_attention_layernorm.weight", (h,)), gate_up=gate_up,
                down=take(p + "mlp.down_proj.weight", (h, c.intermediate_size))))
        norm = take("model.norm.weight", (h,))
        lm_head = embed if c.tie_word_embeddings else take("lm_head.weight", (c.vocab_size, h))
        return cls(config, embed, layers, norm, lm_head)

    @classmethod
    def random(cls, config: ModelConfig, dtype, device, seed=0):
        """Random weights (std 0.02, norms near 1) in the given shape: for benchmarks and tests."""
        gen = torch.Generator(device=device).manual_seed(seed)

        def rand(*shape, std=0.02, mean=0.0):
            return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std + mean).to(dtype)

        c = config
        h, qkv_rows = c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        layers = [LayerWeights(
            input_norm=rand(h, mean=1.0), qkv=rand(qkv_rows, h),
            qkv_bias=rand(qkv_rows) if c.attention_bias else None,
            o_proj=rand(h, c.num_heads * c.head_dim), post_norm=rand(h, mean=1.0),
            gate_up=rand(2 * c.intermediate_size, h), down=rand(h, c.intermediate_size))
            for _ in range(c.num_layers)]
        embed = rand(c.vocab_size, h)
        lm_head = embed if c.tie_word_embeddings else rand(c.vocab_size, h)
        return cls(config, embed, layers, rand(h, mean=1.0), lm_head)

    def matrices(self) -> list[torch.Tensor]:
        """The weights that go through `kernels.linear`, in forward order."""
        # a pipeline stage without the last layers has no lm_head (None)
        return [w for layer in self.layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)] + (
            [] if self.lm_head is None else [self.lm_head])

    def num_parameters(self) -> int:
        tensors = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for layer in self.layers:
            tensors += list(vars(layer).values())
        return sum(t.numel() for t in tensors if t is not None)   # a pipeline stage lacks some
