"""Exercise 12, the int8 KV cache: store_kv writes what `reference.store_kv` writes into an
int8 cache (codes and per-row scales), and dequantize_slots reads back codes * scale."""
import pytest
import torch

import llmlab
from grading import DEVICE, NAN, PROMPTS, fail, randn_view
from llmlab import kernels
from llmlab.kernels import reference

EXERCISE = "ex12_quantized_store_kv"
UNWRITTEN = -128   # an int8 code store_kv never writes (codes are in [-127, 127])


def empty_int8_cache(shape):
    """Codes that store_kv never writes and NaN scales: a stray or missing write shows."""
    caches = [torch.full(shape, UNWRITTEN, dtype=torch.int8, device=DEVICE) for _ in range(2)]
    scales = [torch.full(shape[:3], NAN, device=DEVICE) for _ in range(2)]
    return caches + scales


def check_written(actual, expected, case, names=("k_cache", "v_cache", "k_scales", "v_scales")):
    """Codes and scales as the reference wrote them. The interpreter does the reference's
    float32 operations, so on a CPU they match exactly; a GPU's fp32 division is not
    IEEE-rounded, so there a code may be one step off and a scale one ulp."""
    for name, got, want in zip(names, actual, expected):
        got_f, want_f = got.float(), want.float()
        if not torch.equal(got_f.isnan(), want_f.isnan()) or not torch.equal(got_f == UNWRITTEN, want_f == UNWRITTEN):
            fail(case, [scales_pattern(name, got_f, want_f) or
                        f"{name}: written in the wrong slots -- token t goes to slot slot_mapping[t] (block "
                        "slot // block_size, row slot % block_size), padding (slot -1) writes nothing, and each "
                        "row's scale goes to the same (block, row, head) of the scales tensor"])
        diff = (got_f - want_f).nan_to_num(0.0).abs()
        allowed = 0.0 if DEVICE == "cpu" else (1.0 if "cache" in name else 1e-6 * want_f.nan_to_num(0).abs())
        if (diff > allowed).any():
            worst = diff.max().item()
            fail(case, [f"{name}: values differ (largest difference {worst:.3g}) -- codes are "
                        "floor(x * (127 / absmax) + 0.5) clamped to [-127, 127], the scale is absmax / 127, "
                        "all in float32"])


def scales_pattern(name, got, want):
    """What a scales tensor [..., Hkv] written in the wrong places points to, or None: each
    token wrote one scale, at kv head 0, where it should write one per head."""
    if "scales" not in name or got.dim() < 2 or got.shape[-1] < 2:
        return None
    written, expected = ~got.isnan(), ~want.isnan()
    if torch.equal(written[..., 0], expected[..., 0]) and not written[..., 1:].any() and expected[..., 1:].any():
        others = "head 1 is" if got.shape[-1] == 2 else f"heads 1..{got.shape[-1] - 1} are"
        return (f"{name}: only kv head 0's scales are written, once per token; {others} left untouched -- "
                "every head wrote its scale at head 0's place: the scale of (block, row, head) "
                "is at block * stride(0) + row * stride(1) + head, so add the head to the scale's offset (as the "
                "codes' offset has head * stride_head)")
    return None


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 64), (2, 128)])
def test_matches_reference(ex, block_size, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(block_size + head_dim)
    num_tokens, num_blocks = 9, 5
    k = randn_view(num_tokens, num_kv_heads, head_dim, gen=gen)
    v = randn_view(num_tokens, num_kv_heads, head_dim, gen=gen)
    with torch.no_grad():
        k[1, 0, 3] = 40.0   # an outlier channel: the row's scale follows it
        k[4, 1] = 0.0       # an all-zero row: zero codes, a tiny positive scale
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 5]] = -1      # padding tokens write nothing
    slots = slots.to(DEVICE)
    actual = empty_int8_cache((num_blocks, block_size, num_kv_heads, head_dim))
    expected = [t.clone() for t in actual]
    assert ex.store_kv(k, v, actual[0], actual[1], slots, actual[2], actual[3]) is None, \
        "store_kv writes in place and returns None"
    reference.store_kv(k, v, expected[0], expected[1], slots, expected[2], expected[3])
    check_written(actual, expected, f"{num_kv_heads} kv heads, head_dim {head_dim}, block_size {block_size}, "
                                    f"slots {slots.tolist()}")


