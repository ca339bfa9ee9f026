"""Log-probabilities (SamplingParams.logprobs / prompt_logprobs) against an independent
reference: HF transformers' own forward over the same weights (a tiny random llama3 written
by transformers), then the spec's filter (kernels.reference.filter_logits) and log_softmax.

The engine computes them step by step (chunked prefill, decode steps, preemption, async
scheduling); the reference scores each whole sequence in one forward, so a row taken from
the wrong position or step, a wrong filter, or a logprob attached to the wrong request fails.
"""
from __future__ import annotations

import math

import pytest
import torch

from llmlab import LLMEngine, SamplingParams
from llmlab.kernels import reference

from helpers.engine import assert_all_blocks_free, cpu_engine_config, run_all
from helpers.hf_checkpoints import VOCAB_SIZE, build_hf_model, save

# float32 on both sides, 2 layers, different summation orders (paged attention, fused
# projections): log-probabilities agree to ~1e-6; 1e-4 leaves room and still catches any
# misplaced row (neighbouring positions differ by far more)
ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_and_folder(tmp_path_factory):
    hf = build_hf_model("llama3", seed=3)
    folder = tmp_path_factory.mktemp("llama3")
    save(hf, folder, "safetensors")
    return hf, folder


def engine(folder, **overrides) -> LLMEngine:
    return LLMEngine(cpu_engine_config(model=str(folder), **overrides))


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB_SIZE, (int(n),), generator=gen).tolist()
            for n in torch.randint(5, 60, (count,), generator=gen)]


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()       # [len(ids), vocab]


def processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The spec of what a token is drawn from: logits / T, then top-k, top-p, min-p."""
    if params.greedy:
        return logits
    rows = logits.shape[0]
    k = params.top_k if params.top_k > 0 else -1
    return reference.filter_logits(logits / params.temperature, torch.full((rows,), k),
                                   torch.full((rows,), params.top_p), torch.full((rows,), params.min_p))


def check_output_logprobs(hf, prompt, out, params):
    assert len(out.logprobs) == len(out.token_ids)
    ids = prompt + out.token_ids
    expected = processed(hf_logits(hf, ids)[len(prompt) - 1:len(ids) - 1], params).log_softmax(dim=-1)
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry.token_id == token
        assert math.isfinite(entry.logprob), "a sampled token cannot have been cut by the filters"
        assert entry.logprob == pytest.approx(expected[step, token].item(), abs=ATOL), f"step {step}"
        assert len(entry.top) == params.logprobs
        top_values = [lp for _, lp in entry.top]
        assert top_values == sorted(top_values, reverse=True), "the alternatives are most likely first"
        want = expected[step].topk(params.logprobs)
        assert top_values == pytest.approx(want.values.tolist(), abs=ATOL)
        for token_id, lp in entry.top:
            assert lp == pytest.approx(expected[step, token_id].item(), abs=ATOL)
        if params.greedy:
            assert entry.top[0][0] == token and entry.top[0][1] == pytest.approx(entry.logprob)


def check_prompt_logprobs(hf, prompt, out, k):
    assert out.prompt_logprobs[0] is None, "nothing predicts the first prompt token"
    assert len(out.prompt_logprobs) == len(prompt)
    expected = hf_logits(hf, prompt).log_softmax(dim=-1)
    for position in range(1, len(prompt)):
        entry = out.prompt_logprobs[position]
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(expected[position - 1, prompt[position]].item(), abs=ATOL), position
        assert [lp for _, lp in entry.top] == pytest.approx(expected[position - 1].topk(k).values.tolist(), abs=ATOL)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, seed=5, logprobs=5,
                   ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.3, seed=1, logprobs=0, ignore_eos=True),
], ids=["greedy", "filtered", "plain"])
def test_sampled_tokens_logprobs_equal_the_processed_distributions(hf_and_folder, params):
    hf, folder = hf_and_folder
    e = engine(folder)
    batch = prompts(5)
    for prompt, out in zip(batch, run_all(e, batch, params)):
        check_output_logprobs(hf, prompt, out, params)
    assert_all_blocks_free(e)


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(max_num_batched_tokens=16),                               # prompts in chunks
    dict(num_gpu_blocks=12, block_size=8, preemption_mode="recompute", max_num_batched_tokens=64),
    dict(num_gpu_blocks=12, block_size=8, preemption_mode="swap"),
    dict(async_scheduling=False),
], ids=["plain", "chunked", "recompute", "swap", "sync"])
def test_prompt_logprobs_equal_hf_under_every_schedule(hf_and_folder, overrides):
    hf, folder = hf_and_folder
    e = engine(folder, **overrides)
    batch = prompts(6, seed=1)
    params = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=2, logprobs=1, ignore_eos=True)
    for prompt, out in zip(batch, run_all(e, batch, params)):
        check_prompt_logprobs(hf, prompt, out, 2)
        check_output_logprobs(hf, prompt, out, params)
    assert_all_blocks_free(e)


def test_prompt_logprobs_are_computed_even_when_the_prefix_is_cached(hf_and_folder):
    """Prefix caching would skip the cached prompt tokens' forward; a request that asks for
    its prompt's logprobs computes them all instead (and the others still hit the cache)."""
    hf, folder = hf_and_folder
    e = engine(folder, enable_prefix_caching=True, block_size=8)
    shared = prompts(1, seed=4)[0] * 2
    run_all(e, [shared + [1, 2]], SamplingParams(max_tokens=2))
    prompt = shared + [3, 4, 5]
    out = run_all(e, [prompt], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    check_prompt_logprobs(hf, prompt, out, 1)
    assert out.num_cached_prompt_tokens == 0
    hit = run_all(e, [shared + [6]], SamplingParams(max_tokens=2))[0]
    assert hit.num_cached_prompt_tokens > 0


def test_streamed_logprobs_add_up_to_the_final_ones(hf_and_folder):
    _, folder = hf_and_folder
    e = engine(folder)
    params = SamplingParams(max_tokens=10, temperature=0.7, seed=2, logprobs=2, ignore_eos=True)
    request_id = e.add_request(prompts(1)[0], params)
    streamed, final = [], None
    while e.has_unfinished_requests():
        for out in e.step():
            assert out.request_id == request_id
            assert len(out.delta_logprobs) == len(out.delta_token_ids)
            streamed += out.delta_logprobs
            final = out
    assert streamed == final.logprobs and len(streamed) == 10


def test_requests_without_logprobs_get_none_beside_those_with(hf_and_folder):
    _, folder = hf_and_folder
    e = engine(folder)
    a, b = run_all(e, prompts(2), [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, logprobs=1)])
    assert a.logprobs is None and a.prompt_logprobs is None
    assert len(b.logprobs) == 4 and b.prompt_logprobs is None


@pytest.mark.parametrize("field, value", [("logprobs", -1), ("logprobs", 21), ("logprobs", 2.0),
                                          ("prompt_logprobs", -1), ("prompt_logprobs", True)])
def test_bad_logprobs_values_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


# ---- n completions of one prompt ------------------------------------------------------------

def test_n_completions_equal_separate_requests_with_the_derived_seeds(hf_and_folder):
    from llmlab import LLM

    _, folder = hf_and_folder
    llm = LLM(str(folder), device="cpu", dtype="float32", backend="torch", block_size=8)
    prompt = prompts(1, seed=7)[0] + list(range(40))       # several full blocks to share
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=4, logprobs=1, ignore_eos=True)
    together = llm.generate([prompt], params)
    assert len(together) == 4
    alone = [llm.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=11 + i, logprobs=1,
                                                   ignore_eos=True))[0] for i in range(4)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in together}) > 1, "four seeds, four different draws"
    # the siblings found the prompt's full blocks in the cache: computed once, shared
    assert sum(o.num_cached_prompt_tokens for o in together) >= 3 * ((len(prompt) - 1) // 8 * 8)
    assert_all_blocks_free(llm.engine)


def test_the_engine_takes_one_sequence_per_request(hf_and_folder):
    _, folder = hf_and_folder
    e = engine(folder)
    with pytest.raises(ValueError, match="fan_out"):
        e.add_request([1, 2, 3], SamplingParams(n=2))
    assert not e.has_unfinished_requests()
