"""Parallel execution: this process is rank 0; tensor_parallel_size x pipeline_parallel_size
- 1 worker processes are the other ranks, one GPU each (cuda:{rank}, NCCL) or, without CUDA,
one CPU process each (gloo). engine/parallel/placement.py says which rank holds what.

Rank 0 runs the whole engine: the one scheduler, block manager, runner and sampler. Its
model is a ParallelModel, whose forward broadcasts the prepared batch to every worker
(engine/parallel/wire.py: a small header, then the batch's tensors, all through torch.distributed)
and then runs rank 0's own part of it (engine/parallel/pipeline.py: its layers, its micro-batches);
each worker runs its part of the same step, and the ranks meet in the tensor-parallel
all-reduces (model/tensor_parallel.py) and the pipeline's send/recv. Only rank 0 samples.

The pipes to the workers carry their life-cycle ("started", "ready"), their tracebacks
when they fail, and pipeline timelines when asked for; never a step. Between steps a
worker waits in the header broadcast of a gloo group with no practical timeout: a blocked
socket read, costing nothing however long a server idles, and failing at once if rank 0
dies (as does a thread that watches rank 0's pid).

Life of a worker: spawned -> "started" -> joins the process groups (TCP rendezvous on a
free loopback port) -> receives its weights (placement.distribute_weights) -> "ready" ->
runs FORWARD and SWAP messages until STOP. Its KV cache mirrors rank 0's block for block:
each FORWARD says how many blocks rank 0's cache has, and a worker (re)allocates when that
changes (the start-up memory probe, then the engine's cache).
"""
from __future__ import annotations

import multiprocessing.connection
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llmlab.cache.kv_cache import bytes_per_block
from llmlab.config import EngineConfig, ModelConfig
from llmlab.engine.parallel import wire
from llmlab.engine.parallel.pipeline import StageSpan, cuts_for, micro_batches, run_stage
from llmlab.engine.parallel.placement import Groups, RankLayout, distribute_weights, join_groups, local_config, stage_layers
from llmlab.engine.parallel.worker import COLLECTIVE_TIMEOUT, rank_device, worker_main
from llmlab.model.llama import ForwardBatch, LlamaModel
from llmlab.model.tensor_parallel import TensorParallelGroup, TensorParallelShard, model_from_weights

START_TIMEOUT_S = 300    # a worker's start: import torch, join the groups, receive its weights
TIMELINE_TIMEOUT_S = COLLECTIVE_TIMEOUT.total_seconds()   # a worker's timeline comes after its step


@dataclass
class Worker:
    rank: int
    process: multiprocessing.process.BaseProcess
    pipe: multiprocessing.connection.Connection


