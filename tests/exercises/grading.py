"""What every exercise test shares: loading exercises/ or solutions/, random inputs that
make out-of-bounds reads visible, and the end-to-end run of the embedded model.

On a machine without CUDA the Triton exercises run in Triton's interpreter, about a
millisecond per program instance, so the inputs are small and float32 only.
"""
from __future__ import annotations

import importlib
import math
import pathlib
import sys

import torch

import llmlab
from llmlab import kernels
from llmlab.kernels import reference

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
    that reads past an edge of the view gets NaN into its result."""
    base = torch.full([s + 1 for s in shape], NAN, device=DEVICE)
    view = base[tuple(slice(0, s) for s in shape)]
    view.copy_(torch.randn(shape, generator=gen))
    return view


def paged_kv(seq_lens, block_size, num_kv_heads, head_dim, gen, spare_blocks=3):
    """K/V caches holding random rows for each sequence's first seq_len tokens in shuffled
    blocks, and the block tables that find them. Every slot no sequence owns is NaN, and
    block 0 (where masked lanes of a careless kernel read) is never a sequence's."""
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, NAN), torch.full(shape, NAN)
    block_ids = (1 + torch.randperm(num_blocks - 1, generator=gen)).to(torch.int32)
    block_tables = torch.zeros((len(seq_lens), max(blocks_per_seq, default=0) + 1), dtype=torch.int32)
    used = 0
    for i, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[i, :n] = block_ids[used:used + n]
        used += n
        positions = torch.arange(seq_len)
        slots = block_tables[i, positions // block_size].long() * block_size + positions % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
    return k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE)


def assert_same_with_nans(actual, expected):
    """Equal values, and NaN in exactly the same places."""
    assert torch.equal(actual.isnan(), expected.isnan()), "NaN in different places"
    assert torch.equal(actual.nan_to_num(0.0), expected.nan_to_num(0.0))


# ----------------------------------------------------------------------------- decode attention

def ragged(block_size):
    """Context lengths around the block boundaries, and one 3.5 blocks long."""
    return [1, block_size - 1, block_size, block_size + 1, 7 * block_size // 2]


def check_decode_attention(ex, num_heads, num_kv_heads, head_dim, block_size, seq_lens, num_splits=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = paged_kv(seq_lens, block_size, num_kv_heads, head_dim, gen)
    q = randn_view(len(seq_lens), num_heads, head_dim, gen=gen)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    actual = ex.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits)
    # The reference reads whole blocks and masks afterwards (0 * NaN = NaN), so it gets the
    # caches with the unowned slots zeroed; the kernel must never read them at all.
    expected = reference.decode_attention(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0),
                                          block_tables, seq_lens, scale)
    torch.testing.assert_close(actual, expected, **FP32_TOL)


# ----------------------------------------------------------------------------- end to end

# Two prompts of different lengths in one batch: the first spans two KV blocks of 16.
PROMPTS = ["The capital of France is",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who"]
# Few tokens: under the interpreter every kernel call of the 30-layer model costs time.
GREEDY = llmlab.SamplingParams(max_tokens=3, temperature=0.0)


def generate_token_ids(llm, **overrides):
    """Greedy token ids for PROMPTS, with the given kernels plugged into the engine."""
    with kernels.override(**overrides):
        return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


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
    "ex10_chunked_prefill": [lambda m: m.schedule_chunks(1, [10], 8, 4)],
    "ex11_top_p": [lambda m: m.top_p_filter(torch.zeros(1, 4), 0.5)],
}
