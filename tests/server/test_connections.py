"""Connections cannot be held open for nothing (issue #37, row 2: slowloris). A connection
that sends nothing is closed after the idle (keep-alive) timeout; one that sends half a
request line, half its headers or half its body, or trickles a byte at a time, is answered
408 and closed once the read timeout has passed since its first byte; past the cap on open
connections a request gets a 503 that says so. Requests that arrive whole are unaffected,
however long their answer takes. Timeouts here are a fraction of a second, so no test waits
long; each waits at most WAIT for an event that should come well before."""
from __future__ import annotations

import argparse
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from llmlab.server.app import create_app
from llmlab.server.connections import ConnectionLimits
from llmlab.server.serve import add_arguments, server_config
from helpers.server import free_port, tiny_engine

pytestmark = pytest.mark.slow     # real servers or engines under a workload: left out by make test-fast

LIMITS = ConnectionLimits(timeout_read=0.5, timeout_keep_alive=0.5, max_connections=3)
WAIT = 10    # seconds: a socket's own timeout; the server must close well before


@contextlib.contextmanager
def serving(limits: ConnectionLimits = LIMITS, engine=None):
    """`llmlab serve`'s uvicorn set-up (server_config) on a tiny engine, in a thread."""
    port = free_port()
    app = create_app(engine or tiny_engine())
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, log_level="warning", limits=limits))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def port():
    with serving() as port:
        yield port


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout fails the test)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_connection_that_sends_nothing_is_closed(port):
    with connect(port) as sock:
        assert read_until_closed(sock) == b""      # closed without a word: it asked nothing


@pytest.mark.parametrize("partial", [
    b"GET /hea",                                                   # half a request line
    b"GET /health HTTP/1.1\r\nHost: localhost\r\n",                # half the headers
    b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100\r\n\r\n{\"prompt\": ",                  # half the body
])
def test_half_a_request_is_answered_408_and_closed(port, partial):
    with connect(port) as sock:
        sock.sendall(partial)
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_a_request_trickled_a_byte_at_a_time_is_cut_off(port):
    """The read timeout runs from the first byte: bytes that keep coming do not extend it."""
    request = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Padding: " + b"a" * 1000
    with connect(port) as sock:
        start = time.monotonic()
        with pytest.raises(OSError):       # the server closes while bytes are still coming
            for byte in request:
                sock.sendall(bytes([byte]))
                time.sleep(0.05)           # the whole request would take 50 s
        elapsed = time.monotonic() - start
    assert elapsed < 10 * LIMITS.timeout_read


def test_an_idle_keep_alive_connection_is_closed(port):
    with connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        answer = read_until_closed(sock)      # the answer, then the close once idle
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"status":"ok"}')


def slow_engine(seconds_per_step: float):
    """A tiny engine whose every step takes at least `seconds_per_step`, whatever the machine."""
    engine = tiny_engine()
    step = engine.step

    def slow_step():
        time.sleep(seconds_per_step)
        return step()
    engine.step = slow_step
    return engine


def test_requests_that_arrive_whole_are_unaffected_however_long_they_take():
    """Each answer takes at least 3 read and keep-alive timeouts (150 steps of >= 10 ms); the
    connection is reused after them."""
    body = {"prompt": "Hi", "max_tokens": 150, "ignore_eos": True}
    with serving(engine=slow_engine(0.01)) as port, \
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 150
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) > 10
        assert client.get("/health").status_code == 200


def test_past_the_cap_a_request_gets_a_503_that_says_so():
    with serving(ConnectionLimits(timeout_read=5, timeout_keep_alive=5, max_connections=2)) as port:
        url = f"http://127.0.0.1:{port}/health"
        with connect(port), connect(port):              # two connections open, idle
            time.sleep(0.2)
            response = httpx.get(url, headers={"Connection": "close"})
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == "too_many_connections" and "--max-connections" in error["message"]
        deadline = time.monotonic() + WAIT             # the two have gone: served again
        while (status := httpx.get(url).status_code) != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == 200


def test_the_limits_are_serve_options():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert (args.timeout_read, args.timeout_keep_alive, args.max_connections) == (10.0, 5.0, 1024)
    args = parser.parse_args(["--timeout-read", "1.5", "--timeout-keep-alive", "0.5", "--max-connections", "8"])
    assert (args.timeout_read, args.timeout_keep_alive, args.max_connections) == (1.5, 0.5, 8)
    for bad in (["--timeout-read", "0"], ["--timeout-keep-alive", "-1"], ["--max-connections", "0"]):
        with pytest.raises(SystemExit) as exit:
            parser.parse_args(bad)
        assert exit.value.code == 2
