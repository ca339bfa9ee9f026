"""CUDA graphs for prefill and mixed steps, in pieces around attention.

A step that holds a prompt (a prefill, or a prefill beside decodes) cannot replay a decode
graph: its attention's shapes (how many prompts, how long) change from step to step. Run
eagerly, such a step launches ~10 kernels per layer from Python, which on an H200 with the
8B model took ~15 ms of host time for a step whose GPU work is ~5 ms: every request that
arrives stalls every running stream for that long (ITL p99 44 ms at 8 req/s against a
5.2 ms median).

Everything in a layer but attention depends on the step only through its token count T. So,
as vLLM's piecewise graphs do, the work between two attentions is captured once per padded
token count (`TOKEN_SIZES`), and a step replays:

    piece 0        embedding, layer 0's input norm, qkv, rope + store_kv       -> q, residual
    attention 0    eager: prefill and decode attention over this step's tables -> attn_out
    piece i        layer i-1's o_proj, norm and MLP, layer i's norm, qkv, rope + store_kv
    attention i    ...
    piece L        the last layer's o_proj, norm and MLP                        -> hidden, residual

then the final norm and the logits of the sampling rows, eagerly. Pieces read and write
static buffers (input ids, positions, slots, q, attn_out, hidden, residual), sliced to T;
padding tokens store nothing (slot -1) and their rows are never read. The pieces are the
model's own `layer_head` / `layer_tail` (model/llama.py): the same kernels as an eager step.

What is left (measured on the H200, 2026-12-04, `llmlab bench single-forward --mixed-prompt-lens`):
such a step still costs 2.3-3.9x a decode step of its batch (batch 16 + a 64-token prompt:
11-16 ms against 5.0), though its GPU work is ~6 ms. The host sets the pace: per layer a
graph replay and two attention launches from Python. Launching the attention without
Triton's launch path, PDL off and one flash-decoding split changed nothing measurable;
capturing attention inside the graphs as well (one replay per step, as decode steps have)
is the step still to take, and it sets the server's tail of time between tokens.

Used by ModelRunner.forward for any step of up to `max_tokens` tokens that the decode graphs
do not take, under the decode graphs' conditions (a GPU, the Triton backend, no
enforce_eager, no hook points), and not with a plugged-in decoder layer (its pieces are the
student's) or tensor / pipeline parallelism.
"""
from __future__ import annotations

import torch

from llmlab.model.llama import ForwardBatch

# the padded token counts captured; a step of more tokens runs eagerly (its GPU work hides
# the launches: 512 prompt tokens of the 8B model are ~14 ms of matmuls)
TOKEN_SIZES = (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


def padded_token_count(num_tokens: int, sizes) -> int | None:
    """The smallest captured size that holds `num_tokens`, None when none does."""
    return next((size for size in sizes if size >= num_tokens), None)


class PiecewiseGraphs:
    def __init__(self, model, kv_cache, max_tokens: int, backend: str | None = None):
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.sizes = [size for size in TOKEN_SIZES if size <= max_tokens]
        cfg, n = model.config, self.sizes[-1]
        device, dtype = kv_cache.device.device, model.embed.dtype
        self.input_ids = torch.zeros(n, device=device, dtype=torch.int64)
        self.positions = torch.zeros(n, device=device, dtype=torch.int64)
        self.slot_mapping = torch.full((n,), -1, device=device, dtype=torch.int64)
        self.q = torch.zeros(n, cfg.num_heads, cfg.head_dim, device=device, dtype=dtype)
        self.attn_out = torch.zeros(n, cfg.num_heads * cfg.head_dim, device=device, dtype=dtype)
        self.hidden = torch.zeros(n, cfg.hidden_size, device=device, dtype=dtype)
        self.residual = torch.zeros(n, cfg.hidden_size, device=device, dtype=dtype)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = None
        for size in reversed(self.sizes):   # largest first, so smaller graphs reuse its memory
            self._capture(size)

    def can_run(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.sizes[-1]

    def _piece(self, i: int, size: int) -> None:
        """Piece i of a step of `size` tokens (the list above), static buffers in and out."""
        model, b = self.model, self.backend
        if i == 0:
            hidden, residual = model.embedding(self.input_ids[:size]), None
        else:
            hidden, residual = model.layer_tail(i - 1, self.attn_out[:size], self.residual[:size], b)
        if i == len(model.layers):
            self.hidden[:size].copy_(hidden)
        else:
            cache, scales = self.kv_cache.device, self.kv_cache.device_scales
            layer_scales = (None, None) if scales is None else (scales[i, 0], scales[i, 1])
            q, residual = model.layer_head(i, hidden, residual, self.positions[:size], self.slot_mapping[:size],
                                           cache[i, 0], cache[i, 1], *layer_scales, backend=b)
            self.q[:size].copy_(q)
        self.residual[:size].copy_(residual)

    def _capture(self, size: int) -> None:
        # the warm-up runs below really execute: they must store nothing into the cache
        self.slot_mapping.fill_(-1)
        graphs = []
        for i in range(len(self.model.layers) + 1):
            self._piece(i, size)   # compiles what the piece launches, outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._piece(i, size)
            self.pool = graph.pool()
            graphs.append(graph)
        self.graphs[size] = graphs

    @torch.inference_mode()
    def run(self, input_ids, positions, batch: ForwardBatch) -> torch.Tensor:
        """The step's logits [sampling rows, vocab], as model.forward gives them."""
        model, n = self.model, input_ids.shape[0]
        size = padded_token_count(n, self.sizes)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)    # padding tokens store nothing
        cache, scales = self.kv_cache.device, self.kv_cache.device_scales
        graphs = self.graphs[size]
        for i in range(len(model.layers)):
            graphs[i].replay()
            layer_scales = (None, None) if scales is None else (scales[i, 0], scales[i, 1])
            self.attn_out[:n].copy_(model.attend_stored(self.q[:n], batch, cache[i, 0], cache[i, 1], *layer_scales))
        graphs[-1].replay()
        return model.final_logits(self.hidden[:n], self.residual[:n], batch)
