"""What the command line says to bad input: one line naming the flag or the file, exit
status 2, never a traceback (found by a helper that ran every command with odd values)."""
from __future__ import annotations

import pytest

from llmlab import cli


def fails_with(capsys, argv, *words):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for word in words:
        assert word in err, err
    return err


@pytest.mark.parametrize("argv,flag", [
    (["bench", "offline", "--num-requests", "0"], "--num-requests"),
    (["bench", "serving", "--num-prompts", "0"], "--num-prompts"),
    (["bench", "serving", "--max-concurrency", "0"], "--max-concurrency"),
    (["bench", "hooks", "--steps", "0"], "--steps"),
    (["bench", "sampler", "--repeats", "x"], "--repeats"),
    (["bench", "kv-quant", "--num-tokens", "0"], "--num-tokens"),
])
def test_counts_that_cannot_be_zero(capsys, argv, flag):
    fails_with(capsys, argv, flag, "positive integer")


def test_convert_refuses_an_occupied_output_before_converting(capsys, tmp_path):
    from llmlab.model.loader import embedded_gguf_path

    occupied = tmp_path / "notes"
    occupied.mkdir()
    (occupied / "todo.txt").write_text("mine")
    fails_with(capsys, ["convert", str(embedded_gguf_path()), str(occupied)], "existing folder", "new or empty")
    assert [p.name for p in occupied.iterdir()] == ["todo.txt"]
    a_file = tmp_path / "model.bin"
    a_file.write_text("x")
    fails_with(capsys, ["convert", str(embedded_gguf_path()), str(a_file)], "existing file")


def test_missing_files_and_out_folders_and_no_server(capsys, tmp_path):
    fails_with(capsys, ["bench", "simulate", "--cost-model", str(tmp_path / "none.json")], "No such file")
    fails_with(capsys, ["bench", "serving", "--dataset", str(tmp_path / "none.jsonl"), "--base-url",
                        "http://127.0.0.1:9"], "No such file")
    # checked before the benchmark runs, so no result is lost at the end
    fails_with(capsys, ["bench", "offline", "--out", str(tmp_path / "no" / "dir" / "r.json")], "does not exist")
    fails_with(capsys, ["bench", "serving", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"],
               "ConnectError", "server running")


@pytest.mark.parametrize("argv,words", [
    (["bench", "offline", "--compare", "temperature"], ["--compare", "temperature needs a number"]),
    pytest.param(["bench", "offline", "--min-len", "8", "--max-len", "4"], ["--min-len 8", "min <= max"],
                 marks=pytest.mark.slow),       # it builds the engine before it checks the lengths
    (["bench", "serving", "--rate", "abc"], ["--rate must be positive numbers"]),
    (["bench", "serving", "--burstiness", "0"], ["--burstiness must be a positive number"]),
    (["bench", "serving", "--goodput", "latency:3"], ["--goodput 'latency:3'", "ttft, tpot, e2el"]),
    (["bench", "serving", "--metric-percentiles", "100"], ["--metric-percentiles"]),
    (["bench", "simulate", "--cost-model", "c.json", "--prompt-len", "32"], ["--prompt-len must be LOW,HIGH"]),
    (["bench", "simulate", "--cost-model", "c.json", "--output-len", "9,3"], ["--output-len", "LOW <= HIGH"]),
    (["bench", "calibrate", "--out", "cal", "--preset", "tiny", "--fit-prompt-len", "4"],
     ["--fit-prompt-len must be LOW,HIGH"]),
    (["bench", "calibrate", "--out", "cal", "--preset", "tiny", "--fit-long-prompt-len", "4"],
     ["--fit-long-prompt-len must be LOW,HIGH"]),
])
def test_values_whose_error_names_the_flag(capsys, argv, words):
    fails_with(capsys, argv, *words)


def test_unknown_names_are_refused_before_anything_runs(capsys):
    fails_with(capsys, ["bench", "gemv", "--configs", "nosuch"], "--configs", "nosuch")
    fails_with(capsys, ["bench", "decode-variants", "--cache-dtypes", "int4"], "--cache-dtypes", "int4")
    fails_with(capsys, ["bench", "prefill-variants", "--cache-dtypes", "int4"], "--cache-dtypes", "int4")
    fails_with(capsys, ["bench", "prefill-variants", "--shapes", "4096"], "--shapes", "SEQSxQUERIESxCONTEXT")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("argv", [["generate", "hi", "--device", "cuda"], ["bench", "sampler", "--device", "cuda"],
                                  ["bench", "decode-variants", "--device", "cuda"],
                                  ["bench", "prefill-variants", "--device", "cuda"]])
def test_a_cuda_device_this_machine_lacks(capsys, argv):
    fails_with(capsys, argv, "no CUDA device here")
