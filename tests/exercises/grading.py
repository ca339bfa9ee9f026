"""What every exercise test shares: loading exercises/ or solutions/, random inputs that
make out-of-bounds reads visible, and the end-to-end run of the embedded model.

On a machine without CUDA the Triton exercises run in Triton's interpreter, about a
millisecond per program instance, so the inputs are small and float32 only.
"""
from __future__ import annotations

import importlib
import pathlib
import sys

import torch

import llmlab
from llmlab import kernels, preemption
from llmlab.kernels import reference
from llmlab.plan import Plan
from llmlab.scheduler import Scheduler

from diagnose import check_attention, check_same_text, fail
from helpers import kernels as kernel_inputs

# Triton decides at @triton.jit time whether to interpret: switch it on before any
# exercise module is imported.
kernels.enable_interpreter_if_no_cuda()

REPO = pathlib.Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `exercises` and `solutions` are packages at the repo root

EXERCISES = sorted(path.stem for path in (REPO / "exercises").glob("ex[0-9][0-9]_*.py"))
# Exercise -> the llmlab kernel its launcher stands in for (same signature as in reference.py).
KERNEL_EXERCISES = {
    "ex01_rms_norm": "rms_norm",
    "ex02_silu_mul": "silu_mul",
    "ex03_rope": "rope",
    "ex04_store_kv": "store_kv",
    "ex06_paged_attention_v1": "decode_attention",
    "ex07_flash_decoding": "decode_attention",
    "ex08_prefill_attention": "prefill_attention",
}
TRITON_EXERCISES = {**KERNEL_EXERCISES, "ex05_online_softmax": "online_softmax"}

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN = float("nan")
# Exercise kernels do the reference's fp32 math in another order (sums over tiles, dots in
# "ieee" precision): they agree to a few fp32 ulps of values of order 1.
FP32_TOL = dict(atol=1e-5, rtol=1e-5)


def load(impl: str, name: str):
    """The module exercises/<name>.py or solutions/<name>.py (impl = "exercises" | "solutions")."""
    return importlib.import_module(f"{impl}.{name}")


# ----------------------------------------------------------------------------- inputs

