"""LLMEngine: add requests, call `step()`, read outputs.

The engine is the loop; each room does its own work: `Scheduler.schedule()` plans the step
(scheduler.py); the ModelRunner makes its KV block copies and runs the forward
(model_runner.py); the Sampler draws one token per sampling row on the device (sampling.py);
`Scheduler.update` does the bookkeeping and the token-level stops; the OutputProcessor makes
text, stop strings and RequestOutputs (output.py); the engine emits hook events (hooks.py).
Start-up compiles and captures are warm_up.py's. With async scheduling (in_flight.py) the
host plans and prepares step N+1 while the device runs step N.
"""
from __future__ import annotations

import contextlib
import itertools
import time

import torch

from llmlab.cache.block_manager import BlockManager
from llmlab.config import EngineConfig
from llmlab.cuda_graphs.decode import CudaGraphDecoder
from llmlab.engine.in_flight import InFlightStep
from llmlab.engine.model_runner import ModelRunner
from llmlab.engine.output import OutputProcessor, OutputText
from llmlab.engine.warm_up import warm_up
from llmlab import preemption as preemption_functions
from llmlab.hooks import HookBus, RequestAdded, RequestFinished, step_record
from llmlab import kernels
from llmlab.model.llama import LlamaModel
from llmlab.model.tokenizer import IncrementalDetokenizer, Tokenizer, check_prompt_ids, tokenize_prompt
from llmlab.plan import Plan
from llmlab.policies import fcfs
from llmlab.request import Request, RequestOutput, unused_request_id
from llmlab.sampling import Sampler, SamplingParams, prompt_token_logprobs, request_params
from llmlab.scheduler import Scheduler


