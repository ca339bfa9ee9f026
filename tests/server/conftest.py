"""A real `llmlab serve` process on the embedded model (CPU), shared by the server tests
that need the model's own tokenizer and chat template."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.server import serve_process


@dataclass
class ServerProcess:
    url: str
    log: Path          # the server's stdout and stderr

    def log_text(self) -> str:
        return self.log.read_text()


@pytest.fixture(scope="session")
def embedded_server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("embedded_server") / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "LLMLAB_API_KEY"}
    with open(log_path, "w") as log, serve_process(
            ["--device", "cpu", "--dtype", "float32", "--num-gpu-blocks", "512", "--log-level", "warning"],
            log, env) as url:
        yield ServerProcess(url, log_path)