def randn(*shape, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(DEVICE)


def randn_view(*shape, gen):
    """N(0, 1) values in a view of a NaN-filled tensor one longer in every dim: a kernel
    that reads past an edge of the view gets NaN into its result (float32, on DEVICE)."""
    return kernel_inputs.randn_view(*shape, dtype=torch.float32, gen=gen, dev=DEVICE)


def paged_kv(seq_lens, block_size, num_kv_heads, head_dim, gen, spare_blocks=3):
    """K/V caches holding random rows for each sequence's first seq_len tokens in shuffled
    blocks, and the block tables that find them. Every slot no sequence owns is NaN, and
    block 0 (where masked lanes of a careless kernel read) is never a sequence's. The kernel
    tests' own paged caches (tests/helpers/kernels.py), in float32 on DEVICE."""
    return kernel_inputs.paged_kv(seq_lens, block_size, num_kv_heads, head_dim, torch.float32, gen, DEVICE,
                                  spare_blocks)


def assert_same_with_nans(actual, expected, case="the cache"):
    """Equal values, and NaN in exactly the same places; for a [num_blocks, block_size, ...]
    cache, a mismatch names the slots (block * block_size + row) written wrongly."""
    same = (actual.isnan() & expected.isnan()) | (actual == expected)
    if same.all():
        return
    lines = []
    if actual.dim() >= 3:
        per_slot = ~same.flatten(2).all(-1).flatten()             # [num_blocks * block_size]
        bad = per_slot.nonzero().flatten().tolist()
        expected_empty = expected.flatten(2).isnan().all(-1).flatten()
        stray = [s for s in bad if expected_empty[s]]
        missing = [s for s in bad if not expected_empty[s]]
        if stray:
            lines.append(f"written but should stay untouched (NaN): slots {stray[:8]} -- a padding token "
                         "(slot -1) wrote, or the slot arithmetic is off")
        if missing:
            lines.append(f"wrong or missing rows: slots {missing[:8]} -- token t goes to slot slot_mapping[t]: "
                         "block slot // block_size, row slot % block_size, every kv head and dim of it")
    lines.append(f"{(~same).sum().item()} of {same.numel()} values differ")
    fail(case, lines)


# ----------------------------------------------------------------------------- decode attention

def ragged(block_size):
    """Context lengths around the block boundaries, and one 3.5 blocks long."""
    return [1, block_size - 1, block_size, block_size + 1, 7 * block_size // 2]


# Scores the random cases never produce (their scores stay within a few units of 0):
SCORES = {
    "usual": None,
    # in the hundreds: exp(score) (or exp(lse)) without the running max taken off overflows
    "large": "a softmax without the max subtracted overflows here: exp(s - m), with m the running max "
             "(and, combining splits, weights exp(lse_i - max lse))",
    # all far below 0 (about -250): a running max started at 0 instead of -inf underflows every exp to 0
    "very negative": "every score here is about -250: start the running max at -inf, not 0 (exp(s - 0) "
                     "underflows to 0 and the sum l is 0)",
}


def shape_scores(q, k_cache, scores: str):
    """Push q and k (in place, keeping their layouts) so the scores are `scores` (SCORES);
    the tolerance to compare with (fp32 rounding of scores in the hundreds is ~1e-4)."""
    if scores == "large":
        q.mul_(100.0)
    elif scores == "very negative":
        k_cache.add_(4.0)
        q.abs_().mul_(-10.0)
    return FP32_TOL if scores == "usual" else dict(atol=1e-3, rtol=1e-3)


def check_decode_attention(ex, case, num_heads, num_kv_heads, head_dim, block_size, seq_lens, num_splits=1,
                           seed=0, hint="", scale=None, scores="usual"):
    """ex.decode_attention against the reference on one case; a mismatch fails with a report
    of which sequences and heads differ and what that points to (diagnose.check_attention).
    `scale` defaults to head_dim ** -0.5; `scores` is a key of SCORES."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = paged_kv(seq_lens, block_size, num_kv_heads, head_dim, gen)
    q = randn_view(len(seq_lens), num_heads, head_dim, gen=gen)
    tol = shape_scores(q, k_cache, scores)
    hint = " ".join(filter(None, [hint, SCORES[scores]]))
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5 if scale is None else scale
    actual = ex.decode_attention(q, k_cache, v_cache, block_tables, lens, scale, num_splits)
    # The reference reads whole blocks and masks afterwards (0 * NaN = NaN), so it gets the
    # caches with the unowned slots zeroed; the kernel must never read them at all.
    expected = reference.decode_attention(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0),
                                          block_tables, lens, scale)
    close = isinstance(actual, torch.Tensor) and actual.shape == expected.shape and \
        torch.allclose(actual, expected, **tol)
    notes = []
    if not close and num_splits > 1:
        one_split = ex.decode_attention(q, k_cache, v_cache, block_tables, lens, scale, 1)
        if one_split.shape == expected.shape and torch.allclose(one_split, expected, **tol):
            notes.append(f"-> with num_splits=1 these inputs match, with {num_splits} they do not: check the "
                         "split ranges (together they cover keys 0..seq_len-1 once; a split past the end "
                         "weighs nothing) and the combine: lse_i = m_i + log(l_i), weights exp(lse_i - max lse)")
    case = f"{case!r} ({num_heads} query / {num_kv_heads} kv heads, head_dim {head_dim}, block_size " \
           f"{block_size}, num_splits {num_splits}, seq_lens {seq_lens}, scale {scale:.4g}, {scores} scores)"
    check_attention(actual, expected, case=case, tol=tol, seq_lens=seq_lens, block_size=block_size,
                    num_kv_heads=num_kv_heads, hint=hint, notes=notes)


# ----------------------------------------------------------------------------- end to end

# Two prompts of different lengths in one batch (5 and 19 tokens): the second spans two KV
# blocks of 16, and neither reaches a block's end while decoding, so every decode step
# has a partial last block.
PROMPTS = ["The capital of France is",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who"]
# Few tokens: under the interpreter a decode step of the 30-layer model takes seconds. The
# poisoned cache (below), not the length, is what makes a careless kernel show here.
GREEDY = llmlab.SamplingParams(max_tokens=5, temperature=0.0)


def grading_engine(llm):
    """An engine of its own (64 blocks, no prefix cache) over `llm`'s loaded model, so that
    filling its KV cache with garbage touches no other test's engine."""
    config = llmlab.EngineConfig(device=DEVICE, dtype="float32", backend="torch", num_gpu_blocks=64,
                                 swap_space=0, enable_prefix_caching=False)
    engine = llmlab.LLMEngine(config, model=llm.engine.model, tokenizer=llm.tokenizer)
    return llmlab.LLM.from_engine(engine)


def poison_kv_cache(llm) -> bool:
    """Fill every KV slot with large random values. The engine writes a token's K/V before
    any attention reads it, so a correct kernel never sees these; one that reads a slot past a
    sequence's end (a missing length mask) gets garbage keys with real weight, and the text
    changes at once. Returns False when the cache is not a float tensor it can fill."""
    cache = getattr(getattr(llm.engine, "kv_cache", None), "device", None)
    if not isinstance(cache, torch.Tensor) or not cache.is_floating_point():
        return False
    cache.normal_(0.0, 4.0, generator=torch.Generator(cache.device).manual_seed(0))
    return True


def generate_token_ids(llm, poison=True, **overrides):
    """Greedy token ids for PROMPTS, with the given kernels plugged into the engine and
    (poison=True) garbage in every KV slot no sequence has written."""
    if poison:
        poison_kv_cache(llm)
    with kernels.override(**overrides):
        return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


def check_end_to_end(llm, reference_token_ids, kernel: str, implementation) -> None:
    """The model with `implementation` as llmlab's `kernel`: the same greedy text, or a report."""
    actual = generate_token_ids(llm, **{kernel: implementation})
    check_same_text(actual, reference_token_ids, tokenizer=llm.tokenizer, prompts=PROMPTS, kernel=kernel)


# ----------------------------------------------------------------------------- smoke calls

def _tiny_paged_inputs():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, block_tables = paged_kv([3, 18], 16, 1, 16, gen)
    return k_cache, v_cache, block_tables, torch.tensor([3, 18], dtype=torch.int32, device=DEVICE)


def _decode(module, num_splits):
    k_cache, v_cache, block_tables, seq_lens = _tiny_paged_inputs()
    q = torch.ones(2, 2, 16, device=DEVICE)
    return module.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.25, num_splits)


def _prefill(module):
    k_cache, v_cache, block_tables, seq_lens = _tiny_paged_inputs()
    q = torch.ones(5, 2, 16, device=DEVICE)
    cu_seqlens_q = torch.tensor([0, 3, 5], dtype=torch.int32, device=DEVICE)
    return module.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, 0.25)


