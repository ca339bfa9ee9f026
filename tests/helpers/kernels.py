"""What the kernel tests share: tolerances that say why they are that size, the backend x
dtype grid, and inputs that make out-of-bounds reads visible -- views into larger NaN-filled
tensors, and paged KV caches whose every slot no sequence owns is NaN. tests/exercises'
graders build their paged caches with the same `paged_kv`.
"""
import math

import pytest
import torch

NAN = float("nan")
LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}

# fp32 kernels do the reference's math in another order (dots in "ieee" precision), so
# they agree to a few fp32 ulps of values of order 1.
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
# 16-bit elementwise kernels round once where the reference rounds after every op:
# at most about two half-precision ulps apart (2^-10 relative each).
FP16_ELEMENTWISE_TOL = dict(atol=1e-3, rtol=2e-3)
# fp16 attention rounds the softmax probabilities to fp16 for the P @ V product
# (2^-11 relative each) and the output to fp16; outputs are averages of N(0, 1) values.
FP16_ATTENTION_TOL = dict(atol=3e-3, rtol=3e-3)
# bf16 has 8 significant bits (ulp 2^-7 at 1): the same roundings, 8x coarser.
BF16_ELEMENTWISE_TOL = dict(atol=1e-2, rtol=1.6e-2)
BF16_ATTENTION_TOL = dict(atol=2e-2, rtol=2e-2)
# The reference's rope rounds both products x * cos and rotate_half(x) * sin (up to ~5
# for N(0, 1) inputs) before adding them, so where the sum cancels it is off by up to
# ~1.5 ulps *of the products*: an absolute tolerance of two ulps at 4 (2^-8 in fp16).
FP16_ROPE_TOL = dict(atol=8e-3, rtol=2e-3)
BF16_ROPE_TOL = dict(atol=6.25e-2, rtol=1.6e-2)


def tolerance(dtype, attention=False, rope=False):
    if dtype == torch.float32:
        return FP32_TOL
    if rope:
        return FP16_ROPE_TOL if dtype == torch.float16 else BF16_ROPE_TOL
    if dtype == torch.float16:
        return FP16_ATTENTION_TOL if attention else FP16_ELEMENTWISE_TOL
    return BF16_ATTENTION_TOL if attention else BF16_ELEMENTWISE_TOL


# Both backends are checked on CPU: "torch" in every dtype, "triton" in the interpreter,
# which has no bf16.
BACKEND_DTYPES = pytest.mark.parametrize("backend,dtype", [
    (backend, dtype) for backend in ("torch", "triton")
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    if not (backend == "triton" and dtype == torch.bfloat16)],
    ids=lambda value: value if isinstance(value, str) else str(value).removeprefix("torch."))
BACKENDS = pytest.mark.parametrize("backend", ["torch", "triton"])


def randn_view(*shape, dtype, gen, dev="cpu"):
    """Random N(0, 1) values in a view of a NaN-filled tensor one longer in every dim, so
    a read past any edge of the view turns into NaN in the result."""
    base = torch.full([s + 1 for s in shape], NAN, dtype=dtype, device=dev)
    view = base[tuple(slice(0, s) for s in shape)]
    view.copy_(torch.randn(shape, generator=gen).to(dtype))
    return view


def paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen, dev="cpu", spare_blocks=3):
    """K/V caches holding random rows for each sequence's first seq_len tokens, in shuffled
    (non-contiguous) blocks, and the block tables that find them. Everything no sequence
    owns is NaN: spare blocks, slots past a sequence's end, and the table's padding
    entries, which point at block 0. Block 0 is always spare, because a kernel's masked
    lanes typically gather block 0: its contents must never reach the result."""
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, NAN, dtype=dtype)
    v_cache = torch.full(shape, NAN, dtype=dtype)
    block_ids = (1 + torch.randperm(num_blocks - 1, generator=gen)).to(torch.int32)
    max_blocks = max(blocks_per_seq, default=0) + 1  # at least one padding entry per row
    block_tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)
    used = 0
    for i, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[i, :n] = block_ids[used:used + n]
        used += n
        positions = torch.arange(seq_len)
        slots = block_tables[i, positions // block_size].long() * block_size + positions % block_size
        rows = (seq_len, num_kv_heads, head_dim)
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(rows, generator=gen).to(dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(rows, generator=gen).to(dtype)
    return k_cache.to(dev), v_cache.to(dev), block_tables.to(dev)


def assert_same_with_nans(actual, expected):
    """Equal values, and NaN in exactly the same places."""
    assert torch.equal(actual.isnan(), expected.isnan())
    assert torch.equal(actual.nan_to_num(0.0), expected.nan_to_num(0.0))

def ragged(block_size):
    """Context lengths around the block boundaries, and one ~3.5 blocks long."""
    return [1, block_size - 1, block_size, block_size + 1, 7 * block_size // 2]


def prefill_lengths(kind, block_size):
    """(seq_lens, query_lens). query_len == seq_len is a whole-prompt prefill; shorter is
    a chunk whose earlier context is already cached (chunked prefill, a prefix-cache hit);
    0 is a sequence with nothing to compute this step."""
    if kind == "ragged":
        return ragged(block_size), ragged(block_size)
    # 70 queries after 33 cached tokens: two query tiles, whose causal diagonals end one
    # key past a KV-tile edge (33 = 1 mod 32) -- where an off-by-one in the bound shows.
    return [block_size + 3, 33 + 70, 2 * block_size, 5], [3, 70, 0, 5]


# int8 and fp8 (e4m3) KV caches. Triton's interpreter rounds fp32 -> fp8 wrongly where the
# rounding carries into the exponent (-125.8 becomes -64, not -128), so on a CPU fp8 runs
# through the torch backend and Triton's fp8 path is checked on a GPU.
CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# What store_kv never writes: int8 codes are in [-127, 127]; fp8 codes are finite.
SENTINEL = {torch.int8: -128, torch.float8_e4m3fn: NAN}


def gpu(test):
    """Marks a test `gpu` (select with `pytest -m gpu`) and skips it without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


GPU_DTYPES = [torch.bfloat16, torch.float16]
# Llama-3-8B: 32 query heads, 8 kv heads, head_dim 128, hidden 4096, intermediate 14336.
H, HKV, D = 32, 8, 128
