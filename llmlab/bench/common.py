"""What the benchmarks share: the Llama-3-8B shape, timers, paged KV caches for the kernel
benchmarks, engines (and HF peers) on random weights, writing results to --out, and an
`llmlab serve` process for the benchmarks that measure a server as a client (`served`).

    from llmlab.bench.common import median_ms, paged_cache, random_engine, write_json
    ms = median_ms(lambda: runner.forward(*inputs), repeats=20)     # CUDA events, median of 20
    k_cache, v_cache, block_tables = paged_cache([4096] * 64)       # random K/V, shuffled blocks

Each timer is one way of measuring, used by the benchmarks that measure that way, so
their numbers stay comparable from run to run:
  * median_ms: the median of single calls, timed by CUDA events (device time of each call,
    launch gaps included) or by the wall clock (perf_counter), after a few untimed calls;
  * kernel_time_ms: Triton's do_bench on calls that cycle through inputs larger than L2,
    replayed from a CUDA graph and launched eagerly (bench kernels, decode-variants);
  * graph_replay_ms: many calls captured in one CUDA graph, the mean over its replays
    (bench gemv: weights streamed from HBM, no launch gaps).
The machine a time was measured on is in llmlab/machine.py.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import time

import torch

from llmlab.model.random_weights import LLAMA3_8B, SMALL_LLAMA

# Llama-3-8B: the shape the GPU benchmarks measure (on random weights). Its config.json
# (LLAMA3_8B, for LlamaModel.random and the HF peer) and the few-MB SMALL_LLAMA are the
# model layer's, where `--model random-llama3-8b` is built (model/random_weights.py).
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = (LLAMA3_8B[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
HIDDEN, INTERMEDIATE, VOCAB_SIZE = (LLAMA3_8B[k] for k in ("hidden_size", "intermediate_size", "vocab_size"))
# its weights as [out, in] matrices: what one decode step streams from HBM
LLAMA3_8B_WEIGHTS = {"qkv": ((NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, HIDDEN),
                     "o_proj": (HIDDEN, NUM_HEADS * HEAD_DIM), "gate_up": (2 * INTERMEDIATE, HIDDEN),
                     "down": (HIDDEN, INTERMEDIATE), "lm_head": (VOCAB_SIZE, HIDDEN)}
BLOCK_SIZE = 16
DTYPE = torch.bfloat16


# ----------------------------------------------------------------------------- timing

def median_ms(fn, repeats: int = 10, warmup: int = 3, cuda_events: bool = True) -> float:
    """Median milliseconds of fn() over `repeats` calls, after `warmup` untimed ones. With
    cuda_events, each call is timed on the GPU between two CUDA events; otherwise by the
    wall clock around the call (host work included)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda_events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return sorted(times)[len(times) // 2]


def kernel_time_ms(make_call, bytes_per_call=0, graph=True) -> tuple[float, float]:
    """Median ms of one call: (device time, eager time). make_call(i) builds the i-th
    input set and returns a zero-argument function; enough sets are built that together
    they exceed L2 4x, and calls cycle through them.

    Device time replays the calls from a CUDA graph, as the engine's decode does: it is
    what the GPU spends. Eager time launches each call from Python (do_bench), so it also
    pays the launch cost -- tens of microseconds for a Triton kernel, more than several
    of these kernels take on the GPU. graph=False reports eager time for both: for calls
    that sync with the host (they cannot be captured) and for plain copies (captured,
    they become copy-engine nodes, slower than the copy kernel).
    """
    import triton.testing

    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    copies = max(1, min(32, math.ceil(4 * l2 / bytes_per_call))) if bytes_per_call else 1
    rotation = itertools.cycle([make_call(i) for i in range(copies)])

    def call():
        return next(rotation)()

    call()  # compile outside the timings
    eager = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
    if not graph:
        return eager, eager
    return triton.testing.do_bench_cudagraph(call, rep=50, return_mode="median"), eager


def variant_time_ms(make_call, num_bytes, on_gpu) -> tuple[float, float]:
    """(ms, eager ms) of make_call(0)(): kernel_time_ms on a GPU; on a CPU (Triton's
    interpreter) the median wall time of 3 calls after one, for both. The kernel-variant
    benchmarks time each variant so, to run the same code on both machines."""
    if on_gpu:
        return kernel_time_ms(make_call, num_bytes)
    ms = median_ms(make_call(0), repeats=3, warmup=1, cuda_events=False)
    return ms, ms


def capture_graph(calls):
    """`calls` (functions of no arguments) captured in one CUDA graph, as the engine captures
    a decode step, after one run on a side stream (compiles, cuBLAS workspace); returns the
    graph's replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph.replay


def graph_replay_ms(calls, repeats=10) -> float:
    """Milliseconds per call of `calls` replayed as one CUDA graph: one replay untimed, then
    two events around `repeats` replays (a mean, not a median)."""
    replay = capture_graph(calls)
    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats / len(calls)


# ----------------------------------------------------------------------------- paged KV caches

QUANTIZED_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def variant_setup(device, cache_dtypes, configs, catalogue: dict):
    """What the kernel-variant benchmarks (decode-variants, prefill-variants) check before any
    row runs: (device, on_gpu, dtype, cache dtype names, config names). `device` None or
    "auto": CUDA when there is one; dtype bf16 on a GPU, fp16 in the interpreter (no bf16);
    cache dtypes default to those the device converts; configs to the whole catalogue."""
    from llmlab.config import check_device

    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    check_device(str(device), device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float16
    cache_dtypes = list(quantized_cache_dtypes(device)) if cache_dtypes is None else list(cache_dtypes)
    if any(name not in QUANTIZED_CACHE_DTYPES for name in cache_dtypes):
        raise ValueError(f"--cache-dtypes: int8 and/or fp8, got {','.join(cache_dtypes)}")
    names = list(configs or catalogue)
    unknown = [name for name in names if name not in catalogue]
    if unknown:
        raise ValueError(f"unknown configs {unknown}; known: {sorted(catalogue)}")
    return device, on_gpu, dtype, cache_dtypes, names


def cache_dtype_names(text: str) -> list[str]:
    """--cache-dtypes of the variant benchmarks: int8 and/or fp8, by those names or by the
    engine's (`--kv-cache-dtype fp8_e4m3`); an unknown one fails before any row runs."""
    names = [{"fp8_e4m3": "fp8"}.get(name.strip(), name.strip()) for name in text.split(",")]
    unknown = [name for name in names if name not in QUANTIZED_CACHE_DTYPES]
    if unknown:
        raise ValueError(f"--cache-dtypes: int8 and/or fp8 (or fp8_e4m3), got {text}")
    return names


def quantized_cache_dtypes(device="cuda") -> dict:
    """The 8-bit caches a device runs: int8 everywhere, fp8 e4m3 from compute capability 8.9
    (and both in Triton's interpreter, on a CPU)."""
    if torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return {"int8": torch.int8}
    return dict(QUANTIZED_CACHE_DTYPES)


def paged_cache(seq_lens, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE, dtype=DTYPE,
                device="cuda", generator=None):
    """Random K/V for sequences of the given lengths in shuffled blocks: (k_cache, v_cache,
    block_tables), caches [num_blocks, block_size, num_kv_heads, head_dim], block tables
    int32 [len(seq_lens), most blocks]. With a (CPU) `generator` the values are drawn on
    the CPU and moved, so a seed gives the same cache on every device; without one, on
    `device` from torch's global generator."""
    blocks = [math.ceil(n / block_size) for n in seq_lens]
    if generator is None:
        ids = torch.randperm(sum(blocks), device=device)
    else:
        ids = torch.randperm(sum(blocks), generator=generator)
    ids = ids.to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    offsets = [0] + list(itertools.accumulate(blocks))
    for i, n in enumerate(blocks):
        block_tables[i, :n] = ids[offsets[i]:offsets[i] + n]
    shape = (sum(blocks), block_size, num_kv_heads, head_dim)

    def randn():
        if generator is None:
            return torch.randn(shape, device=device, dtype=dtype)
        return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    return randn(), randn(), block_tables


def quantize_paged_cache(k_cache, v_cache, block_tables, cache_dtype):
    """A paged cache's K/V quantized as store_kv would: (k codes, v codes, block_tables,
    k scales, v scales), scales float32 [num_blocks, block_size, num_kv_heads]."""
    from llmlab.kernels import reference

    (k_codes, k_scales), (v_codes, v_scales) = (reference.quantize(c, cache_dtype) for c in (k_cache, v_cache))
    return k_codes, v_codes, block_tables, k_scales, v_scales


# ----------------------------------------------------------------------------- random weights

def random_engine_config(args, num_gpu_blocks=None, max_num_seqs=256, max_num_batched_tokens=16384,
                         engine_args: dict | None = None):
    """The EngineConfig of random_engine: the fields chosen here, then `engine_args` (the
    EngineConfig flags a command was given). A flag left unset on the command line is None
    in `args` and keeps the default here."""
    from llmlab import EngineConfig

    # (max_model_len left None: the shape's 8,192 positions, or what a small --num-gpu-blocks holds)
    fields = dict(model="random-llama3-8b", num_gpu_blocks=num_gpu_blocks, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens,
                  tensor_parallel_size=getattr(args, "tp", None) or 1,
                  enforce_eager=bool(getattr(args, "enforce_eager", None)))
    fields.update({k: v for k, v in (engine_args or {}).items() if k != "model"})
    return EngineConfig(**fields)


def random_engine(args, num_gpu_blocks=None, max_num_seqs=256, max_num_batched_tokens=16384,
                  engine_args: dict | None = None):
    """(LLM, its HF config): random weights in the Llama-3-8B shape (bf16 on CUDA; `args.layers`,
    when set, fewer layers), with no tokenizer unless `--tokenizer` (EngineConfig.tokenizer)
    names one: then the vocabulary is the tokenizer's (model/random_weights.py).
    `engine_args`: EngineConfig fields that override the ones chosen here."""
    from llmlab.llm import LLM
    from llmlab.config import check_device
    from llmlab.model.loader import resolve_tokenizer
    from llmlab.model.random_weights import check_random_device, random_shape

    config = random_engine_config(args, num_gpu_blocks, max_num_seqs, max_num_batched_tokens, engine_args)
    device = config.resolved_device()
    check_device(config.device, device)
    check_random_device(config.model, device)   # 8B parameters: 32 GB in float32, built before any other check
    tokenizer = resolve_tokenizer(config.tokenizer) if config.tokenizer is not None else None
    hf = random_shape(config.model, tokenizer, getattr(args, "layers", None))
    return LLM.from_engine(engine_with_random_weights(config, hf, tokenizer)), hf


def engine_with_random_weights(config, hf: dict, tokenizer=None):
    """An LLMEngine for `config` on a model of random weights in the shape of `hf` (a HF
    config.json as a dict), in the config's dtype and on its device, with `tokenizer`."""
    from llmlab import LLMEngine
    from llmlab.config import ModelConfig
    from llmlab.model.llama import LlamaModel

    model = LlamaModel.random(ModelConfig.from_hf(hf), config.resolved_dtype(), config.resolved_device())
    return LLMEngine(config, model=model, tokenizer=tokenizer)


def random_hf_model(hf: dict, dtype, device):
    """The HF transformers peer on random weights (its own init: normal, std 0.02) in the
    shape of `hf`, with SDPA attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)


# ----------------------------------------------------------------------------- results

def write_json(path, data, indent=1) -> None:
    """Write a benchmark's results as JSON to `path` (its --out); nothing when path is None."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=indent)


# ----------------------------------------------------------------------------- a server to measure

def free_port() -> int:
    """A free TCP port on the loopback interface (free when asked: bind it soon)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_up(process, probe, timeout_s: float, what: str, interval: float = 0.2) -> None:
    """Call `probe()` until it returns True, a connection error counting as "not yet", for a
    server started in `process` (a benchmark's, a test's); RuntimeError naming `what` if the
    process exits first or `timeout_s` seconds pass."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode} before it answered")
        try:
            if probe():
                return
        except (OSError, httpx.TransportError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer within {timeout_s:g} s")
        time.sleep(interval)


def stop(process, timeout_s: float = 60) -> None:
    """Stop a started server: SIGTERM (unless it has exited), SIGKILL if it is still there after
    `timeout_s` seconds."""
    import subprocess

    if process.poll() is None:
        process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def served(base_url: str | None, serve_args: str = "", timeout_s: float = 900, cpus: set[int] | None = None):
    """The base URL of the server a client benchmark measures: `base_url` when given, else an
    `llmlab serve` started here in a process of its own (so the measuring client never shares
    the engine's interpreter) on a free loopback port, with `serve_args` (e.g. "--max-num-seqs
    16"), stopped by SIGTERM when the block ends. Its output goes to this process's stderr.
    `cpus`: the server (and its engine process) runs on these CPUs only, with as many threads."""
    if base_url:
        yield base_url.rstrip("/")
        return
    import shlex
    import subprocess
    import sys

    import httpx

    port = free_port()
    command = [sys.executable, "-m", "llmlab.cli", "serve", "--port", str(port), "--log-level", "warning",
               *shlex.split(serve_args)]
    if cpus:
        env = {**os.environ, "OMP_NUM_THREADS": str(len(cpus))}    # torch's threads: one per CPU it may use
        process = subprocess.Popen(command, env=env, preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    else:
        process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(process, lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, timeout_s,
                      f"`{shlex.join(command)}`", interval=1)
        yield url
    finally:
        stop(process)
