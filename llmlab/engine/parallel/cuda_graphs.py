"""CUDA graphs of tensor-parallel decode steps: every rank captures the same graphs.

A decode step of a big model is launch-bound (cuda_graphs.py), and more so with tensor
parallelism: each layer adds two all-reduces to its ~10 kernels, and every rank launches
them all. NCCL's collectives can be captured in a CUDA graph, so each rank captures its own
shard's decode forward, collectives included, under the same (batch size, splits) keys as
TP=1, and a step replays the graph of one key on every rank at once: the ranks' graphs meet
in the captured all-reduces, as their eager forwards do.

Rank 0 decides, as without tensor parallelism (ModelRunner.forward), and tells the workers
with the step (engine/parallel/wire.py: the FORWARD header's `graphed` flag). Captures happen on
every rank together too (the CAPTURE message): a capture runs the forward once eagerly,
collectives and all, before recording it. Only without pipeline parallelism: a stage's
step also waits on its neighbours' sends, which these graphs do not hold.
"""
from __future__ import annotations

import torch

from llmlab.cuda_graphs.decode import CudaGraphDecoder
from llmlab.engine.parallel.pipeline import whole_batch_cuts
from llmlab.model.llama import ForwardBatch
from llmlab.model.tensor_parallel import TensorParallelShard


class LocalForward:
    """What a rank's graphs capture: its own shard's forward (collectives inside), not rank
    0's ParallelModel.forward, which would also broadcast the step to the workers."""

    def __init__(self, shard: TensorParallelShard):
        self.shard = shard

    def forward(self, input_ids, positions, batch: ForwardBatch, kv_cache, kv_scales=None) -> torch.Tensor:
        return TensorParallelShard.forward(self.shard, input_ids, positions, batch, kv_cache, kv_scales)


class ParallelCudaGraphs:
    """Rank 0's side, with CudaGraphDecoder's interface (can_run, run, capture), so the
    ModelRunner replays it as it replays one GPU's graphs."""

    def __init__(self, executor, model: TensorParallelShard, kv_cache, max_num_seqs: int,
                 max_blocks_per_seq: int, backend: str | None):
        self.executor, self.kv_cache = executor, kv_cache
        self._sizes = (max_num_seqs, max_blocks_per_seq, kv_cache.device.shape[2], backend)
        executor.send_capture(*self._sizes, [])          # the workers capture the ladder with us
        self.local = self._run(CudaGraphDecoder, LocalForward(model), kv_cache, max_num_seqs,
                               max_blocks_per_seq, backend)

    @property
    def graphs(self):
        return self.local.graphs

    @property
    def sizes(self):
        return self.local.sizes

    def capture(self, keys) -> None:
        keys = sorted(set(keys) - set(self.local.graphs))
        self.executor.send_capture(*self._sizes, keys)
        self._run(self.local.capture, keys)

    def can_run(self, num_seqs: int) -> bool:
        return self.local.can_run(num_seqs)

    def run(self, input_ids, positions, batch: ForwardBatch) -> torch.Tensor:
        """Replay this decode batch's graph on every rank; logits [num_seqs, vocab]."""
        self.executor.send_forward(input_ids, positions, batch, whole_batch_cuts(input_ids, batch),
                                   self._sizes[2], graphed=True)
        logits = self._run(self.local.run, input_ids, positions, batch)
        self.executor.wait_for_step(logits)
        return logits

    def _run(self, fn, *args):
        try:
            return fn(*args)
        except BaseException as err:   # the ranks are out of step now: stop them all
            self.executor._fail(err)
