"""The norm and the residual add folded into the decode step's products (kernels.norm_linear,
kernels.linear_residual; the GEMV and the skinny GEMM with NORM / RESIDUAL / SWIGLU), against
the reference's kernels run one by one; and the model's folded layers against its unfolded
ones, on the CPU through Triton's interpreter and on a GPU."""
import pytest
import torch
import torch.nn.functional as F

from llmlab import kernels
from llmlab.kernels import reference
from llmlab.kernels.dense.gemv import GEMV_CONFIGS, GemvConfig, gemv
from llmlab.kernels.dense.skinny_gemm import config_for as skinny_config_for, skinny_gemm
from llmlab.kernels.triton import linear as triton_linear
from llmlab.model.llama import LlamaModel

EPS = 1e-5


def _nan_framed(rows, cols, gen, scale=1.0):
    """A [rows, cols] view inside a NaN-filled matrix: strided rows, and NaN on every side."""
    big = torch.full((rows + 3, cols + 5), float("nan"))
    big[1:rows + 1, 2:cols + 2] = torch.randn(rows, cols, generator=gen) * scale
    return big[1:rows + 1, 2:cols + 2]


@pytest.mark.parametrize("n,k", [(40, 96), (33, 1500), (7, 1024)])
def test_gemv_folds_norm_residual_and_silu_mul(n, k):
    gen = torch.Generator().manual_seed(n + k)
    weight = _nan_framed(n, k, gen)
    x = torch.randn(1, k, generator=gen) * 3
    gate_up = torch.randn(1, 2 * k, generator=gen)
    norm = torch.randn(k, generator=gen)
    residual = torch.randn(1, n, generator=gen)
    dense = weight.contiguous()
    for config in (GEMV_CONFIGS["n16-k256-w4-s3"], GEMV_CONFIGS["n8-k512-w4-s2"], GEMV_CONFIGS["n4-k1024-w4-s1"]):
        torch.testing.assert_close(gemv(x, weight, config, norm=norm, eps=EPS),
                                   F.linear(reference.rms_norm(x, norm, EPS), dense), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(gemv(x, weight, config, residual=residual),
                                   residual + F.linear(x, dense), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(gemv(gate_up, weight, config, residual=residual, swiglu=True),
                                   residual + F.linear(reference.silu_mul(gate_up), dense), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m,n,k", [(33, 70, 300), (64, 130, 512), (5, 16, 150)])
def test_skinny_gemm_folds_norm_and_residual(m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    weight = _nan_framed(n, k, gen)
    x = _nan_framed(m, k, gen, scale=3.0)
    norm = torch.randn(k, generator=gen)
    residual = _nan_framed(m, n, gen)
    dense = weight.contiguous()
    for config in (skinny_config_for(n, k), GemvConfig(32, 64, 4, 3), GemvConfig(128, 128, 8, 4)):
        torch.testing.assert_close(skinny_gemm(x, weight, config, norm=norm, eps=EPS),
                                   F.linear(reference.rms_norm(x.contiguous(), norm, EPS), dense),
                                   rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(skinny_gemm(x, weight, config, residual=residual),
                                   residual + F.linear(x.contiguous(), dense), rtol=1e-5, atol=1e-4)
    # a split-K tile adds the residual once, after the reduction; it cannot normalize a row it sees part of
    torch.testing.assert_close(skinny_gemm(x, weight, GemvConfig(32, 64, 4, 3, split_k=3), residual=residual),
                               residual + F.linear(x.contiguous(), dense), rtol=1e-5, atol=1e-4)
    with pytest.raises(AssertionError, match="split-K"):
        skinny_gemm(x, weight, GemvConfig(32, 64, 4, 3, split_k=2), norm=norm, eps=EPS)


def _folds_on_cpu(monkeypatch):
    """Let a CPU tensor take the folded path (the interpreter runs the kernels), at the GPU's
    rows, with the knob on."""
    monkeypatch.setattr(kernels.knobs, "fold_norms", True)
    monkeypatch.setattr(triton_linear, "folds", lambda x: kernels.knobs.fold_norms and x.dim() == 2
                        and (x.shape[0] == 1 or 32 < x.shape[0] <= 64))


@pytest.mark.slow
def test_folded_decode_steps_give_the_unfolded_tokens(monkeypatch):
    """A tiny model's engine on the Triton backend: decode steps of 1 and of 40 sequences run
    folded (no rms_norm launch, every layer through folded_decoder_layers) and give the same
    greedy tokens as with knobs.fold_norms off and as the torch backend; a student's rms_norm
    plugged in turns the fold off, so it runs."""
    from llmlab import SamplingParams
    from helpers.engine import cpu_engine, run_all, tiny_model, tiny_prompt

    _folds_on_cpu(monkeypatch)
    model = tiny_model(seed=2)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    folded = []
    monkeypatch.setattr(LlamaModel, "folded_decoder_layers",
                        lambda self, h, *a, _f=LlamaModel.folded_decoder_layers: folded.append(h.shape[0])
                        or _f(self, h, *a))
    for batch in (1, 40):
        prompts = [tiny_prompt(3 + i % 5, seed=i) for i in range(batch)]
        expected = [o.token_ids for o in run_all(cpu_engine(model, num_gpu_blocks=64), prompts, params)]
        folded.clear()
        with kernels.time_kernels() as launches:
            got = run_all(cpu_engine(model, backend="triton", num_gpu_blocks=64), prompts, params)
        assert [o.token_ids for o in got] == expected
        assert folded == [batch] * 3, "every decode step folds; the prefill step does not"
        monkeypatch.setattr(kernels.knobs, "fold_norms", False)
        folded.clear()
        assert [o.token_ids for o in run_all(cpu_engine(model, backend="triton", num_gpu_blocks=64),
                                             prompts, params)] == expected
        assert not folded
        monkeypatch.setattr(kernels.knobs, "fold_norms", True)
        with kernels.override(rms_norm=reference.rms_norm):
            assert [o.token_ids for o in run_all(cpu_engine(model, backend="triton", num_gpu_blocks=64),
                                                 prompts, params)] == expected
        assert not folded
    assert "rms_norm" in launches   # the prefill step's


def test_folds_only_where_the_kernels_take_the_rows(monkeypatch):
    _folds_on_cpu(monkeypatch)
    row, rows = torch.zeros(1, 8), torch.zeros(40, 8)
    assert kernels.folds_add_norm(row, backend="triton") and kernels.folds_add_norm(rows, backend="triton")
    assert not kernels.folds_add_norm(torch.zeros(16, 8), backend="triton")
    assert not kernels.folds_add_norm(torch.zeros(65, 8), backend="triton")
    assert not kernels.folds_add_norm(row, backend="torch")
    for name in ("linear", "rms_norm", "silu_mul"):
        with kernels.override(**{name: getattr(reference, name)}):
            assert not kernels.folds_add_norm(row, backend="triton")
    monkeypatch.undo()
    monkeypatch.setattr(kernels.knobs, "fold_norms", True)
    assert not kernels.folds_add_norm(row, backend="triton"), "a CPU tensor never folds"
    monkeypatch.setattr(kernels.knobs, "fold_norms", False)
    assert not triton_linear.folds(row)


@pytest.mark.gpu
def test_gpu_folded_products_and_step_agree_with_the_pairs(monkeypatch):
    """bf16 on a GPU, Llama-3-8B shapes: each folded product against the pair it replaces, and
    a small Llama-3-shaped model's decode step (1 and 48 sequences) folded against unfolded."""
    from helpers.engine import SMALL_LLAMA3, run_all
    from llmlab import SamplingParams
    from llmlab.config import EngineConfig, ModelConfig
    from llmlab.engine.engine import LLMEngine
    from llmlab.kernels.dense import gemv as dense_gemv, skinny_gemm as dense_skinny_gemm

    monkeypatch.setattr(kernels.knobs, "fold_norms", True)
    folded_calls = []
    for module, name in ((dense_gemv, "gemv"), (dense_skinny_gemm, "skinny_gemm")):
        monkeypatch.setattr(module, name, lambda *a, _f=getattr(module, name), **kw: folded_calls.append(
            sorted(key for key, value in kw.items() if value is not None and value is not False)) or _f(*a, **kw))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((6144, 4096), (28672, 4096), (4096, 4096), (4096, 14336)):
        weight = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).bfloat16()
        norm = (1 + 0.1 * torch.randn(k, generator=gen, device="cuda")).bfloat16()
        for rows in (1, 33, 64):
            x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
            residual = torch.randn(rows, n, generator=gen, device="cuda").bfloat16()
            pair = kernels.linear(kernels.rms_norm(x, norm, EPS, backend="triton"), weight, backend="triton")
            folded_calls.clear()
            got = kernels.norm_linear(x, norm, EPS, weight, backend="triton")
            assert folded_calls == [["eps", "norm"]], "one launch, the norm folded in"
            torch.testing.assert_close(got.float(), pair.float(), rtol=2e-2, atol=2e-2)
            expected = residual + kernels.linear(x, weight)
            folded_calls.clear()
            got = kernels.linear_residual(x, weight, residual, backend="triton")
            assert folded_calls == [["residual"]]
            torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
            if rows == 1 and k == 4096:
                gate_up = torch.randn(1, 2 * k, generator=gen, device="cuda").bfloat16()
                expected = residual + kernels.linear(kernels.silu_mul(gate_up), weight)
                folded_calls.clear()
                got = kernels.linear_residual(gate_up, weight, residual, silu_mul_first=True, backend="triton")
                assert folded_calls == [["residual", "swiglu"]]
                torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)

    model = LlamaModel.random(ModelConfig.from_hf(SMALL_LLAMA3), torch.bfloat16, "cuda", seed=1)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = [torch.randint(16, 32000, (5 + i,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(48)]

    folded = []
    monkeypatch.setattr(LlamaModel, "folded_decoder_layers",
                        lambda self, h, *a, _f=LlamaModel.folded_decoder_layers: folded.append(h.shape[0])
                        or _f(self, h, *a))

    def run(batch, fold):
        monkeypatch.setattr(kernels.knobs, "fold_norms", fold)
        engine = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", backend="triton", num_gpu_blocks=512,
                                        max_num_seqs=64, max_num_batched_tokens=2048), model=model)
        return run_all(engine, prompts[:batch], params)

    for batch in (1, 48):
        folded.clear()
        with_fold = run(batch, True)
        assert batch in folded, "the decode steps (CUDA graphs: at capture) ran folded"
        folded.clear()
        without = run(batch, False)
        assert not folded
        same = [(a, b) for a, b in zip(with_fold, without) if a.token_ids == b.token_ids]
        assert len(same) >= 0.9 * batch, (batch, len(same))   # bf16: a near tie may go either way
        for a, b in same:
            assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=0.05)


def test_folded_products_round_to_x_dtype_before_a_float32_output():
    """out_dtype float32 (the logits): the values are the product's in x's dtype, widened."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 96, generator=gen).half()
    norm = torch.randn(96, generator=gen).half()
    for rows in (1, 40):
        x = torch.randn(rows, 96, generator=gen).half()
        run = gemv if rows == 1 else skinny_gemm
        got = run(x, weight, norm=norm, eps=EPS, out_dtype=torch.float32)
        half = run(x, weight, norm=norm, eps=EPS)
        assert got.dtype == torch.float32 and half.dtype == torch.float16
        assert torch.equal(got, half.float())
