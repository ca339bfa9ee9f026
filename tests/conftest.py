"""Shared fixtures: the embedded model through llmlab and through HF transformers."""
from __future__ import annotations

import os

import pytest
import torch

import llmlab.kernels   # noqa: F401  switches Triton's interpreter on (no CUDA) before any test imports
                        # transformers, which imports Triton: Triton reads the switch once, at import


if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest-xdist workers on CI's two cores: one torch thread each, not two
    # threads each fighting over both cores
    torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--impl", default="solutions", choices=["solutions", "exercises"],
                     help="which implementation tests/exercises grades")


@pytest.fixture(scope="session")
def llm():
    """The embedded SmolLM2-135M-Instruct on CPU, float32, torch kernels."""
    import llmlab

    return llmlab.LLM(device="cpu", dtype="float32", backend="torch", num_gpu_blocks=512)


@pytest.fixture(scope="session")
def hf_model():
    """HF transformers' own loading of the same GGUF file: the independent reference."""
    from transformers import AutoModelForCausalLM

    from llmlab.model.loader import embedded_gguf_path

    path = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def runs_triton(item) -> bool:
    """A test parametrized with backend="triton": on a machine without CUDA its kernels run in
    Triton's interpreter, about a millisecond per program instance. (Tests that call Triton
    without that parameter are marked `slow` where they are written; tests/exercises/conftest.py
    marks the exercises written in Triton.)"""
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("backend") == "triton"


def pytest_collection_modifyitems(config, items):
    # the browser test first (over a minute): on pytest-xdist's workers a long test handed out
    # last keeps one worker busy while the other idles
    items.sort(key=lambda item: "tests/viz/test_browser.py" not in item.nodeid)
    # `slow`, left out by `make test-fast`: Triton's interpreter, processes (parallel ranks, a
    # server of its own), or more than ~5 s on a 2-core CPU. The same tests on any machine.
    for item in items:
        if runs_triton(item):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
