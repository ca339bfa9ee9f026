"""The clients vLLM's users already run, for real, against a live `llmlab serve` on the
embedded model (issue #40): lm-evaluation-harness (`local-completions` on a small local
multiple-choice task) and GuideLLM (a synthetic workload, throughput profile). Not our
reading of their requests: their own code, from PyPI.

They live in a venv of their own (their own transformers and datasets; the project's
dependencies stay free of both): `make clients` builds it (.venv-clients: lm-eval[api,hf]
0.4.13 and guidellm 0.8.1 beside the project's torch pin) and runs this file with
LLMLAB_CLIENTS_VENV pointing at it; CI runs it after `make test`. Without that variable the
tests are skipped. Everything runs offline: the task's data is
tests/server/clients/llmlab_mc.jsonl, the tokenizer is the embedded model's converted folder.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers.server import metrics

CLIENTS_VENV = os.environ.get("LLMLAB_CLIENTS_VENV")
TASK_DIR = Path(__file__).parent / "clients"
MODEL = "SmolLM2-135M-Instruct"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not CLIENTS_VENV, reason="needs the clients' venv: make clients")]


@pytest.fixture(scope="module")
def tokenizer_dir() -> str:
    """The embedded model's converted folder: config, float32 weights and HF tokenizer files,
    which both clients (and lm-eval's `hf` model) load as a local model."""
    from llmlab.model.loader import resolve_model

    return str(resolve_model(None))


def client(*args: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run a client's command from the clients' venv, offline."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)    # their own packages, not ours
    result = subprocess.run([str(Path(CLIENTS_VENV) / "bin" / args[0]), *args[1:]], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def lm_eval_samples(output: Path) -> dict[int, list[tuple[float, bool]]]:
    """doc id -> (loglikelihood, is_greedy) of each choice, from lm-eval's --log_samples file."""
    (path,) = glob.glob(str(output / "**" / "samples_llmlab_mc_*.jsonl"), recursive=True)
    samples = {}
    for line in Path(path).read_text().splitlines():
        sample = json.loads(line)
        samples[sample["doc_id"]] = [(float(r[0][0]), r[0][1] in (True, "True")) for r in sample["resps"]]
    return samples


def lm_eval_accuracy(output: Path) -> float:
    (path,) = glob.glob(str(output / "**" / "results_*.json"), recursive=True)
    return json.loads(Path(path).read_text())["results"]["llmlab_mc"]["acc,none"]


def test_lm_eval_local_completions_scores_as_its_hf_model_does(embedded_server, tokenizer_dir, tmp_path):
    """lm-eval sends batches of 8 token-id prompts (echo, logprobs 1, max_tokens 1); each of
    the 80 loglikelihoods (20 questions x 4 answers) and its is_greedy flag must match lm-eval's
    own `hf` model on the same float32 weights, and so must the accuracy."""
    url = embedded_server.url
    before = metrics(url)
    client("lm_eval", "--model", "local-completions", "--model_args",
           f"model={MODEL},base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={tokenizer_dir},"
           "tokenized_requests=True,num_concurrent=1,max_retries=1",
           "--batch_size", "8", "--include_path", ".", "--tasks", "llmlab_mc",
           "--output_path", str(tmp_path / "api"), "--log_samples", cwd=TASK_DIR)
    client("lm_eval", "--model", "hf", "--model_args", f"pretrained={tokenizer_dir},dtype=float32", "--device", "cpu",
           "--batch_size", "8", "--include_path", ".", "--tasks", "llmlab_mc",
           "--output_path", str(tmp_path / "hf"), "--log_samples", cwd=TASK_DIR)
    ours, theirs = lm_eval_samples(tmp_path / "api"), lm_eval_samples(tmp_path / "hf")
    assert ours.keys() == theirs.keys() and len(ours) == 20
    for doc in ours:
        for (ll, greedy), (ll_hf, greedy_hf) in zip(ours[doc], theirs[doc], strict=True):
            # float32 both, other summation orders over 30 layers: measured 7.3e-5 at most
            # (lm-eval 0.4.13, transformers 5.25, torch 2.14.1, CPU)
            assert ll == pytest.approx(ll_hf, abs=1e-3), doc
            assert greedy == greedy_hf, doc
    assert lm_eval_accuracy(tmp_path / "api") == lm_eval_accuracy(tmp_path / "hf")
    after = metrics(url)
    # 80 scored continuations, 8 per request: 10 requests, none refused or failed
    def finished(m):    # ("stop" too: the one token generated after a prompt may be EOS)
        return sum(v for name, v in m.items() if name.startswith("llmlab_requests_finished_total{"))
    assert finished(after) - finished(before) == 80
    assert not any(name.startswith(("llmlab_requests_rejected_total", "llmlab_requests_failed_total"))
                   and value > before.get(name, 0) for name, value in after.items())


@pytest.mark.parametrize("request_format", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_throughput_profile_has_no_errored_request(embedded_server, tokenizer_dir, tmp_path, request_format):
    """GuideLLM streams with usage on every chunk (stream_options.continuous_usage_stats),
    ignore_eos and stop null; every request completes with exactly the tokens it asked for."""
    output = tmp_path / "guidellm.json"
    client("guidellm", "run",
           "--backend", f"kind=openai_http,target={embedded_server.url},model={MODEL},request_format={request_format}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
           "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=32",
           "--profile", "kind=throughput,max_concurrency=8", "--constraint", "kind=max_requests,count=16",
           "--output", f"kind=json,path={output}", "--disable-console-interactive", cwd=tmp_path)
    (benchmark,) = json.loads(output.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert (totals["successful"], totals["errored"], totals["incomplete"]) == (16, 0, 0)
    assert benchmark["metrics"]["output_token_count"]["successful"]["total_sum"] == 16 * 32
    tok_s = benchmark["metrics"]["output_tokens_per_second"]["successful"]["mean"]
    print(f"GuideLLM {request_format}: {tok_s:.1f} output tok/s")    # (pytest -s shows it)
    assert tok_s > 0
