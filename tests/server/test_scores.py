"""Scores through a real `llmlab serve` (issues #34, #40): the log-likelihoods an evaluation
harness reads from `/v1/completions` (a batch of token-id prompts, `echo`, `logprobs: 1`,
`max_tokens` 1 or 0, `temperature: 0`, as lm-evaluation-harness's `local-completions` sends
them) equal HF transformers' own forward over the same weights.

The checkpoint is a tiny random llama3 written by transformers (tests/helpers/hf_checkpoints.py)
and served from its folder, which holds no tokenizer: the prompts are token ids, and tokens
are named "token_id:N". A slow variant does the same on the embedded SmolLM2 against HF's
loading of its GGUF, with the model's tokenizer.
"""
from __future__ import annotations

import os

import httpx
import pytest
import torch

from helpers.hf_checkpoints import VOCAB_SIZE, build_hf_model, save
from helpers.server import serve_process

# float32 on both sides, 2 layers, other summation orders (paged attention, fused projections):
# log-probabilities agree to ~1e-6; 1e-4 still catches any misplaced row or token
ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_and_server(tmp_path_factory):
    hf = build_hf_model("llama3", seed=5)
    folder = save(hf, tmp_path_factory.mktemp("llama3") / "tiny-llama3", "safetensors")
    log_path = folder.parent / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "LLMLAB_API_KEY"}
    with open(log_path, "w") as log, serve_process(["--model", str(folder), "--device", "cpu", "--dtype", "float32",
                                                    "--log-level", "warning"], log, env) as url:
        yield hf, url


def prompts(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB_SIZE, (int(n),), generator=gen).tolist()
            for n in torch.randint(4, 40, (count,), generator=gen)]


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i scores the token after position i."""
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def score(url: str, batch: list[list[int]], max_tokens: int) -> dict:
    body = {"model": "tiny-llama3", "prompt": batch, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
            "seed": 1234, "echo": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def check_scores(hf, batch, answer, max_tokens, atol):
    """Every prompt token's logprob and top-1 (HF's), then the generated token's."""
    for choice, ids in zip(sorted(answer["choices"], key=lambda c: c["index"]), batch, strict=True):
        logprobs = choice["logprobs"]
        expected = hf_logprobs(hf, ids)
        generated = [expected[-1].argmax().item()][:max_tokens]      # greedy
        tokens = ids + generated
        assert len(logprobs["token_logprobs"]) == len(tokens)
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        want = [expected[i - 1, tokens[i]].item() for i in range(1, len(tokens))]
        assert logprobs["token_logprobs"][1:] == pytest.approx(want, abs=atol)
        for i, top in enumerate(logprobs["top_logprobs"][1:], start=1):
            assert max(top.values()) == pytest.approx(expected[i - 1].max().item(), abs=atol)
            assert len(top) in (1, 2)      # the most likely, and the token itself when it is not that one
        # what lm-eval sums for a continuation: the prompt's last tokens (here its second half)
        ctxlen = len(ids) // 2
        ours = sum(logprobs["token_logprobs"][ctxlen:len(ids)])
        assert ours == pytest.approx(sum(want[ctxlen - 1:len(ids) - 1]), abs=atol * len(ids))


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", [1, 0])
def test_loglikelihoods_of_a_batch_equal_hf_transformers(hf_and_server, max_tokens):
    hf, url = hf_and_server
    batch = prompts(12)
    answer = score(url, batch, max_tokens)
    check_scores(hf, batch, answer, max_tokens, ATOL)
    assert answer["choices"][0]["logprobs"]["tokens"][0] == f"token_id:{batch[0][0]}"
    assert answer["usage"]["prompt_tokens"] == sum(map(len, batch))
    assert answer["usage"]["completion_tokens"] == max_tokens * len(batch)
    metrics = httpx.get(f"{url}/metrics").text
    assert "llmlab_num_requests_running 0.0" in metrics


@pytest.mark.slow
def test_loglikelihoods_on_the_embedded_model_equal_hf_on_its_gguf(embedded_server, llm, hf_model):
    """The same request to the embedded model, its prompts from its tokenizer (a multiple-choice
    question and its answers, as lm-eval builds them), against HF's loading of the GGUF."""
    context = "Question: What is the capital of France?\nAnswer:"
    batch = [llm.tokenizer.encode(context + answer) for answer in (" Paris", " Berlin", " Madrid", " Rome")]
    body = {"prompt": batch, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    answer = httpx.post(f"{embedded_server.url}/v1/completions", json=body, timeout=300).json()
    # 30 float32 layers summed in other orders: logits differ by up to ~1e-3 (test_parity.py),
    # so a log-probability (a logit minus a log-sum-exp) by as much
    check_scores(hf_model, batch, answer, 1, atol=2e-3)
    tokens = answer["choices"][0]["logprobs"]["tokens"]
    assert "".join(tokens[:len(batch[0])]) == context + " Paris"
