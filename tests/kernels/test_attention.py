"""Both kernel backends compute what the pure-torch spec in `llmlab.kernels.reference` says:
the "torch" backend (fused torch ops) and the Triton kernels.

On a machine without CUDA the Triton kernels run in Triton's interpreter (slow, so the
parameter grids below are a representative cross-section, not the full product). The
`gpu` group repeats the checks with bf16/fp16 and Llama-3-8B shapes on a CUDA device.

Out-of-bounds reads are made visible: inputs are views into larger NaN-filled tensors,
and every cache slot that no sequence owns is NaN, so a kernel that reads one returns
NaN. store_kv's writes are compared over the whole (NaN-filled) cache, so a stray write
shows too.
"""
import pytest
import torch

from llmlab import kernels
from llmlab.kernels import reference
from llmlab.kernels.triton.decode_attention import choose_num_splits

from helpers.kernels import (BACKEND_DTYPES, BACKENDS, BF16_ATTENTION_TOL, CACHE_DTYPES, D, FP16_ATTENTION_TOL, FP32_TOL,
                             GPU_DTYPES, H, HKV, LLAMA3_SCALING, NAN, SENTINEL, assert_same_with_nans, gpu, paged_kv,
                             prefill_lengths, ragged, randn_view, tolerance)


# ----------------------------------------------------------------------------- elementwise

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


# ----------------------------------------------------------------------------- attention

GQA = pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (8, 2), (8, 1)],
                              ids=["mha", "gqa3", "gqa4", "gqa8"])


@pytest.mark.parametrize("lengths", ["ragged", "chunked"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@GQA
@BACKEND_DTYPES
def test_prefill_attention(backend, dtype, num_heads, num_kv_heads, head_dim, block_size, lengths):
    seq_lens, query_lens = prefill_lengths(lengths, block_size)
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache, block_tables = paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    cu_seqlens_q = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    q = randn_view(sum(query_lens), num_heads, head_dim, dtype=dtype, gen=gen)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    actual = kernels.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                       backend=backend)
    expected = reference.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    torch.testing.assert_close(actual, expected, **tolerance(dtype, attention=True))


@BACKENDS
def test_prefill_attention_empty_batch(backend):
    k_cache, v_cache, block_tables = paged_kv([], 16, 2, 64, torch.float32, torch.Generator())
    out = kernels.prefill_attention(torch.zeros(0, 4, 64), k_cache, v_cache, block_tables,
                                    torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                                    0.125, backend=backend)
    assert out.shape == (0, 4, 64)


def check_decode_attention(backend, dtype, num_heads, num_kv_heads, head_dim, block_size, seq_lens, num_splits):
    gen = torch.Generator().manual_seed(8)
    k_cache, v_cache, block_tables = paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    q = randn_view(len(seq_lens), num_heads, head_dim, dtype=dtype, gen=gen)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    actual = kernels.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits,
                                      backend=backend)
    # The reference reads whole blocks and masks afterwards (0 * NaN = NaN), so it gets
    # the caches with the unowned slots zeroed; the kernel must never read them at all.
    expected = reference.decode_attention(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0),
                                          block_tables, seq_lens, scale)
    torch.testing.assert_close(actual, expected, **tolerance(dtype, attention=True))


