"""`LLM`: the offline entry point. Builds an engine, runs prompts to completion."""
from __future__ import annotations

import logging
import numbers
import threading
import time

from tqdm.auto import tqdm

from llmlab.config import EngineConfig
from llmlab.engine.engine import LLMEngine
from llmlab.engine.warm_up import heap_frozen
from llmlab.request import RequestOutput
from llmlab.sampling import SamplingParams

logger = logging.getLogger("llmlab")


class LLM:
    """Offline generation: `generate` and `chat` run prompts to completion on one engine.

    Thread-safe: several threads may call `generate` / `chat` on one LLM at once. A lock
    lets one thread at a time add requests or run a step; the threads' requests share the
    engine's steps (batched together), and each call returns the outputs of its own
    prompts, whichever thread's step finished them. `llm.engine` itself is not thread-safe:
    drive it by hand from one thread only (as the server's engine thread does)."""

    def __init__(self, model: str | None = None, policy=None, **engine_args):
        """`model`: a HF folder, a .gguf file, or None for the embedded SmolLM2-135M-Instruct.
        `policy`: the scheduling policy (anything `policies.resolve_policy` takes: a name, a
        SchedulingPolicy, "module:Name", a key function; default FCFS). Other keyword
        arguments are EngineConfig fields (dtype, backend, block_size, ...)."""
        unknown = set(engine_args) - set(EngineConfig.field_names())
        if unknown:
            raise ValueError(f"unknown engine option(s) {sorted(unknown)}; "
                             f"EngineConfig has {EngineConfig.field_names()} (and LLM takes policy=)")
        config = EngineConfig(model=model, **engine_args)
        self._attach(LLMEngine(config) if policy is None else LLMEngine(config, policy=policy))
        logger.info("llmlab: %s", self.engine.sizes.reason)   # what the sizes left None became, and why

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an engine built by hand (e.g. random weights for benchmarks)."""
        llm = cls.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: LLMEngine) -> None:
        self.engine, self.tokenizer = engine, engine.tokenizer
        self._lock = threading.Lock()     # held to add requests, run a step, or abort
        # finished outputs of requests that some call is waiting for, collected by whichever
        # thread ran the step that finished them; each call takes its own out
        self._waited_for: set[str] = set()
        self._finished: dict[str, RequestOutput] = {}

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for one prompt or a list (texts, token-id lists or chat conversations: any
        prompt LLMEngine.add_request takes), batched by the engine.
        Returns one finished RequestOutput per prompt, in order; a prompt whose params ask for
        n > 1 completions gives n outputs in a row (SamplingParams.fan_out)."""
        if hasattr(prompts, "tolist"):   # a tensor or an array of token ids (one prompt, or a row per prompt)
            prompts = prompts.tolist()
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], (numbers.Integral, dict))):
            prompts = [prompts]   # one prompt: a text, token ids or a conversation
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        params = params if params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        for p in params:   # before n is read: a field set since construction (n = "3") is a ValueError here too
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params must be a SamplingParams or a list of them, got {type(p).__name__}")
            p.validate()
        # n completions of a prompt: n requests, next to each other in the results
        prompts, params = zip(*[(prompt, one) for prompt, p in zip(prompts, params) for one in p.fan_out()]) \
            if any(p.n > 1 for p in params) else (prompts, params)
        engine = self.engine
        ids = []
        with self._lock:
            try:
                for prompt, p in zip(prompts, params):
                    ids.append(engine.add_request(prompt, p))
            except BaseException:   # a bad prompt (or a Ctrl-C) halfway: leave the engine as we found it
                for rid in ids:
                    engine.abort(rid)
                raise
            self._waited_for.update(ids)
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm)
        with heap_frozen():    # the collector leaves the heap the run started with alone (warm_up.py)
            try:
                while len(results) < len(ids):
                    with self._lock:
                        # finished in another thread's step, or in the step this thread ran
                        for rid in wanted & self._finished.keys():
                            results[rid] = self._finished.pop(rid)
                            bar.update(1)
                        if len(results) == len(ids):
                            break
                        for out in engine.step():
                            if out.finished and out.request_id in self._waited_for:
                                self._finished[out.request_id] = out
            finally:
                bar.close()
                with self._lock:
                    for rid in wanted - set(results):   # interrupted: don't leave work behind
                        engine.abort(rid)
                        self._finished.pop(rid, None)
                    self._waited_for -= wanted
        return [results[rid] for rid in ids]

    def chat(self, conversations, params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Like generate, for a conversation (a list of {"role", "content"} messages; content a
        string or OpenAI's text parts) or a list of conversations, rendered with the model's
        chat template (by the engine: LLMEngine.tokenize). One RequestOutput per conversation."""
        def is_conversation(x) -> bool:
            return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(m, dict) for m in x)

        if is_conversation(conversations):
            conversations = [conversations]
        if not (isinstance(conversations, (list, tuple)) and all(is_conversation(c) for c in conversations)):
            # (a string would be one conversation per character, a dict a KeyError)
            raise ValueError('chat takes a conversation (a list of {"role", "content"} messages) or a list of '
                             f"conversations, got {conversations!r:.200}")
        return self.generate(list(conversations), params, use_tqdm)

    def throughput(self, prompts, params: SamplingParams) -> tuple[list[RequestOutput], float]:
        """generate() and its output tokens per second."""
        start = time.perf_counter()
        outputs = self.generate(prompts, params)
        elapsed = time.perf_counter() - start
        return outputs, sum(len(o.token_ids) for o in outputs) / elapsed
