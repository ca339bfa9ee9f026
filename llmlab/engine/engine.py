"""LLMEngine: add requests, call `step()`, read outputs.

The engine is the loop; each room does its own work:
  Scheduler.schedule()   -> the Plan of this step (scheduler.py)
  ModelRunner.swap       -> the plan's KV block copies (model_runner.py)
  ModelRunner.prepare / forward -> logits of the rows that sample
  Sampler                -> one token per such row, on the device (sampling.py)
  Scheduler.update       -> computed tokens, full-block hashes, tokens appended, token-level
                            stops (EOS, stop ids, max_tokens, context), finished blocks freed
  OutputProcessor        -> first-token time, text, stop strings (the text-level stop),
                            RequestOutputs (output.py)
  the engine             -> hook events: a StepRecord (hooks.step_record), requests added and finished
Start-up, after the runner is built: warm_up.warm_up, every compile and capture (GPU only).
With async scheduling (EngineConfig.async_scheduling, in_flight.py) the step launched by one
call is read by the next: the host plans and prepares step N+1 while the device runs step N.
"""
from __future__ import annotations

import itertools
import time

import torch

from llmlab.cache.block_manager import BlockManager
from llmlab.config import EngineConfig
from llmlab.engine import batch as batches
from llmlab.engine.in_flight import InFlightStep
from llmlab.engine.model_runner import ModelRunner
from llmlab.engine.output import OutputProcessor
from llmlab.engine.warm_up import warm_up
from llmlab.hooks import HookBus, RequestAdded, RequestFinished, step_record
from llmlab import kernels
from llmlab.model.llama import LlamaModel
from llmlab.model.tokenizer import Tokenizer, tokenize_prompt
from llmlab.plan import Plan
from llmlab.policies import fcfs
from llmlab.request import ContextLengthError, Request, RequestOutput
from llmlab.sampling import Sampler, SamplingParams
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

    def __init__(self, config: EngineConfig, model: LlamaModel | None = None,
                 tokenizer: Tokenizer | None = None, policy=fcfs):
        """Loads `config.model` (or uses the given model and tokenizer, e.g. random weights)."""
        self.config = config
        # load -> prepack -> memory profile -> KV cache: the runner's work
        self.runner = runner = ModelRunner(config, model, tokenizer)
        # found beside the weights; the engine's: prompts in (tokenize), text out (its output processor)
        self.tokenizer = runner.tokenizer
        self.block_manager = BlockManager(runner.num_device_blocks, runner.num_host_blocks, config.block_size,
                                          config.enable_prefix_caching)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len, policy, eos)
        self.output = OutputProcessor(self.tokenizer, eos)
        self.sampler = Sampler(config.seed, self.backend)
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
        """(token ids, prompt text) of a prompt: a string, token ids or chat messages
        (model/tokenizer.py's `tokenize_prompt`, with this engine's tokenizer). The one place
        prompts become tokens: add_request, LLM.chat, the CLI and the server all come here."""
        return tokenize_prompt(self.tokenizer, prompt)

    def add_request(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a prompt (text, token ids or chat messages: see `tokenize`); returns its
        request id."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError("a request is one sequence: fan SamplingParams.n > 1 out first "
                             "(SamplingParams.fan_out, as LLM.generate and the server do)")
        token_ids, text = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ContextLengthError(f"prompt has {len(token_ids)} tokens, but max_model_len is "
                             f"{self.max_model_len} (the prompt and at least one new token must fit)")
        if request_id is None:   # the next number no caller has taken
            while (request_id := str(next(self._ids))) in self.requests:
                pass
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
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
        """Run one iteration; returns the outputs of requests that produced a token or finished.
        schedule -> swap -> runner (prepare, forward) -> sample -> scheduler.update -> outputs.
        With async scheduling the step launched here is completed by the next call, after
        it has launched its own: the outputs are those of the step before (in_flight.py)."""
        # parallel workers run each step in lockstep with this process (their own loop)
        synchronous = (not self.async_scheduling or self.hooks.active or self.kernel_timing
                       or self.model.taps is not None or self.runner.executor is not None)
        outputs = []
        if synchronous and self._in_flight is not None:   # e.g. a hook was just attached
            outputs += self._complete(self._take_in_flight())
        timings = {}
        clock = time.perf_counter()
        plan = self.scheduler.schedule()
        timings["schedule"], clock = time.perf_counter() - clock, time.perf_counter()
        self.runner.swap(plan.swap_out_copies, plan.swap_in_copies)
        timings["swap"], clock = time.perf_counter() - clock, time.perf_counter()
        launched = self._launch(plan, timings, clock, overlapped=not synchronous)
        previous = self._take_in_flight()
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
        """A step that planned nothing (no tokens, no swaps, no preemptions), with nothing in
        flight and nothing finished, leaves the scheduler as it found it: every later step
        would do the same and the engine would spin. Two in a row are a scheduler (or
        policy) bug; say so rather than hang. The requests stay queued: the caller may
        abort them (the server and LLM.generate do)."""
        moved = (plan.items or plan.swap_out_copies or plan.swap_in_copies or plan.preempted or plan.swapped_out
                 or plan.swapped_in or previous is not None or outputs or self._in_flight is not None)
        if moved or not self.scheduler.has_unfinished():
            self._idle_steps = 0
            return
        self._idle_steps += 1
        if self._idle_steps >= 2:
            self._idle_steps = 0
            s = self.scheduler
            raise RuntimeError(
                f"the scheduler planned nothing for {len(s.waiting)} waiting, {len(s.running)} running, "
                f"{len(s.swapped)} swapped requests, twice in a row, with {self.block_manager.num_free_blocks} of "
                f"{self.block_manager.num_device_blocks} KV blocks free: no step can make progress "
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
            if self.kernel_timing:   # eager, so that every kernel call is seen
                with kernels.time_kernels() as kernel_timings:
                    logits = self.runner.forward(input_ids, positions, batch, eager=True)
            else:
                logits = self.runner.forward(input_ids, positions, batch)
            timings["forward"], clock = self._lap(clock)
            params, all_logits, logits = [r.params for r in requests], logits, logits[:len(requests)]
            if requests:   # a step of mid-prompt chunks only samples nothing
                sampled = self.sampler(logits, params, [r.sampling_seed for r in requests],
                                       [len(r.output_token_ids) for r in requests])
                logprobs = self.sampler.logprobs(logits, params, sampled)
            prompt_logprobs = batches.prompt_logprobs(all_logits[len(requests):], plan)   # rows after the sampling ones
            timings["sample"], clock = self._lap(clock)
        return InFlightStep(plan, requests, sampled, timings, kernel_timings, self.step_index, overlapped,
                            logprobs, prompt_logprobs)

    def _take_in_flight(self) -> InFlightStep | None:
        step, self._in_flight = self._in_flight, None
        return step

    def _complete(self, step: InFlightStep) -> list[RequestOutput]:
        """Read a launched step's tokens and finish its bookkeeping: scheduler.resolve (tokens,
        token-level stops), the output processor (text, stop strings), hook events; its outputs."""
        outcome = self.scheduler.resolve(step.requests, step.tokens())
        self.num_dropped_tokens += outcome.num_dropped
        self._freed_blocks += outcome.freed_blocks
        if step.logprobs is not None or step.prompt_logprobs is not None:
            self.output.add_logprobs(step.requests, outcome.advanced, *step.logprob_entries())
        for request in self.output.add_tokens(outcome.advanced):   # a stop string ended it
            # also when the same token reached max_tokens: a stop string wins over "length"
            self._freed_blocks += self.scheduler.finish(request, "stop")
        for request in outcome.advanced:
            if request.finished:
                self._finished(request)
        if self.hooks.active:
            freed, self._freed_blocks = self._freed_blocks, []
            self.hooks.emit(step_record(step.index, step.plan, self.scheduler, outcome.advanced,
                                        freed_blocks=freed, timings=step.timings,
                                        kernel_timings=step.kernel_timings, time=time.perf_counter(),
                                        overlapped=step.overlapped))
        else:
            self._freed_blocks.clear()
        return self.output.outputs(outcome.advanced)

    def _lap(self, clock):
        if self.device.type == "cuda" and self.hooks.active:
            torch.cuda.synchronize()    # honest phase timings when someone is watching
        now = time.perf_counter()
        return now - clock, now

    def _finished(self, request: Request) -> None:
        """The engine's side of a request the scheduler has finished: its output side (end
        time, held-back text), forgotten, events."""
        self.output.finish(request)
        self.requests.pop(request.request_id, None)
        if self.hooks.active:
            self.hooks.emit(RequestFinished(request.request_id, request.finish_reason,
                                            len(request.output_token_ids), request.finish_time))
