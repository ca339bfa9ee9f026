"""A real `llmlab serve` process on the embedded model (CPU), shared by the server tests
that need the model's own tokenizer and chat template."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from helpers.server import free_port


@dataclass
class ServerProcess:
    url: str
    log: Path          # the server's stdout and stderr

    def log_text(self) -> str:
        return self.log.read_text()


@pytest.fixture(scope="session")
def embedded_server(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("embedded_server") / "server.log"
    log = open(log_path, "w")
    env = {k: v for k, v in os.environ.items() if k != "LLMLAB_API_KEY"}
    process = subprocess.Popen(
        [sys.executable, "-m", "llmlab.cli", "serve", "--port", str(port), "--device", "cpu", "--dtype", "float32",
         "--num-gpu-blocks", "512", "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert process.poll() is None, f"the server exited early:\n{log_path.read_text()}"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)
    yield ServerProcess(url, log_path)
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    log.close()
