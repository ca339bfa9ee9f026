"""Warm-up: everything compiled or captured at start-up, in one place, so that nothing is
compiled or captured while requests wait. A first-time compile in the middle of a run
stalls every stream (a first mixed step took 2 s on an H200; first captures of
long-context decode graphs showed in the calibration's p90).

`warm_up(runner, sampler, config)`, called once by LLMEngine.__init__ once the runner has
its KV cache, does, on a GPU with the Triton backend (on a CPU nothing compiles: torch
kernels, or Triton's interpreter), in this order:
  1. decode CUDA graphs  runner.make_decode_graphs captures one per size of the batch-size
                         ladder with one split (cuda_graphs/decode.py; every rank's with tensor
                         parallelism), then every other (size, splits) key `graph_keys` lists;
                         then the graphs of steps that hold a prompt, one per padded
                         token count (cuda_graphs/prompt.py);
                         not with enforce_eager, nor with pipeline parallelism (eager steps)
  2. kernel variants     `compile_kernels`: the `warm_up_plans` batches through the runner
  3. sampler graphs      Sampler.warm_up: every row count up to max_num_seqs, with and
                         without greedy rows, on the logits' dtype (float32)
and, for a process that serves from then on, `freeze_heap()` (the garbage collector, below).
(Before it, the runner's memory profile ran one worst-case forward on CUDA, which compiles
what that shape uses; it is there to measure memory, not to warm up.)

Triton compiles a kernel once per value of its constexprs and per class of each integer
argument: 1, a multiple of 16, anything else (`spec`). What changes from step to step:
  prefill attention  the number of prefill sequences P (its class, and BLOCK_S, the power
                     of two >= 16 above it) and the width of the block tables (the longest)
  decode attention   the number of flash-decoding splits (each split count has its own
                     combine kernel) and the width of the block tables, in eager steps
  the sampler        its chunking follows the number of rows (3. above)
Every other integer argument is a model constant (heads, strides of the weights).
`warm_up_plans` covers each combination once; `graph_keys` lists every (batch size,
splits) CUDA graph a decode step can replay.
"""
from __future__ import annotations

import contextlib
import gc
import itertools

import torch

from llmlab.config import EngineConfig
from llmlab.engine.batch import dummy_plan, num_blocks_of
from llmlab.cuda_graphs.decode import padded_batch_size
from llmlab.model.llama import LOGITS_DTYPE
from llmlab.plan import Plan


def warm_up(runner, sampler, config: EngineConfig) -> None:
    """Compile and capture, before the first request, everything a step of this engine can
    ask for (the list above). `runner`: the engine's ModelRunner; `sampler`: its Sampler."""
    if runner.device.type != "cuda" or runner.backend != "triton":
        return
    # pipeline-parallel steps run eagerly; tensor-parallel ones replay on every rank at once
    if not config.enforce_eager and config.pipeline_parallel_size == 1:
        graphs = runner.make_decode_graphs()   # captures the ladder, one split each
        # every split count a long context can ask for, now rather than mid-run
        graphs.capture(graph_keys(graphs.sizes, config.max_num_seqs, runner.max_model_len, runner.num_splits))
        runner.make_prompt_graphs()   # steps that hold a prompt, per padded token count
    compile_kernels(runner)   # on every rank with tensor parallelism
    # the logits' dtype, not the weights': a graph captured for bf16 logits is never replayed
    sampler.warm_up(runner.model_config.vocab_size, runner.device, LOGITS_DTYPE, config.max_num_seqs)


def compile_kernels(runner) -> None:
    """Run throwaway batches (warm_up_plans) so that Triton compiles every kernel variant a
    step can ask for now, not inside the first requests' steps (a first mixed step took 2 s
    on an H200). They write K/V into blocks that no request owns yet."""
    num_blocks = runner.kv_cache.device.shape[2]
    config = runner.config
    plans = warm_up_plans(runner.block_size, config.max_num_seqs, config.max_num_batched_tokens,
                          runner.max_model_len, runner.num_splits)
    for plan in plans:
        longest = max(item.start_position + item.num_tokens for item in plan.items)
        if longest > runner.max_model_len or num_blocks_of(plan, runner.block_size) > num_blocks:
            continue   # a small engine never sees this shape
        runner.execute(plan)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