def _allocator_with_one_sequence(module):
    """An allocator whose sequence 0 holds 3 tokens in block 0 (state set by hand)."""
    allocator = module.BlockAllocator(4, 4)
    allocator.free_blocks.remove(0)
    allocator.ref_counts[0] = 1
    allocator.block_tables[0] = [0]
    allocator.seq_lens[0] = 3
    return allocator


# One cheap call of each public entry point. A pristine exercise raises NotImplementedError
# on every one of them (checked by test_pristine_exercises.py); a solution runs them all.
SMOKE_CALLS = {
    "ex01_rms_norm": [lambda m: m.rms_norm(torch.ones(2, 8, device=DEVICE), torch.ones(8, device=DEVICE), 1e-5)],
    "ex02_silu_mul": [lambda m: m.silu_mul(torch.ones(2, 8, device=DEVICE))],
    "ex03_rope": [lambda m: m.rope(torch.ones(2, 2, 16, device=DEVICE), torch.ones(2, 1, 16, device=DEVICE),
                                   torch.arange(2, device=DEVICE), 10000.0)],
    "ex04_store_kv": [lambda m: m.store_kv(torch.ones(2, 1, 16, device=DEVICE), torch.ones(2, 1, 16, device=DEVICE),
                                           torch.zeros(2, 16, 1, 16, device=DEVICE),
                                           torch.zeros(2, 16, 1, 16, device=DEVICE),
                                           torch.tensor([0, 17], device=DEVICE))],
    "ex05_online_softmax": [lambda m: m.online_softmax(torch.ones(2, 8, device=DEVICE))],
    "ex06_paged_attention_v1": [lambda m: _decode(m, 1)],
    "ex07_flash_decoding": [lambda m: _decode(m, 2)],
    "ex08_prefill_attention": [_prefill],
    "ex09_block_allocator": [
        lambda m: m.BlockAllocator(4, 4).allocate(0, 5),
        lambda m: _allocator_with_one_sequence(m).append_slot(0),
        lambda m: _allocator_with_one_sequence(m).fork(0, 1),
        lambda m: _allocator_with_one_sequence(m).free(0),
    ],
    "ex13_block_manager": [
        lambda m: m.BlockManager(4, 2, 4).allocate(_request(5), 5),
        lambda m: m.BlockManager(4, 2, 4).block_hashes(_request(9), 2),
        lambda m: m.BlockManager(4, 2, 4).match_prefix(_request(9)),
        lambda m: _on_one_request(m, "free"),
        lambda m: _on_one_request(m, "cache_full_blocks"),
        lambda m: _on_one_request(m, "swap_out"),
    ],
    "ex14_detokenizer": [
        lambda m: m.IncrementalDetokenizer(_Bytes(), [0]).add_token(1),
        lambda m: m.OutputText(m.IncrementalDetokenizer(_Bytes(), [0]), ["x"]).finish(),
        lambda m: _OutputTextOfSolution(m).add_token(1),
    ],
    "ex15_decoder_layer": [
        lambda m: _tiny_layer(m).mlp(torch.ones(2, 8)),
        lambda m: _tiny_layer(m).attention(torch.ones(2, 8), *_tiny_layer_batch()),
        lambda m: _tiny_layer(m)(torch.ones(2, 8), None, *_tiny_layer_batch()),
    ],
    "ex16_sampler": [
        lambda m: m.filter_logits(torch.zeros(1, 4), torch.tensor([2]), torch.tensor([0.9]), torch.tensor([0.0])),
        lambda m: m.Sampler(0)(torch.zeros(1, 4), [llmlab.SamplingParams()], [0], [0]),
    ],
    "ex17_scheduler_step": [lambda m: _scheduler(m.Scheduler, preemption).schedule(now=0.0)],
    "ex18_preemption": [
        lambda m: m.make_room(*_full_scheduler(m, "recompute"), 1.0),
        lambda m: m.preempt(*_full_scheduler(m, "recompute")[:2], Plan()),
        lambda m: _swapped_back_in(m),
    ],
    "ex19_chat_endpoint": [lambda m: m.build_app(None)],   # builds the app only: the engine is not touched
    # its class needs CUDA to be built at all (it captures in its constructor): the pure part only
    "ex20_cuda_graphs": [lambda m: m.padded_batch_size(3, [1, 2, 4, 8])],
    "ex10_chunked_prefill": [lambda m: m.schedule_chunks(1, [10], 8, 4)],
    "ex11_top_p": [lambda m: m.top_p_filter(torch.zeros(1, 4), 0.5)],
    "ex12_quantized_store_kv": [
        lambda m: _store_int8(m, *_int8_cache()),
        lambda m: m.dequantize_slots(_int8_cache()[0], _int8_cache()[2], torch.tensor([0, 17], device=DEVICE)),
    ],
}


