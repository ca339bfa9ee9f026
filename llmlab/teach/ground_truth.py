"""Where the checker's right answers come from when a notebook ran the embedded model: its
config and tokenizer (read from the converted model folder, no weights loaded), and a
notebook's workload replayed on the simulator.

`replay` runs the engine's own Scheduler and BlockManager (`experiments.simulate`) on the
prompts' real token ids, every step taking one simulated second: who is admitted, chunked,
preempted, swapped or served from the prefix cache is what the notebook's engine decided,
step by step, without running the model. (Every request generates its whole `max_tokens`, as
the notebooks' `ignore_eos=True` requests do; tests/teach checks the replays against real
engine runs.)
"""
from __future__ import annotations

import functools

import torch

from llmlab.cache.kv_cache import bytes_per_block
from llmlab.config import EngineConfig, ModelConfig
from llmlab.experiments import CostModel, Workload, simulate
from llmlab.experiments.workload import WorkloadRequest
from llmlab.hooks import Trace


@functools.cache
def embedded_config() -> ModelConfig:
    """SmolLM2-135M-Instruct's ModelConfig, as `llmlab.LLM()` loads it."""
    from llmlab.model.loader import load_config, resolve_model

    return load_config(resolve_model(None))


@functools.cache
def embedded_tokenizer():
    from llmlab.model.loader import resolve_model
    from llmlab.model.tokenizer import Tokenizer

    return Tokenizer(str(resolve_model(None)))


def encode(text: str) -> list[int]:
    return embedded_tokenizer().encode(text)


def chat(text: str) -> list[int]:
    """A user turn through the chat template, as notebook 06's `user(text)`."""
    return embedded_tokenizer().apply_chat_template([{"role": "user", "content": text}])


def replay(arrivals: list[tuple[list[int], int, int]], policy="fcfs", **config) -> Trace:
    """The Trace `viz.record(LLMEngine(EngineConfig(**config), model=...), workload)` records,
    scheduling only. `arrivals`: (prompt token ids, max_tokens, step it arrives at) per request,
    named "0", "1", ... in order. The host swap space is sized as the float32 CPU cache's."""
    config = EngineConfig(device="cpu", **config)
    workload = Workload([WorkloadRequest(str(i), float(step), list(ids), max_tokens)
                         for i, (ids, max_tokens, step) in enumerate(arrivals)])
    per_block = bytes_per_block(embedded_config(), config.block_size, torch.float32)
    one_second = CostModel.constant(1.0, {"bytes_per_block": per_block})
    return simulate(workload, config, one_second, policy=policy, record_trace=True).trace


def prefill_tokens(trace: Trace, request_id: str) -> int:
    """Prompt (and recomputed) tokens the request's prefill steps computed."""
    return sum(item.num_tokens for step in trace.steps for item in step.scheduled
               if item.request_id == request_id and item.kind == "prefill")


def first_scheduled(trace: Trace, request_id: str) -> int:
    """The first step (from 0) that scheduled the request."""
    return next(i for i, step in enumerate(trace.steps) if any(item.request_id == request_id
                                                               for item in step.scheduled))
