"""Paged attention, prefill and decode: both kernel backends compute what the pure-torch spec
in `llmlab.kernels.reference` says -- the "torch" backend (fused torch ops) and the Triton
kernels.

On a machine without CUDA the Triton kernels run in Triton's interpreter (slow, so the
parameter grids below are a representative cross-section, not the full product). The
`gpu` group repeats the checks with bf16/fp16 and Llama-3-8B shapes on a CUDA device.

Out-of-bounds reads are made visible: queries are views into larger NaN-filled tensors,
and every cache slot that no sequence owns is NaN, so a kernel that reads one returns
NaN. The 8-bit cache's kernels are in test_quantized_kernels.py.
"""
import pytest
import torch

from llmlab import kernels
from llmlab.kernels import reference
from llmlab.kernels.triton.decode_attention import choose_num_splits

from helpers.kernels import (BACKEND_DTYPES, BACKENDS, D, FP32_TOL, GPU_DTYPES, H, HKV, gpu, paged_kv, prefill_lengths,
                             ragged, randn_view, tolerance)


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


# A program that takes all query heads of a kv head (rows = tokens x heads) over ragged and
# chunked lengths, and the configs that fall back to one head a program (a group of 3; 64
# rows for a group of 8 leave 8 tokens a tile, under 16). The interpreter at 16 and 32 rows
# a head, so tiles hold several tokens and a token's heads (the GPU test runs every config).
@pytest.mark.parametrize("lengths", ["ragged", "chunked"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (8, 1), (6, 2), (4, 4)], ids=["gqa4", "gqa8", "gqa3", "mha"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("block_m", [64, 128])
def test_prefill_attention_packed_gqa(block_m, dtype, num_heads, num_kv_heads, lengths):
    from llmlab.kernels.triton import prefill_attention as triton_prefill
    from llmlab.kernels.triton.prefill_configs import PrefillConfig

    config = PrefillConfig(block_m, 32, 4, 1, pack_gqa=True)
    heads = triton_prefill._heads_per_program(config, num_heads // num_kv_heads)
    assert heads == (num_heads // num_kv_heads if (num_heads, num_kv_heads, block_m) in
                     {(8, 2, 64), (8, 2, 128), (8, 1, 128)} else 1)
    seq_lens, query_lens = prefill_lengths(lengths, 16)
    gen = torch.Generator().manual_seed(9)
    k_cache, v_cache, block_tables = paged_kv(seq_lens, 16, num_kv_heads, 64, dtype, gen)
    cu_seqlens_q = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    q = randn_view(sum(query_lens), num_heads, 64, dtype=dtype, gen=gen)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    actual = triton_prefill.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, 0.125,
                                              config=config)
    expected = reference.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, 0.125)
    torch.testing.assert_close(actual, expected, **tolerance(dtype, attention=True))


def test_prefill_configs_by_name():
    from llmlab.kernels import knobs
    from llmlab.kernels.triton import prefill_attention as triton_prefill
    from llmlab.kernels.triton.prefill_configs import DEFAULT_PREFILL_CONFIG, PREFILL_CONFIGS, prefill_config

    assert all(PREFILL_CONFIGS[name].name == name for name in PREFILL_CONFIGS)
    assert prefill_config().name == DEFAULT_PREFILL_CONFIG
    cuda = torch.device("cuda")   # only the choice: nothing is launched
    assert triton_prefill._launch_config(torch.bfloat16, cuda).name == DEFAULT_PREFILL_CONFIG
    assert triton_prefill._launch_config(torch.bfloat16, cuda, "m128-n64-w8-s3-gqa").pack_gqa
    old, knobs.prefill_config = knobs.prefill_config, "m64-n64-w4-s3"
    try:
        assert triton_prefill._launch_config(torch.bfloat16, cuda).name == "m64-n64-w4-s3"
        assert triton_prefill._launch_config(torch.float32, cuda).name != "m64-n64-w4-s3"   # 16-bit queries only
        assert triton_prefill._launch_config(torch.float32, torch.device("cpu")).block_n == 32   # the interpreter's
    finally:
        knobs.prefill_config = old
    with pytest.raises(ValueError, match="unknown prefill-attention config 'm1-n2'"):
        prefill_config("m1-n2")


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


@pytest.mark.parametrize("in_kernel", [True, False], ids=["combined-in-launch", "combine-kernel"])
def test_split_decode_attention_combines_its_ranges(monkeypatch, in_kernel):
    """The Triton kernel's splits are combined by flash_decoding.combine after it (or, with
    knobs.combine_in_launch, by the last program of each (sequence, kv head)): the reference's
    result either way, empty splits included, and every counter back at 0 for the next call
    or graph replay."""
    from llmlab.kernels.triton import decode_attention_bf16

    monkeypatch.setattr(kernels.knobs, "combine_in_launch", in_kernel)
    monkeypatch.setattr(decode_attention_bf16, "_counters", {})
    for seq_lens, splits in (([1, 100, 37], 5), ([70, 3], 2)):
        check_decode_attention("triton", torch.float32, 8, 2, 64, 16, seq_lens, splits)
    counters = decode_attention_bf16._counters.get(torch.device("cpu"))
    assert (counters is not None) == in_kernel
    assert counters is None or not counters.any()


def test_torch_decode_attention_groups_sequences_by_length():
    """Short and long contexts in one batch: the torch backend gathers them in groups of
    similar length (each padded only to its own longest), out of batch order."""
    from llmlab.kernels.torch_backend import decode_groups

    seq_lens = [3, 700, 20, 1500, 64, 5, 900, 33]
    groups = decode_groups(seq_lens, 16)
    assert len(groups) > 1 and sorted(i for g in groups for i in g) == list(range(len(seq_lens)))
    check_decode_attention("torch", torch.float32, 6, 2, 64, 16, seq_lens, 1)


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
@pytest.mark.parametrize("seq_lens", [[0, 37, 0, 5, 0], [0, 700, 20, 0, 1500, 64, 0, 900], [0, 0]],
                         ids=["one-group", "groups", "all-empty"])
def test_decode_attention_a_sequence_of_no_tokens_gets_zeros(backend, seq_lens):
    """A row of seq_len 0 attends to nothing and gets zeros (a prompt graph's rows that are
    not decodes); the other rows get what they get in a batch without those rows."""
    gen = torch.Generator().manual_seed(9)
    k_cache, v_cache, block_tables = paged_kv(seq_lens, 16, 2, 64, torch.float32, gen)
    q = randn_view(len(seq_lens), 6, 64, dtype=torch.float32, gen=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    actual = kernels.decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125, 2, backend=backend)
    empty = lens == 0
    assert torch.equal(actual[empty], torch.zeros_like(actual[empty]))
    if not empty.all():
        expected = reference.decode_attention(q[~empty], k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0),
                                              block_tables[~empty], lens[~empty], 0.125)
        torch.testing.assert_close(actual[~empty], expected, **FP32_TOL)


