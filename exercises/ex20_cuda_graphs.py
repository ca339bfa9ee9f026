"""Exercise 20 -- CUDA graphs for decode steps: capture the decode forward once per batch size
over static input buffers, then replay it for any decode batch that fits, padded.
Difficulty: *** (no Triton; torch only; about 60 minutes; its replay is graded on a CUDA GPU only)

Read first: notebooks/11_serving_and_benchmarking.ipynb ("A trace recorded on a GPU": where a
decode step's time goes), kernels_explained/decode_attention.md ("CUDA graphs": why the split
count is part of a graph's key) and PyTorch's notes on CUDA graphs (torch.cuda.CUDAGraph,
torch.cuda.graph, graph.pool()). Use: the model's `forward(input_ids, positions, batch,
kv_cache, kv_scales)` (llmlab/model/llama.py) and the `ForwardBatch` it takes, the KVCache
(`kv_cache.device`, `kv_cache.device_scales`), and `batch_size_ladder` (imported below).
`__init__`, `_batch`, `capture` and `can_run` are written for you. Nothing else is needed.

Why
    A decode step launches ~10 kernels per layer; at small batches the GPU finishes each one
    faster than Python launches the next, so the step costs its launches, not its math. A
    CUDA graph records the step's kernels once, arguments and raw addresses included, and
    replays them all with one launch. A replay repeats exactly what was recorded: the same
    shapes, grids and addresses. So the inputs live in static buffers that never move (each
    step copies into them), and there is one graph per batch size of a ladder (1, 2, 4, 8,
    16, 24, ...) and per flash-decoding split count (it sets the attention's grid); a batch
    of 5 replays the graph of 8, its last 3 rows padding.

Task
    padded_batch_size(num_seqs, sizes)   the batch size a decode step of num_seqs >= 1
            sequences replays: the smallest of `sizes` (ascending) that holds them; None when
            none does (the step then runs eagerly).
    CudaGraphDecoder._capture(size, num_splits)   one graph for the key (size, num_splits):
            the model's forward over the first `size` rows of the static buffers
            (self._batch(size, num_splits) is the ForwardBatch of views into them).
              1. Reset the buffers to a harmless batch first (slot_mapping -1: store nothing;
                 seq_lens 1; block_tables 0): the runs below really execute, and a previous
                 step's slots left there would overwrite K/V that requests own.
              2. Warm up: run the forward once eagerly, on a side stream (as torch.cuda.graph's
                 docs do: the stream waits for the current one, and the current one for it),
                 so Triton compiles its kernels and every tensor a kernel caches is allocated
                 before the capture (a compile cannot run inside one, and a tensor cached
                 there would live in the graph's pool).
              3. Record it: `with torch.cuda.graph(graph, pool=self.pool):` around the forward;
                 then self.pool = graph.pool(), so every graph shares one memory pool.
              4. Keep, under the key, the graph (self.graphs), the logits tensor the forward
                 returned inside the capture (self.logits: every replay writes there) and the
                 ForwardBatch (self.batches: a graph reads raw addresses, so every tensor it
                 reads must live as long as the graph).
    CudaGraphDecoder.run(input_ids, positions, batch)   a decode batch of num_seqs sequences,
            as the eager forward takes it (batch.num_prefill_tokens == 0, can_run(num_seqs)):
            its size is padded_batch_size; capture the key (size, batch.num_splits) now if it
            is missing; copy the inputs into the first num_seqs rows of the buffers (the block
            tables into their first `width` columns); make the padding rows num_seqs..size
            harmless (slot -1, seq_len 1); replay; return the logits of the real rows.

Shapes
    input_ids, positions       int64 [num_seqs]
    batch.slot_mapping         int64 [num_seqs]      (-1: store nothing)
    batch.decode_seq_lens      int32 [num_seqs]      (context length, the new token included)
    batch.decode_block_tables  int32 [num_seqs, width], width <= max_blocks_per_seq
    returns                    logits [num_seqs, vocab] (float32)

Hints
    - Copy into the buffers (`self.input_ids[:n].copy_(input_ids)`), never rebind them
      (`self.input_ids = input_ids`): the graph reads the addresses it was captured with.
    - Padding rows keep the previous step's values unless you overwrite them: a stale slot
      writes the K/V of a stale token into a block that another request may own by now.
    - Capture before copying: the capture's reset (step 1) would wipe this step's inputs.
    - Capture the largest size first (`__init__` does): the smaller graphs then fit in the
      memory the largest one's pool already holds.

What you will have built: the decode-step CUDA graphs of a GPU inference engine (vLLM's
CUDAGraphRunner, SGLang's CudaGraphRunner); the grader compares your replayed logits with the
eager forward's for batches between the ladder's sizes, checks that padding rows store
nothing, and runs the real engine on a GPU with yours (LLMEngine(config,
cuda_graphs=CudaGraphDecoder)). Without CUDA only padded_batch_size is graded.

Grade: `make grade EX=ex20`, or `pytest tests/exercises/test_ex20_cuda_graphs.py --impl=exercises`.
"""
from __future__ import annotations

