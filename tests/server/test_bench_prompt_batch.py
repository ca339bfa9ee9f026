"""`llmlab bench prompt-batch` against a live `llmlab serve` (the embedded model): every
repeat sends one request of all the prompts and as many one-prompt requests, each answered
with a choice per prompt, and the server finishes exactly those requests' prompts."""
import argparse

import pytest

from helpers.server import metrics
from llmlab.bench import prompt_batch

pytestmark = pytest.mark.slow


def finished(url) -> float:
    return sum(v for name, v in metrics(url).items() if name.startswith("llmlab_requests_finished_total{"))


@pytest.mark.parametrize("plain", [False, True])
def test_prompt_batch_times_both_ways_and_sends_what_it_says(embedded_server, plain, capsys):
    parser = argparse.ArgumentParser()
    prompt_batch.add_arguments(parser)
    args = parser.parse_args(["--base-url", embedded_server.url, "--batch", "3", "--prompt-tokens", "8",
                              "--repeats", "2"] + (["--plain"] if plain else []))
    before = finished(embedded_server.url)
    report = prompt_batch.main(args)
    # a warm-up batch, then per repeat one batch of 3 and 3 single prompts
    assert finished(embedded_server.url) - before == 3 + 2 * (3 + 3)
    assert [len(report["seconds"][mode]) for mode in ("batched", "concurrent")] == [2, 2]
    assert all(t > 0 for times in report["seconds"].values() for t in times)
    assert report["echo_logprobs"] is not plain
    assert "batched / concurrent" in capsys.readouterr().out


def test_a_request_the_server_refuses_is_an_error_not_a_time(embedded_server):
    parser = argparse.ArgumentParser()
    prompt_batch.add_arguments(parser)
    args = parser.parse_args(["--base-url", embedded_server.url, "--batch", "2", "--prompt-tokens", "9000",
                              "--repeats", "1"])      # longer than the model's context: a 400
    with pytest.raises(RuntimeError, match="HTTP 400"):
        prompt_batch.main(args)
