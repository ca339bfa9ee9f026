"""`llmlab serve` runs its engine in an engine-core process (engine_process.py): the same text
through the split as from `LLM.generate`, and no new ways to lose work: a dead engine
process ends every request with a 5xx and the server exits 1; SIGTERM or Ctrl-C stops both
processes; a dead API process takes the engine process with it; a client that disconnects
frees its blocks in the engine process. Real processes, every wait bounded."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import llmlab
from helpers.server import dies_with_parent, engine_pid, free_port, metrics, process_alive as alive, wait_until_healthy

FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-gpu-blocks", "512", "--log-level", "warning"]
LONG = {"prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True}


def wait_until(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


class Server:
    """`llmlab serve` in a session of its own (so a Ctrl-C can go to its process group)."""

    def __init__(self, tmp_path: Path, flags=()):
        self.port, self.log_path = free_port(), tmp_path / "server.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(self.log_path, "w")
        env = {k: v for k, v in os.environ.items() if k != "LLMLAB_API_KEY"}
        self.process = subprocess.Popen([sys.executable, "-m", "llmlab.cli", "serve", "--port", str(self.port),
                                         *FLAGS, *flags], stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True, preexec_fn=dies_with_parent)
        wait_until_healthy(self.process, self.url, 240, self.log_path)

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.log.close()


@pytest.fixture
def server(tmp_path):
    server = Server(tmp_path)
    yield server
    server.close()


def start_stream(url: str, lines: list[str]) -> threading.Thread:
    """A streamed request on a thread, its SSE lines into `lines`; returns once it has
    received its first token (so its request holds KV blocks in the engine)."""
    started = threading.Event()

    def run():
        try:
            with httpx.Client(timeout=60) as client, \
                    client.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}) as response:
                for line in response.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()
        except httpx.TransportError:    # the server was killed mid-stream
            lines.append("(connection lost)")
        started.set()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(120)
    return thread


# ---- the same text through the split -----------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    return llmlab.LLM(device="cpu", dtype="float32", backend="torch", num_gpu_blocks=512)


@pytest.mark.slow
@pytest.mark.parametrize("fields", [dict(temperature=0.0, max_tokens=24),
                                    dict(temperature=0.9, top_p=0.9, seed=1234, max_tokens=24)],
                         ids=["greedy", "seeded"])
def test_streamed_and_whole_text_equal_generate(embedded_server, llm, fields):
    prompt = "The three most important inventions are"
    expected = llm.generate(prompt, llmlab.SamplingParams(**fields))[0]
    payload = {"prompt": prompt, **fields}
    whole = httpx.post(f"{embedded_server.url}/v1/completions", json=payload, timeout=120).json()
    assert whole["choices"][0]["text"] == expected.text
    assert whole["usage"]["completion_tokens"] == len(expected.token_ids)
    pieces = []
    with httpx.stream("POST", f"{embedded_server.url}/v1/completions", json={**payload, "stream": True},
                      timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(pieces) == expected.text
    assert len(pieces) == len(expected.token_ids)    # one event per token: nothing merged, nothing lost


def test_disconnect_mid_stream_frees_the_engine_process_blocks(embedded_server):
    url = embedded_server.url
    before = metrics(url)
    with httpx.Client(timeout=60) as client, \
            client.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}) as response:
        events = response.iter_lines()
        for _ in range(3):    # a few tokens in: the request holds KV blocks in the engine process
            while not next(events).startswith("data:"):
                pass
        assert metrics(url)['llmlab_kv_blocks_used{location="device"}'] > 0
    aborted = 'llmlab_requests_finished_total{finish_reason="abort"}'
    wait_until(lambda: metrics(url).get(aborted, 0) == before.get(aborted, 0) + 1)
    wait_until(lambda: metrics(url)['llmlab_kv_blocks_used{location="device"}'] == 0
               and metrics(url)["llmlab_num_requests_running"] == 0)


# ---- failures ------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_killed_engine_process_ends_requests_with_500_and_the_server_exits_1(server):
    engine = engine_pid(server.process.pid)
    lines: list[str] = []
    stream = start_stream(server.url, lines)
    whole: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: whole.append(httpx.post(f"{server.url}/v1/completions",
                                                                      json=LONG, timeout=60)), daemon=True)
    waiting.start()
    wait_until(lambda: metrics(server.url)["llmlab_num_requests_running"] == 2)

    os.kill(engine, signal.SIGKILL)
    stream.join(30)
    waiting.join(30)
    assert not stream.is_alive() and not waiting.is_alive()
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["type"] == "server_error"
    assert whole[0].status_code == 500 and whole[0].json()["error"]["type"] == "server_error"

    assert server.process.wait(timeout=30) == 1
    log = server.log_path.read_text()
    assert log.count("the engine process died") == 1, log
    assert "the server is exiting" in log
    assert not alive(engine)


@pytest.mark.slow
def test_ctrl_c_stops_both_processes(server):
    """(SIGTERM: test_server_shutdown.py, which checks the engine process exits too.)"""
    engine = engine_pid(server.process.pid)
    lines: list[str] = []
    stream = start_stream(server.url, lines)
    os.killpg(server.process.pid, signal.SIGINT)   # a terminal sends Ctrl-C to the whole process group
    assert server.process.wait(timeout=60) == 0
    stream.join(30)
    assert lines[-1] == "data: [DONE]" and "shutting down" in lines[-2]    # drained: ended with a 503 event
    wait_until(lambda: not alive(engine))


@pytest.mark.slow
def test_the_engine_process_exits_when_the_api_process_is_killed(server):
    engine = engine_pid(server.process.pid)
    lines: list[str] = []
    start_stream(server.url, lines)     # the engine is mid-generation, not waiting for a command
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=30)
    wait_until(lambda: not alive(engine))
