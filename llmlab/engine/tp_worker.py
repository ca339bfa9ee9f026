"""A tensor-parallel worker process: ranks 1 .. tensor_parallel_size - 1.

Each worker joins the process group, receives its weight shard from rank 0, and then runs
the same forward as rank 0 on its own shard, one "forward" message per engine step, until
"stop" (see llmlab.engine.distributed for rank 0's side and the life of a worker).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from llmlab.cache.kv_cache import KVCache, bytes_per_block
from llmlab.config import EngineConfig, ModelConfig
from llmlab.model.llama import ForwardBatch
from llmlab.model.tensor_parallel import (TensorParallelGroup, TensorParallelShard, model_from_weights,
                                          scatter_weights, shard_config)

COLLECTIVE_TIMEOUT = timedelta(minutes=5)
def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """cuda:{first + rank} where rank 0 is on cuda:first; the CPU for every rank otherwise."""
    device = config.resolved_device()
    if device.type == "cpu":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _from_wire(value, device):
    return torch.from_numpy(value).to(device) if isinstance(value, np.ndarray) else value


def worker_main(rank: int, port: int, config: EngineConfig, model_config: ModelConfig, pipe,
                parent_pid: int) -> None:
    """Entry point of worker `rank`: join the group, take a shard, run steps until "stop"."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is rank 0's to handle
        torch.set_num_threads(1)                       # the ranks share the CPU cores
        _exit_with_parent(parent_pid)
        tp, device = config.tensor_parallel_size, rank_device(config, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        pipe.send(("started",))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=tp,
                                init_method=f"tcp://127.0.0.1:{port}", timeout=COLLECTIVE_TIMEOUT)
        local_config = shard_config(model_config, tp)
        model = model_from_weights(TensorParallelShard, local_config, scatter_weights(None, rank, tp, device))
        model.tp_group = TensorParallelGroup(rank, tp, model_config.vocab_size)
        pipe.send(("ready",))
        dtype = config.resolved_dtype()
        # the same count as num_blocks_for gives rank 0, whose heads are the same size as ours
        num_host_blocks = int(config.swap_space * 2**30) // bytes_per_block(local_config, config.block_size, dtype)
        kv_cache = None
        while True:
            try:
                message = pipe.recv()
            except EOFError:                   # rank 0 is gone
                break
            if message[0] == "stop":
                break
            if message[0] == "forward":
                _, input_ids, positions, fields, num_blocks = message
                if kv_cache is None or kv_cache.device.shape[2] != num_blocks:
                    kv_cache = None            # free the old cache before taking the new one
                    kv_cache = KVCache(local_config, num_blocks, num_host_blocks, config.block_size,
                                       dtype, device)
                batch = ForwardBatch(**{name: _from_wire(v, device) for name, v in fields.items()})
                model.forward(_from_wire(input_ids, device), _from_wire(positions, device), batch,
                              kv_cache.device)
            elif message[0] == "swap":
                kv_cache.swap_out(message[1])
                kv_cache.swap_in(message[2])
            else:
                raise ValueError(f"unknown message {message[0]!r} from rank 0")
        dist.destroy_process_group()
    except BaseException:
        error = traceback.format_exc()
        print(f"llmlab tensor-parallel worker {rank} failed:\n{error}", file=sys.stderr, flush=True)
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

    threading.Thread(target=watch, name="llmlab-tp-parent-watch", daemon=True).start()
