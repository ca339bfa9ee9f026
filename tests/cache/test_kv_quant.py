"""KV-cache quantization (EngineConfig.kv_cache_dtype): the round trip's error bounds, which
configurations are refused, how many blocks fit, scales moving with their blocks, "auto"
leaving every kernel call as it was, and int8 engine runs -- batching, chunked prefill,
preemption by swap and by recompute, prefix caching -- that give the same tokens as the
int8 engine running each prompt alone, and give every block back.

The kernels themselves are checked against kernels.reference in tests/kernels/.
"""
import pytest
import torch

from llmlab import EngineConfig, LLMEngine, SamplingParams, kernels
from llmlab.cache.kv_cache import KVCache, bytes_per_block, kv_cache_dtype, num_blocks_for
from llmlab.config import ModelConfig
from llmlab.kernels import reference
from llmlab.model.llama import LlamaModel

import helpers.engine
from helpers.engine import assert_all_blocks_free, cpu_engine, embedded_engine

PROMPTS = ["What is the capital of France?", "Write a short poem about autumn leaves falling.",
           "1, 2, 3, 4,", "Explain what a hash table is to a ten year old child, step by step."]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def run_all(engine, prompts, params=GREEDY, recorder=None):
    return helpers.engine.run_all(engine, prompts, params, recorder)


def outlier_rows(gen, num_rows=64, head_dim=64):
    """N(0, 1) rows with a few large channels (as real keys have), some rows tiny, one all zero."""
    x = torch.randn(num_rows, head_dim, generator=gen)
    x[:, [3, 17]] *= 20
    x[5] *= 1e-6
    x[7] = 0
    return x


# ----------------------------------------------------------------------------- the round trip

def test_int8_round_trip_is_within_half_a_step():
    x = outlier_rows(torch.Generator().manual_seed(0))
    codes, scales = reference.quantize(x, torch.int8)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (64,)
    assert codes.abs().max() <= 127
    # rounding to the nearest step: at most half a step off (plus fp32 rounding of x / scale)
    error = (reference.dequantize(codes, scales) - x).abs()
    assert (error <= scales[:, None] * (0.5 + 1e-5)).all()
    # each row's largest value lands exactly on +-127, and the all-zero row stays zero
    assert (codes.abs().amax(-1)[scales > reference.QUANT_EPS] == 127).all()
    assert (codes[7] == 0).all() and scales[7] > 0


def test_fp8_round_trip_is_within_half_an_e4m3_ulp():
    x = outlier_rows(torch.Generator().manual_seed(1))
    codes, scales = reference.quantize(x, torch.float8_e4m3fn)
    assert codes.dtype == torch.float8_e4m3fn and codes.float().abs().max() == 448
    error = (reference.dequantize(codes, scales) - x).abs()
    # e4m3 has 3 mantissa bits: half an ulp is 2^-4 relative; below 2^-6 (subnormal) it is a
    # fixed 2^-10 of the scale
    bound = torch.maximum(x.abs() * 2**-4, scales[:, None] * 2**-10) * (1 + 1e-5)
    assert (error <= bound).all()


# ----------------------------------------------------------------------------- configuration

@pytest.mark.parametrize("kwargs, match", [
    ({"kv_cache_dtype": "int4"}, "kv_cache_dtype must be auto, int8 or fp8_e4m3"),
    ({"kv_cache_dtype": "fp8_e4m3", "device": "cpu"}, "compute capability 8.9"),
    ({"kv_cache_dtype": "int8", "tensor_parallel_size": 2}, "tensor_parallel_size"),
])
def test_bad_combinations_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9),
                    reason="this GPU converts fp8")
def test_fp8_is_refused_where_the_device_cannot_convert_it():
    with pytest.raises(ValueError, match="fp8_e4m3"):
        EngineConfig(kv_cache_dtype="fp8_e4m3")


