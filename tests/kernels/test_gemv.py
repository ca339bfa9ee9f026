"""The Triton GEMV (kernels/dense/gemv.py) against F.linear: one row times a weight, shapes
whose N and K are not multiples of the tiles, every variant; on a GPU, kernels.linear sends
one-row products to it and the model's outputs do not change."""
import pytest
import torch
import torch.nn.functional as F

from llmlab import kernels

from llmlab.kernels.dense.gemv import GEMV_CONFIGS, config_for, gemv


@pytest.mark.parametrize("n,k", [(40, 96), (33, 2048), (16, 1024), (7, 1500)])
@pytest.mark.slow
def test_gemv_matches_f_linear(n, k):
    gen = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=gen)
    x = torch.randn(1, k, generator=gen)
    for config in (config_for(n, k), GEMV_CONFIGS["n4-k1024-w4-s1"], GEMV_CONFIGS["n32-k256-w4-s3"]):
        got = gemv(x, weight, config)
        assert got.shape == (1, n) and got.dtype == x.dtype
        torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_gemv_reads_only_its_weight_rows():
    """A weight that is a row slice of a bigger matrix (strided rows): the rows around it,
    NaN, must not leak into the result, and rows past N are never written."""
    gen = torch.Generator().manual_seed(0)
    big = torch.full((50, 300), float("nan"))
    big[10:30, :256] = torch.randn(20, 256, generator=gen)
    weight = big[10:30, :256]
    x = torch.randn(1, 256, generator=gen)
    got = gemv(x, weight, GEMV_CONFIGS["n16-k256-w4-s3"])
    torch.testing.assert_close(got, F.linear(x, weight.contiguous()), rtol=1e-5, atol=1e-4)


def test_gemv_rejects_more_than_one_row():
    with pytest.raises(AssertionError, match="one row"):
        gemv(torch.zeros(2, 8), torch.zeros(4, 8))