@pytest.mark.parametrize("num_splits", [1, 3], ids=["v1", "v2"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@GQA
@BACKEND_DTYPES
def test_decode_attention(backend, dtype, num_heads, num_kv_heads, head_dim, block_size, num_splits):
    check_decode_attention(backend, dtype, num_heads, num_kv_heads, head_dim, block_size, ragged(block_size), num_splits)


@BACKENDS
def test_decode_attention_more_splits_than_tiles(backend):
    """Splits past the end of a short sequence are empty and must weigh nothing."""
    check_decode_attention(backend, torch.float32, 4, 1, 128, 16, [1, 100], num_splits=5)


def test_torch_decode_attention_groups_sequences_by_length():
    """Short and long contexts in one batch: the torch backend gathers them in groups of
    similar length (each padded only to its own longest), out of batch order."""
    from llmlab.kernels.torch_backend import decode_groups

    seq_lens = [3, 700, 20, 1500, 64, 5, 900, 33]
    groups = decode_groups(seq_lens, 16)
    assert len(groups) > 1 and sorted(i for g in groups for i in g) == list(range(len(seq_lens)))
    check_decode_attention("torch", torch.float32, 6, 2, 64, 16, seq_lens, 1)


@pytest.mark.parametrize("num_splits", [0, None])
def test_decode_attention_chooses_splits(num_splits):
    check_decode_attention("triton", torch.float32, 3, 1, 64, 16, [5, 60], num_splits)


@BACKENDS
def test_decode_attention_empty_batch(backend):
    k_cache, v_cache, block_tables = paged_kv([], 16, 2, 64, torch.float32, torch.Generator())
    out = kernels.decode_attention(torch.zeros(0, 4, 64), k_cache, v_cache, block_tables,
                                   torch.zeros(0, dtype=torch.int32), 0.125, 1, backend=backend)
    assert out.shape == (0, 4, 64)


def test_choose_num_splits():
    assert choose_num_splits(64, 8, 4096) == 1         # 512 programs already fill 132 SMs 4 deep
    assert choose_num_splits(1, 8, 200) == 1           # short context: nothing worth splitting
    assert choose_num_splits(1, 8, 32768) > 8          # 8 programs would leave most SMs idle
    assert choose_num_splits(4, 8, 32768) < choose_num_splits(1, 8, 32768)
    assert choose_num_splits(0, 8, 4096) == 1
    assert choose_num_splits(64, 8, 4096, programs_per_sm=8, min_split_tokens=512) == 2  # the 8-bit kernel
    assert choose_num_splits(64, 8, 512, programs_per_sm=8, min_split_tokens=512) == 1   # splits more, in
    assert choose_num_splits(8, 8, 2048, programs_per_sm=8, min_split_tokens=512) == 4   # long ranges


# ----------------------------------------------------------------------------- quantized KV cache

# int8 through both backends; fp8 through torch alone (CACHE_DTYPES says why the interpreter cannot)
QUANT_BACKENDS = pytest.mark.parametrize("backend,cache_dtype", [("torch", "int8"), ("triton", "int8"), ("torch", "fp8")])
# The kernels take the reference's dequantized values in another order, (q . c) * s for
# q . (c * s) and sum (p * s) c for sum p (c * s): a few fp32 ulps of the products, which
# reach ~127 * sqrt(D) before scaling.
QUANT_FP32_TOL = dict(atol=2e-5, rtol=2e-5)


def quant_tolerance(dtype):
    return QUANT_FP32_TOL if dtype == torch.float32 else tolerance(dtype, attention=True)


def quantized_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, cache_dtype, gen):
    """paged_kv's caches quantized: (k codes, k scales, v codes, v scales, block tables).
    Every slot no sequence owns has a NaN scale and a code store_kv never writes, so a
    kernel that reads one gets NaN. Also returns the scales with those NaNs zeroed, for the
    reference (which reads whole blocks and masks afterwards, 0 * NaN = NaN)."""
    k_cache, v_cache, block_tables = paged_kv(seq_lens, block_size, num_kv_heads, head_dim, torch.float32, gen)
    out, clean_scales = [], []
    for cache in (k_cache, v_cache):
        unowned = cache.isnan().any(-1)                     # [num_blocks, block_size, Hkv]
        codes, scales = reference.quantize(cache.nan_to_num(0.0), cache_dtype)
        # (as bytes: torch cannot index-assign into fp8 tensors; 0x7f is e4m3's NaN)
        codes.view(torch.int8)[unowned] = torch.tensor(SENTINEL[cache_dtype]).to(cache_dtype).view(torch.int8)
        clean_scales.append(scales.masked_fill(unowned, 0.0))
        out += [codes, scales.masked_fill(unowned, NAN)]
    return (*out, block_tables, *clean_scales)


@BACKENDS
@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 64), (8, 128)])
def test_quantized_store_kv(backend, cache_dtype, dtype, num_kv_heads, head_dim):
    if backend == "triton" and cache_dtype == "fp8":
        pytest.skip("the interpreter's fp8 rounding is wrong (see CACHE_DTYPES); checked on a GPU")
    gen = torch.Generator().manual_seed(16)
    num_tokens, num_blocks, block_size = 9, 5, 16
    k = randn_view(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=gen) * 3
    v = randn_view(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    k[4, 0] = 0                                  # an all-zero row: a positive scale, zero codes
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 5]] = -1
    cache_dtype = CACHE_DTYPES[cache_dtype]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(shape, SENTINEL[cache_dtype]).to(cache_dtype) for _ in range(2)]
    scales = [torch.full(shape[:3], NAN) for _ in range(2)]
    expected = [t.clone() for t in caches + scales]
    assert kernels.store_kv(k, v, *caches, slots, *scales, backend=backend) is None
    reference.store_kv(k, v, expected[0], expected[1], slots, expected[2], expected[3])
    for actual, wanted in zip(caches + scales, expected):  # the interpreter does the same fp32 ops: exact
        assert_same_with_nans(actual.float(), wanted.float())


