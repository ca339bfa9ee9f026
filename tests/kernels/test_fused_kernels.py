"""The fused kernels compute what the composition of the reference kernels they replace
computes, and the model still runs a kernel a student plugs in for one of the parts.

rope_store_kv = rope, then store_kv of the rotated keys and the values. Inputs are views
of a fused qkv projection inside a NaN-padded tensor (as the model hands them over, strided),
caches are NaN wherever no token is written, and token counts are not multiples of the
block size; int8 caches too (fp8 through the torch backend: the interpreter's fp8 rounding
is wrong, see helpers/kernels.py's CACHE_DTYPES; Triton's fp8 path is checked on a GPU).
"""
import pytest
import torch

from llmlab import SamplingParams, kernels
from llmlab.bench.launches import count_launches, decode_step, per_layer, random_engine, unfused
from llmlab.kernels import reference

from helpers.engine import run_all
from helpers.kernels import (BACKEND_DTYPES, CACHE_DTYPES, FP32_TOL, LLAMA3_SCALING, NAN, SENTINEL, assert_same_with_nans,
                             gpu, tolerance)


def qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, gen, dev="cpu"):
    """q [T, H, D], k and v [T, Hkv, D]: views of one [T, (H + 2 Hkv) D] projection output
    inside a NaN tensor one row and one column larger (a read past an edge gives NaN)."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    base = torch.full((num_tokens + 1, width + 1), NAN, dtype=dtype, device=dev)
    qkv = base[:num_tokens, :width]
    qkv.copy_(torch.randn(num_tokens, width, generator=gen).to(dtype))
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim))


def slots_and_positions(num_tokens, num_blocks, block_size, gen, dev="cpu"):
    """Distinct random cache slots, two of them padding (-1), and positions up to LLaMA-3.1's
    scaled range."""
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[1, num_tokens - 2]] = -1   # padding tokens store nothing (their q still rotates)
    positions = torch.cat([torch.tensor([0, 1]), torch.randint(0, 131072, (num_tokens - 2,), generator=gen)])
    return slots.to(dev), positions.to(dev)


def reference_composition(q, k, v, positions, theta, scaling, caches):
    """What rope_store_kv must compute: the reference rope, then the reference store_kv."""
    rotated_q, rotated_k = reference.rope(q, k, positions, theta, scaling)
    reference.store_kv(rotated_k, v, *caches)
    return rotated_q


@BACKEND_DTYPES
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["plain", "llama3"])
def test_rope_store_kv_is_rope_then_store_kv(backend, dtype, num_heads, num_kv_heads, head_dim, block_size, scaling):
    gen = torch.Generator().manual_seed(30)
    num_tokens, num_blocks = 21, 3     # 19 stored tokens over 3 blocks: not a multiple of the block size
    q, k, v = qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, gen)
    slots, positions = slots_and_positions(num_tokens, num_blocks, block_size, gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(shape, NAN, dtype=dtype) for _ in range(2)]
    expected_caches = [c.clone() for c in caches]
    expected_q = reference_composition(q, k, v, positions, 500000.0, scaling, expected_caches + [slots])
    rotated_q = kernels.rope_store_kv(q, k, v, positions, 500000.0, scaling, *caches, slots, backend=backend)
    tol = tolerance(dtype, rope=True)
    torch.testing.assert_close(rotated_q, expected_q, **tol)
    # the same slots written and no others (NaN elsewhere), with the rotated keys ...
    torch.testing.assert_close(caches[0], expected_caches[0], equal_nan=True, **tol)
    # ... and the values, copied exactly
    assert_same_with_nans(caches[1], expected_caches[1])


@pytest.mark.parametrize("backend,cache_dtype", [("torch", "int8"), ("triton", "int8"), ("torch", "fp8")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
def test_quantized_rope_store_kv(backend, cache_dtype, dtype, num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(31)
    num_tokens, num_blocks, block_size = 21, 3, 16
    q, k, v = qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, gen)
    k[4, 0] = 0                                   # an all-zero row: a positive scale, zero codes
    slots, positions = slots_and_positions(num_tokens, num_blocks, block_size, gen)
    cache_dtype = CACHE_DTYPES[cache_dtype]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    tensors = [torch.full(shape, SENTINEL[cache_dtype]).to(cache_dtype) for _ in range(2)]
    tensors += [torch.full(shape[:3], NAN) for _ in range(2)]
    expected = [t.clone() for t in tensors]
    expected_q = reference_composition(q, k, v, positions, 500000.0, LLAMA3_SCALING,
                                       [expected[0], expected[1], slots, expected[2], expected[3]])
    rotated_q = kernels.rope_store_kv(q, k, v, positions, 500000.0, LLAMA3_SCALING, tensors[0], tensors[1], slots,
                                      tensors[2], tensors[3], backend=backend)
    torch.testing.assert_close(rotated_q, expected_q, **tolerance(dtype, rope=True))
    # values are not rotated: their codes and scales are the reference's exactly
    assert_same_with_nans(tensors[1].float(), expected[1].float())
    assert_same_with_nans(tensors[3], expected[3])
    # keys: rotated as rope rotates them (a rope tolerance apart), then quantized. A row's
    # scale is its absmax / qmax, so it moves by the rope tolerance; a code near a rounding
    # boundary may move one step (int8: 1; e4m3: 2^-3 relative, its mantissa step)
    k_scales, expected_scales = tensors[2], expected[2]
    assert torch.equal(k_scales.isnan(), expected_scales.isnan())
    rope_tol = tolerance(dtype, rope=True)
    torch.testing.assert_close(k_scales, expected_scales, atol=rope_tol["atol"] / 127, rtol=rope_tol["rtol"],
                               equal_nan=True)
    codes, wanted = tensors[0].float(), expected[0].float()
    assert torch.equal(codes.isnan(), wanted.isnan())
    step = 1.0 if cache_dtype == torch.int8 else (wanted.abs() * 2**-3 + 2**-9).nan_to_num(float("inf"))
    assert ((codes - wanted).nan_to_num(0.0).abs() <= step).all()


@pytest.mark.slow
def test_triton_rope_store_kv_is_bit_exact_with_the_triton_pair():
    """The interpreter does the same fp32 ops fused as apart: the same bits, int8 codes included."""
    gen = torch.Generator().manual_seed(32)
    q, k, v = qkv_views(13, 9, 3, 64, torch.float16, gen)
    slots, positions = slots_and_positions(13, 2, 16, gen)
    for cache_dtype in (torch.float16, torch.int8):
        shape = (2, 16, 3, 64)
        fused = [torch.zeros(shape, dtype=cache_dtype) for _ in range(2)]
        pair = [torch.zeros(shape, dtype=cache_dtype) for _ in range(2)]
        scales = [] if cache_dtype == torch.float16 else [torch.zeros(shape[:3]) for _ in range(4)]
        fused_q = kernels.rope_store_kv(q, k, v, positions, 10000.0, None, *fused, slots, *scales[:2],
                                        backend="triton")
        pair_q, pair_k = kernels.rope(q, k, positions, 10000.0, backend="triton")
        kernels.store_kv(pair_k, v, *pair, slots, *scales[2:], backend="triton")
        assert torch.equal(fused_q, pair_q)
        for a, b in zip(fused + scales[:2], pair + scales[2:]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_rope_store_kv_empty_batch(backend):
    cache = torch.zeros(2, 16, 2, 64)
    q = kernels.rope_store_kv(torch.zeros(0, 4, 64), torch.zeros(0, 2, 64), torch.zeros(0, 2, 64),
                              torch.zeros(0, dtype=torch.int64), 10000.0, None, cache, cache.clone(),
                              torch.zeros(0, dtype=torch.int64), backend=backend)
    assert q.shape == (0, 4, 64)


# ---- rope_store_decode_attention: a decode step's rope, store and attention in one -----------

def decode_step_inputs(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, gen, dev="cpu",
                       padding=()):
    """A decode step's inputs: q, k, v views of a NaN-padded qkv output (one row per
    sequence), caches NaN except the first seq_len - 1 tokens of each sequence (in shuffled
    blocks), the slot and position of each sequence's newest token (slot -1 for rows in
    `padding`, as the CUDA graphs pad a batch), block tables and seq_lens."""
    num_seqs = len(seq_lens)
    q, k, v = qkv_views(num_seqs, num_heads, num_kv_heads, head_dim, dtype, gen, dev)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    width = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + 1
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(num_seqs, width, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(shape, NAN, dtype=dtype) for _ in range(2)]
    slots, positions = [], []
    for i, n in enumerate(seq_lens):
        tables[i, :blocks_per_seq[i]] = torch.tensor(order[:blocks_per_seq[i]], dtype=torch.int32)
        order = order[blocks_per_seq[i]:]
        slot_of = [int(tables[i, t // block_size]) * block_size + t % block_size for t in range(n)]
        old = torch.tensor(slot_of[:-1], dtype=torch.int64)
        reference.store_kv(torch.randn(n - 1, num_kv_heads, head_dim, generator=gen).to(dtype),
                           torch.randn(n - 1, num_kv_heads, head_dim, generator=gen).to(dtype), *caches, old)
        slots.append(-1 if i in padding else slot_of[-1])
        positions.append(n - 1)
    as_dev = lambda t: t.to(dev)   # noqa: E731
    return (q, k, v, as_dev(torch.tensor(positions)), [as_dev(c) for c in caches], as_dev(torch.tensor(slots)),
            as_dev(tables), as_dev(torch.tensor(seq_lens, dtype=torch.int32)))


def check_fused_decode(backend, dtype, seq_lens, heads, block_size, num_splits, scaling, gen, dev="cpu",
                       padding=()):
    num_heads, num_kv_heads, head_dim = heads
    q, k, v, positions, caches, slots, tables, lens = decode_step_inputs(
        seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, gen, dev, padding)
    expected_caches = [c.clone() for c in caches]
    scale = head_dim ** -0.5
    expected = reference.rope_store_decode_attention(q, k, v, positions, 500000.0, scaling, *expected_caches,
                                                     slots, tables, lens, scale, num_splits)
    got = kernels.rope_store_decode_attention(q, k, v, positions, 500000.0, scaling, *caches, slots, tables, lens,
                                              scale, num_splits, backend=backend)
    real = [i for i in range(len(seq_lens)) if i not in padding]   # a padding row's output is not used
    torch.testing.assert_close(got[real], expected[real], **tolerance(dtype, attention=True))
    assert not got[real].isnan().any()
    # the new tokens' rows written, rotated keys within rope's tolerance, values exactly; nothing else
    torch.testing.assert_close(caches[0], expected_caches[0], equal_nan=True, **tolerance(dtype, rope=True))
    assert_same_with_nans(caches[1], expected_caches[1])


@BACKEND_DTYPES
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads,block_size", [((8, 2, 64), 16), ((4, 4, 128), 32)], ids=["gqa4-d64", "mha-d128-b32"])
def test_rope_store_decode_attention_is_rope_store_kv_then_decode_attention(backend, dtype, num_splits, heads,
                                                                            block_size):
    """Lengths 1, a block, a block + 1, 2 blocks + 8 (the newest token first in a block, last
    in one, and in a tile's middle), a padding row; with splits, some empty, and the newest
    token in the last split's range."""
    gen = torch.Generator().manual_seed(33)
    check_fused_decode(backend, dtype, [1, block_size, block_size + 1, 2 * block_size + 8, 5], heads, block_size,
                       num_splits, None, gen, padding=(4,))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rope_store_decode_attention_llama3_scaling_long_positions(backend):
    gen = torch.Generator().manual_seed(34)
    check_fused_decode(backend, torch.float32, [70, 33, 2], (8, 2, 64), 16, 2, LLAMA3_SCALING, gen)


@pytest.mark.slow
def test_rope_store_decode_attention_quantized_cache_runs_the_pair():
    """int8: the fused path is full precision only; the Triton entry point runs the pair,
    which gives what the pair gives, bit for bit."""
    gen = torch.Generator().manual_seed(35)
    q, k, v, positions, caches, slots, tables, lens = decode_step_inputs([3, 20], 4, 2, 64, 16, torch.float16, gen)
    shape = caches[0].shape
    tensors = [torch.zeros(shape, dtype=torch.int8) for _ in range(2)] + [torch.ones(shape[:3]) for _ in range(2)]
    pair = [t.clone() for t in tensors]
    got = kernels.rope_store_decode_attention(q, k, v, positions, 10000.0, None, tensors[0], tensors[1], slots,
                                              tables, lens, 0.125, 1, tensors[2], tensors[3], backend="triton")
    rotated = kernels.rope_store_kv(q, k, v, positions, 10000.0, None, pair[0], pair[1], slots, pair[2], pair[3],
                                    backend="triton")
    expected = kernels.decode_attention(rotated, pair[0], pair[1], tables, lens, 0.125, 1, pair[2], pair[3],
                                        backend="triton")
    assert torch.equal(got, expected)
    for a, b in zip(tensors, pair):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_rope_store_decode_attention_empty_batch(backend):
    cache = torch.zeros(2, 16, 2, 64)
    out = kernels.rope_store_decode_attention(
        torch.zeros(0, 4, 64), torch.zeros(0, 2, 64), torch.zeros(0, 2, 64), torch.zeros(0, dtype=torch.int64),
        10000.0, None, cache, cache.clone(), torch.zeros(0, dtype=torch.int64), torch.zeros(0, 1, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32), 0.125, backend=backend)
    assert out.shape == (0, 4, 64)


@gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_rope_store_decode_attention_gpu_llama3_shape(num_splits):
    """bf16, Llama-3-8B heads, the shipped tiles (64 tokens): lengths around tile and block edges."""
    gen = torch.Generator().manual_seed(36)
    check_fused_decode("triton", torch.bfloat16, [1, 63, 64, 65, 513, 1000, 17, 4097], (32, 8, 128), 16,
                       num_splits, LLAMA3_SCALING, gen, dev="cuda", padding=(6,))


# ---- the model and overrides -------------------------------------------------------------

def spy(calls, name, kernel):
    def call(*args):
        calls.append(name)
        return kernel(*args)
    return call


@pytest.mark.parametrize("overridden", ["rope", "store_kv", "rope_store_kv"])
def test_model_runs_an_overridden_part(llm, overridden):
    """A kernel plugged in for rope or store_kv (an exercise) is called by every layer, with
    the other half of the pair beside it; one plugged in for the fused kernel replaces it."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = "The capital of France is"
    expected = llm.generate(prompt, params)[0].token_ids
    calls = []
    fused = spy(calls, "rope_store_kv", kernels.get_kernel("rope_store_kv", "torch"))
    watch = {name: spy(calls, name, kernels.get_kernel(name, "torch")) for name in ("rope", "store_kv")}
    with kernels.override(**{overridden: watch.get(overridden, fused)}):
        got = llm.generate(prompt, params)[0].token_ids
    assert got == expected
    layers_run = 2 * llm.engine.model_config.num_layers      # a prefill and a decode step
    assert calls == [overridden] * layers_run


def test_model_calls_the_fused_kernel_and_not_the_pair(llm):
    calls = []
    original = {name: kernels.get_kernel(name, "torch") for name in ("rope", "store_kv", "rope_store_kv")}
    # installed through the same hook exercises use, but all three at once: the fused one wins
    with kernels.override(**{name: spy(calls, name, fn) for name, fn in original.items()}):
        llm.generate("Hello", SamplingParams(max_tokens=1, temperature=0.0))
    assert set(calls) == {"rope_store_kv"}


@pytest.mark.slow
def test_greedy_tokens_with_the_triton_pair_and_fused():
    """Triton kernels (the interpreter here), prefill and decode: fused or unfused, the same
    greedy tokens (tests/engine/test_engine.py checks the fused path against the torch backend on
    the embedded model)."""
    engine = random_engine("small", 2, [2], 40, "triton")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 300, 2, 9, 44, 1000, 7, 7], [3, 1, 4, 1, 5, 9, 2, 6]]
    fused = [o.token_ids for o in run_all(engine, prompts, params)]
    with unfused("triton"):
        pair = [o.token_ids for o in run_all(engine, prompts, params)]
    assert fused == pair and all(len(t) == 4 for t in fused)


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.slow
def test_a_decode_step_launches_two_kernels_fewer_per_layer(batch_size):
    """Counted on the Triton backend (the GPU's launch sequence): a decode step without
    flash-decoding splits runs rope,
    store_kv and attention as one launch per layer -- one fewer than rope_store_kv followed by
    decode_attention (what the model runs while decode_attention is overridden), two fewer than
    the unfused rope + store_kv pair -- and no layer copies q, k or v out of the qkv output."""
    engine = random_engine("small", 3, [batch_size], 40, "triton")
    step = decode_step(engine, batch_size, 40, num_splits=1)   # split steps run rope_store_kv apart
    step()
    with count_launches() as fused:
        step()
    with kernels.override(decode_attention=kernels.get_kernel("decode_attention", "triton")):
        with count_launches() as apart:
            step()
    with unfused("triton"):
        with count_launches() as pair:
            step()
    fused_layer, apart_layer, pair_layer = per_layer(fused, 3), per_layer(apart, 3), per_layer(pair, 3)
    assert len(fused) == len(apart) - 3 == len(pair) - 6
    assert fused_layer["per_layer_total"] == apart_layer["per_layer_total"] - 1 == pair_layer["per_layer_total"] - 2
    assert fused_layer["per_layer"].count("decode_attention") == 1
    assert not {"rope", "store_kv", "rope_store_kv"} & set(fused_layer["per_layer"])
    assert apart_layer["per_layer"].count("rope_store_kv") == 1
    assert not {"clone", "copy_", "contiguous", "_to_copy"} & set(fused_layer["per_layer"])


# ---- GPU, 16-bit, Llama-3-8B shapes -----------------------------------------------------------

H, HKV, D = 32, 8, 128


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache_dtype", [None, "int8", "fp8"])
def test_gpu_rope_store_kv(dtype, cache_dtype):
    if cache_dtype == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 e4m3 conversions need compute capability 8.9")
    gen = torch.Generator().manual_seed(33)
    num_tokens, num_blocks, block_size = 3001, 400, 16
    q, k, v = qkv_views(num_tokens, H, HKV, D, dtype, gen, dev="cuda")
    slots, positions = slots_and_positions(num_tokens, num_blocks, block_size, gen, dev="cuda")
    shape = (num_blocks, block_size, HKV, D)
    if cache_dtype is None:
        tensors = [torch.full(shape, NAN, dtype=dtype, device="cuda") for _ in range(2)]
    else:
        code_dtype = CACHE_DTYPES[cache_dtype]
        tensors = [torch.full(shape, SENTINEL[code_dtype], device="cuda").to(code_dtype) for _ in range(2)]
        tensors += [torch.full(shape[:3], NAN, device="cuda") for _ in range(2)]
    expected = [t.clone() for t in tensors]
    tol = tolerance(dtype, rope=True)
    rotated_q = kernels.rope_store_kv(q, k, v, positions, 500000.0, LLAMA3_SCALING, tensors[0], tensors[1], slots,
                                      *tensors[2:], backend="triton")
    expected_q, expected_k = reference.rope(q, k, positions, 500000.0, LLAMA3_SCALING)
    torch.testing.assert_close(rotated_q, expected_q, **tol)
    if cache_dtype is None:
        reference.store_kv(expected_k, v, expected[0], expected[1], slots)
        torch.testing.assert_close(tensors[0], expected[0], equal_nan=True, **tol)
        assert_same_with_nans(tensors[1], expected[1])
        return
    # 16-bit keys a rope tolerance apart would be several int8 codes apart in bf16, so the
    # quantized write is checked on the Triton rope's keys: the same fp32 rotation rounded
    # once, up to the compiler's choice of fused multiply-adds (one 16-bit ulp, 2^-7 at most)
    _, triton_k = kernels.rope(q, k, positions, 500000.0, LLAMA3_SCALING, backend="triton")
    reference.store_kv(triton_k, v, *expected[:2], slots, *expected[2:])
    for codes, scales, codes_ref, scales_ref in ((tensors[0], tensors[2], expected[0], expected[2]),
                                                 (tensors[1], tensors[3], expected[1], expected[3])):
        assert torch.equal(scales.isnan(), scales_ref.isnan())   # the same slots written, no others
        torch.testing.assert_close(scales, scales_ref, atol=0, rtol=2**-7, equal_nan=True)
        # and the GPU's fp32 division is not IEEE-rounded: a code on a rounding boundary may
        # move one step (int8: 1; e4m3: 2^-3 relative)
        step = 1.0 if codes.dtype == torch.int8 else codes_ref.float().abs() * 2**-3 + 2**-9
        if torch.is_tensor(step):
            assert torch.equal(codes.float().isnan(), codes_ref.float().isnan())
            step = step.nan_to_num(float("inf"))
        assert ((codes.float() - codes_ref.float()).nan_to_num(0.0).abs() <= step).all()
