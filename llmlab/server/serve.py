"""an OpenAI-compatible HTTP server (FastAPI + uvicorn), with graceful shutdown.

    llmlab serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
                 [--shutdown-timeout 5] [--allowed-hosts a,b] [--timeout-read 10]
                 [--timeout-keep-alive 5] [--max-connections 1024] [--engine-in-process]
                 [every EngineConfig flag]

The engine runs in an engine-core process of its own (engine_process.py: the engine's host
work and the server's HTTP work then hold separate GILs); `--engine-in-process` runs it on a
thread of the server's process instead. If the engine process dies, running requests end
with a 500 and the server exits with status 1, saying so in one line.

On SIGTERM or Ctrl-C the server stops accepting connections, lets running requests
finish for up to --shutdown-timeout seconds, then ends every open stream with an error
event and `[DONE]` and every waiting non-streaming request with a 503 (OpenAI's error
format), and exits with status 0. A request whose body is still arriving then gets a 503
with Retry-After. A second Ctrl-C quits at once, with status 130.

Every option is checked as it is parsed (argparse `type=` functions), so a value that
could not work is one error line and exit status 2 before the model loads, not a
traceback 15 s later or a server that refuses every request.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import sys
import threading
import time

import uvicorn

from llmlab.server.connections import ConnectionLimits, LimitedH11Protocol, protocol_for

SHUTDOWN_TIMEOUT = 5.0         # seconds running requests get to finish on SIGTERM
# after the grace period every request ends within a step; this long more and uvicorn
# cancels what is still open (a client that stopped reading, say)
SHUTDOWN_BACKSTOP = 10.0


def add_arguments(parser) -> None:
    from llmlab.cli_flags import add_engine_arguments
    from llmlab.server.app import MAX_BODY_BYTES

    parser.add_argument("--host", type=bind_address, default="127.0.0.1",
                        help="address to bind (default: loopback only; 0.0.0.0 exposes the server)")
    parser.add_argument("--port", type=tcp_port, default=8000)
    # (argparse runs `type` on a string default too: $LLMLAB_API_KEY is checked like the flag)
    parser.add_argument("--api-key", type=bearer_key, default=os.environ.get("LLMLAB_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $LLMLAB_API_KEY)")
    parser.add_argument("--served-model-name", type=non_empty, default=None,
                        help="the model's name in the API (default: the --model file or folder name)")
    parser.add_argument("--allowed-hosts", type=host_list, default=None,
                        help="comma-separated Host header values to accept, '*' = any, '*.example.com' = "
                             "subdomains (default: the loopback names when --host is loopback, else any)")
    parser.add_argument("--shutdown-timeout", type=seconds(allow_zero=True), default=SHUTDOWN_TIMEOUT,
                        help="on SIGTERM, seconds running requests get to finish before they are ended "
                             "with a 503 (default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=positive_int, default=MAX_BODY_BYTES)
    limits = ConnectionLimits()   # (connections.py says why each exists)
    parser.add_argument("--timeout-read", type=seconds(), default=limits.timeout_read,
                        help="seconds a request's headers and body have to arrive, from its first byte; "
                             "then a 408 and the connection closes (default: %(default)s)")
    parser.add_argument("--timeout-keep-alive", type=seconds(), default=limits.timeout_keep_alive,
                        help="seconds a connection may sit idle, before its first request or between two "
                             "(default: %(default)s)")
    parser.add_argument("--max-connections", type=positive_int, default=limits.max_connections,
                        help="open connections; a request on one more gets a 503 (default: %(default)s)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--engine-in-process", action="store_true",
                        help="run the engine on a thread of the server's process, not in an engine-core "
                             "process of its own (engine_process.py)")
    parser.add_argument("--policy", default="fcfs",
                        help="the scheduling policy: fcfs, shortest_prompt_first, shortest_output_first, priority "
                             "(a request's `priority` field, lower first), or module:Name (a SchedulingPolicy, its class, or a key function; module may be "
                             "path/to/file.py) (default: %(default)s)")
    add_engine_arguments(parser)


# ---- option types: each returns the value or raises ArgumentTypeError (argparse: exit 2) ----
def tcp_port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1 to 65535, got {text}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def seconds(allow_zero: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"expected a number of seconds {'>= 0' if allow_zero else '> 0'}, "
                                             f"got {text!r}")
        return value
    return parse


def bind_address(text: str) -> str:
    # asyncio reads "" as every interface: never what an empty value meant
    if not text.strip():
        raise argparse.ArgumentTypeError("give an address: 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)")
    return text.strip()


def non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the name is empty")
    return text.strip()


def split_hosts(text: str) -> list[str]:
    return [h.strip() for h in text.split(",") if h.strip()]


def host_list(text: str) -> str:
    """A comma-separated list that names at least one host (an empty one would refuse every
    request, /health included)."""
    if not split_hosts(text):
        raise argparse.ArgumentTypeError("names no host: give host names, or '*' for any Host header")
    return text


def bearer_key(text: str) -> str:
    """A key a client can send: HTTP strips spaces around a header value and carries only
    ASCII reliably (a non-ASCII key reaches the server as Latin-1 or UTF-8, by client). The
    key is never repeated in the message: it is a secret."""
    from llmlab.server.guards import check_api_key_value

    try:
        check_api_key_value(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if text != text.strip():
        raise argparse.ArgumentTypeError("the API key (or $LLMLAB_API_KEY) starts or ends with whitespace, which "
                                         "HTTP strips from a header: no client could send it")
    if not all(" " <= c <= "~" for c in text):
        raise argparse.ArgumentTypeError("the API key (or $LLMLAB_API_KEY) has characters HTTP headers cannot "
                                         "carry reliably: use printable ASCII (letters, digits, -._~+/=)")
    return text


def allowed_hosts_for(args) -> list[str]:
    from llmlab.server.guards import LOOPBACK_HOSTS

    if args.allowed_hosts is not None:
        return split_hosts(args.allowed_hosts)
    return LOOPBACK_HOSTS if args.host in LOOPBACK_HOSTS else ["*"]


CPU_LONG_PREFILL_THRESHOLD = 64


def main(args) -> None:
    from llmlab.cli_flags import engine_kwargs
    from llmlab.config import EngineConfig
    from llmlab.engine.engine import LLMEngine
    from llmlab.engine.warm_up import freeze_heap
    from llmlab.policies import resolve_policy
    from llmlab.server.app import EMBEDDED_MODEL_NAME, create_app
    from llmlab.server.engine_process import EngineProcess
    kwargs = engine_kwargs(args)
    kwargs["usage_context"] = "server"   # the server's sizes when left None (sizing.py): shorter steps
    config = EngineConfig(**kwargs)
    if "long_prefill_token_threshold" not in kwargs and config.resolved_device().type == "cpu":
        # a CPU step over a whole 512-token budget takes seconds: cap each prompt's share so a
        # short request is not queued behind a long prompt (BENCHMARKS.md, "Head-of-line blocking")
        config = EngineConfig(**kwargs, long_prefill_token_threshold=CPU_LONG_PREFILL_THRESHOLD)
    policy = resolve_policy(args.policy)   # a bad --policy fails before minutes of loading, not after
    start = time.perf_counter()
    print(f"loading {config.model or 'the embedded ' + EMBEDDED_MODEL_NAME} ...", file=sys.stderr, flush=True)
    engine = LLMEngine(config, policy=policy) if args.engine_in_process else EngineProcess(config, args.policy)
    print(f"loaded in {time.perf_counter() - start:.1f}s on {engine.device.type}: max_model_len "
          f"{engine.max_model_len} (model context {engine.model_config.context_length}), KV cache "
          f"{engine.kv_cache_tokens} tokens", file=sys.stderr, flush=True)
    print(engine.sizes.reason, file=sys.stderr, flush=True)
    print(f"scheduling policy: {policy.name} ({args.policy})", file=sys.stderr, flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach this "
              f"port can use the model", file=sys.stderr, flush=True)
    try:
        app = create_app(engine, args.served_model_name, args.api_key, args.max_body_bytes, allowed_hosts_for(args))
        limits = ConnectionLimits(args.timeout_read, args.timeout_keep_alive, args.max_connections)
        freeze_heap()    # this process serves until it exits (warm_up.py, "the garbage collector")
        serve(app, args.host, args.port, args.shutdown_timeout, args.log_level, limits)
    finally:
        if isinstance(engine, EngineProcess):
            engine.stop()    # (a no-op after the app's shutdown; not after a port that was taken)


def serve(app, host: str, port: int, shutdown_timeout: float = SHUTDOWN_TIMEOUT, log_level: str = "info",
          limits: ConnectionLimits = ConnectionLimits()) -> None:
    config = server_config(app, host, port, shutdown_timeout, log_level, limits)
    server = GracefulServer(config, app.state.async_engine, shutdown_timeout)
    server.run()
    if server.exit_status:
        sys.exit(server.exit_status)


def server_config(app, host: str, port: int, shutdown_timeout: float = SHUTDOWN_TIMEOUT, log_level: str = "info",
                  limits: ConnectionLimits = ConnectionLimits()) -> uvicorn.Config:
    """uvicorn's settings for `app`: its h11 protocol with the connection limits (connections.py)."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol_for(limits),
                          timeout_keep_alive=limits.timeout_keep_alive,
                          timeout_graceful_shutdown=shutdown_timeout + SHUTDOWN_BACKSTOP)