# (prefills as (chunk, context) pairs, decode contexts): a step of one token, odd and
# multiple-of-16 token counts, prefill-only, decode-only and mixed steps
STATIC_SHAPES = [([(7, 7)], []), ([(5, 5), (12, 12)], [2, 40, 2]), ([(16, 16)], [2] * 16), ([(29, 29)], [33]),
                 ([], [2]), ([], [2, 40, 2]), ([], [2] * 16)]


def spec(value: int) -> int:
    """How Triton specializes an integer argument: 1, 16 (a multiple of it) or 0 (other)."""
    return 1 if value == 1 else 16 if value % 16 == 0 else 0


def first_of_each(values, key) -> list:
    """The first value of `values` for each distinct key(value), in order."""
    seen = {}
    for value in values:
        seen.setdefault(key(value), value)
    return list(seen.values())


def warm_up_plans(block_size: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                  num_splits) -> list[Plan]:
    """Dummy plans (batch.dummy_plan) that together hit every kernel variant listed above.
    `num_splits(num_decodes, longest context)` is the runner's split choice."""
    max_width = -(-max_model_len // block_size)
    # one context per class of block-table width: tables of 1, 2 and 16 blocks
    contexts = [min(width * block_size, max_model_len) for width in first_of_each(range(1, max_width + 1), spec)]
    # one count of prefill sequences per (class, BLOCK_S): 1, 2, 16, 17, 32, 33, 48, 65, ...
    most_prefills = max(1, min(max_num_seqs, max_num_batched_tokens))
    prefill_counts = first_of_each(range(1, most_prefills + 1), lambda p: (spec(p), max(16, 1 << (p - 1).bit_length())))
    # one decode batch (size, longest context) per (splits, class of table width); the split
    # count only falls as the batch grows, so batch sizes of powers of two find them all
    sizes = sorted({1 << i for i in range(max_num_seqs.bit_length())} | {max_num_seqs})
    decodes = first_of_each(((n, c) for n in sizes for c in range(1, max_model_len + 1)),
                            lambda nc: (num_splits(*nc), spec(-(-nc[1] // block_size))))
    plans = [dummy_plan(block_size, prefills, contexts) for prefills, contexts in STATIC_SHAPES]
    mixed = list(itertools.product(prefill_counts, contexts))
    for i in range(max(len(mixed), len(decodes))):
        prefills, decode_contexts = [], []
        if i < len(mixed):   # P - 1 one-token prompts and one whose table has the width wanted
            count, context = mixed[i]
            prefills = [(1, 1)] * (count - 1) + [(1, context)]
        if i < len(decodes):
            size, context = decodes[i]
            decode_contexts = [2] * (size - 1) + [context]
        plans.append(dummy_plan(block_size, prefills, decode_contexts))
    return plans


def graph_keys(sizes: list[int], max_num_seqs: int, max_model_len: int, num_splits) -> list[tuple[int, int]]:
    """Every (graph batch size, splits) a decode step of 1 .. max_num_seqs sequences with
    contexts up to max_model_len replays (cuda_graphs/decode.py); the split count only grows with
    the context, so a batch whose longest context gets one split needs no other key."""
    keys = set()
    for num_seqs in range(1, min(max_num_seqs, sizes[-1]) + 1):
        size = padded_batch_size(num_seqs, sizes)
        if num_splits(num_seqs, max_model_len) == 1:
            keys.add((size, 1))
            continue
        keys.update((size, num_splits(num_seqs, context)) for context in range(1, max_model_len + 1, 16))
        keys.add((size, num_splits(num_seqs, max_model_len)))
    return sorted(keys)


# ---- the garbage collector ---------------------------------------------------------------
# Python's collector scans every container object alive (the model's modules, the tokenizer,
# the block manager's blocks, Triton's caches) each time it collects the oldest generation:
# 100-290 ms with the 8B model on an H200, in the middle of a run (a stall of every stream,
# and 3% of a saturated run's throughput). Objects alive at start-up live as long as the
# engine, so they are frozen (gc.freeze: out of the collector's reach) and collections only
# scan what the run itself made. vLLM's engine does the same.
def freeze_heap() -> None:
    """For a process that serves from now on (`llmlab serve`'s engine-core and API
    processes): collect once, then freeze everything alive. Frozen objects are never
    collected, so only a process that keeps its engine to the end calls this."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def heap_frozen():
    """Freeze what is alive for the length of a run, and give it back to the collector after
    (LLM.generate): the run's steps do not rescan the heap it started with. A heap frozen
    already (freeze_heap, the caller's own gc.freeze, another thread's run) is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
