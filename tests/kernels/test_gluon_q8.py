"""The Gluon 8-bit decode kernel (kernels/gluon/decode_attention_q8.py) against the reference,
on a GPU: lengths that are not multiples of its 16-token tiles or of the block size, empty
splits, int8 and fp8 codes, NaN scales in every slot no sequence owns."""
import itertools
import math

import pytest
import torch

from llmlab.kernels import reference
from llmlab.kernels.triton.decode_attention import decode_attention

pytestmark = pytest.mark.gpu

LENS = [1, 5, 15, 16, 17, 31, 33, 100, 257, 1000, 4097]


def _case(cache_dtype, block_size, lens, group=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim = 2, 128
    num_heads = num_kv_heads * group
    per_seq = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(per_seq) + 3
    ids = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        table[i, :n] = ids[used:used + n].to(torch.int32)
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    codes, scales = [], []
    for _ in range(2):
        c, s = reference.quantize(torch.randn(shape, generator=gen) * 3, cache_dtype)
        s = torch.full_like(s, float("nan"))  # only owned slots get a scale
        codes.append(c)
        scales.append(s)
    k_real, v_real = (reference.quantize(torch.randn(shape, generator=gen) * 3, cache_dtype) for _ in range(2))
    for i, n in enumerate(lens):
        for t in range(n):
            b, slot = int(table[i, t // block_size]), t % block_size
            for (c, s), (rc, rs) in zip(zip(codes, scales), (k_real, v_real)):
                c[b, slot] = rc[b, slot]
                s[b, slot] = rs[b, slot]
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    cuda = dict(device="cuda")
    return (q.to(dtype=torch.bfloat16, **cuda), codes[0].to(**cuda), codes[1].to(**cuda), table.to(**cuda),
            torch.tensor(lens, dtype=torch.int32, **cuda), scales[0].to(**cuda), scales[1].to(**cuda))


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("variant", ["gluon-n16-w1-s2", "gluon-n16-w1-s4", "gluon-n32-w1-s2", "gluon-n32-w1-s3",
                                     "gluon-n64-w1-s3"])
def test_gluon_matches_reference(cache_dtype, block_size, num_splits, variant):
    if cache_dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 needs compute capability 8.9")
    q, k, v, table, lens, ks, vs = _case(cache_dtype, block_size, LENS)
    scale = 128 ** -0.5
    expected = reference.decode_attention(q.float().cpu(), k.cpu(), v.cpu(), table.cpu(), lens.cpu(), scale, 1,
                                          ks.cpu(), vs.cpu())
    got = decode_attention(q, k, v, table, lens, scale, num_splits, ks, vs, q8_variant=variant)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float().cpu(), expected, atol=2e-2, rtol=2e-2)


def test_gluon_takes_the_group_sizes_of_real_models():
    """GQA groups of 1 (MHA), 2 and 8 query heads per kv head; 16 runs the Triton kernel."""
    for group in (1, 2, 8, 16):
        q, k, v, table, lens, ks, vs = _case(torch.int8, 16, [7, 300], group=group, seed=group)
        expected = reference.decode_attention(q.float().cpu(), k.cpu(), v.cpu(), table.cpu(), lens.cpu(), 0.1, 1,
                                              ks.cpu(), vs.cpu())
        got = decode_attention(q, k, v, table, lens, 0.1, 2, ks, vs, q8_variant="gluon-n16-w1-s4")
        torch.testing.assert_close(got.float().cpu(), expected, atol=2e-2, rtol=2e-2)



@pytest.mark.parametrize("num_splits", [1, 3])
def test_gluon_reads_scales_of_any_head_stride(num_splits):
    """The same logical scales stored kv head by kv head within a block (`bench
    decode-variants --scale-layouts head`): the kernel reads the same values, so the same
    bits come out."""
    q, k, v, table, lens, ks, vs = _case(torch.int8, 16, LENS, seed=3)
    head_major = [s.transpose(1, 2).contiguous().transpose(1, 2) for s in (ks, vs)]
    assert head_major[0].stride(-1) == 16
    torch.testing.assert_close(head_major[0], ks, rtol=0, atol=0, equal_nan=True)
    got = decode_attention(q, k, v, table, lens, 0.1, num_splits, *head_major, q8_variant="gluon-n16-w1-s2")
    assert torch.equal(got, decode_attention(q, k, v, table, lens, 0.1, num_splits, ks, vs,
                                             q8_variant="gluon-n16-w1-s2"))


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_gluon_tma_and_cp_async_copies_give_the_same_bits(cache_dtype):
    """The engine's caches (a block's slots and a slot's kv heads back to back) go to the TMA;
    rows with room after their kv heads still do; blocks that are not back to back (every
    other block of a bigger tensor) go to cp.async. The tile's values are the same either way."""
    from llmlab.kernels.gluon import decode_attention_q8 as gluon

    q, k, v, table, lens, ks, vs = _case(cache_dtype, 16, LENS, seed=5)
    num_blocks, block_size, num_kv_heads, head_dim = k.shape

    def every_other_block(c):
        big = torch.zeros((2 * num_blocks,) + tuple(c.shape[1:]), dtype=c.dtype, device=c.device)
        big[::2] = c
        return big[::2]

    def roomy_rows(c):
        big = torch.zeros((num_blocks, block_size, num_kv_heads + 1, head_dim), dtype=c.dtype, device=c.device)
        big[:, :, :num_kv_heads] = c
        return big[:, :, :num_kv_heads]

    words = lambda c: c.view(torch.int32)
    engine_like = words(k)
    assert gluon._tma_descriptors(engine_like, words(v), 16)[0].base is engine_like
    roomy = words(roomy_rows(k))
    assert gluon._tma_descriptors(roomy, words(roomy_rows(v)), 16)[0].base is roomy
    assert gluon._tma_descriptors(words(every_other_block(k)), words(every_other_block(v)), 16)[0].base.numel() == 16 * 32
    assert gluon._tma_descriptors(engine_like, words(v), 32)[0].base is engine_like   # two blocks a tile
    for num_splits, variant in itertools.product((1, 3), ("gluon-n16-w1-s2", "gluon-n32-w1-s2")):
        run = lambda kc, vc: decode_attention(q, kc, vc, table, lens, 0.1, num_splits, ks, vs,
                                              q8_variant=variant)
        tma = run(k, v)
        assert torch.equal(run(roomy_rows(k), roomy_rows(v)), tma)
        assert torch.equal(run(every_other_block(k), every_other_block(v)), tma)
