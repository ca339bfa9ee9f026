"""Tensor-parallel execution: this process is rank 0; tensor_parallel_size - 1 worker
processes are the other ranks, one GPU each (cuda:{rank}, NCCL) or, without CUDA, one
CPU process each (gloo).

Rank 0 runs the whole engine: the one scheduler, block manager and runner. Its model is
a TensorParallelModel, whose forward sends the prepared batch (input_ids, positions,
ForwardBatch) to every worker and then runs rank 0's own shard; each worker runs the same
forward on its shard, and inside it the ranks meet in the all-reduces and the all-gather
of llmlab.model.tensor_parallel. Only rank 0 samples; the workers drop their logits.

Steps travel through one pipe per worker, the math through torch.distributed. A worker
waiting on a pipe costs nothing however long a server idles, sees rank 0 end (the pipe
closes, so no process is left orphaned) and can send back its traceback when it fails;
a worker idling inside a collective would time out or keep a GPU spinning.

Life of a worker: spawned -> "started" -> joins the process group (TCP rendezvous on a
free loopback port) -> receives its weight shard (scatter_weights) -> "ready" -> runs
"forward" and "swap" messages until "stop". Its KV cache mirrors rank 0's: each forward
says how many blocks rank 0's cache has, and a worker (re)allocates when that changes
(the start-up memory probe, then the engine's cache).
"""
from __future__ import annotations

import dataclasses
import multiprocessing.connection
import os
import pickle
import socket
import threading
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llmlab.config import EngineConfig, ModelConfig
from llmlab.model.llama import ForwardBatch, LlamaModel
from llmlab.engine.tp_worker import COLLECTIVE_TIMEOUT, rank_device, worker_main
from llmlab.model.tensor_parallel import (TensorParallelGroup, TensorParallelShard, model_from_weights,
                                          scatter_weights, shard_config)

START_TIMEOUT_S = 300    # a worker's start: import torch, join the group, receive its weights
# longest any rank may wait inside one collective; ranks only enter collectives together
# (workers idle on their pipe, not in a collective), so only a hang or a first-time kernel
# compile on one rank comes near it




@dataclass
class Worker:
    rank: int
    process: multiprocessing.process.BaseProcess
    pipe: multiprocessing.connection.Connection