def _store_int8(module, k_cache, v_cache, k_scales, v_scales):
    rows = torch.ones(2, 1, 16, device=DEVICE)
    return module.store_kv(rows, rows, k_cache, v_cache, torch.tensor([0, 17], device=DEVICE), k_scales, v_scales)


def _int8_cache():
    """k_cache, v_cache (int8) and k_scales, v_scales of 2 blocks of 16 slots, 1 kv head of 16."""
    codes = [torch.zeros(2, 16, 1, 16, dtype=torch.int8, device=DEVICE) for _ in range(2)]
    scales = [torch.ones(2, 16, 1, device=DEVICE) for _ in range(2)]
    return codes[0], codes[1], scales[0], scales[1]


def _request(num_tokens):
    from llmlab.request import Request

    return Request("0", None, list(range(num_tokens)), llmlab.SamplingParams())


def _manager_with_one_request(module):
    """A block manager whose request holds 5 computed tokens in blocks 0 and 1 (state set by hand)."""
    manager = module.BlockManager(4, 2, 4)
    request = _request(5)
    for block in (0, 1):
        manager.free_blocks.remove(block)
        manager.ref_counts[block] = 1
    request.block_table = [0, 1]
    request.num_computed_tokens = 5
    return manager, request


def _on_one_request(module, method: str):
    manager, request = _manager_with_one_request(module)
    return getattr(manager, method)(request)