@pytest.mark.gpu
def test_gpu_decode_rows_take_triton_and_match_cublas(monkeypatch):
    """On a GPU, the Triton backend's linear sends 1 row to the GEMV and 33-64 rows to the skinny
    GEMM (bf16, programmatic dependent launch on Hopper), other row counts to cuBLAS; all agree
    with it."""
    from llmlab import kernels
    from llmlab.kernels.dense import gemv as triton_gemv, skinny_gemm as triton_skinny_gemm

    calls = []
    monkeypatch.setattr(triton_gemv, "gemv", lambda *a, _f=triton_gemv.gemv: calls.append("gemv") or _f(*a))
    monkeypatch.setattr(triton_skinny_gemm, "skinny_gemm",
                        lambda *a, _f=triton_skinny_gemm.skinny_gemm: calls.append("skinny") or _f(*a))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((6144, 4096), (4096, 14336), (1000, 333), (28672, 4096)):
        weight = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).bfloat16()
        for rows, path in ((1, "gemv"), (7, None), (32, None), (33, "skinny"), (64, "skinny"), (65, None)):
            x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
            calls.clear()
            got = kernels.linear(x, weight, backend="triton")
            assert calls == ([path] if path else []), (n, k, rows)
            torch.testing.assert_close(got.float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("m,n,k", [(2, 40, 96), (5, 70, 300), (17, 33, 256), (64, 130, 512), (33, 16, 1500)])
@pytest.mark.slow
def test_skinny_gemm_matches_f_linear(m, n, k):
    """2-64 rows: every row padded into one tile, N and K tails masked, each shipped tile."""
    from llmlab.kernels.dense.skinny_gemm import config_for as skinny_config_for, skinny_gemm
    from llmlab.kernels.dense.gemv import GemvConfig

    gen = torch.Generator().manual_seed(m * n + k)
    weight = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen)
    for config in (skinny_config_for(n, k), GemvConfig(32, 256, 4, 4), GemvConfig(128, 128, 8, 4)):
        got = skinny_gemm(x, weight, config)
        assert got.shape == (m, n)
        torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_swiglu_gemm_is_silu_mul_of_the_product():
    """gate_up and silu_mul in one kernel: a strided x and a gate_up slice of a NaN-filled
    matrix (nothing around them may leak in), I and K not multiples of the tile."""
    from llmlab.kernels.triton import silu_mul as triton_silu_mul
    from llmlab.kernels.dense.gemv import GemvConfig
    from llmlab.kernels.dense.skinny_gemm import swiglu_gemm

    gen = torch.Generator().manual_seed(4)
    m, k, features = 37, 72, 25
    big_x = torch.full((40, k + 7), float("nan"))
    big_x[:m, :k] = torch.randn(m, k, generator=gen)
    big_w = torch.full((2 * features + 3, k + 5), float("nan"))
    big_w[:2 * features, :k] = torch.randn(2 * features, k, generator=gen) * 0.5
    x, gate_up = big_x[:m, :k], big_w[:2 * features, :k]
    expected = triton_silu_mul.silu_mul(F.linear(x.contiguous(), gate_up.contiguous()))
    for config in (GemvConfig(32, 64, 4, 3), GemvConfig(64, 32, 4, 2)):
        got = swiglu_gemm(x, gate_up, config)
        assert got.shape == (m, features)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_gpu_swiglu_gemm_routing_and_agreement(monkeypatch):
    """kernels.swiglu with LLMLAB_SWIGLU_GEMM on: 33-64 bf16 rows take the fused kernel and agree
    with silu_mul after the skinny GEMM; other row counts, the torch backend and a student's
    silu_mul override take the pair."""
    from llmlab import kernels
    from llmlab.kernels.dense import skinny_gemm as triton_skinny_gemm
    from llmlab.kernels.triton import silu_mul as triton_silu_mul

    monkeypatch.setattr(kernels.knobs, "swiglu_gemm", True)
    fused = []
    monkeypatch.setattr(triton_skinny_gemm, "swiglu_gemm",
                        lambda *a, _f=triton_skinny_gemm.swiglu_gemm: fused.append(1) or _f(*a))
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(2 * 14336, 4096, generator=gen, device="cuda") * 0.02).bfloat16()
    for rows in (33, 64, 16):
        x = torch.randn(rows, 4096, generator=gen, device="cuda").bfloat16()
        fused.clear()
        got = kernels.swiglu(x, gate_up, backend="triton")
        assert len(fused) == (1 if rows > 32 else 0), rows
        pair = triton_silu_mul.silu_mul(kernels.linear(x, gate_up, backend="triton"))
        torch.testing.assert_close(got.float(), pair.float(), rtol=2e-2, atol=2e-3)
        fused.clear()
        kernels.swiglu(x, gate_up, backend="torch")
        with kernels.override(silu_mul=triton_silu_mul.silu_mul):
            kernels.swiglu(x, gate_up, backend="triton")
        assert not fused


@pytest.mark.slow
def test_skinny_gemm_padding_rows_and_columns_stay_out():
    """NaN around a strided x and weight: nothing outside them reaches the result."""
    from llmlab.kernels.dense.skinny_gemm import skinny_gemm
    from llmlab.kernels.dense.gemv import GemvConfig

    gen = torch.Generator().manual_seed(1)
    big_w = torch.full((40, 200), float("nan"))
    big_w[:20, :128] = torch.randn(20, 128, generator=gen)
    big_x = torch.full((10, 200), float("nan"))
    big_x[:3, :128] = torch.randn(3, 128, generator=gen)
    got = skinny_gemm(big_x[:3, :128], big_w[:20, :128], GemvConfig(32, 64, 4, 3))
    torch.testing.assert_close(got, F.linear(big_x[:3, :128].contiguous(), big_w[:20, :128].contiguous()),
                               rtol=1e-5, atol=1e-4)