class LLMEngine:
    # the runner's (it owns the model's life), readable here by name for notebooks and tests
    device = property(lambda self: self.runner.device, doc="torch.device the model runs on")
    dtype = property(lambda self: self.runner.dtype, doc="the weights' torch dtype")
    backend = property(lambda self: self.runner.backend, doc='kernel backend: "torch" | "triton" | "reference"')
    model = property(lambda self: self.runner.model, doc="the LlamaModel (rank 0's shard with parallelism)")
    model_config = property(lambda self: self.runner.model_config, doc="the model's ModelConfig")
    kv_cache = property(lambda self: self.runner.kv_cache, doc="the KVCache: device and host blocks")
    executor = property(lambda self: self.runner.executor, doc="the parallel ranks' executor, or None")
    max_model_len = property(lambda self: self.runner.max_model_len, doc="the longest prompt + output")
    kv_cache_tokens = property(lambda self: self.runner.kv_cache_tokens, doc="tokens the device KV cache holds")
    sizes = property(lambda self: self.runner.sizes, doc="max_num_seqs and max_num_batched_tokens as chosen, and why")

    def __init__(self, config: EngineConfig, model: LlamaModel | None = None,
                 tokenizer: Tokenizer | None = None, policy=fcfs, block_manager=BlockManager,
                 detokenizer=IncrementalDetokenizer, output_text=OutputText, decoder_layer=None,
                 sampler=Sampler, scheduler=Scheduler, preemption=preemption_functions,
                 cuda_graphs=CudaGraphDecoder):
        """Loads `config.model` (or uses the given model and tokenizer, e.g. random weights).
        The plug-in points (the exercises' components run here): `block_manager`, `detokenizer`,
        `output_text`, `sampler`, `scheduler` and `cuda_graphs` are classes with the constructor
        and methods of the llmlab class they default to; `preemption`, a module or object with
        preemption.py's functions; `decoder_layer`, a class run as each layer's body (None: the
        model's own). ARCHITECTURE.md ("Plug-in points for engine components") says how each is called.
        `policy` is the scheduler's (policies.py)."""
        # load -> prepack -> memory profile -> KV cache: the runner's work; its config has the
        # sizes that were left None chosen for this device and cache (sizing.py)
        self.runner = runner = ModelRunner(config, model, tokenizer, decoder_layer, cuda_graphs)
        self.config = config = runner.config
        # found beside the weights; the engine's: prompts in (tokenize), text out (its output processor)
        self.tokenizer = runner.tokenizer
        self.block_manager = block_manager(runner.num_device_blocks, runner.num_host_blocks, config.block_size,
                                          config.enable_prefix_caching)
        eos = runner.eos_token_ids
        self.scheduler = scheduler(config, self.block_manager, self.max_model_len, policy, eos, preemption)
        self.output = OutputProcessor(self.tokenizer, eos, detokenizer, output_text)
        self.sampler = sampler(config.seed, self.backend)
        warm_up(runner, self.sampler, config)   # decode graphs, kernel variants, sampler graphs (GPU only)
        self.hooks = HookBus()
        self.kernel_timing = False     # set True to record per-kernel timings in StepRecords
        # overlap steps (in_flight.py); a hook, kernel timing or model.capture() runs them one at a time
        self.async_scheduling = config.resolved_async_scheduling()
        self._in_flight: InFlightStep | None = None   # launched, its tokens not read yet
        self.num_dropped_tokens = 0    # sampled for requests that had finished meanwhile
        self.requests: dict[str, Request] = {}
        self.step_index = 0
        self._idle_steps = 0    # steps in a row that planned nothing while requests were left
        self._freed_blocks: list[int] = []     # since the last StepRecord
        self._ids = itertools.count()

    # ---- requests --------------------------------------------------------------------
    def tokenize(self, prompt) -> tuple[list[int], str | None]:
        """(token ids, prompt text) of a string, token ids or chat messages (tokenize_prompt):
        the one place prompts become tokens, for add_request, LLM.chat, the CLI and the server."""
        return tokenize_prompt(self.tokenizer, prompt)

    def add_request(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a prompt (text, token ids or chat messages: see `tokenize`); returns its id."""
        params = request_params(params)   # checked again: its fields may have changed since it was built
        token_ids, text = self.tokenize(prompt)
        check_prompt_ids(token_ids, self.model_config.vocab_size, self.max_model_len)
        request_id = unused_request_id(request_id, self.requests, self._ids)
        # arrival on the scheduler's clock, the one every policy decision's `now` is on
        request = Request(request_id, text, token_ids, params, arrival_time=self.scheduler.now())
        request.sampling_seed = params.seed if params.seed is not None else self.sampler.new_seed()
        self.output.add_request(request)
        self.requests[request_id] = request
        self.scheduler.add(request)
        if self.hooks.active:
            self.hooks.emit(RequestAdded(request_id, len(token_ids), time.perf_counter()))
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now, wherever it is (waiting, mid-prefill, swapped); frees its blocks."""
        request = self.requests.get(str(request_id))   # add_request took str(request_id) too
        if request is not None:
            self._freed_blocks += self.scheduler.finish(request, "abort")
            self._finished(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def kv_stats(self) -> dict:
        """The block manager's counts (BlockManager.stats), the queues' lengths, the cache's format."""
        s = self.scheduler
        return {**self.block_manager.stats(), "num_waiting": len(s.waiting), "num_running": len(s.running),
                "num_swapped": len(s.swapped), "kv_cache_dtype": str(self.kv_cache.dtype).removeprefix("torch."),
                "bytes_per_block": self.kv_cache.bytes_per_block}

    # ---- one iteration ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of requests that produced a token or finished.
        schedule -> swap -> runner (prepare, forward) -> sample -> scheduler.update -> outputs.
        With async scheduling the step launched here is completed by the next call, after
        it has launched its own: the outputs are those of the step before (in_flight.py)."""
        # parallel workers run each step in lockstep with this process (their own loop)
        synchronous = (not self.async_scheduling or self.hooks.active or self.kernel_timing
                       or self.model.taps is not None or self.runner.executor is not None)
        outputs = []
        if synchronous and self._in_flight is not None:   # e.g. a hook was just attached
            step, self._in_flight = self._in_flight, None
            outputs += self._complete(step)
        timings = {}
        clock = time.perf_counter()
        plan = self.scheduler.schedule()
        timings["schedule"], clock = time.perf_counter() - clock, time.perf_counter()
        self.runner.swap(plan.swap_out_copies, plan.swap_in_copies)
        timings["swap"], clock = time.perf_counter() - clock, time.perf_counter()
        launched = self._launch(plan, timings, clock, overlapped=not synchronous)
        previous, self._in_flight = self._in_flight, None
        if previous is not None:      # the device is busy with `launched` meanwhile
            outputs += self._complete(previous)
        self.scheduler.update(plan)   # computed tokens; placeholders for the tokens on the device
        if synchronous:
            outputs += self._complete(launched)
        elif not plan.is_empty:
            self._in_flight = launched
        self.step_index += 1
        self._check_progress(plan, previous, outputs)
        return outputs

    def _check_progress(self, plan: Plan, previous: InFlightStep | None, outputs: list) -> None:
        """Two steps in a row that change nothing (an empty plan, nothing in flight or finished)
        while requests are left mean every later step would do the same: a scheduler or policy
        bug. Say so rather than spin; the requests stay queued (the caller may abort them)."""
        if not plan.changes_nothing or previous or outputs or self._in_flight or not self.scheduler.has_unfinished():
            self._idle_steps = 0
            return
        self._idle_steps += 1
        if self._idle_steps >= 2:
            self._idle_steps = 0
            s, bm = self.scheduler, self.block_manager
            raise RuntimeError(
                f"the scheduler planned nothing for {len(s.waiting)} waiting, {len(s.running)} running, "
                f"{len(s.swapped)} swapped requests, twice in a row, with {bm.num_free_blocks} of "
                f"{bm.num_device_blocks} KV blocks free: no step can make progress "
                f"(a scheduler or policy bug); abort the requests or fix the scheduler")

    def _launch(self, plan: Plan, timings: dict, clock: float, overlapped: bool) -> InFlightStep:
        """Prepare, forward and sample the plan; the tokens stay on the device. Requests whose
        newest token is still in flight take it from the step in flight's tensor."""
        requests = [item.request for item in plan.sampling_items]
        sampled, kernel_timings, logprobs, prompt_logprobs = torch.empty(0, dtype=torch.int64), {}, None, None
        if not plan.is_empty:
            previous = self._in_flight.previous if self._in_flight is not None else None
            input_ids, positions, batch = self.runner.prepare_step(plan, previous)
            timings["prepare"], clock = self._lap(clock)
            # with kernel timing: eager, so that every kernel call is seen
            with kernels.time_kernels() if self.kernel_timing else contextlib.nullcontext({}) as kernel_timings:
                logits = self.runner.forward(input_ids, positions, batch, eager=self.kernel_timing)
            timings["forward"], clock = self._lap(clock)
            if requests:   # a step of mid-prompt chunks only samples nothing
                sampled, logprobs = self.sampler.sample_requests(logits[:len(requests)], requests)
            prompt_logprobs = prompt_token_logprobs(logits[len(requests):], plan)   # rows after the sampling ones
            timings["sample"], clock = self._lap(clock)
        return InFlightStep(plan, requests, sampled, timings, kernel_timings, self.step_index, overlapped,
                            logprobs, prompt_logprobs)

    def _complete(self, step: InFlightStep) -> list[RequestOutput]:
        """Read a launched step's tokens and finish its bookkeeping: scheduler.resolve (tokens,
        token-level stops), the output processor (text, stop strings), hook events; its outputs."""
        outcome = self.scheduler.resolve(step.requests, step.tokens())
        self.num_dropped_tokens += outcome.num_dropped
        self._freed_blocks += outcome.freed_blocks
        self.output.add_logprobs(step, outcome.advanced)
        for request in self.output.add_tokens(outcome.advanced):   # a stop string ended it
            # also when the same token reached max_tokens: a stop string wins over "length"
            self._freed_blocks += self.scheduler.finish(request, "stop")
        for request in outcome.advanced:
            if request.finished:
                self._finished(request)
        freed, self._freed_blocks = self._freed_blocks, []
        if self.hooks.active:
            self.hooks.emit(step_record(step.index, step.plan, self.scheduler, outcome.advanced, freed_blocks=freed,
                                        timings=step.timings, kernel_timings=step.kernel_timings,
                                        blocks=self.hooks.blocks, time=time.perf_counter(), overlapped=step.overlapped))
        return outcome.checked(self.output.outputs(outcome.advanced))   # (a policy's on_step error: now)

    def _lap(self, clock):
        if self.device.type == "cuda" and self.hooks.active:
            torch.cuda.synchronize()    # honest phase timings when someone is watching
        now = time.perf_counter()
        return now - clock, now

    def _finished(self, request: Request) -> None:
        """A request the scheduler finished: its output side (end time, held-back text), forgotten, events."""
        self.output.finish(request)
        self.requests.pop(request.request_id, None)
        if self.hooks.active:
            self.hooks.emit(RequestFinished(request.request_id, request.finish_reason,
                                            len(request.output_token_ids), request.finish_time))