class ParallelExecutor:
    """Rank 0's side: starts the workers, hands out the weights, sends them every step."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.layout = RankLayout(0, tp, pp, model_config.num_layers)
        stage_layers(model_config.num_layers, pp)              # sizes that do not fit raise here,
        self.local_config = local_config(model_config, self.layout)   # before any process starts
        self.config, self.size, self.vocab_size = config, self.layout.world_size, model_config.vocab_size
        self.device = rank_device(config, 0)
        if self.device.type == "cuda" and torch.cuda.device_count() < self.device.index + self.size:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} from {self.device} "
                             f"needs {self.device.index + self.size} GPUs; this machine has {torch.cuda.device_count()}")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process (another "
                               "parallel engine is running?); shut it down first with "
                               "engine.executor.shutdown()")
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        # NVLink multicast (NVLS) stays off: these all-reduces are small and latency-bound,
        # and multicast objects on a shared host can wedge its GPUs. Workers inherit this.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        self.failure: str | None = None       # why the executor stopped, once it has
        self.workers: list[Worker] = []
        self.groups: Groups | None = None
        # set record_timeline to collect a StageSpan per micro-batch and rank of every step
        self.record_timeline = False
        self.timeline: list[StageSpan] = []
        self.steps_run = 0                    # forwards so far (the workers count them too)
        self._lock = threading.Lock()
        # the same host block count as rank 0's (num_blocks_for): one block manager for all
        dtype = config.resolved_dtype()
        num_host_blocks = int(config.swap_space * 2**30) // bytes_per_block(self.local_config, config.block_size,
                                                                             dtype)
        threads = torch.get_num_threads()
        if self.backend == "gloo":
            # CPU ranks share the cores: one thread each, as the workers have. More, and every
            # collective waits for ranks descheduled by rank 0's spinning threads (~10x slower).
            torch.set_num_threads(1)
        # shutdown(), garbage collection and interpreter exit all end up here, once; `state`
        # tells it whether the workers can still be asked to stop
        self._state = {"groups": None, "failed": False}
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers, threads, self._state)
        port = _free_port()
        context = mp.get_context("spawn")     # fork would copy CUDA state and the engine's threads
        try:
            for rank in range(1, self.size):
                ours, theirs = context.Pipe()
                process = context.Process(target=worker_main, name=f"llmlab-rank{rank}", daemon=True,
                                          args=(rank, port, config, model_config, theirs, os.getpid(),
                                                num_host_blocks))
                process.start()
                theirs.close()
                self.workers.append(Worker(rank, process, ours))
            self._wait_for("started")
            dist.init_process_group(self.backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                    world_size=self.size, timeout=COLLECTIVE_TIMEOUT)
            self.groups = self._state["groups"] = join_groups(self.layout)
        except BaseException:
            self._abandon()
            raise

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def distribute(self, model: LlamaModel) -> "ParallelModel":
        """Give every worker its weights of `model` (held by rank 0 only); returns rank 0's
        part, on rank 0's device. The full model is not needed afterwards."""
        try:
            weights = distribute_weights(model, self.layout, self.device)
        except BaseException as err:
            self._fail(err)
        self._wait_for("ready")
        part = model_from_weights(ParallelModel, self.local_config, weights)
        part.tp_group = TensorParallelGroup(0, self.layout.tp, self.vocab_size, self.groups.tensor_parallel)
        part.executor = self
        sentinels = [w.process.sentinel for w in self.workers]
        threading.Thread(target=_watch_workers, args=(weakref.ref(self), sentinels),
                         name="llmlab-parallel-watch", daemon=True).start()
        return part

    # ---- every step ------------------------------------------------------------------------
    def send_forward(self, input_ids, positions, batch: ForwardBatch, cuts, num_blocks: int,
                     graphed: bool = False) -> None:
        """Tell the workers to run this forward, cut at `cuts`, on a KV cache of `num_blocks`
        blocks (graphed: by replaying their CUDA graph of it; no timeline then)."""
        self._send(wire.send_forward, input_ids, positions, batch, cuts, num_blocks,
                   self.record_timeline and not graphed, graphed)
        self.steps_run += 1

    def cuda_graphs(self, model, kv_cache, max_num_seqs: int, max_blocks_per_seq: int, backend):
        """Decode-step CUDA graphs captured on every rank (parallel/cuda_graphs.py); tensor
        parallelism only."""
        from llmlab.engine.parallel.cuda_graphs import ParallelCudaGraphs

        if self.layout.pp > 1:
            raise ValueError("CUDA graphs of pipeline-parallel steps are not supported; their steps run eagerly")
        return ParallelCudaGraphs(self, model, kv_cache, max_num_seqs, max_blocks_per_seq, backend)

    def send_capture(self, max_num_seqs: int, max_blocks_per_seq: int, num_blocks: int, backend, keys) -> None:
        self._send(wire.send_capture, max_num_seqs, max_blocks_per_seq, num_blocks, backend, keys)

    def swap(self, swap_out_copies, swap_in_copies) -> None:
        """Repeat rank 0's swap copies on the workers' KV caches (each holds its own heads
        and layers of the same blocks)."""
        if swap_out_copies or swap_in_copies:
            self._send(wire.send_swap, swap_out_copies, swap_in_copies)

    def _send(self, send, *args) -> None:
        if self.failure is not None:          # seen by the watcher since the last step
            self._fail(RuntimeError(self.failure))
        if self.closed:
            raise RuntimeError("this parallel engine was shut down")
        try:
            send(self.groups, *args)
        except BaseException as err:          # a worker is gone
            self._fail(err)

    def collect_timeline(self, spans: list[StageSpan]) -> None:
        """Rank 0's spans of this step and every worker's (each sends them after its step)."""
        for worker in self.workers:
            ready = multiprocessing.connection.wait([worker.pipe, worker.process.sentinel], TIMELINE_TIMEOUT_S)
            if worker.pipe not in ready:
                raise RuntimeError(f"worker {worker.rank} sent no timeline within {TIMELINE_TIMEOUT_S}s")
            message = worker.pipe.recv()
            if message[0] != "timeline":
                raise RuntimeError(f"worker {worker.rank} failed:\n{message[1]}")
            spans += message[1]
        self.timeline += sorted(spans, key=lambda span: (span.rank, span.micro_batch))

    def wait_for_step(self, logits: torch.Tensor) -> None:
        """On GPUs the collectives run asynchronously: wait for this step here, so that a
        worker that died inside it (the watcher then aborts the group) is reported now.
        Not with async scheduling, whose point is not to wait: the next step reports it."""
        if logits.is_cuda and not self.config.resolved_async_scheduling():
            torch.cuda.current_stream(logits.device).synchronize()
        if self.failure is not None:
            self._fail(RuntimeError(self.failure))

    # ---- failures and shutdown -------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        self._finalizer()

    def _abandon(self) -> None:
        """Shut down after a failure: workers may be stuck in a collective or a rendezvous
        that will never complete, so they get no polite STOP."""
        self._state["failed"] = True
        for worker in self.workers:
            worker.process.kill()
        self.shutdown()

    def _fail(self, err: BaseException):
        """An error in the middle of a step leaves the ranks out of step for good: find out
        whether a worker failed (its traceback is the real error), stop everything, raise."""
        wait_s = 0.0 if isinstance(err, KeyboardInterrupt) else 5.0
        message = self._worker_failure(wait_s)
        self.failure = message or f"the parallel engine stopped after an error on rank 0: {err!r}"
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
                f"parallel worker {worker.rank} was not {expected} within {START_TIMEOUT_S}s")
            if expected == "started":
                message += ("\n(workers are spawned: a script that starts a parallel engine "
                            "needs the `if __name__ == \"__main__\":` guard, see the multiprocessing docs)")
            self._abandon()
            raise RuntimeError(message)


