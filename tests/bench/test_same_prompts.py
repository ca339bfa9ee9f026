"""`bench offline --dataset serving-synthetic --workload-seed S` runs the prompts `bench serving
--seed S` sends (bench/prompts.py): the same token ids and output lengths, so the two give the
server / offline ratio of issue 36. Checked end to end: bench serving's client against a real
server, and the offline workload on the same engine, greedy."""
from __future__ import annotations

import argparse
import math

import pytest

import llmlab
from llmlab.bench import offline, serving

LENGTHS = ["--mean-input-len", "12", "--max-input-len", "24", "--mean-output-len", "4", "--max-output-len", "6"]


def offline_args(*argv):
    parser = argparse.ArgumentParser()
    offline.add_arguments(parser)
    return parser.parse_args(["--dataset", "serving-synthetic", *LENGTHS, *argv])


@pytest.fixture(scope="module")
def llm():
    # random weights with the embedded tokenizer: text in and out, in a few MB
    return llmlab.LLM("random-llama3-tiny", tokenizer="embedded", device="cpu", num_gpu_blocks=256)


def test_the_same_seed_gives_the_same_token_ids_on_both_paths(llm):
    from llmlab.server.app import create_app

    from helpers.server import running

    workload = offline.serving_workload(offline_args("--workload-seed", "3", "--num-requests", "4"), llm.engine)
    params = [llmlab.SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in workload]
    offline_outputs = llm.generate([r.prompt_token_ids for r in workload], params)

    serving_parser = argparse.ArgumentParser()
    serving.add_arguments(serving_parser)
    serving_args = serving_parser.parse_args(["--seed", "3", "--num-prompts", "4", *LENGTHS])
    prompts = serving.synthetic_prompts_of(serving_args, serving_args.num_prompts, serving_args.seed)
    with running(create_app(llm.engine)) as url:
        report = serving.run(url, [math.inf], prompts, progress=False, seed=3)
    sent = report["results"][0]["requests"]

    assert [r["error"] for r in sent] == [None] * 4
    # the server counted the offline prompt's tokens, and generated its output length...
    assert [r["prompt_tokens"] for r in sent] == [len(r.prompt_token_ids) for r in workload]
    assert [r["output_tokens"] for r in sent] == [r.output_len for r in workload] == [p.output_len for p in prompts]
    # ...and, greedy on the same weights, the same text: the same prompt token ids
    assert [r["text"] for r in sent] == [o.text for o in offline_outputs]
    assert all(len(o.token_ids) == r.output_len for o, r in zip(offline_outputs, workload))


def test_another_seed_gives_other_prompts(llm):
    three = offline.serving_workload(offline_args("--workload-seed", "3", "--num-requests", "4"), llm.engine)
    again = offline.serving_workload(offline_args("--workload-seed", "3", "--num-requests", "4"), llm.engine)
    four = offline.serving_workload(offline_args("--workload-seed", "4", "--num-requests", "4"), llm.engine)
    assert three == again and [r.prompt_token_ids for r in three] != [r.prompt_token_ids for r in four]


def test_serving_synthetic_needs_a_tokenizer():
    engine = llmlab.LLM("random-llama3-tiny", device="cpu", num_gpu_blocks=16).engine   # token ids only
    with pytest.raises(ValueError, match="needs a tokenizer"):
        offline.serving_workload(offline_args("--num-requests", "2"), engine)
