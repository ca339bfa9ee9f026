"""CUDA graphs for steps that hold a prompt (a prefill, or prefills beside decodes).

A decode graph (decode.py) cannot take such a step: its attention has prompts of
lengths that change from step to step. Run eagerly, it launches ~10 kernels per layer from
Python: on an H200 with the 8B model ~15 ms of host time for ~6 ms of GPU work, and every
request that arrives stalls every running stream for that long (ITL p99 44 ms at 8 req/s
against a 5.2 ms median). Graphs of every layer but its attention (vLLM's piecewise graphs)
still left a step at 2.3-3.9x a decode step: per layer a replay and the attention's
launches from Python.

So the whole step is one graph per padded token count (`TOKEN_SIZES`), attention included. What makes attention capturable is that both attention
kernels run over every row of the graph, whatever the step's mix, and each row keeps the
result that is its own (`ForwardBatch.decode_rows`). For a step of n tokens, p of them in
prefill chunks, in a graph of `size`, the static buffers hold

    prefill   cu_seqlens_q, seq_lens and block tables of the step's prefill chunks, then
              padding sequences of no tokens up to `MAX_PROMPTS` (their programs return at
              once): the prefill kernel finds each program's sequence on the GPU
    decode    per row: the decoding sequence's seq_len and block table at rows p .. p + D,
              a seq_len of 0 elsewhere (nothing read: the kernels write zeros there, and
              the row keeps its prefill result; a one-token context on those rows made a
              step with a 496-token prompt 3.5% slower on the H200, 14.9 against 14.4 ms,
              and a 512-token prefill 13.0 against 12.5); one flash-decoding split (the split count
              the step's few decodes would take, over every row of the graph, cost a step of
              16 decodes and a 496-token prompt ~1.8 ms on the H200)
    slot_mapping   the step's slots; padding tokens n .. size store nothing (-1)

and the graph runs the model's own `decoder_layers` over them. The final norm and the
logits of the sampling rows run eagerly after the replay (their row count varies).

Used by ModelRunner.forward for any step of up to `max_tokens` tokens and `MAX_PROMPTS`
prompt chunks that the decode graphs do not take, under the decode graphs' conditions (a GPU, the Triton backend, no
enforce_eager, no hook points), and not with a plugged-in decoder layer (its layers are the
student's) or tensor / pipeline parallelism.
"""
from __future__ import annotations

import torch

from llmlab.model.llama import ForwardBatch

