"""`llmlab bench guidellm`: GuideLLM's points read as the loads `bench serving` runs beside
them, and `bench serving`'s prompts of the fixed lengths GuideLLM's synthetic data has. (The
commands themselves, against a live server: tests/server/test_real_clients.py.)"""
import argparse
import json
import math
from pathlib import Path

import pytest

from llmlab.bench import serving
from llmlab.bench import guidellm_vs_serving
from llmlab.bench.guidellm_vs_serving import format_rows, guidellm_point


def benchmark(strategy: dict, tok_s=17.1, errored=0) -> dict:
    """A GuideLLM 0.8 benchmark as its JSON output has it (the fields read, the values made up):
    its requests in no order, each with the time its schedule targeted and the time it started."""
    def summary(mean, median):
        return {"successful": {"mean": mean, "median": median}}

    def request(targeted):
        return {"request_start_time": targeted + 0.01, "info": {"timings": {"targeted_start": targeted}}}

    requests = {"successful": [request(t) for t in (100.5, 100.0, 103.25)], "errored": [request(101.0)],
                "incomplete": [{"request_start_time": 104.0, "info": None}]}   # never scheduled: its start
    return {"config": {"strategy": strategy}, "requests": requests,
            "metrics": {"request_totals": {"successful": 6, "errored": errored, "incomplete": 0, "total": 6 + errored},
                        "output_tokens_per_second": summary(tok_s, 15.0),
                        "time_to_first_token_ms": summary(700.0, 650.0),
                        "inter_token_latency_ms": summary(210.0, 200.0),
                        "prompt_token_count": summary(16.0, 16.0)}}


@pytest.mark.parametrize("strategy, rate, concurrency, name", [
    ({"type_": "synchronous", "worker_count": 1, "max_concurrency": 1}, math.inf, 1, "synchronous"),
    ({"type_": "throughput", "worker_count": 4, "max_concurrency": 4, "rampup_duration": 0.0}, math.inf, 4,
     "throughput"),
    ({"type_": "poisson", "worker_count": 4, "max_concurrency": 4, "rate": 2.1403836, "random_seed": 42}, 2.1403836,
     4, "poisson 2.14/s"),
])
def test_each_guidellm_point_becomes_the_load_bench_serving_runs(strategy, rate, concurrency, name):
    point = guidellm_point(benchmark(strategy), max_concurrency=16)
    assert (point["rate"], point["max_concurrency"], point["point"]) == (rate, concurrency, name)
    assert point["guidellm"] == {"output_tok_s": 17.1, "successful": 6, "errored": 0, "incomplete": 0,
                                 "ttft_p50_ms": 650.0, "itl_p50_ms": 200.0, "mean_prompt_tokens": 16.0}


def test_bench_serving_sends_a_poisson_point_at_guidellms_own_times():
    poisson = guidellm_point(benchmark({"type_": "poisson", "max_concurrency": 4, "rate": 2.0}), max_concurrency=4)
    assert poisson["arrivals"] == [0.0, 0.5, 1.0, 3.25, 4.0]    # every request's, errored ones too
    assert "arrivals" not in guidellm_point(benchmark({"type_": "throughput", "max_concurrency": 4}), 4)


def test_a_point_bench_serving_cannot_run_is_refused():
    with pytest.raises(ValueError, match="concurrent"):
        guidellm_point(benchmark({"type_": "concurrent", "streams": 4}), max_concurrency=16)


def test_the_table_puts_both_throughputs_and_the_errors_side_by_side():
    row = {"run": "throughput", **guidellm_point(benchmark({"type_": "throughput", "max_concurrency": 4}, 20.0, 2),
                                                 max_concurrency=4),
           "serving": {"output_tok_s": 25.0, "completed": 8, "failed": 0, "ttft_p50_ms": 640.0, "itl_p50_ms": 190.0,
                       "mean_prompt_tokens": 17.0, "client_cpu_share": 0.31}}
    row["guidellm"]["client_cpu_share"] = 1.42
    line = format_rows([row]).splitlines()[1]
    assert "20.0" in line and "25.0" in line and "0.80" in line           # GuideLLM / bench serving
    assert line.split("|")[2].strip() == "2"                               # GuideLLM's errored requests
    assert "650 / 640" in line and "200 / 190" in line
    assert "1.42 / 0.31" in line                                           # each client's CPU share


def test_sigma_zero_gives_every_prompt_and_output_the_asked_length():
    prompts = serving.synthetic_prompts(20, 3, mean_input_len=128, mean_output_len=32, sigma=0.0,
                                        max_input_len=128, max_output_len=32)
    assert {len(p.text.split()) for p in prompts} == {128} and {p.output_len for p in prompts} == {32}
    assert len({p.text for p in prompts}) == 20


def test_guidellm_is_given_a_relative_tokenizer_folder_as_a_path_it_can_find(tmp_path, monkeypatch):
    """GuideLLM runs in a temporary folder of its own, where `--tokenizer tok` (a folder here)
    would be read as a hub name and fail; it gets the folder's absolute path."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "guidellm").touch()
    monkeypatch.chdir(tmp_path)
    commands = []

    def run(command, cwd, env, check):
        commands.append(command)
        (Path(cwd) / "guidellm.json").write_text(json.dumps({"benchmarks": []}))

    monkeypatch.setattr(guidellm_vs_serving.subprocess, "run", run)
    args = argparse.Namespace(clients_venv=str(tmp_path / "venv"), guidellm_workers=None,
                              prompt_tokens=16, output_tokens=8)
    for tokenizer, expected in [("tok", str(tmp_path / "tok")), ("org/some-model", "org/some-model")]:
        guidellm_vs_serving.guidellm(args, "http://127.0.0.1:1", "m", tokenizer, "synchronous", 4)
        assert f"kind=huggingface_auto,model={expected}" in commands[-1]
