"""`llmlab bench head-of-line --flood-clients`: its arguments, the flood it sends (the one
tests/server/test_tokenize_flood.py sends too), and a small run's report. No timing is
checked: the numbers are for BENCHMARKS.md, measured on a quiet machine."""
from __future__ import annotations

import json

import pytest

from llmlab import cli
from llmlab.bench.flood import completion_body, flood_prompt, latencies


def test_a_million_byte_prompt_makes_the_issues_body():
    assert len(completion_body(flood_prompt(1_000_000))) == 1_000_031
    assert flood_prompt(30) == "hello world hello world hello "


def test_p90_is_the_nearest_rank():
    assert latencies([0.3, 0.1, 0.2]) == {"p50_s": 0.2, "p90_s": 0.3, "max_s": 0.3, "seconds": [0.3, 0.1, 0.2]}
    many = latencies([i / 10 for i in range(1, 21)])     # 0.1 ... 2.0
    assert (many["p50_s"], many["p90_s"], many["max_s"]) == (pytest.approx(1.05), 1.8, 2.0)


@pytest.mark.parametrize("argv, message", [
    (["--flood-clients", "4,0"], "expected client counts such as 4,12,16, got '4,0'"),
    (["--flood-clients", "four"], "expected client counts such as 4,12,16, got 'four'"),
    (["--flood-clients", "4", "--samples", "0"], "--samples: must be a positive integer"),
    (["--flood-clients", "4", "--big-prompt-kb", "900"], "--flood-clients and --big-prompt-kb are two measurements"),
])
def test_bad_arguments_are_one_error_line_before_any_server_starts(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "head-of-line", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err, err


@pytest.mark.slow       # starts an `llmlab serve` of the embedded model
def test_a_small_flood_reports_every_setting(capsys, tmp_path):
    """One client sending 30 kB prompts to a server whose context is 256 tokens: every one
    is refused by the character bound (255 x 81 characters), the report has the idle and
    the flood's latencies, the answers, /health and the machine; the engine flags reach the
    server the command starts."""
    out = tmp_path / "flood.json"
    cli.main(["bench", "head-of-line", "--flood-clients", "1", "--samples", "2", "--flood-kb", "30",
              "--device", "cpu", "--num-gpu-blocks", "64", "--max-model-len", "256", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["server"] == "llmlab serve --device cpu --num-gpu-blocks 64 --max-model-len 256"
    assert result["flood_body_bytes"] == 30_031 and result["samples"] == 2
    assert len(result["idle"]["seconds"]) == 2 and result["idle"]["p50_s"] > 0
    [setting] = result["settings"]
    assert setting["clients"] == 1 and len(setting["seconds"]) == 2
    assert setting["ratio_to_idle_p50"] == pytest.approx(setting["p50_s"] / result["idle"]["p50_s"])
    assert setting["flood_statuses"] == {"400 context_length_exceeded": setting["flood_requests"]}
    assert setting["flood_requests"] >= 1 and setting["flood_seconds"] > 0
    assert setting["health"]["status"] == 200
    assert {"cpu", "cores", "load"} <= set(result["machine"])
    printed = capsys.readouterr().out
    assert "30,031-byte prompts" in printed and "400 context_length_exceeded" in printed
    assert printed.splitlines()[-1].split("|")[0].strip() == "1"     # one row, for one client