@pytest.mark.parametrize("num_splits", [0, None])
@pytest.mark.slow
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


# ----------------------------------------------------------------------------- GPU, 16-bit, large

@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("seq_lens,query_lens", [
    ([4096], [4096]),                                   # one long prompt
    ([1, 15, 16, 17, 600, 2500], [1, 15, 16, 17, 600, 2500]),
    ([5000, 300, 1040], [512, 300, 17]),                # chunks after cached context
    # many sequences: a chunk, one-token queries and sequences of no queries after them (a
    # prompt graph pads its sequences so, cuda_graphs/prompt.py), 300 in all: BLOCK_S 512
    ([40, 1040] + [1 + 37 * i % 2000 for i in range(98)] + [0] * 200, [40, 17] + [1] * 98 + [0] * 200),
], ids=["4k", "ragged", "chunked", "graph-step"])
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


def test_warp_specialized_configs_fall_back_to_the_triton_kernel_off_hopper():
    """Where the Gluon kernel cannot run (here: no GPU) a -ws config runs the Triton kernel
    with its tiles, and gives the reference's answer."""
    from llmlab.kernels.gluon import prefill_attention as gluon_prefill
    from llmlab.kernels.triton import prefill_attention as triton_prefill

    gen = torch.Generator().manual_seed(31)
    seq_lens, query_lens = [1, 17, 150], [1, 17, 20]
    k_cache, v_cache, block_tables = paged_kv(seq_lens, 16, 2, 64, torch.float32, gen)
    q = randn_view(sum(query_lens), 4, 64, dtype=torch.float32, gen=gen)
    cu_seqlens_q = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    assert not gluon_prefill.supported(q, k_cache, v_cache)
    actual = triton_prefill.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, lens, 0.125,
                                              config="m128-n128-w12-s2-ws")
    expected = reference.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, lens, 0.125)
    torch.testing.assert_close(actual, expected, **FP32_TOL)