# Split-K: each output tile's K shared by SPLIT_K programs, the last to finish summing the
# partials in order 0..SPLIT_K-1 (kernels_explained/gemv.md, 4c). Small shapes: the
# interpreter runs every program in turn.
@pytest.mark.parametrize("m", [1, 17, 33, 64])
@pytest.mark.parametrize("n,k,config", [
    (70, 200, "n32-k32-w4-s2-split4"),    # 7 slices over 4 programs: 1, 2, 2, 2; N 70 = 2 tiles + 6
    (40, 64, "n32-k32-w4-s2-split4"),     # 2 slices over 4: two programs get none
    (130, 512, "n128-k128-w8-s4-split2"),  # whole slices, K exactly split
])
@pytest.mark.slow
def test_split_k_matches_f_linear(m, n, k, config):
    from llmlab.kernels.dense import skinny_gemm as triton_skinny_gemm
    from llmlab.kernels.dense.gemv import GemvConfig

    gen = torch.Generator().manual_seed(m * n + k)
    weight = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen)
    cfg = GemvConfig.from_name(config)
    # every partial a program leaves in the workspace counts, an empty share's zeros too:
    # NaN there before the call would show in the result
    triton_skinny_gemm.skinny_gemm(x, weight, cfg)
    for workspace, _ in triton_skinny_gemm._split_buffers.values():
        workspace.fill_(float("nan"))
    got = triton_skinny_gemm.skinny_gemm(x, weight, cfg)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_split_k_is_bitwise_repeatable_and_leaves_counters_at_zero():
    """Two calls give the same bits (the reduction's order is fixed), and each leaves every
    tile counter at 0, which the next call and CUDA graph replays count from."""
    from llmlab.kernels.dense import skinny_gemm as triton_skinny_gemm
    from llmlab.kernels.dense.gemv import GemvConfig

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(70, 200, generator=gen)
    x = torch.randn(17, 200, generator=gen)
    config = GemvConfig.from_name("n32-k32-w4-s2-split4")
    first = triton_skinny_gemm.skinny_gemm(x, weight, config)
    second = triton_skinny_gemm.skinny_gemm(x, weight, config)
    assert torch.equal(first, second)
    counters = [c for (_, split, _, _), (_, c) in triton_skinny_gemm._split_buffers.items() if split == 4]
    assert counters and all(int(c.abs().sum()) == 0 for c in counters)


@pytest.mark.slow
def test_split_k_reuses_its_workspace_for_any_row_count():
    """One workspace per (device, split, padded N, tiles), sized for 64 rows on the first call, so a
    CUDA graph captured after an eager call of another batch size allocates nothing."""
    from llmlab.kernels.dense import skinny_gemm as triton_skinny_gemm
    from llmlab.kernels.dense.gemv import GemvConfig

    config = GemvConfig.from_name("n32-k32-w4-s2-split2")
    weight = torch.randn(40, 64)
    triton_skinny_gemm.skinny_gemm(torch.randn(3, 64), weight, config)
    buffers = dict(triton_skinny_gemm._split_buffers)
    triton_skinny_gemm.skinny_gemm(torch.randn(64, 64), weight, config)
    triton_skinny_gemm.skinny_gemm(torch.randn(20, 64), torch.randn(50, 64), config)   # same padded N
    assert triton_skinny_gemm._split_buffers.keys() == buffers.keys()
    assert all(triton_skinny_gemm._split_buffers[key][0] is buffers[key][0] for key in buffers)


@pytest.mark.slow
def test_split_k_tiles_of_another_width_and_the_same_padded_n_get_their_own_counters():
    """96 outputs pad to 128 in one 128-wide tile or two 64-wide ones: the second needs two
    counters, not the one the first left behind."""
    from llmlab.kernels.dense import skinny_gemm as triton_skinny_gemm
    from llmlab.kernels.dense.gemv import GemvConfig

    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(96, 64, generator=gen)
    x = torch.randn(5, 64, generator=gen)
    for name in ("n128-k32-w4-s2-split2", "n64-k32-w4-s2-split2", "n128-k32-w4-s2-split2"):
        got = triton_skinny_gemm.skinny_gemm(x, weight, GemvConfig.from_name(name))
        torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-4)
    assert all(int(c.abs().sum()) == 0 for _, c in triton_skinny_gemm._split_buffers.values())


