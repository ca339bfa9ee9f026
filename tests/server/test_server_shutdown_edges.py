"""The edges of shutdown on a real `llmlab serve` process (issue #34): a second Ctrl-C
during the drain quits at once and cleanly (it aborted in C++: `terminate called without
an active exception`), and a request whose body is still arriving when the grace period
ends is refused with a 503 and Retry-After (it got a 500 when uvicorn cancelled it, 10 s
later). (`llmlab serve --port 70000` is refused before loading: tests/server/test_serve_options.py.)"""
from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from helpers.server import serve_subprocess

pytestmark = pytest.mark.slow     # a `llmlab serve` process of its own

GRACE = 1           # --shutdown-timeout, seconds
QUICK = 5           # seconds: a clean exit or a refusal comes well within this; uvicorn's backstop is 10 s more
FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-gpu-blocks", "512", "--log-level", "warning",
         "--shutdown-timeout", str(GRACE)]


@pytest.fixture
def server(tmp_path):
    log_path = tmp_path / "server.log"
    # a read timeout longer than the whole shutdown: only the shutdown can end a half-sent body
    with open(log_path, "w") as log, serve_subprocess([*FLAGS, "--timeout-read", "60"], log) as (process, url):
        yield process, url, log_path
    print(log_path.read_text())    # shown when the test fails


def start_long_stream(url: str) -> threading.Thread:
    """A streaming completion of thousands of tokens, read in the background until it ends."""
    first_token = threading.Event()

    def read():
        payload = {"prompt": "Tell me a story.", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        first_token.set()
        except httpx.TransportError:
            pass    # the force quit cut it
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    assert first_token.wait(60), "the stream never started"
    return thread


def test_a_second_ctrl_c_quits_at_once_and_cleanly(server):
    process, url, log_path = server
    start_long_stream(url)       # the drain has a request to wait for
    process.send_signal(signal.SIGINT)
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    start = time.monotonic()
    returncode = process.wait(timeout=QUICK + 30)
    took = time.monotonic() - start
    log = log_path.read_text()
    assert "terminate called" not in log and "Traceback" not in log, log
    assert returncode == 130, log          # 128 + SIGINT: what a shell reports for a program Ctrl-C stopped
    assert took < QUICK and "second Ctrl-C" in log


def test_a_body_still_arriving_when_the_grace_period_ends_gets_a_503(server):
    process, url, log_path = server
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"prompt": "hello", "max_tokens": 4}).encode()
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:10]))   # headers and a third of the body
        time.sleep(0.3)
        process.send_signal(signal.SIGTERM)
        client.settimeout(GRACE + QUICK)
        answer = b""
        try:
            while chunk := client.recv(65536):
                answer += chunk
        except socket.timeout:
            pytest.fail(f"the connection was still open {GRACE + QUICK} s after SIGTERM; got {answer!r}")
    assert process.wait(timeout=QUICK + 30) == 0
    # a 503 that says to come back (OpenAI's error format), then the connection closed: not a 500
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), answer
    assert b"retry-after:" in head.lower()
    error = json.loads(payload)["error"]
    assert error["type"] == "server_error" and "shutting down" in error["message"]
    assert "Traceback" not in log_path.read_text()