def test_one_layer_of_a_stacked_cache(ex):
    """The engine passes kv_cache[layer, 0|1] and kv_scales[layer, 0|1]: views into one tensor each.
    A padding token (slot -1) written anyway lands in the tensor before the view, and shows."""
    gen = torch.Generator().manual_seed(7)
    kv_cache = torch.full((2, 2, 4, 16, 2, 64), UNWRITTEN, dtype=torch.int8, device=DEVICE)
    kv_scales = torch.full((2, 2, 4, 16, 2), NAN, device=DEVICE)   # [layers, k|v, blocks, block_size, Hkv]
    expected_cache, expected_scales = kv_cache.clone(), kv_scales.clone()
    k, v = randn_view(4, 2, 64, gen=gen), randn_view(4, 2, 64, gen=gen)
    slots = torch.tensor([5, -1, 16, 63], device=DEVICE)
    ex.store_kv(k, v, kv_cache[1, 0], kv_cache[1, 1], slots, kv_scales[1, 0], kv_scales[1, 1])
    reference.store_kv(k, v, expected_cache[1, 0], expected_cache[1, 1], slots,
                       expected_scales[1, 0], expected_scales[1, 1])
    check_written([kv_cache.flatten(0, 2), kv_scales.flatten(0, 2)],
                  [expected_cache.flatten(0, 2), expected_scales.flatten(0, 2)],
                  "layer 1 of a stacked cache (blocks of all layers in a row)",
                  names=("kv_cache (codes of every layer)", "kv_scales (scales of every layer)"))


@pytest.mark.parametrize("row,why", [
    ([127.0, -0.5, 0.5, -1.5, 1.5, -2.5, 2.5, -126.5], "half-way values (absmax 127, so x * 127 / absmax = x): "
     "floor(y + 0.5) rounds them up, not away from zero nor to even"),
    ([2.402235984802246, 1.5605075359344482], "a value next to a rounding edge: x * (127 / absmax), not "
     "x / (absmax / 127), which rounds differently here"),
], ids=["half-way", "rounding-edge"])
def test_codes_exactly_as_the_reference_rounds(ex, row, why):
    """Random rows seldom land on a rounding edge; these do."""
    k = torch.tensor(row + [0.0] * (16 - len(row)), device=DEVICE).view(1, 1, 16)
    actual = empty_int8_cache((1, 16, 1, 16))
    expected = [t.clone() for t in actual]
    slots = torch.tensor([3], device=DEVICE)
    ex.store_kv(k, k, actual[0], actual[1], slots, actual[2], actual[3])
    reference.store_kv(k, k, expected[0], expected[1], slots, expected[2], expected[3])
    check_written(actual, expected, why)


def test_each_kv_head_has_its_own_scale(ex):
    """Two tokens of four kv heads, head h's rows about 4**h in size: every head's scale is
    its own absmax / 127, at [block, row, head] of the scales tensor."""
    gen = torch.Generator().manual_seed(5)
    rows = randn_view(2, 4, 16, gen=gen) * torch.tensor([1.0, 4.0, 16.0, 64.0], device=DEVICE)[:, None]
    actual = empty_int8_cache((2, 16, 4, 16))
    expected = [t.clone() for t in actual]
    slots = torch.tensor([3, 20], device=DEVICE)
    ex.store_kv(rows, rows, actual[0], actual[1], slots, actual[2], actual[3])
    reference.store_kv(rows, rows, expected[0], expected[1], slots, expected[2], expected[3])
    check_written(actual[2:], expected[2:], "one scale per kv head (2 tokens, 4 kv heads of different sizes)",
                  names=("k_scales", "v_scales"))
    check_written(actual, expected, "one scale per kv head (2 tokens, 4 kv heads of different sizes)")


