"""The 8-bit KV cache's kernels (int8 or fp8 codes, one fp32 scale per token and kv head):
store_kv quantizes as `llmlab.kernels.reference` does, prefill and decode attention over
codes + scales compute the reference's attention, and every 8-bit decode config of
q8_configs agrees (and every prefill config of prefill_configs, over bf16 caches too); the
`gpu` group repeats them at Llama-3-8B shapes on a CUDA device.

Every slot no sequence owns has a NaN scale and a code store_kv never writes (SENTINEL),
so a kernel that reads one returns NaN.
"""
import pytest
import torch

from llmlab import kernels
from llmlab.kernels import reference

from helpers.kernels import (BACKENDS, BF16_ATTENTION_TOL, CACHE_DTYPES, D, FP16_ATTENTION_TOL, H, HKV, NAN, SENTINEL,
                             assert_same_with_nans, gpu, paged_kv, prefill_lengths, ragged, randn_view, tolerance)

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


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 3), (8, 2)], ids=["gqa2", "gqa4"])
@pytest.mark.parametrize("lengths", ["ragged", "chunked"])
def test_dequantize_first_is_the_16bit_kernel_over_the_dequantized_cache(cache_dtype, num_heads, num_kv_heads,
                                                                         lengths):
    """A `-dq` prefill config over an 8-bit cache dequantizes the sequences' blocks into a
    scratch cache, then runs the 16-bit kernel: bit for bit what that kernel computes over
    codes x scales in float32 (unowned slots have NaN scales: any read of one shows). Past the
    scratch limit it converts in the kernel, as the other configs do."""
    from llmlab.kernels.triton import prefill_attention as triton_prefill
    from llmlab.kernels.triton.prefill_configs import PrefillConfig

    seq_lens, query_lens = prefill_lengths(lengths, 16)
    gen = torch.Generator().manual_seed(18)
    k_codes, k_scales, v_codes, v_scales, block_tables, k_clean, v_clean = quantized_paged_kv(
        seq_lens, 16, num_kv_heads, 64, CACHE_DTYPES[cache_dtype], gen)
    cu_seqlens_q = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    q = randn_view(sum(query_lens), num_heads, 64, dtype=torch.float32, gen=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    first, plain = PrefillConfig(64, 32, 4, 1, dequant_first=True), PrefillConfig(64, 32, 4, 1)
    actual = triton_prefill.prefill_attention(q, k_codes, v_codes, block_tables, cu_seqlens_q, lens, 0.125,
                                              k_scales, v_scales, config=first)
    k_full, v_full = reference.dequantize(k_codes, k_scales), reference.dequantize(v_codes, v_scales)
    expected = triton_prefill.prefill_attention(q, k_full, v_full, block_tables, cu_seqlens_q, lens, 0.125,
                                                config=plain)
    assert torch.equal(actual, expected)
    reference_out = reference.prefill_attention(q, k_codes, v_codes, block_tables, cu_seqlens_q, lens, 0.125,
                                                k_clean, v_clean)
    torch.testing.assert_close(actual, reference_out, **QUANT_FP32_TOL)
    limit, triton_prefill.DEQUANT_SCRATCH_MAX_BYTES = triton_prefill.DEQUANT_SCRATCH_MAX_BYTES, 0
    try:   # no scratch: the codes converted in the kernel
        fallback = triton_prefill.prefill_attention(q, k_codes, v_codes, block_tables, cu_seqlens_q, lens, 0.125,
                                                    k_scales, v_scales, config=first)
    finally:
        triton_prefill.DEQUANT_SCRATCH_MAX_BYTES = limit
    torch.testing.assert_close(fallback, reference_out, **QUANT_FP32_TOL)


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
@pytest.mark.slow
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
@pytest.mark.slow
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

    monkeypatch.setattr(kernels.knobs, "q8_decode", None)
    assert q8_config() == Q8_CONFIGS[DEFAULT_Q8_CONFIG]
    monkeypatch.setattr(kernels.knobs, "q8_decode", "cast-n64-w4-s2")   # LLMLAB_Q8_DECODE=cast-n64-w4-s2
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


# ----------------------------------------------------------------------------- GPU, Llama-3-8B shapes

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
@pytest.mark.parametrize("cache_dtype", ["bf16", "int8", "fp8"])
def test_gpu_prefill_attention_configs(cache_dtype):
    """Every prefill config (prefill_configs.py) compiled: tiles, warps, stages and packed
    heads the interpreter cannot check, bf16 queries at Llama-3-8B shapes, over a bf16 and
    both 8-bit caches; lengths off every tile and block size, chunks after cached context.
    The -dq configs' scratch (7 sequences x 1,026 table entries, 449 MiB) stays under its cap."""
    from llmlab.kernels.triton import prefill_attention as triton_prefill
    from llmlab.kernels.triton.prefill_configs import PREFILL_CONFIGS

    gen = torch.Generator().manual_seed(23)
    # whole prompts, chunks after cached context, and a 300-token chunk at 16k (#32: lengths 1 to 16k)
    seq_lens, query_lens = [1, 17, 300, 1000, 4100, 2100, 16400], [1, 17, 300, 129, 4100, 77, 300]
    if cache_dtype == "bf16":
        caches = paged_kv(seq_lens, 16, HKV, D, torch.bfloat16, gen, dev="cuda")
        scales = clean_scales = ()
    else:
        skip_unless_fp8_converts(cache_dtype)
        k_codes, k_scales, v_codes, v_scales, tables, k_clean, v_clean = [
            t.cuda() for t in quantized_paged_kv(seq_lens, 16, HKV, D, CACHE_DTYPES[cache_dtype], gen)]
        caches, scales = (k_codes, v_codes, tables), (k_scales, v_scales)
        clean_scales = (k_clean, v_clean)   # the reference reads whole blocks (quantized_paged_kv)
    cu_seqlens_q = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32).cuda()
    lens = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    q = randn_view(sum(query_lens), H, D, dtype=torch.bfloat16, gen=gen, dev="cuda")
    expected = reference.prefill_attention(q, *caches, cu_seqlens_q, lens, D ** -0.5, *clean_scales)
    for name in PREFILL_CONFIGS:
        actual = triton_prefill.prefill_attention(q, *caches, cu_seqlens_q, lens, D ** -0.5, *scales, config=name)
        torch.testing.assert_close(actual, expected, **BF16_ATTENTION_TOL, msg=name)


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