def test_int8_cache_holds_about_four_times_the_float32_blocks_and_twice_the_bf16_ones():
    # SmolLM2-135M: 30 layers, 3 kv heads of 64 channels
    model = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 10000.0)
    rows = 2 * 30 * 16 * 3                                  # K and V rows of a 16-token block
    assert bytes_per_block(model, 16, torch.float32) == rows * 64 * 4
    assert bytes_per_block(model, 16, torch.bfloat16) == rows * 64 * 2
    assert bytes_per_block(model, 16, torch.int8) == rows * (64 + 4)   # codes + a float32 scale
    config = EngineConfig(device="cpu", cpu_kv_cache_gib=0.25, kv_cache_dtype="int8")
    int8_blocks, _ = num_blocks_for(config, model, torch.float32, torch.device("cpu"), 0)
    fp32_blocks, _ = num_blocks_for(EngineConfig(device="cpu", cpu_kv_cache_gib=0.25), model, torch.float32,
                                    torch.device("cpu"), 0)
    bf16_blocks, _ = num_blocks_for(EngineConfig(device="cpu", cpu_kv_cache_gib=0.25), model, torch.bfloat16,
                                    torch.device("cpu"), 0)
    assert int8_blocks == 2**28 // (rows * 68)
    assert 3.7 < int8_blocks / fp32_blocks < 3.8 and 1.85 < int8_blocks / bf16_blocks < 1.9   # 256/68, 128/68
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn


def test_swap_moves_each_blocks_scales_with_it():
    model = ModelConfig("llama", 256, 64, 96, 2, 4, 2, 16, 1e-5, 10000.0)
    cache = KVCache(model, 4, 3, 8, torch.int8, torch.device("cpu"))
    assert cache.device_scales.shape == (2, 2, 4, 8, 2) and cache.host_scales.shape == (2, 2, 3, 8, 2)
    gen = torch.Generator().manual_seed(2)
    cache.device.copy_(torch.randint(-127, 128, cache.device.shape, generator=gen))
    cache.device_scales.copy_(torch.rand(cache.device_scales.shape, generator=gen))
    codes, scales = cache.device[:, :, [1, 3]].clone(), cache.device_scales[:, :, [1, 3]].clone()
    cache.swap_out([(1, 2), (3, 0)])
    cache.device.zero_()
    cache.device_scales.zero_()
    cache.swap_in([(2, 0), (0, 2)])   # back into other device blocks
    assert torch.equal(cache.device[:, :, [0, 2]], codes)
    assert torch.equal(cache.device_scales[:, :, [0, 2]], scales)
    assert KVCache(model, 4, 3, 8, torch.float32, torch.device("cpu")).device_scales is None


# ----------------------------------------------------------------------------- the engine

def make_engine(llm, kv_cache_dtype="int8", **overrides) -> LLMEngine:
    return embedded_engine(llm, kv_cache_dtype=kv_cache_dtype, **overrides)


def test_auto_calls_every_kernel_as_before(llm):
    """No scales exist and none are passed: each kernel gets exactly its old arguments."""
    calls = []

    def spy(name, kernel):
        def call(*args):
            calls.append((name, len(args)))
            return kernel(*args)
        return call

    engine = make_engine(llm, "auto", num_gpu_blocks=64, max_num_batched_tokens=8)
    assert engine.kv_cache.device_scales is None and engine.kv_cache.dtype == torch.float32
    names = ("store_kv", "prefill_attention", "decode_attention")
    with kernels.override(**{n: spy(n, kernels.get_kernel(n, "torch")) for n in names}):
        outputs = run_all(engine, PROMPTS[:2], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 3 for o in outputs), [o.token_ids for o in outputs]
    assert {name for name, _ in calls} == set(names)   # chunked: prefill, decode and mixed steps
    assert set(calls) == {("store_kv", 5), ("prefill_attention", 7), ("decode_attention", 7)}


