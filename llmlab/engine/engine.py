"""LLMEngine: add requests, call `step()`, read outputs.

One step = schedule -> swap copies -> prepare + forward -> sample -> update requests
(detokenize, stop checks, free finished blocks) -> emit hook events.
"""
from __future__ import annotations

import itertools
import time

import torch

from llmlab.cache.block_manager import BlockManager
from llmlab.cache.kv_cache import KVCache, kv_cache_dtype, num_blocks_for
from llmlab.config import EngineConfig, ModelConfig
from llmlab.engine.host_memory import keep_freed_memory
from llmlab.engine.runner import Runner
from llmlab.hooks import HookBus, RequestAdded, RequestFinished, ScheduledRecord, StepRecord
from llmlab import kernels
from llmlab.model import dense
from llmlab.model.llama import LlamaModel
from llmlab.model.tokenizer import IncrementalDetokenizer, Tokenizer
from llmlab.request import ContextLengthError, Request, RequestOutput, RequestStatus
from llmlab.sampling import Sampler, SamplingParams
from llmlab.scheduler import Plan, Scheduler, fcfs


class LLMEngine:
    def __init__(self, config: EngineConfig, model: LlamaModel | None = None,
                 tokenizer: Tokenizer | None = None, policy=fcfs):
        """Loads `config.model` (or uses the given model and tokenizer, e.g. random weights)."""
        self.config = config
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        self.backend = config.resolved_backend()
        if model is None:
            from llmlab.model.loader import iter_weights, load_config, resolve_model

            folder = resolve_model(config.model)
            model_config = load_config(folder)
            # tensor parallel: the full model waits on the CPU to be cut into per-GPU shards
            load_device = self.device if config.tensor_parallel_size == 1 else torch.device("cpu")
            model = LlamaModel.from_state_dict(model_config, iter_weights(folder), self.dtype,
                                               load_device, self.backend)
            has_tokenizer = any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
            if tokenizer is None and has_tokenizer:   # a bare weights folder runs on token ids
                tokenizer = Tokenizer(str(folder))
        # ---- tensor parallelism (llmlab.engine.distributed): this process is rank 0 and keeps
        # one shard; its forward also runs the shards of tensor_parallel_size - 1 workers
        self.executor = None
        if config.tensor_parallel_size > 1:
            from llmlab.engine.distributed import TensorParallelExecutor

            self.executor = TensorParallelExecutor(config, model.config)   # starts the workers
            model = self.executor.distribute(model)   # rank 0's shard; its config has its heads
        # ----
        model.backend = self.backend
        if self.device.type == "cpu":
            dense.prepack(model.matrices())   # oneDNN's blocked weight layout, made once
            keep_freed_memory()               # no page faults for every large temporary
        self.model, self.tokenizer = model, tokenizer
        self.model_config: ModelConfig = model.config

        weights_bytes = model.num_parameters() * model.embed.element_size()
        num_device, num_host = num_blocks_for(config, self.model_config, self.dtype, self.device,
                                              weights_bytes, self._profile_activation_bytes())
        self.kv_cache = KVCache(self.model_config, num_device, num_host, config.block_size,
                                kv_cache_dtype(config.kv_cache_dtype, self.dtype), self.device)
        # full attention equals sliding-window attention only within the window
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.sliding_window or 1 << 62,
                                 num_device * config.block_size)
        self.block_manager = BlockManager(num_device, num_host, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len, policy)
        use_graphs = (self.device.type == "cuda" and self.backend == "triton" and not config.enforce_eager
                      and self.executor is None)   # a graph replay would skip the workers' step
        self.runner = Runner(model, self.kv_cache, config.block_size, self.device,
                             config.max_num_seqs, self.max_model_len, use_graphs)
        if self.device.type == "cuda" and self.backend == "triton" and self.executor is None:
            self.runner.warm_up()   # compile the Triton kernel variants before the first request
        self.sampler = Sampler(config.seed, self.backend)
        self.hooks = HookBus()
        self.kernel_timing = False     # set True to record per-kernel timings in StepRecords
        self.requests: dict[str, Request] = {}
        self.step_index = 0
        self._freed_blocks: list[int] = []     # since the last StepRecord
        self._ids = itertools.count()
        eos = set(self.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = eos

    def _profile_activation_bytes(self) -> int:
        """Peak extra memory of a worst-case forward (full token budget), measured on CUDA."""
        if self.device.type != "cuda" or self.config.num_gpu_blocks is not None:
            return 0
        from llmlab.scheduler import ScheduledItem

        tokens = self.config.max_num_batched_tokens
        probe = KVCache(self.model_config, -(-tokens // self.config.block_size), 0,
                        self.config.block_size, self.dtype, self.device)
        request = Request("profile", None, [0] * tokens, SamplingParams())
        request.block_table = list(range(probe.device.shape[2]))
        plan = Plan(prefills=[ScheduledItem(request, "prefill", tokens, 0)])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        Runner(self.model, probe, self.config.block_size, self.device).execute(plan)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del probe
        torch.cuda.empty_cache()
        return int(peak * 1.2)   # headroom for allocator fragmentation

    # ---- requests --------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a prompt (text or token ids); returns its request id."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass token ids")
            token_ids, text = self.tokenizer.encode(prompt), prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            token_ids, text = list(prompt), None
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ContextLengthError(f"prompt has {len(token_ids)} tokens, but max_model_len is "
                             f"{self.max_model_len} (the prompt and at least one new token must fit)")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, text, token_ids, params)
        request.sampling_seed = params.seed if params.seed is not None else self.sampler.new_seed()
        if self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params.stop)
        self.requests[request_id] = request
        self.scheduler.add(request)
        if self.hooks.active:
            self.hooks.emit(RequestAdded(request_id, len(token_ids), time.perf_counter()))
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now, wherever it is (waiting, mid-prefill, swapped); frees its blocks."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def kv_stats(self) -> dict:
        bm = self.block_manager
        return {
            "free_device_blocks": bm.num_free_blocks, "total_device_blocks": bm.num_device_blocks,
            "free_host_blocks": bm.num_free_host_blocks, "total_host_blocks": bm.num_host_blocks,
            "block_size": bm.block_size, "prefix_hit_rate": bm.prefix_hit_rate,
            "num_waiting": len(self.scheduler.waiting), "num_running": len(self.scheduler.running),
            "num_swapped": len(self.scheduler.swapped),
            "kv_cache_dtype": str(self.kv_cache.dtype).removeprefix("torch."),
            "bytes_per_block": self.kv_cache.bytes_per_block,
        }

    # ---- one iteration ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of requests that produced a token or finished."""
        timings = {}
        clock = time.perf_counter()
        plan = self.scheduler.schedule()
        timings["schedule"], clock = time.perf_counter() - clock, time.perf_counter()
        self.kv_cache.swap_out(plan.swap_out_copies)   # before swap-in: they may reuse blocks
        self.kv_cache.swap_in(plan.swap_in_copies)
        if self.executor is not None:   # every rank caches its own kv heads
            self.executor.swap(plan.swap_out_copies, plan.swap_in_copies)
        timings["swap"], clock = time.perf_counter() - clock, time.perf_counter()
        sampled, advanced, kernel_timings = {}, [], {}
        if not plan.is_empty:
            input_ids, positions, batch = self.runner.prepare(plan)
            timings["prepare"], clock = self._lap(clock)
            if self.kernel_timing:   # eager, so that every kernel call is seen
                with kernels.time_kernels() as kernel_timings:
                    logits = self.model.forward(input_ids, positions, batch, self.kv_cache.device,
                                                self.kv_cache.device_scales)
            else:
                logits = self.runner.forward(input_ids, positions, batch)
            timings["forward"], clock = self._lap(clock)
            rows = [i for i, item in enumerate(plan.items) if item.completes_prompt]
            requests = [plan.items[i].request for i in rows]
            if len(rows) < len(plan.items):   # mid-prompt chunks sample nothing
                logits = logits[rows]
            tokens = self.sampler(logits, [r.params for r in requests], [r.sampling_seed for r in requests],
                                  [len(r.output_token_ids) for r in requests]).tolist() if rows else []
            timings["sample"], clock = self._lap(clock)
            for item in plan.items:
                item.request.num_computed_tokens += item.num_tokens
                self.block_manager.cache_full_blocks(item.request)
            for request, token in zip(requests, tokens):
                sampled[request.request_id] = token
                self._append_token(request, token)
                advanced.append(request)
        finished = {r.request_id: r.finish_reason for r in advanced if r.finished}
        if self.hooks.active:
            self.hooks.emit(self._record(plan, sampled, finished, timings, kernel_timings))
        else:
            self._freed_blocks.clear()
        self.step_index += 1
        return [RequestOutput.of(r) for r in advanced]

    def _lap(self, clock):
        if self.device.type == "cuda" and self.hooks.active:
            torch.cuda.synchronize()    # honest phase timings when someone is watching
        now = time.perf_counter()
        return now - clock, now

    def _append_token(self, request: Request, token: int) -> None:
        request.output_token_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = time.perf_counter()
        params = request.params
        is_eos = token in self.eos_token_ids
        stop_string = False
        if request.detokenizer is not None and not is_eos:
            stop_string = request.detokenizer.add_token(token)
        if stop_string or token in params.stop_token_ids or (is_eos and not params.ignore_eos):
            self._finish(request, "stop")
        elif len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            self._finish(request, "length")

    def _finish(self, request: Request, reason: str) -> None:
        self._freed_blocks += self.scheduler.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = time.perf_counter()
        if request.detokenizer is not None and reason != "stop":
            request.detokenizer.finish()
        self.requests.pop(request.request_id, None)
        if self.hooks.active:
            self.hooks.emit(RequestFinished(request.request_id, reason, len(request.output_token_ids),
                                            request.finish_time))

    def _take_freed_blocks(self) -> list[int]:
        freed, self._freed_blocks = self._freed_blocks, []
        return freed

    def _record(self, plan: Plan, sampled, finished, timings, kernel_timings) -> StepRecord:
        bm = self.block_manager
        running = self.scheduler.running
        return StepRecord(
            step=self.step_index,
            scheduled=[ScheduledRecord(i.request.request_id, i.kind, i.num_tokens, i.start_position)
                       for i in plan.items],
            preempted=list(plan.preempted), swapped_out=list(plan.swapped_out),
            swapped_in=list(plan.swapped_in),
            allocated_blocks={k: list(v) for k, v in plan.allocated_blocks.items()},
            freed_blocks=self._take_freed_blocks(),
            prefix_hit_tokens=dict(plan.prefix_hit_tokens),
            block_tables={r.request_id: list(r.block_table) for r in running},
            host_block_tables={k: list(v) for k, v in bm.host_tables.items()},
            shared_blocks=[b for b, c in enumerate(bm.ref_counts) if c > 1],
            cached_blocks=sorted(bm.cached_blocks.values()),
            sampled=sampled, finished=finished,
            waiting=[r.request_id for r in self.scheduler.waiting],
            free_device_blocks=bm.num_free_blocks, total_device_blocks=bm.num_device_blocks,
            free_host_blocks=bm.num_free_host_blocks, total_host_blocks=bm.num_host_blocks,
            token_budget=self.scheduler.token_budget,
            timings=timings, kernel_timings=dict(kernel_timings), time=time.perf_counter())
