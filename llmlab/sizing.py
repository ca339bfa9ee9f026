"""The engine's batch sizes when EngineConfig leaves them None: `max_num_seqs` (requests
running at once), `max_num_batched_tokens` (tokens per step) and the largest decode CUDA
graph, chosen from the device, its memory and the KV cache's size, as vLLM's engine
chooses them (vLLM V1, `EngineArgs._set_default_args`).

Why they follow the device: a decode step streams the weights once whatever its batch, so
on a GPU a larger batch is nearly free tokens until the KV cache or the compute runs out
(on the H200, Llama-3-8B shape: 64 sequences gave 5.3k tok/s, 256 gave 10.3k; issue 36).
On a CPU a step's time grows with every token, and a step over 2048 tokens keeps every
stream waiting for seconds, so the CPU keeps small values.

`resolve(config, kv_cache_blocks)` is the one place they are decided: the ModelRunner calls
it once its KV cache is sized, and the engine's scheduler, warm-up and CUDA graphs read the
config it returns (a copy: the caller's config keeps its None). A value the user set is
kept as it is. A Scheduler built on a config with None (tests, the simulator) calls it
too, with its block manager's size. `token_budget(config)` is the part that needs no KV
cache: the runner's memory profile runs one forward of that many tokens before the cache
exists.

`max_model_len`, the longest prompt + output, is the third size left None: the model's
context, or what the KV cache holds if less (`max_model_len_for`, called by the runner once
the cache is sized). A value past the model's context is refused before the weights load
(`check_context`, called by model/loader.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from llmlab.config import EngineConfig, ModelConfig

GIB = 2**30


@dataclass(frozen=True)
class GpuSizes:
    min_memory_gib: float    # this row is for CUDA devices with at least this much memory
    max_num_seqs: int
    offline_tokens: int      # max_num_batched_tokens for LLM() (throughput: larger prefill steps)
    server_tokens: int       # ... for `llmlab serve` (latency: a smaller step keeps ITL down)


# The table to retune after measuring (BENCHMARKS.md, "Online serving"): the first row whose memory
# the device has wins. vLLM V1's values (EngineArgs._set_default_args): 70 GiB and up is
# its "A100 / H100 class", 1024 sequences and 16384 (offline) / 8192 (server) tokens; a
# smaller GPU 256 and 8192 / 2048.
GPU_SIZES = [GpuSizes(min_memory_gib=70, max_num_seqs=1024, offline_tokens=16384, server_tokens=8192),
             GpuSizes(min_memory_gib=0, max_num_seqs=256, offline_tokens=8192, server_tokens=2048)]
# A CPU: 64 sequences, and a 512-token step (~1 ms per token for the 135M model on a
# laptop: a CPU step near a second while a long prompt is prefilled; BENCHMARKS.md, "Online serving").
CPU_MAX_NUM_SEQS = 64
CPU_TOKEN_BUDGET = 512
# The largest decode batch captured as a CUDA graph (vLLM: 512). Past it a decode step runs
# eagerly: its launches are short next to a step of > 512 sequences.
MAX_GRAPH_BATCH_SIZE = 512


@dataclass(frozen=True)
class Sizes:
    max_num_seqs: int
    max_num_batched_tokens: int
    reason: str     # one line: what was chosen and why (`llmlab serve` and LLM() log it)


def device_memory(device: torch.device) -> int:
    """Bytes of memory the CUDA device has (0 for a CPU)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0


def gpu_row(memory_bytes: int) -> GpuSizes:
    return next(row for row in GPU_SIZES if memory_bytes >= row.min_memory_gib * GIB)


def token_budget(config: EngineConfig) -> int:
    """max_num_batched_tokens: the user's, or the device's default for config.usage_context."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    device = config.resolved_device()
    if device.type != "cuda":
        return CPU_TOKEN_BUDGET
    row = gpu_row(device_memory(device))
    return row.server_tokens if config.usage_context == "server" else row.offline_tokens


def resolve(config: EngineConfig, kv_cache_blocks: int) -> tuple[EngineConfig, Sizes]:
    """(a copy of config with max_num_seqs and max_num_batched_tokens set, what was chosen and
    why). On a CUDA device a default max_num_seqs is capped at the KV cache's blocks: every
    running sequence holds at least one block, so more could never run at once (their
    graphs and sampler rows would be captured for nothing). A value the user set is kept."""
    device = config.resolved_device()
    tokens = token_budget(config)
    seqs = config.max_num_seqs
    if device.type == "cuda":
        memory = device_memory(device)
        why = [f"CUDA device with {memory / GIB:.0f} GiB, {config.usage_context} defaults"]
        if seqs is None:
            seqs = min(gpu_row(memory).max_num_seqs, max(kv_cache_blocks, 1))
            if seqs < gpu_row(memory).max_num_seqs:
                why.append(f"max_num_seqs capped at the KV cache's {kv_cache_blocks} blocks")
    else:
        why = ["CPU device"]
        seqs = CPU_MAX_NUM_SEQS if seqs is None else seqs
    explicit = [name for name in ("max_num_seqs", "max_num_batched_tokens") if getattr(config, name) is not None]
    if explicit:
        why.append(f"{' and '.join(explicit)} set explicitly")
    why.append(f"KV cache holds {kv_cache_blocks * config.block_size:,} tokens")
    reason = f"max_num_seqs {seqs}, max_num_batched_tokens {tokens} ({'; '.join(why)})"
    return dataclasses.replace(config, max_num_seqs=seqs, max_num_batched_tokens=tokens), Sizes(seqs, tokens, reason)


def check_context(config: EngineConfig, model_config: ModelConfig) -> None:
    """A max_model_len past the model's context is refused with both numbers (as vLLM does):
    positions past it were never trained, so the text there would be garbage, not an error."""
    if config.max_model_len is not None and config.max_model_len > model_config.context_length:
        raise ValueError(f"EngineConfig.max_model_len is {config.max_model_len}, more than the model's context of "
                         f"{model_config.context_length} tokens ({model_config.context_source()}); lower it, or "
                         f"leave it None for the model's context")


def max_model_len_for(config: EngineConfig, model_config: ModelConfig, kv_cache_tokens: int) -> int:
    """The longest prompt + output the engine runs: config.max_model_len, or None = the
    model's context, or what the KV cache holds if less (a sequence needs all its blocks on
    the device at once). An asked-for length the KV cache cannot hold is refused: a silent
    cap would surface later as refused or cut-short requests."""
    check_context(config, model_config)
    if config.max_model_len is None:
        return min(model_config.context_length, kv_cache_tokens)
    if config.max_model_len > kv_cache_tokens:
        raise ValueError(
            f"EngineConfig.max_model_len is {config.max_model_len}, more than the KV cache holds: {kv_cache_tokens} "
            f"tokens ({kv_cache_tokens // config.block_size} blocks of {config.block_size}); lower it, or give "
            f"the KV cache more memory (gpu_memory_utilization, cpu_kv_cache_gib or num_gpu_blocks)")
    return config.max_model_len
