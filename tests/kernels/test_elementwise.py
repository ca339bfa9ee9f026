"""rms_norm, rope, silu_mul and store_kv: both kernel backends compute what the pure-torch
spec in `llmlab.kernels.reference` says -- the "torch" backend (fused torch ops) and the
Triton kernels, which on a machine without CUDA run in Triton's interpreter. The `gpu` group
repeats the checks with bf16/fp16 and Llama-3-8B shapes on a CUDA device.

Inputs are views into larger NaN-filled tensors, so a kernel that reads past an edge
returns NaN; store_kv's writes are compared over the whole (NaN-filled) cache, so a stray
write shows too.
"""
import pytest
import torch

from llmlab import kernels
from llmlab.kernels import reference

from helpers.kernels import (BACKEND_DTYPES, BACKENDS, D, FP32_TOL, GPU_DTYPES, H, HKV, LLAMA3_SCALING, NAN,
                             assert_same_with_nans, gpu, randn_view, tolerance)


@BACKEND_DTYPES
@pytest.mark.parametrize("hidden_size", [576, 1024])  # SmolLM2's non-power-of-two size, and a power of two
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(backend, dtype, hidden_size, with_residual):
    gen = torch.Generator().manual_seed(0)
    x = randn_view(7, hidden_size, dtype=dtype, gen=gen)
    weight = randn_view(hidden_size, dtype=dtype, gen=gen)
    residual = randn_view(7, hidden_size, dtype=dtype, gen=gen) if with_residual else None
    actual = kernels.rms_norm(x, weight, 1e-5, residual, backend=backend)
    expected = reference.rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        torch.testing.assert_close(actual[1], expected[1], atol=0, rtol=0)  # one rounding of x + residual
        actual, expected = actual[0], expected[0]
    torch.testing.assert_close(actual, expected, **tolerance(dtype))


@BACKENDS
def test_rms_norm_leading_dims_and_empty(backend):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 64, generator=gen)
    weight = torch.randn(64, generator=gen)
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6, backend=backend),
                               reference.rms_norm(x, weight, 1e-6), **FP32_TOL)
    assert kernels.rms_norm(x[:0, 0], weight, 1e-6, backend=backend).shape == (0, 64)