@pytest.fixture(scope="module")
def int8_alone(llm):
    """Greedy tokens of each prompt run alone on an int8 cache, no chunking."""
    engine = make_engine(llm, num_gpu_blocks=256, enable_chunked_prefill=False)
    assert engine.kv_stats()["kv_cache_dtype"] == "int8"
    return [run_all(engine, [p])[0].token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def int8_batched(llm):
    """The prompts batched on an int8 cache, every prefill in one step (the engine and its
    greedy tokens): one run that two tests check."""
    engine = make_engine(llm, num_gpu_blocks=256, max_num_batched_tokens=2048)
    return engine, [o.token_ids for o in run_all(engine, PROMPTS)]


def test_kv_stats_report_the_cache_dtype_and_block_bytes(llm):
    int8, auto = make_engine(llm, cpu_kv_cache_gib=0.05), make_engine(llm, "auto", cpu_kv_cache_gib=0.05)
    assert (int8.kv_stats()["kv_cache_dtype"], auto.kv_stats()["kv_cache_dtype"]) == ("int8", "float32")
    assert int8.kv_stats()["bytes_per_block"] == 2 * 30 * 16 * 3 * (64 + 4)
    assert auto.kv_stats()["bytes_per_block"] == 2 * 30 * 16 * 3 * 64 * 4
    assert int8.kv_stats()["total_device_blocks"] == int(0.05 * 2**30) // (2 * 30 * 16 * 3 * 68)


def test_int8_batch_and_chunked_prefill_equal_each_prompt_alone(llm, int8_alone, int8_batched):
    """A token's codes and scale depend on that token's K/V only, so how prompts are batched
    or chunked does not change what the cache holds."""
    engine, tokens = int8_batched
    assert tokens == int8_alone
    assert_all_blocks_free(engine)
    engine = make_engine(llm, num_gpu_blocks=256, max_num_batched_tokens=8)
    assert [o.token_ids for o in run_all(engine, PROMPTS)] == int8_alone
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_int8_preemption_keeps_greedy_output(llm, int8_alone, mode):
    import llmlab

    engine = make_engine(llm, num_gpu_blocks=12, block_size=4, preemption_mode=mode, swap_space=0.01,
                         max_num_batched_tokens=64)
    recorder = llmlab.Recorder()
    assert [o.token_ids for o in run_all(engine, PROMPTS, recorder=recorder)] == int8_alone
    kind = "preempted" if mode == "recompute" else "swapped_out"
    assert any(getattr(s, kind) for s in recorder.trace.steps), f"no {mode} preemption happened"
    assert_all_blocks_free(engine)


def test_int8_prefix_caching_reuses_quantized_blocks(llm, int8_alone):
    import llmlab

    engine = make_engine(llm, num_gpu_blocks=256, enable_prefix_caching=True, block_size=4)
    first = run_all(engine, PROMPTS[3:])
    recorder = llmlab.Recorder()
    again = run_all(engine, PROMPTS[3:] + PROMPTS[:1], recorder=recorder)
    assert first[0].token_ids == again[0].token_ids == int8_alone[3]
    assert again[1].token_ids == int8_alone[0]
    assert sum(sum(s.prefix_hit_tokens.values()) for s in recorder.trace.steps) >= 8
    assert_all_blocks_free(engine)


def test_int8_runs_are_deterministic_and_close_to_full_precision(llm, int8_alone, int8_batched):
    assert int8_batched[1] == int8_alone      # a second int8 engine, the same tokens
    full = [o.token_ids for o in run_all(make_engine(llm, "auto", num_gpu_blocks=256), PROMPTS)]
    # an 8-bit cache may flip a near-tie, but not the first tokens of every prompt
    assert sum(a[:4] == b[:4] for a, b in zip(full, int8_alone)) >= 3


def tiny_engine(backend, kv_cache_dtype="int8", **overrides):
    """Random weights, 2 layers, GQA 4/2, head_dim 16: cheap enough for Triton's interpreter."""
    config = ModelConfig("llama", 256, 64, 96, 2, 4, 2, 16, 1e-5, 10000.0)
    model = LlamaModel.random(config, torch.float32, torch.device("cpu"), seed=3)
    for layer in model.layers:   # larger weights than random()'s: clear-cut greedy argmaxes
        layer.qkv.mul_(10)
    return cpu_engine(model, backend=backend, kv_cache_dtype=kv_cache_dtype, **overrides)


@pytest.mark.slow
def test_int8_triton_and_reference_backends_match_torch():
    """The three backends' quantized kernels, end to end, with chunked prefill (mixed steps)
    and decodes long enough to span several blocks."""
    prompts = [[5, 17, 99, 3, 250, 7, 8, 9, 10, 11, 12], [42, 43, 44]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton", "reference"):
        engine = tiny_engine(backend, num_gpu_blocks=16, block_size=4, max_num_batched_tokens=6)
        tokens[backend] = [o.token_ids for o in run_all(engine, prompts, params)]
        assert_all_blocks_free(engine)
    assert tokens["triton"] == tokens["torch"] == tokens["reference"]