import torch

from llmlab.cuda_graphs.decode import batch_size_ladder
from llmlab.model.llama import ForwardBatch


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest of `sizes` (ascending) >= num_seqs; None when num_seqs is past them all."""
    raise NotImplementedError("ex20: write padded_batch_size (the smallest captured size that holds the batch)")


class CudaGraphDecoder:
    """One CUDA graph per (batch size, flash-decoding splits) of the decode forward, over
    static input buffers; `run` replays the one a decode batch fits."""

    def __init__(self, model, kv_cache, max_num_seqs: int, max_blocks_per_seq: int, backend: str | None = None):
        """Allocates the static buffers (for the largest size) and captures every size of the
        ladder with one split, largest first. Given."""
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        device = kv_cache.device.device
        self.sizes = batch_size_ladder(max_num_seqs)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, device=device, dtype=torch.int64)
        self.positions = torch.zeros(n, device=device, dtype=torch.int64)
        self.slot_mapping = torch.full((n,), -1, device=device, dtype=torch.int64)
        self.seq_lens = torch.ones(n, device=device, dtype=torch.int32)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, device=device, dtype=torch.int32)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.batches: dict[tuple[int, int], ForwardBatch] = {}
        self.pool = None   # the memory pool every graph shares (graph.pool() of the first)
        for size in reversed(self.sizes):
            self._capture(size, 1)

    def _batch(self, size: int, num_splits: int) -> ForwardBatch:
        """A decode ForwardBatch whose tensors are views of the first `size` rows of the
        buffers: every sequence samples (logits_indices 0..size-1). Given."""
        device = self.input_ids.device
        empty = torch.zeros(0, device=device, dtype=torch.int32)
        return ForwardBatch(
            num_prefill_tokens=0, slot_mapping=self.slot_mapping[:size],
            prefill_cu_seqlens_q=torch.zeros(1, device=device, dtype=torch.int32),
            prefill_seq_lens=empty, prefill_block_tables=empty.reshape(0, 0),
            decode_seq_lens=self.seq_lens[:size], decode_block_tables=self.block_tables[:size],
            logits_indices=torch.arange(size, device=device), num_splits=num_splits, backend=self.backend)

    def _capture(self, size: int, num_splits: int) -> None:
        """Warm up, then record the forward of the key (size, num_splits)."""
        raise NotImplementedError("ex20: write _capture (reset the buffers, warm up on a side stream, record the "
                                  "graph into the shared pool)")

    def capture(self, keys) -> None:
        """Capture the (size, splits) graphs of `keys` not captured yet, largest first. Given."""
        for size, num_splits in sorted(set(keys) - set(self.graphs), reverse=True):
            self._capture(size, num_splits)

    def can_run(self, num_seqs: int) -> bool:
        """Whether a decode step of num_seqs sequences has a graph size (else it runs eagerly). Given."""
        return 0 < num_seqs <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Replay the graph this decode batch fits; logits [num_seqs, vocab] of its real rows."""
        raise NotImplementedError("ex20: write run (pad, capture a missing key, copy into the buffers, replay)")