def test_the_default_8bit_variant_follows_the_steps_shape(monkeypatch):
    """Unnamed, the 8-bit decode variant is chosen per step: 16-token tiles where the batch
    alone gives >= 1,024 programs and no split is made, 32-token tiles elsewhere; a knob or an
    explicit name overrides the choice for every shape."""
    from llmlab.kernels.triton.q8_configs import (DEFAULT_Q8_CONFIG, SMALL_TILE_Q8_CONFIG, default_q8_config,
                                                  q8_config)

    monkeypatch.setattr(kernels.knobs, "q8_decode", None)
    assert default_q8_config(128, 8, 1) == SMALL_TILE_Q8_CONFIG      # 1,024 programs, whole contexts
    assert default_q8_config(256, 8, 1) == SMALL_TILE_Q8_CONFIG
    assert default_q8_config(127, 8, 1) == DEFAULT_Q8_CONFIG         # 1,016 programs
    assert default_q8_config(128, 8, 2) == DEFAULT_Q8_CONFIG         # split: 32-token tiles
    assert default_q8_config(64, 8, 1) == DEFAULT_Q8_CONFIG
    assert default_q8_config() == DEFAULT_Q8_CONFIG                  # no shape given
    assert q8_config(None, 128, 8, 1).name == SMALL_TILE_Q8_CONFIG
    assert q8_config("prmt-n128-w4-s2", 128, 8, 1).name == "prmt-n128-w4-s2"
    monkeypatch.setattr(kernels.knobs, "q8_decode", "gluon-n32-w1-s2")
    assert q8_config(None, 128, 8, 1).name == "gluon-n32-w1-s2"


def test_8bit_decode_splits_keep_about_500_tokens_each():
    """kernels.decode_num_splits for an 8-bit cache on 132 SMs: 8 programs per SM, >= 500
    tokens a split, rounded down to a power of two (one graph per count)."""
    assert kernels.decode_num_splits(64, 8, 512, 132, quantized=True) == 1
    assert kernels.decode_num_splits(64, 8, 1000, 132, quantized=True) == 2
    assert kernels.decode_num_splits(32, 8, 2000, 132, quantized=True) == 4
    assert kernels.decode_num_splits(64, 8, 4096, 132, quantized=True) == 2
    assert kernels.decode_num_splits(128, 8, 1000, 132, quantized=True) == 1
    assert kernels.decode_num_splits(64, 8, 4096, None, quantized=True) == 1   # not on a GPU