def _failure_of(worker: Worker) -> tuple[bool, float, str] | None:
    """(has a traceback, when, why) if `worker` has failed: its traceback, or how it ended."""
    for _ in range(2):    # once more after seeing it dead: its last message may have just arrived
        try:
            while worker.pipe.poll():          # past any timeline it sent before failing
                message = worker.pipe.recv()
                if message[0] == "error":
                    return True, message[2], f"parallel worker {worker.rank} failed:\n{message[1]}"
        except (EOFError, OSError):
            pass
        if worker.process.is_alive():
            return None
    return False, time.time(), (f"parallel worker {worker.rank} (pid {worker.process.pid}) died with "
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


def _stop_workers(workers: list[Worker], threads: int, state: dict) -> None:
    if state["groups"] is not None and not state["failed"]:
        try:                                   # they all wait for the next header
            wire.send_stop(state["groups"])
        except Exception:
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
    torch.set_num_threads(threads)             # rank 0's own, as before the workers started


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ParallelModel(TensorParallelShard):
    """Rank 0's part of the model: stage 0's layers, tensor-parallel rank 0's shard of them.
    Its forward is the whole model's: it sends the step to the workers, runs its own part
    in step with theirs, and returns the whole logits (all-gathered, or received from the
    last stage)."""

    executor: ParallelExecutor

    def forward(self, input_ids, positions, batch: ForwardBatch, kv_cache, kv_scales=None) -> torch.Tensor:
        executor, layout = self.executor, self.executor.layout
        cuts, step = cuts_for(input_ids, batch, layout.pp), executor.steps_run
        executor.send_forward(input_ids, positions, batch, cuts, kv_cache.shape[2])
        spans = [] if executor.record_timeline else None
        try:   # kv_scales is None: EngineConfig allows no quantized cache with parallelism
            logits = run_stage(self, layout, micro_batches(input_ids, positions, batch, cuts), kv_cache,
                               kv_scales, spans, step)
            if spans is not None:
                executor.collect_timeline(spans)
        except BaseException as err:
            executor._fail(err)
        executor.wait_for_step(logits)
        return logits
