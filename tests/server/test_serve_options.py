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
