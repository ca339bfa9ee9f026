"""A worker process: ranks 1 .. tensor_parallel_size x pipeline_parallel_size - 1.

Each worker joins the process groups, receives its weights from rank 0 (its stage's
layers, its tensor-parallel shard of them), and then runs its part of every step rank 0
broadcasts (engine/parallel/wire.py) until STOP: see llmlab.engine.parallel.executor for rank 0's side
and the life of a worker, engine/parallel/pipeline.py for what one part of a step is.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from llmlab.cache.kv_cache import KVCache
from llmlab.config import EngineConfig, ModelConfig
from llmlab.engine.parallel import wire
from llmlab.cuda_graphs.decode import CudaGraphDecoder
from llmlab.engine.host_memory import keep_freed_memory
from llmlab.engine.parallel.pipeline import micro_batches, run_stage
from llmlab.engine.parallel.placement import RankLayout, distribute_weights, join_groups, local_config
from llmlab.engine.parallel.cuda_graphs import LocalForward
from llmlab import kernels
from llmlab.model.tensor_parallel import TensorParallelGroup, TensorParallelShard, model_from_weights

# longest any rank may wait inside one collective of a step or of the start-up; between
# steps workers wait in the control group, which has no practical timeout (placement.py),
# so only a hang or a first-time kernel compile on one rank comes near it
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """cuda:{first + rank} where rank 0 is on cuda:first; the CPU for every rank otherwise."""
    device = config.resolved_device()
    if device.type == "cpu":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def worker_main(rank: int, port: int, config: EngineConfig, model_config: ModelConfig, pipe,
                parent_pid: int, num_host_blocks: int) -> None:
    """Entry point of worker `rank`: join the groups, take its weights, run steps until STOP."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is rank 0's to handle
        torch.set_num_threads(1)                       # the ranks share the CPU cores
        _exit_with_parent(parent_pid)
        layout = RankLayout(rank, config.tensor_parallel_size, config.pipeline_parallel_size,
                            model_config.num_layers)
        device = rank_device(config, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        pipe.send(("started",))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank,
                                world_size=layout.world_size, init_method=f"tcp://127.0.0.1:{port}",
                                timeout=COLLECTIVE_TIMEOUT)
        groups = join_groups(layout)
        config_here = local_config(model_config, layout)
        model = model_from_weights(TensorParallelShard, config_here, distribute_weights(None, layout, device))
        model.tp_group = TensorParallelGroup(layout.tp_rank, layout.tp, model_config.vocab_size,
                                             groups.tensor_parallel)
        if device.type == "cpu":               # as the ModelRunner does for rank 0's part
            kernels.prepack(model.matrices())
            keep_freed_memory()
        pipe.send(("ready",))
        dtype, kv_cache, graphs, steps_run = config.resolved_dtype(), None, None, 0

        def cache_of(num_blocks: int) -> KVCache:
            nonlocal kv_cache
            if kv_cache is None or kv_cache.device.shape[2] != num_blocks:
                if graphs is not None:         # they replay the addresses of this cache
                    raise RuntimeError("rank 0's KV cache changed after the CUDA graphs were captured")
                kv_cache = None                # free the old cache before taking the new one
                kv_cache = KVCache(config_here, num_blocks, num_host_blocks, config.block_size, dtype, device)
            return kv_cache

        while True:
            message = wire.receive(groups, device)
            if message[0] == "stop":
                break
            if message[0] == "swap":
                kv_cache.swap_out(message[1])
                kv_cache.swap_in(message[2])
                continue
            if message[0] == "capture":        # with rank 0, key for key (parallel/cuda_graphs.py)
                _, max_num_seqs, max_blocks_per_seq, num_blocks, backend, keys = message
                cache = cache_of(num_blocks)
                if graphs is None:
                    graphs = CudaGraphDecoder(LocalForward(model), cache, max_num_seqs, max_blocks_per_seq, backend)
                graphs.capture(keys)
                continue
            step = message[1]
            cache = cache_of(step.num_blocks)
            spans = [] if step.record else None
            if step.graphed:
                graphs.run(step.input_ids, step.positions, step.batch)
            else:
                run_stage(model, layout, micro_batches(step.input_ids, step.positions, step.batch, step.cuts),
                          cache.device, None, spans, steps_run)
            steps_run += 1
            if spans is not None:
                pipe.send(("timeline", spans))
        dist.destroy_process_group()
    except BaseException:
        error = traceback.format_exc()
        print(f"llmlab parallel worker {rank} failed:\n{error}", file=sys.stderr, flush=True)
        try:
            pipe.send(("error", error, time.time()))
        except Exception:
            pass
        os._exit(1)                            # no clean-up: it could wait on the other ranks


def _exit_with_parent(parent_pid: int) -> None:
    """If rank 0 dies while this worker waits inside a collective, the pipe cannot tell it."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="llmlab-parent-watch", daemon=True).start()