@BACKEND_DTYPES
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (32, 8, 128)])
@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["plain", "llama3"])
def test_rope(backend, dtype, num_heads, num_kv_heads, head_dim, scaling):
    gen = torch.Generator().manual_seed(2)
    num_tokens = 32
    q = randn_view(num_tokens, num_heads, head_dim, dtype=dtype, gen=gen)
    k = randn_view(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    # 0 and 1, and positions far past LLaMA-3's original 8192, where the scaling matters
    positions = torch.cat([torch.tensor([0, 1]), torch.randint(0, 131072, (num_tokens - 2,), generator=gen)])
    theta = 500000.0
    actual = kernels.rope(q, k, positions, theta, scaling, backend=backend)
    expected = reference.rope(q, k, positions, theta, scaling)
    torch.testing.assert_close(actual[0], expected[0], **tolerance(dtype, rope=True))
    torch.testing.assert_close(actual[1], expected[1], **tolerance(dtype, rope=True))


@pytest.mark.slow
def test_rope_inplace_and_empty():
    from llmlab.kernels.triton.rope import rope
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(4, 6 + 2 * 2, 64, generator=gen)  # a fused projection's output, split by views
    q, k = qkv[:, :6], qkv[:, 6:8]
    expected = reference.rope(q, k, torch.arange(4), 10000.0)
    rope(q, k, torch.arange(4), 10000.0, inplace=True)
    torch.testing.assert_close(q, expected[0], **FP32_TOL)
    torch.testing.assert_close(k, expected[1], **FP32_TOL)
    for backend in ("torch", "triton"):
        empty_q, empty_k = kernels.rope(q[:0], k[:0], torch.arange(0), 10000.0, backend=backend)
        assert empty_q.shape == (0, 6, 64) and empty_k.shape == (0, 2, 64)


@BACKEND_DTYPES
@pytest.mark.parametrize("n", [300, 2048 + 5])  # under one block; two blocks with a ragged tail
def test_silu_mul(backend, dtype, n):
    gen = torch.Generator().manual_seed(4)
    x = randn_view(6, 2 * n, dtype=dtype, gen=gen) * 3  # gates well into silu's curved part
    torch.testing.assert_close(kernels.silu_mul(x, backend=backend), reference.silu_mul(x), **tolerance(dtype))


@BACKENDS
def test_silu_mul_leading_dims_and_empty(backend):
    x = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(kernels.silu_mul(x, backend=backend), reference.silu_mul(x), **FP32_TOL)
    assert kernels.silu_mul(x[:0], backend=backend).shape == (0, 3, 20)


@BACKEND_DTYPES
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 64), (8, 128)])
def test_store_kv(backend, dtype, block_size, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(6)
    num_tokens, num_blocks = 9, 5
    k = randn_view(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    v = randn_view(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 5]] = -1  # padding tokens write nothing
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, NAN, dtype=dtype), torch.full(shape, NAN, dtype=dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    assert kernels.store_kv(k, v, k_cache, v_cache, slots, backend=backend) is None
    reference.store_kv(k, v, k_expected, v_expected, slots)
    assert_same_with_nans(k_cache, k_expected)  # a copy: bit-exact, and nothing else touched
    assert_same_with_nans(v_cache, v_expected)


@BACKENDS
def test_store_kv_empty(backend):
    cache = torch.zeros(2, 16, 2, 64)
    kernels.store_kv(torch.zeros(0, 2, 64), torch.zeros(0, 2, 64), cache, cache.clone(),
                     torch.zeros(0, dtype=torch.int64), backend=backend)


# ----------------------------------------------------------------------------- GPU, 16-bit, large

@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("hidden_size", [4096, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gpu_rms_norm(dtype, hidden_size, with_residual):
    gen = torch.Generator().manual_seed(10)
    x = randn_view(1000, hidden_size, dtype=dtype, gen=gen, dev="cuda")
    weight = randn_view(hidden_size, dtype=dtype, gen=gen, dev="cuda")
    residual = randn_view(1000, hidden_size, dtype=dtype, gen=gen, dev="cuda") if with_residual else None
    actual = kernels.rms_norm(x, weight, 1e-5, residual, backend="triton")
    expected = reference.rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        torch.testing.assert_close(actual[1], expected[1], atol=0, rtol=0)
        actual, expected = actual[0], expected[0]
    torch.testing.assert_close(actual, expected, **tolerance(dtype))


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_rope(dtype):
    gen = torch.Generator().manual_seed(11)
    num_tokens = 2048
    q = randn_view(num_tokens, H, D, dtype=dtype, gen=gen, dev="cuda")
    k = randn_view(num_tokens, HKV, D, dtype=dtype, gen=gen, dev="cuda")
    positions = torch.randint(0, 131072, (num_tokens,), generator=gen).cuda()  # large angles: needs accurate cos/sin
    actual = kernels.rope(q, k, positions, 500000.0, LLAMA3_SCALING, backend="triton")
    expected = reference.rope(q, k, positions, 500000.0, LLAMA3_SCALING)
    torch.testing.assert_close(actual[0], expected[0], **tolerance(dtype, rope=True))
    torch.testing.assert_close(actual[1], expected[1], **tolerance(dtype, rope=True))


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_silu_mul_and_store_kv(dtype):
    gen = torch.Generator().manual_seed(12)
    x = randn_view(1000, 2 * 14336, dtype=dtype, gen=gen, dev="cuda") * 3
    torch.testing.assert_close(kernels.silu_mul(x, backend="triton"), reference.silu_mul(x), **tolerance(dtype))
    num_tokens, num_blocks, block_size = 3000, 400, 16
    k = randn_view(num_tokens, HKV, D, dtype=dtype, gen=gen, dev="cuda")
    v = randn_view(num_tokens, HKV, D, dtype=dtype, gen=gen, dev="cuda")
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].cuda()
    slots[::7] = -1
    k_cache = torch.full((num_blocks, block_size, HKV, D), NAN, dtype=dtype, device="cuda")
    v_cache = torch.full_like(k_cache, NAN)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    kernels.store_kv(k, v, k_cache, v_cache, slots, backend="triton")
    reference.store_kv(k, v, k_expected, v_expected, slots)
    assert_same_with_nans(k_cache, k_expected)
    assert_same_with_nans(v_cache, v_expected)