def _tiny_layer(module):
    """The module's DecoderLayer over random weights: hidden 8, 2 heads of 4, 1 kv head."""
    from llmlab.config import ModelConfig
    from llmlab.model.llama import LlamaModel

    config = ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=12, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5, rope_theta=10000.0)
    return module.DecoderLayer(config, LlamaModel.random(config, torch.float32, "cpu").layers[0])


def _tiny_layer_batch():
    """positions, a ForwardBatch of one 2-token prefill in block 0, k_cache, v_cache for _tiny_layer."""
    from llmlab.model.llama import ForwardBatch

    ints = lambda *v: torch.tensor(v, dtype=torch.int32)   # noqa: E731
    batch = ForwardBatch(num_prefill_tokens=2, slot_mapping=torch.tensor([0, 1]), prefill_cu_seqlens_q=ints(0, 2),
                         prefill_seq_lens=ints(2), prefill_block_tables=ints(0)[None], decode_seq_lens=ints(),
                         decode_block_tables=torch.zeros(0, 1, dtype=torch.int32),
                         logits_indices=torch.tensor([1]), backend="torch")
    return torch.arange(2), batch, torch.zeros(2, 4, 1, 4), torch.zeros(2, 4, 1, 4)


def _scheduler(scheduler_class, preemption_functions, mode="recompute"):
    """A scheduler over 2 blocks of 4 tokens with one waiting request of 5 tokens."""
    from llmlab.cache.block_manager import BlockManager

    config = llmlab.EngineConfig(block_size=4, max_num_batched_tokens=16, preemption_mode=mode,
                                 enable_prefix_caching=False)
    scheduler = scheduler_class(config, BlockManager(2, 2, 4, False), 64, llmlab.policies.fcfs, (),
                                preemption_functions)
    scheduler.add(_request(5))
    return scheduler


def _full_scheduler(module, mode):
    """(llmlab's scheduler with `module`'s preemption, its one running request holding both
    blocks, the request, a Plan): the arguments of preempt / make_room for one more block."""
    scheduler = _scheduler(Scheduler, module, mode)
    scheduler.update(scheduler.schedule(now=0.0), [7])
    request = scheduler.running[0]
    return scheduler, request, request.num_tokens + 4, Plan()


def _swapped_back_in(module):
    """swap_in of a request llmlab's preemption swapped out."""
    scheduler, request, _, plan = _full_scheduler(preemption, "swap")
    preemption.preempt(scheduler, request, plan)
    return module.swap_in(scheduler, request, Plan())


class _Bytes:
    """A tokenizer whose every token is the byte b"a"."""
    def decode(self, token_ids, skip_special_tokens=True) -> str:
        return "a" * len(token_ids)


def _OutputTextOfSolution(module):
    """The module's OutputText over the solution's detokenizer: its add_token alone is called."""
    detokenizer = load("solutions", "ex14_detokenizer").IncrementalDetokenizer(_Bytes(), [0])
    return module.OutputText(detokenizer, ["x"])
