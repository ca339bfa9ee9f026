"""CUDA graphs of steps that hold a prompt (cuda_graphs/prompt.py), on a GPU:
the same logits as the eager forward for prefill-only and mixed steps of every padded size
(token counts that are not multiples of 16, one token, the largest size), over float32,
bf16 and int8 caches; an engine that replays them gives eager's greedy tokens for requests
that arrive while others decode; and the cases that must stay eager do."""
import pytest
import torch

from llmlab import EngineConfig, LLMEngine, SamplingParams
from llmlab.config import ModelConfig
from llmlab.engine.batch import dummy_plan
from llmlab.cuda_graphs.prompt import MAX_PROMPTS, TOKEN_SIZES
from llmlab.model.llama import LlamaModel

from helpers.engine import SMALL_LLAMA3

pytestmark = pytest.mark.gpu


def engine_of(dtype="float32", enforce_eager=False, **kwargs) -> LLMEngine:
    config = EngineConfig(device="cuda", dtype=dtype, backend="triton", enforce_eager=enforce_eager,
                          num_gpu_blocks=512, max_num_seqs=16, max_num_batched_tokens=1024, **kwargs)
    model = LlamaModel.random(ModelConfig.from_hf(SMALL_LLAMA3), config.resolved_dtype(), "cuda", seed=1)
    return LLMEngine(config, model=model)


# (prefill (chunk, context) pairs, decode contexts): prefill-only, mixed, a chunk after a
# cached prefix, token counts of 1, 16, 17, 100, 300 and 512 (the largest graph)
PLANS = [([(1, 1)], []), ([(16, 16)], []), ([(17, 17)], []), ([(7, 30), (60, 60)], [5, 90, 33]),
         ([(100, 100)], [40] * 15), ([(287, 287)], [2, 700, 64] * 4 + [1]), ([(500, 900)], [3] * 12),
         ([(20, 20)], [3000])]   # one long decode: flash-decoding splits eagerly, one split in the graph


# float32: the same logits (the check that sees a wrong row, slot or layer); bf16: a graph's
# matmuls run on the padded token count, which rounds differently from the eager step's (a
# 1-token step is a GEMV there), and an int8 cache can turn that into another code: logits
# near 1 differ by about one bf16 step (0.004) on average (measured on the H200)
@pytest.mark.parametrize("dtype,kv_cache_dtype,tol,mean_tol", [("float32", "auto", 1e-4, 1e-5),
                                                                ("bfloat16", "auto", 0.15, 1.5e-2),
                                                                ("bfloat16", "int8", 0.15, 1.5e-2)])
def test_prompt_graphs_give_the_eager_logits(dtype, kv_cache_dtype, tol, mean_tol):
    engine = engine_of(dtype, kv_cache_dtype=kv_cache_dtype)
    runner = engine.runner
    assert runner.prompt_graphs is not None and runner.prompt_graphs.sizes[-1] == 512
    for prefills, decodes in PLANS:
        plan = dummy_plan(runner.block_size, prefills, decodes)
        if decodes == [3000]:
            assert runner.prepare(plan)[2].num_splits > 1
        graphed = runner.forward(*runner.prepare(plan)).float()
        # the graphs wrote the step's K/V (the eager step writes the same values to the same slots)
        eager = runner.forward(*runner.prepare(plan), eager=True).float()
        assert graphed.shape == eager.shape
        torch.testing.assert_close(graphed, eager, atol=tol, rtol=tol)
        assert (graphed - eager).abs().mean() < mean_tol


def test_steps_past_the_largest_graph_and_with_hook_points_run_eagerly():
    engine = engine_of()
    runner = engine.runner
    replays = []
    run = runner.prompt_graphs.run
    runner.prompt_graphs.run = lambda *args: replays.append(1) or run(*args)
    runner.execute(dummy_plan(runner.block_size, [(513, 513)]))    # past 512 tokens
    runner.execute(dummy_plan(runner.block_size, [(2, 2)] * (MAX_PROMPTS + 1)))   # past the prompts a graph holds
    with runner.model.capture():
        runner.execute(dummy_plan(runner.block_size, [(20, 20)], [4]))
    assert replays == []
    runner.execute(dummy_plan(runner.block_size, [(20, 20)], [4]))
    assert replays == [1]


def greedy_with_arrivals(enforce_eager: bool) -> list[list[int]]:
    """Requests that arrive while others decode: every arrival's prefill is a mixed step."""
    engine = engine_of("float32", enforce_eager)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(16, 32000, (n,), generator=gen).tolist() for n in (5, 17, 40, 33, 300, 1, 129, 64)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ids, done, pending = [], {}, list(prompts)
    while pending or engine.has_unfinished_requests():
        if pending:
            ids.append(engine.add_request(pending.pop(0), params))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    stats = engine.kv_stats()
    assert stats["free_device_blocks"] == stats["total_device_blocks"]
    return [done[i] for i in ids]


def test_an_engine_replaying_them_gives_eagers_greedy_tokens():
    assert greedy_with_arrivals(False) == greedy_with_arrivals(True)


def test_sizes_follow_the_token_budget():
    small = EngineConfig(device="cuda", dtype="float32", backend="triton", num_gpu_blocks=128, max_num_seqs=4,
                         max_num_batched_tokens=100)
    model = LlamaModel.random(ModelConfig.from_hf(SMALL_LLAMA3), torch.float32, "cuda", seed=1)
    runner = LLMEngine(small, model=model).runner
    assert runner.prompt_graphs.sizes == [s for s in TOKEN_SIZES if s <= 100]
