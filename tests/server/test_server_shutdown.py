"""SIGTERM on a real `llmlab serve` process: it stops accepting connections, lets running
requests finish for --shutdown-timeout seconds, then ends every open stream with an
error event and [DONE] and every waiting non-streaming request with OpenAI's 503, and
exits with status 0."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from helpers.server import engine_pid, metrics, process_alive, serve_subprocess

pytestmark = pytest.mark.slow     # a `llmlab serve` process of its own

GRACE = 5    # seconds; the short request needs well under one, the long ones minutes


@pytest.fixture
def server_process(tmp_path):
    log_path = tmp_path / "server.log"
    flags = ["--shutdown-timeout", str(GRACE), "--device", "cpu", "--dtype", "float32", "--num-gpu-blocks", "512",
             "--log-level", "warning"]
    with open(log_path, "w") as log, serve_subprocess(flags, log, {**os.environ, "LLMLAB_API_KEY": "k"}) as started:
        yield started
    print(log_path.read_text())    # shown when the test fails


class Stream(threading.Thread):
    """A streaming completion read in the background; `lines` are its `data:` payloads."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.lines = url, max_tokens, []

    def run(self):
        payload = {"prompt": "Tell me a story.", "max_tokens": self.max_tokens, "ignore_eos": True,
                   "temperature": 0.0, "stream": True}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=payload, timeout=120,
                          headers={"Authorization": "Bearer k"}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.lines.append(line.removeprefix("data: "))

    def num_texts(self) -> int:
        return sum(1 for line in self.lines if line != "[DONE]" and json.loads(line).get("choices"))


def wait_until(condition, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_sigterm_drains_then_ends_what_is_left_with_503s(server_process):
    process, url = server_process
    long_stream, short_stream = Stream(url, 3000), Stream(url, 8)
    whole = {}

    def non_streaming():
        whole["response"] = httpx.post(f"{url}/v1/completions", timeout=120, headers={"Authorization": "Bearer k"},
                                       json={"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True})

    long_stream.start()
    waiting = threading.Thread(target=non_streaming, daemon=True)
    waiting.start()
    wait_until(lambda: metrics(url)["llmlab_num_requests_running"] == 2 and long_stream.num_texts() >= 2)
    short_stream.start()
    wait_until(lambda: short_stream.num_texts() >= 1)    # running: it has its first token

    engine = engine_pid(process.pid)
    process.send_signal(signal.SIGTERM)

    def refused() -> bool:    # the listening socket closes: no new connections
        try:
            httpx.get(f"{url}/health", timeout=1)
            return False
        except httpx.TransportError:
            return True
    wait_until(refused, timeout=5)

    for thread in (short_stream, long_stream, waiting):
        thread.join(timeout=GRACE + 30)
        assert not thread.is_alive()
    assert process.wait(timeout=30) == 0
    wait_until(lambda: not process_alive(engine))     # no orphan: the engine process stopped too

    # the short request finished normally inside the grace period
    assert short_stream.lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in short_stream.lines[:-1]]
    assert "error" not in chunks[-1] and chunks[-1]["choices"][0]["finish_reason"] == "length"
    # the long stream got an error event, then [DONE]
    assert long_stream.lines[-1] == "[DONE]"
    error = json.loads(long_stream.lines[-2])["error"]
    assert error["type"] == "server_error" and "shutting down" in error["message"]
    assert long_stream.num_texts() < 3000
    # the non-streaming request got an OpenAI-format 503
    response = whole["response"]
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "server_error"
    assert "shutting down" in response.json()["error"]["message"]