@QUANT_BACKENDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (8, 1)], ids=["gqa3", "gqa8"])
@pytest.mark.parametrize("lengths", ["ragged", "chunked"])
def test_quantized_prefill_attention(backend, cache_dtype, dtype, num_heads, num_kv_heads, lengths):
    seq_lens, query_lens = prefill_lengths(lengths, 16)
    gen = torch.Generator().manual_seed(17)
    k_codes, k_scales, v_codes, v_scales, block_tables, *_ = quantized_paged_kv(
        seq_lens, 16, num_kv_heads, 64, CACHE_DTYPES[cache_dtype], gen)
    cu_seqlens_q = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    q = randn_view(sum(query_lens), num_heads, 64, dtype=dtype, gen=gen)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    actual = kernels.prefill_attention(q, k_codes, v_codes, block_tables, cu_seqlens_q, seq_lens, 0.125,
                                       k_scales, v_scales, backend=backend)
    expected = reference.prefill_attention(q, k_codes, v_codes, block_tables, cu_seqlens_q, seq_lens, 0.125,
                                           k_scales, v_scales)
    torch.testing.assert_close(actual, expected, **quant_tolerance(dtype))


@QUANT_BACKENDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (8, 1)], ids=["gqa3", "gqa8"])
@pytest.mark.parametrize("num_splits", [1, 3], ids=["v1", "v2"])
def test_quantized_decode_attention(backend, cache_dtype, dtype, num_heads, num_kv_heads, num_splits):
    gen = torch.Generator().manual_seed(18)
    k_codes, k_scales, v_codes, v_scales, block_tables, k_clean, v_clean = quantized_paged_kv(
        ragged(16), 16, num_kv_heads, 64, CACHE_DTYPES[cache_dtype], gen)
    q = randn_view(5, num_heads, 64, dtype=dtype, gen=gen)
    seq_lens = torch.tensor(ragged(16), dtype=torch.int32)
    actual = kernels.decode_attention(q, k_codes, v_codes, block_tables, seq_lens, 0.125, num_splits,
                                      k_scales, v_scales, backend=backend)
    expected = reference.decode_attention(q, k_codes, v_codes, block_tables, seq_lens, 0.125, 1, k_clean, v_clean)
    torch.testing.assert_close(actual, expected, **quant_tolerance(dtype))


# The 8-bit decode kernel's conversions, each at the tile sizes it is run with (the
# interpreter ignores warps and stages), over lengths that end inside, at and just past a
# tile, in the block sizes the engine uses. fp16 queries take the fp16 dots of a GPU.
Q8_VARIANTS = ["legacy-n64-w4-s2", "cast-n64-w4-s2", "magic-n128-w4-s2",
               "packed-n64-w4-s2", "packed-n128-w4-s2", "packed-n256-w8-s1",
               "prmt-n128-w4-s2"]   # (on a CPU "prmt" runs "packed"'s Triton ops in place of its PTX)
Q8_LENGTHS = [1, 127, 129, 256, 280, 64]


@pytest.mark.parametrize("variant,block_size", [(variant, 16) for variant in Q8_VARIANTS] +
                         [("packed-n128-w4-s2", 32), ("packed-n256-w8-s1", 32)])
@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
def test_quantized_decode_attention_variants(variant, cache_dtype, block_size):
    from llmlab.kernels.triton.decode_attention import decode_attention

    gen = torch.Generator().manual_seed(23)
    k_codes, k_scales, v_codes, v_scales, block_tables, k_clean, v_clean = quantized_paged_kv(
        Q8_LENGTHS, block_size, 2, 64, CACHE_DTYPES[cache_dtype], gen)
    q = randn_view(len(Q8_LENGTHS), 6, 64, dtype=torch.float16, gen=gen)
    seq_lens = torch.tensor(Q8_LENGTHS, dtype=torch.int32)
    expected = reference.decode_attention(q, k_codes, v_codes, block_tables, seq_lens, 0.125, 1, k_clean, v_clean)
    for num_splits in (1, 2):
        actual = decode_attention(q, k_codes, v_codes, block_tables, seq_lens, 0.125, num_splits,
                                  k_scales, v_scales, q8_variant=variant)
        torch.testing.assert_close(actual, expected, **FP16_ATTENTION_TOL)