class TensorParallelExecutor:
    """Rank 0's side: starts the workers, hands out the weights, sends them every step."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        tp = config.tensor_parallel_size
        self.local_config = shard_config(model_config, tp)   # a size that does not fit raises here
        self.config, self.size, self.vocab_size = config, tp, model_config.vocab_size
        self.device = rank_device(config, 0)
        if self.device.type == "cuda" and torch.cuda.device_count() < self.device.index + tp:
            raise ValueError(f"tensor_parallel_size={tp} from {self.device} needs {self.device.index + tp} "
                             f"GPUs; this machine has {torch.cuda.device_count()}")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process (another "
                               "tensor-parallel engine is running?); shut it down first with "
                               "engine.executor.shutdown()")
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        # NVLink multicast (NVLS) stays off: these all-reduces are small and latency-bound,
        # and multicast objects on a shared host can wedge its GPUs. Workers inherit this.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        self.failure: str | None = None       # why the executor stopped, once it has
        self.workers: list[Worker] = []
        self._lock = threading.Lock()
        threads = torch.get_num_threads()
        if self.backend == "gloo":
            # CPU ranks share the cores: one thread each, as the workers have. More, and every
            # collective waits for ranks descheduled by rank 0's spinning threads (~10x slower).
            torch.set_num_threads(1)
        # shutdown(), garbage collection and interpreter exit all end up here, once
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers, threads)
        port = _free_port()
        context = mp.get_context("spawn")     # fork would copy CUDA state and the engine's threads
        try:
            for rank in range(1, tp):
                ours, theirs = context.Pipe()
                process = context.Process(target=worker_main, name=f"llmlab-tp-rank{rank}", daemon=True,
                                          args=(rank, port, config, model_config, theirs, os.getpid()))
                process.start()
                theirs.close()
                self.workers.append(Worker(rank, process, ours))
            self._wait_for("started")
            dist.init_process_group(self.backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                    world_size=tp, timeout=COLLECTIVE_TIMEOUT)
        except BaseException:
            self._abandon()
            raise

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def distribute(self, model: LlamaModel) -> "TensorParallelModel":
        """Give every worker its shard of `model` (held by rank 0 only); returns rank 0's
        shard, on rank 0's device. The full model is not needed afterwards."""
        try:
            weights = scatter_weights(model, 0, self.size, self.device)
        except BaseException as err:
            self._fail(err)
        self._wait_for("ready")
        shard = model_from_weights(TensorParallelModel, self.local_config, weights)
        shard.tp_group = TensorParallelGroup(0, self.size, self.vocab_size)
        shard.executor = self
        sentinels = [w.process.sentinel for w in self.workers]
        threading.Thread(target=_watch_workers, args=(weakref.ref(self), sentinels),
                         name="llmlab-tp-watch", daemon=True).start()
        return shard

    # ---- every step ------------------------------------------------------------------------
    def send_forward(self, input_ids, positions, batch: ForwardBatch, num_blocks: int) -> None:
        """Tell the workers to run this forward on a KV cache of `num_blocks` blocks."""
        fields = {f.name: _to_wire(getattr(batch, f.name)) for f in dataclasses.fields(batch)}
        self._send(("forward", _to_wire(input_ids), _to_wire(positions), fields, num_blocks))

    def swap(self, swap_out_copies, swap_in_copies) -> None:
        """Repeat rank 0's swap copies on the workers' KV caches (each holds its own heads)."""
        if swap_out_copies or swap_in_copies:
            self._send(("swap", list(swap_out_copies), list(swap_in_copies)))

    def _send(self, message) -> None:
        if self.failure is not None:          # seen by the watcher since the last step
            self._fail(RuntimeError(self.failure))
        if self.closed:
            raise RuntimeError("this tensor-parallel engine was shut down")
        data = pickle.dumps(message)          # pickled once, sent to every worker
        try:
            for worker in self.workers:
                worker.pipe.send_bytes(data)
        except OSError as err:                # a worker is gone
            self._fail(err)

    def wait_for_step(self, logits: torch.Tensor) -> None:
        """On GPUs the collectives run asynchronously: wait for this step here, so that a
        worker that died inside it (the watcher then aborts the group) is reported now."""
        if logits.is_cuda:
            torch.cuda.current_stream(logits.device).synchronize()
        if self.failure is not None:
            self._fail(RuntimeError(self.failure))

    # ---- failures and shutdown -------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        self._finalizer()

    def _abandon(self) -> None:
        """Shut down after a failure: workers may be stuck in a collective or a rendezvous
        that will never complete, so they get no polite "stop"."""
        for worker in self.workers:
            worker.process.kill()
        self.shutdown()

    def _fail(self, err: BaseException):
        """An error in the middle of a step leaves the ranks out of step for good: find out
        whether a worker failed (its traceback is the real error), stop everything, raise."""
        wait_s = 0.0 if isinstance(err, KeyboardInterrupt) else 5.0
        message = self._worker_failure(wait_s)
        self.failure = message or f"the tensor-parallel engine stopped after an error on rank 0: {err!r}"
        self._abandon()
        if message is None:
            raise err
        raise RuntimeError(message) from err

    def _worker_failure(self, wait_s: float) -> str | None:
        """Why the workers failed, as a message, or None if none fails within `wait_s` s.
        When one worker fails, the others fail too, in the collective it left ("connection
        closed by peer"): a worker that died without a word (killed), else the earliest
        traceback, is the one that explains the rest."""
        with self._lock:
            deadline = time.monotonic() + wait_s
            failures = {}                         # rank -> (has a traceback, when, message)
            while self.failure is None and time.monotonic() < deadline:
                for worker in self.workers:
                    if worker.rank not in failures and (failure := _failure_of(worker)) is not None:
                        failures[worker.rank] = failure
                        deadline = min(deadline, time.monotonic() + 0.5)   # let the others report
                time.sleep(0.02)
            if self.failure is None and failures:
                self.failure = min(failures.values())[2]
            return self.failure

    def _wait_for(self, expected: str) -> None:
        """Wait until every worker has sent `expected`; raise what went wrong otherwise."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for worker in self.workers:
            left = max(deadline - time.monotonic(), 0)
            ready = multiprocessing.connection.wait([worker.pipe, worker.process.sentinel], left)
            if worker.pipe in ready:
                try:
                    if worker.pipe.recv() == (expected,):
                        continue
                except EOFError:
                    pass
            message = self._worker_failure(2.0) or (
                f"tensor-parallel worker {worker.rank} was not {expected} within {START_TIMEOUT_S}s")
            if expected == "started":
                message += ("\n(workers are spawned: a script that starts a tensor-parallel engine "
                            "needs the `if __name__ == \"__main__\":` guard, see the multiprocessing docs)")
            self._abandon()
            raise RuntimeError(message)


def _failure_of(worker: Worker) -> tuple[bool, float, str] | None:
    """(has a traceback, when, why) if `worker` has failed: its traceback, or how it ended."""
    for _ in range(2):    # once more after seeing it dead: its last message may have just arrived
        try:
            if worker.pipe.poll():
                message = worker.pipe.recv()
                if message[0] == "error":
                    return True, message[2], f"tensor-parallel worker {worker.rank} failed:\n{message[1]}"
        except (EOFError, OSError):
            pass
        if worker.process.is_alive():
            return None
    return False, time.time(), (f"tensor-parallel worker {worker.rank} (pid {worker.process.pid}) died with "
                         f"exit code {worker.process.exitcode} and no traceback (killed, or out of memory?)")


def _watch_workers(executor_ref, sentinels) -> None:
    """Rank 0's watcher thread: when a worker process ends before shutdown, record why and,
    on NCCL, abort the group so that rank 0 does not wait forever on the dead rank (gloo
    notices a closed connection by itself)."""
    multiprocessing.connection.wait(sentinels)
    executor = executor_ref()
    if executor is None or executor.closed or executor.failure is not None:
        return                                 # a clean stop, or rank 0 is already on it
    executor._worker_failure(wait_s=1.0)
    if executor.backend == "nccl":
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            abort()


def _stop_workers(workers: list[Worker], threads: int) -> None:
    for worker in workers:
        try:
            worker.pipe.send(("stop",))
        except (OSError, ValueError):
            pass                               # already gone
    # leave the group together with the workers: NCCL's teardown in a worker can wait for
    # rank 0's, so joining them first would stall until the timeout below kills them
    if dist.is_initialized():                  # ours: __init__ refuses to start beside another
        try:
            dist.destroy_process_group()
        except Exception:                      # already aborted after a failure
            pass
    for worker in workers:
        worker.process.join(timeout=10)
        if worker.process.is_alive():          # stuck, e.g. in a collective with a dead rank
            worker.process.kill()
            worker.process.join(timeout=5)
        worker.pipe.close()
    torch.set_num_threads(threads)             # rank 0's own, as before tensor parallelism


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_wire(value):
    """Tensors travel as numpy arrays: plain pickles, no shared-memory handles."""
    return value.cpu().numpy() if isinstance(value, torch.Tensor) else value




class TensorParallelModel(TensorParallelShard):
    """Rank 0's shard. Its forward is the whole model's: it sends the step to the workers,
    then runs its own shard in step with theirs. Logits come back whole (all-gathered)."""

    executor: TensorParallelExecutor

    def forward(self, input_ids, positions, batch: ForwardBatch, kv_cache, kv_scales=None) -> torch.Tensor:
        self.executor.send_forward(input_ids, positions, batch, kv_cache.shape[2])
        try:   # kv_scales is None: EngineConfig allows no quantized cache with tensor parallelism
            logits = super().forward(input_ids, positions, batch, kv_cache, kv_scales)
        except BaseException as err:
            self.executor._fail(err)
        self.executor.wait_for_step(logits)
        return logits