class GracefulServer(uvicorn.Server):
    """uvicorn's server, whose shutdown first drains the engine (`AsyncEngine.drain`).

    uvicorn alone waits up to its timeout for connections to close, then cancels their
    tasks: a stream is cut with no error and no [DONE]. Here the engine ends every request
    itself once the grace period is over, so each handler still writes its proper ending
    before uvicorn closes the connection."""

    def __init__(self, config: uvicorn.Config, async_engine, shutdown_timeout: float):
        super().__init__(config)
        self.async_engine, self.shutdown_timeout = async_engine, shutdown_timeout
        self.exit_status = 0
        async_engine.on_engine_death = self.engine_died

    def engine_died(self, num_ended: int) -> None:
        """The engine process died: its requests have been ended with a 500; shut down (the
        drain finds nothing left to wait for) and exit with status 1, so that a supervisor
        restarts the server with a fresh engine."""
        exitcode = getattr(self.async_engine.engine, "exitcode", None)
        print(f"llmlab serve: the engine process died (exit code {exitcode}); ended its {num_ended} running "
              f"requests with a 500; the server is exiting (status 1)", file=sys.stderr, flush=True)
        self.exit_status = 1
        self.should_exit = True

    async def shutdown(self, sockets=None):
        # uvicorn's shutdown closes the listening sockets at once (no new connections), then
        # waits for the open ones: those close as the drain lets their requests end
        drain = asyncio.ensure_future(self.drain())
        await super().shutdown(sockets)
        drain.cancel()

    async def drain(self) -> None:
        """The grace period for running requests, then the engine ends the rest; a request
        still arriving then gets a 503 too (connections.py: no handler could answer it)."""
        await self.async_engine.drain(self.shutdown_timeout)
        for connection in list(self.server_state.connections):
            if isinstance(connection, LimitedH11Protocol):
                connection.refuse_arriving_request()

    def handle_exit(self, sig, frame) -> None:
        """A signal (SIGINT or SIGTERM) starts the graceful shutdown; a Ctrl-C while it runs
        quits at once. Without waiting for anything: the process ends here, as its state is
        (uvicorn's own force-exit returns from a shutdown that left the engine thread inside
        a step, and the C++ runtime aborted as Python exited under it). Status 130, as a
        shell reports a program a Ctrl-C stopped."""
        if sig == signal.SIGINT and self.should_exit:
            print("llmlab serve: second Ctrl-C: quitting now, without waiting for running requests",
                  file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(128 + signal.SIGINT)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        """As uvicorn's, without raising the signal again after the shutdown: uvicorn does
        that so that the process dies of it; a server that drained cleanly exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield    # (signals reach only the main thread: a notebook's server has none)
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