def test_config_names_round_trip():
    from llmlab.kernels.dense.gemv import GemvConfig

    for name in ("n16-k256-w4-s3", "n128-k128-w8-s4-split8", "n64-k64-w8-s3-m128"):
        assert GemvConfig.from_name(name).name == name
    assert GemvConfig.from_name("n64-k128-w4-s5-split2").split_k == 2
    assert GemvConfig.from_name("n64-k128-w4-s5-m64") == GemvConfig(64, 128, 4, 5, 1, 64)
    assert GemvConfig.from_name("n64-k128-w4-s5").split_k == 1
    with pytest.raises(ValueError):
        GemvConfig.from_name("n64-k128-split2")


def test_prefetch_lines(monkeypatch):
    """How much of its weight rows a skinny-GEMM program asks L2 for before it waits: ~32 KB
    a program, a power of two of 128-byte lines, none without PDL or with LLMLAB_PREFETCH=0."""
    from llmlab.kernels.triton import pdl

    x = torch.zeros(1)
    assert pdl.prefetch_lines(x, 32, 8192) == 0          # a CPU tensor: no PDL, nothing to overlap
    monkeypatch.setattr(pdl, "use_pdl", lambda tensor: True)
    assert [pdl.prefetch_lines(x, rows, 8192) for rows in (32, 64, 128)] == [8, 4, 2]
    assert pdl.prefetch_lines(x, 32, 384) == 2           # a row of 3 lines: 2, a power of two
    assert pdl.prefetch_lines(x, 256, 8192) == 1
    monkeypatch.setattr(kernels.knobs, "prefetch_kb", 64)   # LLMLAB_PREFETCH=64
    assert pdl.prefetch_lines(x, 32, 8192) == 16
    monkeypatch.setattr(kernels.knobs, "prefetch_kb", 0)    # LLMLAB_PREFETCH=0
    assert pdl.prefetch_lines(x, 32, 8192) == 0


@pytest.mark.slow
def test_skinny_gemm_takes_up_to_256_rows_without_split_k():
    """Past the engine's 64 rows (the bench times 128-256 against cuBLAS): one tile holds every
    row, padded to a power of two, or block_m rows each; a split-K tile still takes 64 at most
    and does not split rows."""
    from llmlab.kernels.dense.gemv import GemvConfig
    from llmlab.kernels.dense.skinny_gemm import MORE_ROWS, skinny_gemm

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 96, generator=gen)
    for m in (100, MORE_ROWS):
        x = torch.randn(m, 96, generator=gen)
        for config in (GemvConfig(32, 64, 4, 3), GemvConfig(32, 64, 4, 3, block_m=32), GemvConfig.from_name(
                "n16-k32-w4-s2-m64")):   # every row in one tile, or tiles of 32 / 64 rows (the last one short)
            torch.testing.assert_close(skinny_gemm(x, weight, config), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    with pytest.raises(AssertionError, match="1..64 rows"):
        skinny_gemm(torch.zeros(65, 96), weight, GemvConfig(32, 64, 4, 3, split_k=2))
    with pytest.raises(AssertionError, match="not both"):
        skinny_gemm(torch.zeros(8, 96), weight, GemvConfig(32, 64, 4, 3, split_k=2, block_m=16))
    with pytest.raises(AssertionError, match=f"1..{MORE_ROWS} rows"):
        skinny_gemm(torch.zeros(MORE_ROWS + 1, 96), weight, GemvConfig(32, 64, 4, 3))
