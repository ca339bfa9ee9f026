"""What `llmlab serve` and `LLM` refuse at start-up, before any model is loaded: a bad value
is one line naming the option and what it takes, and `llmlab serve` exits with status 2
(argparse's status for a bad command line) within seconds, not after a 15 s model load."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import llmlab

pytestmark = pytest.mark.slow     # real servers or engines under a workload: left out by make test-fast

FAST = 20   # seconds: an interpreter start and llmlab's imports; a model load would add ~15 more


def serve(*argv: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """Run `llmlab serve ARGV` to its end (it must not start): (the result, seconds taken)."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "llmlab.cli", "serve", "--device", "cpu", *argv],
                            capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    return result, time.perf_counter() - start


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one error line (argparse prints its usage first); no traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    assert "loading" not in result.stderr, "the model started loading before the option was checked"
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("model", ["", 123, 1.5, b"folder", ["folder"]])
def test_a_model_that_is_no_path_is_a_value_error_naming_what_model_takes(model):
    with pytest.raises(ValueError, match=r"model must be None .* or the path of a HF model folder or a \.gguf file"):
        llmlab.LLM(model=model, device="cpu")


def test_serve_refuses_an_empty_model_before_loading():
    result, seconds = serve("--model", "")
    assert result.returncode == 2, result.stderr
    assert "model must be None" in error_line(result) and seconds < FAST


@pytest.mark.parametrize("argv, env, names", [
    (["--port", "70000"], {}, "--port"),
    (["--port", "-1"], {}, "--port"),
    (["--port", "0"], {}, "--port"),
    (["--max-body-bytes", "0"], {}, "--max-body-bytes"),
    (["--max-body-bytes", "-5"], {}, "--max-body-bytes"),
    (["--allowed-hosts", ""], {}, "--allowed-hosts"),
    (["--allowed-hosts", " , "], {}, "--allowed-hosts"),
    (["--host", ""], {}, "--host"),
    (["--shutdown-timeout", "-1"], {}, "--shutdown-timeout"),
    (["--shutdown-timeout", "nan"], {}, "--shutdown-timeout"),
    (["--served-model-name", ""], {}, "--served-model-name"),
    (["--api-key", "abc "], {}, "--api-key"),           # HTTP strips the space: no client could match it
    (["--api-key", " abc"], {}, "--api-key"),
    (["--api-key", "clé"], {}, "--api-key"),            # Latin-1 or UTF-8? clients differ
    (["--api-key", "a\tb"], {}, "--api-key"),
    ([], {"LLMLAB_API_KEY": "abc\n"}, "--api-key"),     # the environment variable is checked the same way
])
def test_a_bad_startup_option_is_one_line_and_exit_2_before_loading(argv, env, names):
    result, seconds = serve(*argv, env=env)
    assert result.returncode == 2, result.stderr
    line = error_line(result)
    assert line.startswith("llmlab serve: error: argument " + names), line
    assert "abc" not in line and "clé" not in line      # an API key is a secret: never echoed
    assert seconds < FAST


def test_good_options_parse():
    import argparse

    from llmlab.server.serve import add_arguments, allowed_hosts_for

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--port", "65535", "--max-body-bytes", "1", "--allowed-hosts", "a.example, *.lan",
                              "--api-key", "sk-a b", "--shutdown-timeout", "0"])
    assert (args.port, args.max_body_bytes, allowed_hosts_for(args)) == (65535, 1, ["a.example", "*.lan"])
    assert (args.api_key, args.shutdown_timeout) == ("sk-a b", 0.0)
