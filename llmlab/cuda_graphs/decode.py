"""CUDA graphs for decode steps.

A decode step of a big model launches ~10 kernels per layer; at batch 1 the GPU finishes
each faster than Python can launch the next. So, at start-up, the decode forward is
captured per batch size of a ladder (1, 2, 4, 8, 16, 24, ... 256, 272, ... up to 512,
sizing.py's MAX_GRAPH_BATCH_SIZE) over static input buffers;
a pure-decode step copies its inputs into the buffers of the smallest size that fits
(padding rows write nowhere: slot -1) and replays the graph. The number of flash-decoding
splits is baked into a graph, so graphs are keyed by (size, splits): every size is captured
with one split, then the ModelRunner asks for every other key a step can reach
(warm_up.graph_keys), so no capture happens mid-run (a key still missing is captured the
first time it is asked for). Prefill and mixed steps run eagerly: their shapes vary too much.
"""
from __future__ import annotations

import torch

from llmlab.model.llama import ForwardBatch
from llmlab.sizing import MAX_GRAPH_BATCH_SIZE


def batch_size_ladder(max_num_seqs: int, largest: int = MAX_GRAPH_BATCH_SIZE) -> list[int]:
    """The batch sizes captured, as vLLM's: 1, 2, 4, multiples of 8 up to 256, then of 16, up
    to max_num_seqs and at most `largest` (a larger decode step runs eagerly)."""
    top = max(min(max_num_seqs, largest), 1)
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max(top, 8) + 1, 16))
    return [s for s in sizes if s <= top]


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The captured batch size a decode step of `num_seqs` sequences replays (vLLM's
    pad_for_cudagraph): the smallest of `sizes` (ascending) that holds them, the rows past
    num_seqs padding; None when none does (the step runs eagerly)."""
    return next((size for size in sizes if size >= num_seqs), None)


class CudaGraphDecoder:
    def __init__(self, model, kv_cache, max_num_seqs: int, max_blocks_per_seq: int, backend: str | None = None):
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        device = kv_cache.device.device
        self.sizes = batch_size_ladder(max_num_seqs)
        n = self.sizes[-1]
        ints = dict(device=device, dtype=torch.int32)
        self.input_ids = torch.zeros(n, device=device, dtype=torch.int64)
        self.positions = torch.zeros(n, device=device, dtype=torch.int64)
        self.slot_mapping = torch.full((n,), -1, device=device, dtype=torch.int64)
        self.seq_lens = torch.ones(n, **ints)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, **ints)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        # a graph replays raw addresses: every tensor it reads (logits_indices too) must live
        # as long as the graph, or the allocator hands its memory to someone else
        self.batches: dict[tuple[int, int], ForwardBatch] = {}
        self.pool = None
        for size in reversed(self.sizes):   # largest first, so smaller graphs reuse its memory
            self._capture(size, 1)

    def _batch(self, size: int, num_splits: int) -> ForwardBatch:
        device = self.input_ids.device
        empty = torch.zeros(0, device=device, dtype=torch.int32)
        return ForwardBatch(
            num_prefill_tokens=0, slot_mapping=self.slot_mapping[:size],
            prefill_cu_seqlens_q=torch.zeros(1, device=device, dtype=torch.int32),
            prefill_seq_lens=empty, prefill_block_tables=empty.reshape(0, 0),
            decode_seq_lens=self.seq_lens[:size], decode_block_tables=self.block_tables[:size],
            logits_indices=torch.arange(size, device=device), num_splits=num_splits, backend=self.backend)

    def _capture(self, size: int, num_splits: int) -> None:
        key = (size, num_splits)
        # the eager run below really executes: with an earlier step's inputs still in the
        # buffers it would write K/V into slots that now belong to other requests
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.block_tables.zero_()
        batch = self.batches[key] = self._batch(size, num_splits)
        args = (self.input_ids[:size], self.positions[:size], batch, self.kv_cache.device,
                self.kv_cache.device_scales)   # a quantized cache's scales: fixed tensors, like the cache
        self.model.forward(*args)   # warm-up: compiles kernels, allocates cached tensors
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[key] = self.model.forward(*args)
        self.pool = graph.pool()
        self.graphs[key] = graph

    def capture(self, keys) -> None:
        """Capture the (size, splits) graphs of `keys` not captured yet, largest first."""
        for size, num_splits in sorted(set(keys) - set(self.graphs), reverse=True):
            self._capture(size, num_splits)

    def can_run(self, num_seqs: int) -> bool:
        return 0 < num_seqs <= self.sizes[-1]

    def run(self, input_ids, positions, batch: ForwardBatch) -> torch.Tensor:
        """Replay the decode graph for an eager-shaped decode batch; logits [num_seqs, vocab]."""
        num_seqs = input_ids.shape[0]
        size = padded_batch_size(num_seqs, self.sizes)
        key = (size, batch.num_splits)
        if key not in self.graphs:
            self._capture(size, batch.num_splits)
        width = batch.decode_block_tables.shape[1]
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(batch.slot_mapping)
        self.seq_lens[:num_seqs].copy_(batch.decode_seq_lens)
        self.block_tables[:num_seqs, :width].copy_(batch.decode_block_tables)
        # padding rows: attend to one (ignored) cached token, store nothing
        self.slot_mapping[num_seqs:size].fill_(-1)
        self.seq_lens[num_seqs:size].fill_(1)
        self.graphs[key].replay()
        return self.logits[key][:num_seqs]
