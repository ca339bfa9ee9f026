"""Helpers for the server tests: a real uvicorn server on a free loopback port, and a tiny
random-weight engine with a one-character-per-token tokenizer (fast enough for streams of
thousands of tokens on a CPU)."""
from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from llmlab.bench.common import free_port, stop, wait_until_up  # noqa: F401  (free_port: the tests' too)
from llmlab.engine.engine import LLMEngine

from helpers.engine import cpu_engine, tiny_config, tiny_model

# the tiny model with room for streams of thousands of tokens
LONG_CONTEXT = tiny_config(max_position_embeddings=8192)


class CharTokenizer:
    """Token t <-> the character chr(32 + t % 95): every token is exactly one printable
    character, so text lengths count tokens. Records the threads it ran on."""
    eos_token_id = None
    vocab_size = 128

    def __init__(self):
        self.threads: set[str] = set()

    def encode(self, text: str) -> list[int]:
        self.threads.add(threading.current_thread().name)
        return [(ord(c) - 32) % 95 for c in text]

    def decode(self, token_ids, skip_special_tokens=True) -> str:
        return "".join(chr(32 + t % 95) for t in token_ids)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")


def tiny_engine(**config) -> LLMEngine:
    config = {**dict(model="tiny-random", num_gpu_blocks=1024), **config}   # max_model_len: the model's 8,192
    return cpu_engine(tiny_model(seed=0, config=LONG_CONTEXT), CharTokenizer(), **config)


@contextlib.contextmanager
def running(app, timeout: float = 60):
    """Serve `app` with uvicorn in a background thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def assert_idle(app, timeout: float = 30) -> None:
    """Wait until the app's engine runs nothing and every KV block is free (the engine thread
    refreshes `kv_stats` after each step); fail after `timeout` seconds."""
    async_engine, deadline = app.state.async_engine, time.monotonic() + timeout
    while True:
        stats = async_engine.kv_stats
        if (async_engine.num_unfinished == 0 and stats["free_device_blocks"] == stats["total_device_blocks"]
                and stats["num_running"] == stats["num_waiting"] == stats["num_swapped"] == 0):
            return
        assert time.monotonic() < deadline, f"still running, or KV blocks not freed: {stats}"
        time.sleep(0.05)


def metrics(url: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    text = httpx.get(f"{url}/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


@contextlib.contextmanager
def serve_process(flags: list[str], log, env=None, timeout: float = 180):
    """`llmlab serve --port <free> *flags` in a process of its own, its output to `log` (an
    open file); yields its URL once /health answers, and stops it at the end."""
    with serve_subprocess(flags, log, env, timeout) as (process, url):
        yield url


def dies_with_parent() -> None:
    """A Popen preexec_fn: the child gets SIGTERM when the test process dies (Linux's
    PR_SET_PDEATHSIG), so a server a killed pytest started (out of memory, a timeout) does
    not live on holding its model; elsewhere a no-op."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def serve_subprocess(flags: list[str], log, env=None, timeout: float = 180):
    """The same, yielding (the process, its URL): for tests that signal the process
    themselves. At the end it is stopped (SIGTERM, then SIGKILL) unless it has exited."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "llmlab.cli", "serve", "--port", str(port), *flags],
                               stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=dies_with_parent)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, url, timeout)
        yield process, url
    finally:
        stop(process, 30)


def wait_until_healthy(process, url: str, timeout: float, log_path: Path | None = None) -> None:
    """Poll `url`/health until it answers 200; fail if the process exits first (with its log
    when given) or `timeout` seconds pass."""
    try:
        wait_until_up(process, lambda: httpx.get(f"{url}/health").status_code == 200, timeout, "the server")
    except RuntimeError as error:
        raise AssertionError(f"{error}: " + (log_path.read_text() if log_path else "see its log")) from None


def child_pids(pid: int) -> list[int]:
    """The process ids of a process's children (Linux: /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def engine_pid(server_pid: int) -> int:
    """A `llmlab serve` process's engine-core process (multiprocessing's spawned child; the
    other child is multiprocessing's resource tracker)."""
    found = [c for c in child_pids(server_pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(found) == 1, found
    return found[0]


def process_alive(pid: int) -> bool:
    """True while the process runs (a zombie, exited and not yet reaped, is not alive)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