# the padded token counts captured; a step of more tokens runs eagerly (its GPU work hides
# the launches: 512 prompt tokens of the 8B model are ~14 ms of matmuls)
TOKEN_SIZES = (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
# the prompt chunks a graph holds: the prefill kernel's grid has a program per head for each
# (mostly a padding sequence), and padding all 512 of the largest graph's rows so cost a
# 496-token prompt beside 16 decodes 2.5 ms on the H200 (17.9 against 15.4 ms)
MAX_PROMPTS = 16


def padded_token_count(num_tokens: int, sizes) -> int | None:
    """The smallest captured size that holds `num_tokens`, None when none does."""
    return next((size for size in sizes if size >= num_tokens), None)


class PromptInputs:
    """The static buffers a prompt graph reads (the module's docstring) and the staging of a
    step into them; on any device."""

    def __init__(self, max_tokens: int, max_blocks_per_seq: int, device):
        ints = dict(device=device, dtype=torch.int32)
        self.input_ids = torch.zeros(max_tokens, device=device, dtype=torch.int64)
        self.positions = torch.zeros(max_tokens, device=device, dtype=torch.int64)
        self.slot_mapping = torch.full((max_tokens,), -1, device=device, dtype=torch.int64)
        self.cu_seqlens_q = torch.zeros(MAX_PROMPTS + 1, **ints)
        self.prefill_seq_lens = torch.zeros(MAX_PROMPTS, **ints)
        self.prefill_block_tables = torch.zeros(MAX_PROMPTS, max_blocks_per_seq, **ints)
        self.decode_seq_lens = torch.zeros(max_tokens, **ints)
        self.decode_block_tables = torch.zeros(max_tokens, max_blocks_per_seq, **ints)
        self.decode_rows = torch.zeros(max_tokens, device=device, dtype=torch.bool)

    def batch(self, size: int, backend: str | None = None) -> ForwardBatch:
        """The ForwardBatch of a graph of `size` tokens over these buffers."""
        return ForwardBatch(
            num_prefill_tokens=size, slot_mapping=self.slot_mapping[:size],
            prefill_cu_seqlens_q=self.cu_seqlens_q, prefill_seq_lens=self.prefill_seq_lens,
            prefill_block_tables=self.prefill_block_tables, decode_seq_lens=self.decode_seq_lens[:size],
            decode_block_tables=self.decode_block_tables[:size], logits_indices=self.input_ids[:0],
            backend=backend, decode_rows=self.decode_rows[:size])

    def clear(self) -> None:
        """No sequences, no slots: a run over the buffers stores nothing and reads nothing."""
        self.slot_mapping.fill_(-1)
        self.cu_seqlens_q.zero_()
        self.decode_seq_lens.zero_()
        self.decode_rows.zero_()

    def stage(self, input_ids, positions, batch: ForwardBatch, size: int) -> None:
        """Copy a step of n <= size tokens and at most MAX_PROMPTS prompt chunks in (its
        prefill chunks first, then its decodes)."""
        n, p = input_ids.shape[0], batch.num_prefill_tokens
        prefills, decodes = batch.prefill_seq_lens.shape[0], batch.decode_seq_lens.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)    # padding tokens store nothing
        self.cu_seqlens_q[:prefills + 1].copy_(batch.prefill_cu_seqlens_q)
        self.cu_seqlens_q[prefills + 1:].fill_(p)   # padding sequences start and end at p
        self.prefill_seq_lens[:prefills].copy_(batch.prefill_seq_lens)
        self.prefill_block_tables[:prefills, :batch.prefill_block_tables.shape[1]].copy_(batch.prefill_block_tables)
        self.decode_seq_lens[:size].zero_()
        self.decode_seq_lens[p:p + decodes].copy_(batch.decode_seq_lens)
        self.decode_block_tables[p:p + decodes, :batch.decode_block_tables.shape[1]].copy_(batch.decode_block_tables)
        self.decode_rows[:size].zero_()
        self.decode_rows[p:p + decodes].fill_(True)


class PromptGraphs:
    def __init__(self, model, kv_cache, max_tokens: int, max_blocks_per_seq: int, backend: str | None = None):
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.sizes = [size for size in TOKEN_SIZES if size <= max_tokens]
        self.inputs = PromptInputs(self.sizes[-1], max_blocks_per_seq, kv_cache.device.device)
        # the outputs (hidden, residual) and the batch a graph reads live as long as the graph
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.batches: dict[int, ForwardBatch] = {}
        self.pool = None
        for size in reversed(self.sizes):   # largest first, so smaller graphs reuse its memory
            self._capture(size)

    def can_run(self, num_tokens: int, num_prompts: int) -> bool:
        return 0 < num_tokens <= self.sizes[-1] and num_prompts <= MAX_PROMPTS

    def _forward(self, size: int):
        model, kv_cache, inputs = self.model, self.kv_cache, self.inputs
        hidden = model.embedding(inputs.input_ids[:size])
        return model.decoder_layers(hidden, None, inputs.positions[:size], self.batches[size], kv_cache.device,
                                    kv_cache.device_scales)

    def _capture(self, size: int) -> None:
        self.inputs.clear()   # the warm-up run below really executes
        self.batches[size] = self.inputs.batch(size, self.backend)
        self._forward(size)   # compiles what the step launches, outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[size] = self._forward(size)
        self.pool = graph.pool()
        self.graphs[size] = graph

    @torch.inference_mode()
    def run(self, input_ids, positions, batch: ForwardBatch) -> torch.Tensor:
        """The step's logits [sampling rows, vocab], as model.forward gives them."""
        n = input_ids.shape[0]
        size = padded_token_count(n, self.sizes)
        self.inputs.stage(input_ids, positions, batch, size)
        self.graphs[size].replay()
        hidden, residual = self.outputs[size]
        return self.model.final_logits(hidden[:n], None if residual is None else residual[:n], batch)