@pytest.mark.parametrize("variant", ["cast-n64-w4-s2", "packed-n128-w4-s2"])
def test_quantized_decode_attention_queries_beyond_fp16s_half_range(variant):
    """|q| > 2^15 would overflow the kernel's fp16 dots once multiplied out: it halves q
    exactly and doubles the scores instead."""
    from llmlab.kernels.triton.decode_attention import decode_attention

    gen = torch.Generator().manual_seed(24)
    k_codes, k_scales, v_codes, v_scales, block_tables, k_clean, v_clean = quantized_paged_kv(
        [40, 130], 16, 1, 64, torch.int8, gen)
    q = (torch.randn(2, 4, 64, generator=gen).clamp(-3, 3) * 20000).to(torch.float16)
    assert q.abs().max() > 2 ** 15
    seq_lens = torch.tensor([40, 130], dtype=torch.int32)
    scale = 1e-5  # logits of order 1 again
    actual = decode_attention(q, k_codes, v_codes, block_tables, seq_lens, scale, 1, k_scales, v_scales,
                              q8_variant=variant)
    expected = reference.decode_attention(q, k_codes, v_codes, block_tables, seq_lens, scale, 1, k_clean, v_clean)
    assert actual.isfinite().all()
    torch.testing.assert_close(actual, expected, **FP16_ATTENTION_TOL)


def test_q8_config_by_name_and_environment(monkeypatch):
    from llmlab.kernels.triton.q8_configs import DEFAULT_Q8_CONFIG, Q8_CONFIGS, q8_config

    monkeypatch.delenv("LLMLAB_Q8_DECODE", raising=False)
    assert q8_config() == Q8_CONFIGS[DEFAULT_Q8_CONFIG]
    monkeypatch.setenv("LLMLAB_Q8_DECODE", "cast-n64-w4-s2")
    assert q8_config().name == "cast-n64-w4-s2"
    assert q8_config("magic-n128-w4-s2").dequant == "magic"   # an explicit name wins
    with pytest.raises(ValueError, match="unknown 8-bit decode config"):
        q8_config("packed-n99-w4-s2")


def test_quantized_attention_is_the_attention_of_the_dequantized_cache():
    """The reference's definition, checked once: reading codes + scales is reading their product."""
    gen = torch.Generator().manual_seed(19)
    k_codes, _, v_codes, _, block_tables, k_scales, v_scales = quantized_paged_kv([5, 40], 16, 2, 64, torch.int8, gen)
    q = torch.randn(2, 4, 64, generator=gen)
    seq_lens = torch.tensor([5, 40], dtype=torch.int32)
    expected = reference.decode_attention(q, reference.dequantize(k_codes, k_scales),
                                          reference.dequantize(v_codes, v_scales), block_tables, seq_lens, 0.125)
    actual = reference.decode_attention(q, k_codes, v_codes, block_tables, seq_lens, 0.125, 1, k_scales, v_scales)
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_quantized_kernels_refuse_missing_or_stray_scales(backend):
    gen = torch.Generator().manual_seed(20)
    k_codes, k_scales, v_codes, v_scales, block_tables, *_ = quantized_paged_kv([5], 16, 2, 64, torch.int8, gen)
    float_cache = torch.zeros(k_codes.shape)
    lens, q = torch.tensor([5], dtype=torch.int32), torch.zeros(1, 2, 64)
    with pytest.raises(ValueError, match="needs k_scales and v_scales"):
        kernels.decode_attention(q, k_codes, v_codes, block_tables, lens, 0.125, backend=backend)
    with pytest.raises(ValueError, match="only int8/fp8 caches"):
        kernels.decode_attention(q, float_cache, float_cache, block_tables, lens, 0.125, 1, k_scales, v_scales,
                                 backend=backend)
    with pytest.raises(ValueError, match="one per token per kv head"):
        kernels.store_kv(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), k_codes, v_codes, torch.tensor([0]),
                         k_scales[..., :1], v_scales[..., :1], backend=backend)


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


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("seq_lens,query_lens", [
    ([4096], [4096]),                                   # one long prompt
    ([1, 15, 16, 17, 600, 2500], [1, 15, 16, 17, 600, 2500]),
    ([5000, 300, 1040], [512, 300, 17]),                # chunks after cached context
], ids=["4k", "ragged", "chunked"])
def test_gpu_prefill_attention(dtype, seq_lens, query_lens):
    gen = torch.Generator().manual_seed(13)
    k_cache, v_cache, block_tables = paged_kv(seq_lens, 16, HKV, D, dtype, gen, dev="cuda")
    cu_seqlens_q = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32).cuda()
    q = randn_view(sum(query_lens), H, D, dtype=dtype, gen=gen, dev="cuda")
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    actual = kernels.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, D ** -0.5,
                                       backend="triton")
    expected = reference.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, D ** -0.5)
    torch.testing.assert_close(actual, expected, **tolerance(dtype, attention=True))


