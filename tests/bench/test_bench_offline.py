"""`llmlab bench offline` runs the paths users take: several sampling settings side by side,
prefix caching off and on from a cold cache each time, prompts sharing a prefix."""
from __future__ import annotations

import argparse

import pytest
import torch

from llmlab.bench import offline


def parse(*argv):
    parser = argparse.ArgumentParser()
    offline.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_settings_and_workload():
    args = parse("--num-requests", "6", "--input-len", "5", "--output-len", "3", "--prefix-len", "20",
                 "--num-prefixes", "2", "--temperature", "0.7", "--top-p", "0.9",
                 "--compare", "greedy", "temperature=1.0,top_k=50,seed=3")
    settings = offline.sampling_settings(args)
    assert [offline.describe(s) for s in settings] == [
        "temperature=0.7, top_p=0.9", "greedy", "temperature=1.0, top_k=50, seed=3"]
    workload = offline.build_workload(args, vocab_size=1000)
    prompts = [r.prompt_token_ids for r in workload]
    assert [len(ids) for ids in prompts] == [25] * 6 and [r.output_len for r in workload] == [3] * 6
    assert prompts[0][:20] == prompts[2][:20] != prompts[1][:20]
    assert workload == offline.build_workload(args, vocab_size=1000)          # seeded


@pytest.mark.slow
def test_runs_every_setting_with_prefix_caching_off_and_on(tmp_path):
    # 2 output tokens: a prefill and a decode step per request; each token more is 6 steps of
    # the embedded model per engine (3 requests one at a time, 2 settings)
    args = parse("--num-requests", "3", "--input-len", "40", "--output-len", "2", "--prefix-len", "32",
                 "--compare", "temperature=0.7,top_p=0.9,seed=1", "--compare-prefix-caching",
                 "--num-gpu-blocks", "64", "--max-num-seqs", "1", "--warmup", "light", "--out", str(tmp_path / "r.json"))
    results = offline.main(args)
    assert [(r["sampling"], r["prefix_caching"]) for r in results] == [
        ("greedy", False), ("temperature=0.7, top_p=0.9, seed=1", False),
        ("greedy", True), ("temperature=0.7, top_p=0.9, seed=1", True)]
    # one request at a time, from a cold cache each time: requests 2 and 3 find the 2-block prefix
    assert results[2]["prefix_hit_rate"] == results[3]["prefix_hit_rate"] > 0
    assert (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_reports_each_runs_share_of_the_bound(capsys):
    """--roofline: the same requests simulated through the engine's scheduler at the given
    ceilings (experiments/roofline.py); every llmlab row gets its share of that bound."""
    from llmlab.experiments import simulate
    from llmlab.experiments.roofline import Roofline

    args = parse("--num-requests", "3", "--input-len", "20", "--output-len", "3", "--num-gpu-blocks", "64",
                 "--warmup", "light", "--roofline", "0.02,0.5")
    results = offline.main(args)
    llm = offline.build_llm(args)   # the same engine, to compute the bound independently here
    workload = offline.build_workload(args, llm.engine.model_config.vocab_size)
    expected = simulate(workload, llm.engine.config, Roofline.of_engine(llm.engine, 0.02, 0.5)).summary()
    row = results[0]
    assert row["of_bound"] == pytest.approx(row["output_tokens_per_s"] / expected["output_tok_s"])
    in_sequence = simulate(workload, llm.engine.config,
                           Roofline.of_engine(llm.engine, 0.02, 0.5, overlapped=False)).summary()["output_tok_s"]
    assert row["of_bound_in_sequence"] == pytest.approx(row["output_tokens_per_s"] / in_sequence)
    assert in_sequence <= expected["output_tok_s"]
    assert "bound: " in capsys.readouterr().out
    args = parse("--num-requests", "2", "--input-len", "8", "--output-len", "2", "--warmup", "light")
    assert "of_bound" not in offline.main(args)[0]   # no bound on a CPU unless asked for


def test_the_random_model_takes_the_command_lines_engine_flags():
    """`--model random-llama3-8b` (the GPU benchmarks) builds its EngineConfig from the
    command line: flags left unset (None in the namespace) keep the defaults, set ones win."""
    from llmlab.bench.common import random_engine_config
    from llmlab.cli_flags import engine_kwargs

    args = parse("--model", "random-llama3-8b", "--kv-cache-dtype", "int8", "--gpu-memory-utilization", "0.25")
    config = random_engine_config(args, engine_args=engine_kwargs(args))
    assert (config.enforce_eager, config.tensor_parallel_size) == (False, 1)
    assert (config.kv_cache_dtype, config.gpu_memory_utilization) == ("int8", 0.25)
    args = parse("--model", "random-llama3-8b", "--enforce-eager")
    assert random_engine_config(args, engine_args=engine_kwargs(args)).enforce_eager is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_the_random_8b_model_on_a_cpu_is_a_clear_error_before_any_weight_is_made(monkeypatch):
    """32 GB of float32 weights would be built first, and the process killed for memory."""
    from llmlab.model.llama import LlamaModel

    def never(*args, **kwargs):
        raise AssertionError("weights built before the device was checked")

    monkeypatch.setattr(LlamaModel, "random", never)
    for argv in (["--model", "random-llama3-8b"], ["--model", "random-llama3-8b", "--device", "cuda"]):
        with pytest.raises(ValueError, match="CUDA"):
            offline.build_llm(parse(*argv))


def test_logprobs_is_a_sampling_setting():
    """`--logprobs K` (and logprobs=K in --compare) times the engine with every token's logprob
    and its K most likely alternatives computed (#34's aim: >= 0.95x of the same run without)."""
    args = parse("--logprobs", "5", "--compare", "greedy", "temperature=0.8,top_p=0.95,logprobs=5")
    settings = offline.sampling_settings(args)
    assert [offline.describe(s) for s in settings] == [
        "greedy, logprobs=5", "greedy", "temperature=0.8, top_p=0.95, logprobs=5"]
    from llmlab import SamplingParams

    assert SamplingParams(**settings[0]).logprobs == 5 and SamplingParams(**settings[1]).logprobs is None