def tma_view(num_tokens, num_heads, head_dim, dtype, gen):
    """Random queries in a view of a NaN-filled tensor with a spare row and a spare head per
    row, laid out as the TMA takes them (a head's channels back to back)."""
    base = torch.full((num_tokens + 1, (num_heads + 1) * head_dim), float("nan"), dtype=dtype, device="cuda")
    q = base[:num_tokens, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
    return q


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("config", ["m128-n128-w12-s2-ws", "m128-n128-w12-s3-ws"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (32, 8, 128, 16), (32, 8, 128, 32), (8, 8, 64, 16), (12, 4, 64, 128)], ids=["llama3", "block32", "mha64", "gqa3"])
@pytest.mark.parametrize("seq_lens,query_lens", [
    ([4096], [4096]),
    ([1, 15, 16, 17, 127, 129, 600, 2500], [1, 15, 16, 17, 127, 129, 600, 2500]),
    ([5000, 300, 1040, 16400], [512, 300, 17, 300]),     # chunks after cached context, one at 16k
    ([40, 1040] + [1 + 37 * i % 2000 for i in range(98)] + [0] * 200, [40, 17] + [1] * 98 + [0] * 200),
], ids=["4k", "ragged", "chunked", "graph-step"])
def test_gpu_warp_specialized_prefill_attention(dtype, config, num_heads, num_kv_heads, head_dim, block_size,
                                                seq_lens, query_lens, monkeypatch):
    """The Gluon kernel (gluon/prefill_attention.py) against the reference, and that it ran:
    lengths off every tile and block size, unowned cache slots NaN (a tile past a sequence's
    end copies them), queries in a NaN-padded view."""
    from llmlab.kernels.gluon import prefill_attention as gluon_prefill
    from llmlab.kernels.triton import prefill_attention as triton_prefill

    launches = []
    launch = gluon_prefill.launch
    monkeypatch.setattr(gluon_prefill, "launch", lambda *args, **kw: launches.append(1) or launch(*args, **kw))
    gen = torch.Generator().manual_seed(29)
    k_cache, v_cache, block_tables = paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen, dev="cuda")
    cu_seqlens_q = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32).cuda()
    lens = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    q = tma_view(sum(query_lens), num_heads, head_dim, dtype, gen)
    scale = head_dim ** -0.5
    actual = triton_prefill.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, lens, scale,
                                              config=config)
    expected = reference.prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, lens, scale)
    assert launches == [1], "the Gluon kernel did not take the problem"
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
@pytest.mark.parametrize("combine_in_launch", [False, True], ids=["combine-kernel", "combined-in-launch"])
def test_gpu_decode_attention(dtype, seq_lens, num_splits, combine_in_launch, monkeypatch):
    monkeypatch.setattr(kernels.knobs, "combine_in_launch", combine_in_launch)
    gen = torch.Generator().manual_seed(14)
    k_cache, v_cache, block_tables = paged_kv(seq_lens, 16, HKV, D, dtype, gen, dev="cuda")
    q = randn_view(len(seq_lens), H, D, dtype=dtype, gen=gen, dev="cuda")
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    actual = kernels.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, D ** -0.5, num_splits,
                                      backend="triton")
    expected = reference.decode_attention(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0),
                                          block_tables, seq_lens, D ** -0.5)
    torch.testing.assert_close(actual, expected, **tolerance(dtype, attention=True))