@gpu
def test_gpu_fp32_attention():
    """fp32 takes other tile sizes on a GPU (and FMA dots, not tensor cores)."""
    gen = torch.Generator().manual_seed(15)
    seq_lens, query_lens = [1, 15, 16, 17, 300, 1000], [1, 15, 16, 5, 300, 64]
    k_cache, v_cache, block_tables = paged_kv(seq_lens, 16, HKV, D, torch.float32, gen, dev="cuda")
    cu_seqlens_q = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32).cuda()
    lens = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    q = randn_view(sum(query_lens), H, D, dtype=torch.float32, gen=gen, dev="cuda")
    torch.testing.assert_close(
        kernels.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, lens, D ** -0.5, backend="triton"),
        reference.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, lens, D ** -0.5), **FP32_TOL)
    q = randn_view(len(seq_lens), H, D, dtype=torch.float32, gen=gen, dev="cuda")
    expected = reference.decode_attention(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), block_tables, lens,
                                          D ** -0.5)
    for num_splits in (1, 4):
        actual = kernels.decode_attention(q, k_cache, v_cache, block_tables, lens, D ** -0.5, num_splits,
                                          backend="triton")
        torch.testing.assert_close(actual, expected, **FP32_TOL)


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("seq_lens", [[1, 15, 16, 17, 1000, 4096, 4100, 333], [32768], [9000, 20000]],
                         ids=["ragged", "32k", "two-long"])
@pytest.mark.parametrize("num_splits", [1, 7, None])
def test_gpu_decode_attention(dtype, seq_lens, num_splits):
    gen = torch.Generator().manual_seed(14)
    k_cache, v_cache, block_tables = paged_kv(seq_lens, 16, HKV, D, dtype, gen, dev="cuda")
    q = randn_view(len(seq_lens), H, D, dtype=dtype, gen=gen, dev="cuda")
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    actual = kernels.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, D ** -0.5, num_splits,
                                      backend="triton")
    expected = reference.decode_attention(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0),
                                          block_tables, seq_lens, D ** -0.5)
    torch.testing.assert_close(actual, expected, **tolerance(dtype, attention=True))



def skip_unless_fp8_converts(cache_dtype):
    if cache_dtype == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 e4m3 conversions need compute capability 8.9")


@gpu
@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
def test_gpu_quantized_store_kv(cache_dtype):
    skip_unless_fp8_converts(cache_dtype)
    gen = torch.Generator().manual_seed(21)
    num_tokens, num_blocks, block_size = 3000, 400, 16
    k = randn_view(num_tokens, HKV, D, dtype=torch.bfloat16, gen=gen, dev="cuda") * 3
    v = randn_view(num_tokens, HKV, D, dtype=torch.bfloat16, gen=gen, dev="cuda")
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].cuda()
    slots[::7] = -1
    cache_dtype = CACHE_DTYPES[cache_dtype]
    shape = (num_blocks, block_size, HKV, D)
    tensors = [torch.full(shape, SENTINEL[cache_dtype], device="cuda").to(cache_dtype) for _ in range(2)]
    tensors += [torch.full(shape[:3], NAN, device="cuda") for _ in range(2)]
    expected = [t.clone() for t in tensors]
    kernels.store_kv(k, v, tensors[0], tensors[1], slots, tensors[2], tensors[3], backend="triton")
    reference.store_kv(k, v, expected[0], expected[1], slots, expected[2], expected[3])
    for codes, scales, codes_ref, scales_ref in ((tensors[0], tensors[2], expected[0], expected[2]),
                                                 (tensors[1], tensors[3], expected[1], expected[3])):
        assert torch.equal(scales.isnan(), scales_ref.isnan())   # the same slots written, no others
        # the GPU's fp32 division is not IEEE-rounded: a scale may be an ulp off, and a code
        # that sits on a rounding boundary one step off (int8: 1; e4m3: 2^-3 relative)
        torch.testing.assert_close(scales, scales_ref, atol=0, rtol=1e-6, equal_nan=True)
        step = 1.0 if cache_dtype == torch.int8 else codes_ref.float().abs() * 2**-3 + 2**-9
        if torch.is_tensor(step):   # unwritten fp8 slots hold the NaN sentinel: any step there
            assert torch.equal(codes.float().isnan(), codes_ref.float().isnan())
            step = step.nan_to_num(float("inf"))
        assert ((codes.float() - codes_ref.float()).nan_to_num(0.0).abs() <= step).all()