def test_round_trip_is_within_half_a_step(ex):
    gen = torch.Generator().manual_seed(3)
    k = randn_view(16, 2, 64, gen=gen) * 5
    cache, _, scales, _ = empty_int8_cache((1, 16, 2, 64))
    ex.store_kv(k, k, cache, cache.clone(), torch.arange(16, device=DEVICE), scales, scales.clone())
    expected_scales = k.abs().amax(-1).clamp(min=1e-12) / 127                          # [tokens, kv heads]
    if not torch.allclose(scales[0], expected_scales, rtol=1e-6, atol=0):
        wrong = (~torch.isclose(scales[0], expected_scales, rtol=1e-6, atol=0)).any(0).nonzero().flatten().tolist()
        fail("round trip of 16 rows", [f"k_scales of kv heads {wrong} are not their rows' absmax / 127 (missing or "
                                       "misplaced: see the case 'one scale per kv head'), so the codes cannot be "
                                       "judged here"])
    error = (reference.dequantize(cache[0], scales[0]) - k).abs()
    if (error > scales[0, :, :, None] * (0.5 + 1e-5)).any():
        fail("round trip of 16 rows", [f"|codes * scale - x| reaches {error.max().item():.3g}, more than half a "
                                       "step (scale / 2): round to the nearest code, don't truncate"])


@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 64), (1, 16)])
def test_dequantize_slots(ex, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    codes = torch.randint(-127, 128, (4, 16, num_kv_heads, head_dim), generator=gen, dtype=torch.int8).to(DEVICE)
    scales = torch.rand(4, 16, num_kv_heads, generator=gen).to(DEVICE)
    slots = torch.tensor([0, 17, 63, 5, 17], device=DEVICE)   # any order, repeats allowed
    actual = ex.dequantize_slots(codes, scales, slots)
    expected = reference.dequantize(codes.view(-1, num_kv_heads, head_dim)[slots], scales.view(-1, num_kv_heads)[slots])
    if not (isinstance(actual, torch.Tensor) and actual.shape == expected.shape and actual.dtype == torch.float32):
        fail("dequantize_slots", [f"expected a float32 tensor {tuple(expected.shape)}"])
    if not torch.allclose(actual, expected, atol=0, rtol=1e-6):
        bad = (~torch.isclose(actual, expected, atol=0, rtol=1e-6)).flatten(1).any(1).nonzero().flatten().tolist()
        fail("dequantize_slots", [f"rows {bad} differ -- row i is the codes of slot slots[i] (block slot // "
                                  "block_size, row slot % block_size) times that slot's scale"])


def test_empty(ex):
    cache, _, scales, _ = empty_int8_cache((2, 16, 2, 64))
    ex.store_kv(torch.zeros(0, 2, 64, device=DEVICE), torch.zeros(0, 2, 64, device=DEVICE), cache, cache.clone(),
                torch.zeros(0, dtype=torch.int64, device=DEVICE), scales, scales.clone())


@pytest.fixture(scope="module")
def int8_llm(engine_llm):
    """An engine of its own with an int8 KV cache over the loaded embedded model, and no
    prefix cache (on by default): int8_token_ids fills every slot with garbage between runs,
    and a cached prompt block would be read back from that garbage instead of recomputed."""
    config = llmlab.EngineConfig(device=DEVICE, dtype="float32", backend="torch", num_gpu_blocks=64,
                                 swap_space=0, kv_cache_dtype="int8", enable_prefix_caching=False)
    return llmlab.LLM.from_engine(llmlab.LLMEngine(config, model=engine_llm.engine.model,
                                                   tokenizer=engine_llm.tokenizer))


def int8_token_ids(llm, **overrides):
    """Greedy token ids of grading.PROMPTS; every slot starts with garbage codes and NaN
    scales, which a correct store_kv overwrites before anything reads them."""
    from grading import GREEDY

    llm.engine.kv_cache.device.random_(-127, 128, generator=torch.Generator(DEVICE).manual_seed(0))
    llm.engine.kv_cache.device_scales.fill_(NAN)
    with kernels.override(**overrides):
        return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


def test_end_to_end(ex, int8_llm):
    """The embedded model on an int8 cache, every KV write on your kernel: the same greedy text."""
    from diagnose import check_same_text

    expected = int8_token_ids(int8_llm)
    check_same_text(int8_token_ids(int8_llm, store_kv=ex.store_kv), expected, tokenizer=int8_llm.tokenizer,
                    prompts=PROMPTS, kernel="store_kv")