@gpu
@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("num_splits", [1, 7, None])
def test_gpu_quantized_decode_and_prefill_attention(cache_dtype, num_splits):
    skip_unless_fp8_converts(cache_dtype)
    gen = torch.Generator().manual_seed(22)
    seq_lens = [1, 15, 16, 17, 1000, 4096, 4100, 333]
    k_codes, k_scales, v_codes, v_scales, block_tables, k_clean, v_clean = [
        t.cuda() for t in quantized_paged_kv(seq_lens, 16, HKV, D, CACHE_DTYPES[cache_dtype], gen)]
    lens = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    q = randn_view(len(seq_lens), H, D, dtype=torch.bfloat16, gen=gen, dev="cuda")
    actual = kernels.decode_attention(q, k_codes, v_codes, block_tables, lens, D ** -0.5, num_splits,
                                      k_scales, v_scales, backend="triton")
    expected = reference.decode_attention(q, k_codes, v_codes, block_tables, lens, D ** -0.5, 1, k_clean, v_clean)
    torch.testing.assert_close(actual, expected, **BF16_ATTENTION_TOL)
    if num_splits != 1:
        return
    query_lens = [1, 15, 16, 5, 1000, 512, 4100, 333]   # whole prompts and chunks after cached context
    cu_seqlens_q = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32).cuda()
    q = randn_view(sum(query_lens), H, D, dtype=torch.bfloat16, gen=gen, dev="cuda")
    actual = kernels.prefill_attention(q, k_codes, v_codes, block_tables, cu_seqlens_q, lens, D ** -0.5,
                                       k_scales, v_scales, backend="triton")
    expected = reference.prefill_attention(q, k_codes, v_codes, block_tables, cu_seqlens_q, lens, D ** -0.5,
                                           k_scales, v_scales)
    torch.testing.assert_close(actual, expected, **BF16_ATTENTION_TOL)


@gpu
@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
def test_gpu_quantized_decode_attention_variants(cache_dtype):
    """Every 8-bit decode config compiled (the bit tricks, tile shapes, warps and stages
    the interpreter cannot check), v1 and v2, bf16 queries at Llama-3-8B shapes."""
    from llmlab.kernels.triton.decode_attention import decode_attention
    from llmlab.kernels.triton.q8_configs import Q8_CONFIGS

    skip_unless_fp8_converts(cache_dtype)
    gen = torch.Generator().manual_seed(25)
    seq_lens = [1, 15, 16, 17, 127, 129, 1000, 4096, 4100, 333]
    k_codes, k_scales, v_codes, v_scales, block_tables, k_clean, v_clean = [
        t.cuda() for t in quantized_paged_kv(seq_lens, 16, HKV, D, CACHE_DTYPES[cache_dtype], gen)]
    lens = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    q = randn_view(len(seq_lens), H, D, dtype=torch.bfloat16, gen=gen, dev="cuda")
    expected = reference.decode_attention(q, k_codes, v_codes, block_tables, lens, D ** -0.5, 1, k_clean, v_clean)
    for name in Q8_CONFIGS:
        for num_splits in (1, 7):
            actual = decode_attention(q, k_codes, v_codes, block_tables, lens, D ** -0.5, num_splits,
                                      k_scales, v_scales, q8_variant=name)
            torch.testing.assert_close(actual, expected, **BF16_ATTENTION_TOL, msg=lambda m: f"{name}, {num_splits} splits: {m}")

