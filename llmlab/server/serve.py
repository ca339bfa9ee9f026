"""an OpenAI-compatible HTTP server (FastAPI + uvicorn), with graceful shutdown.

    llmlab serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
                 [--shutdown-timeout 5] [--allowed-hosts a,b] [every EngineConfig flag]

On SIGTERM or Ctrl-C the server stops accepting connections, lets running requests
finish for up to --shutdown-timeout seconds, then ends every open stream with an error
event and `[DONE]` and every waiting non-streaming request with a 503 (OpenAI's error
format), and exits with status 0. A second Ctrl-C quits at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time

import uvicorn

SHUTDOWN_TIMEOUT = 5.0         # seconds running requests get to finish on SIGTERM
# after the grace period every request ends within a step; this long more and uvicorn
# cancels what is still open (a client that stopped reading, say)
SHUTDOWN_BACKSTOP = 10.0


def add_arguments(parser) -> None:
    from llmlab.cli_flags import add_engine_arguments
    from llmlab.server.app import MAX_BODY_BYTES

    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: loopback only; 0.0.0.0 exposes the server)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("LLMLAB_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $LLMLAB_API_KEY)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model's name in the API (default: the --model file or folder name)")
    parser.add_argument("--allowed-hosts", default=None,
                        help="comma-separated Host header values to accept, '*' = any, '*.example.com' = "
                             "subdomains (default: the loopback names when --host is loopback, else any)")
    parser.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT,
                        help="on SIGTERM, seconds running requests get to finish before they are ended "
                             "with a 503 (default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--policy", default="fcfs",
                        help="the scheduling policy: fcfs, shortest_prompt_first, shortest_output_first, priority, "
                             "or module:Name (a SchedulingPolicy, its class, or a key function; module may be "
                             "path/to/file.py) (default: %(default)s)")
    add_engine_arguments(parser)


def allowed_hosts_for(args) -> list[str]:
    from llmlab.server.guards import LOOPBACK_HOSTS

    if args.allowed_hosts is not None:
        return [h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
    return LOOPBACK_HOSTS if args.host in LOOPBACK_HOSTS else ["*"]


CPU_LONG_PREFILL_THRESHOLD = 64


def main(args) -> None:
    from llmlab.cli_flags import engine_kwargs
    from llmlab.config import EngineConfig
    from llmlab.engine.engine import LLMEngine
    from llmlab.policies import resolve_policy
    from llmlab.server.app import EMBEDDED_MODEL_NAME, create_app
    from llmlab.server.guards import check_api_key_value

    check_api_key_value(args.api_key)   # before minutes of loading, not after
    kwargs = engine_kwargs(args)
    config = EngineConfig(**kwargs)
    if "long_prefill_token_threshold" not in kwargs and config.resolved_device().type == "cpu":
        # a CPU step over a whole 512-token budget takes seconds: cap each prompt's share so a
        # short request is not queued behind a long prompt (BENCHMARKS.md, "Head-of-line blocking")
        config = EngineConfig(**kwargs, long_prefill_token_threshold=CPU_LONG_PREFILL_THRESHOLD)
    policy = resolve_policy(args.policy)   # a bad --policy fails before minutes of loading, not after
    start = time.perf_counter()
    print(f"loading {config.model or 'the embedded ' + EMBEDDED_MODEL_NAME} ...", file=sys.stderr, flush=True)
    engine = LLMEngine(config, policy=policy)
    print(f"loaded in {time.perf_counter() - start:.1f}s on {engine.device.type}", file=sys.stderr, flush=True)
    check_max_model_len(config, engine)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach this "
              f"port can use the model", file=sys.stderr, flush=True)
    app = create_app(engine, args.served_model_name, args.api_key, args.max_body_bytes, allowed_hosts_for(args))
    serve(app, args.host, args.port, args.shutdown_timeout, args.log_level)


def check_max_model_len(config, engine) -> None:
    """A --max-model-len the engine cannot give is an error at start-up (as in vLLM), not a
    silent clamp that surfaces later as refused or cut-short requests."""
    if config.max_model_len is None or config.max_model_len <= engine.max_model_len:
        return
    kv_tokens = engine.kv_stats()["total_device_blocks"] * config.block_size
    raise ValueError(
        f"--max-model-len {config.max_model_len} is more than this engine can hold: "
        f"{engine.max_model_len} tokens (model context {engine.model_config.max_position_embeddings}, "
        f"KV cache {kv_tokens} tokens). Lower --max-model-len, or give the KV cache more memory "
        f"(--gpu-memory-utilization, --cpu-kv-cache-gib, --num-gpu-blocks)")


def serve(app, host: str, port: int, shutdown_timeout: float, log_level: str = "info") -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout + SHUTDOWN_BACKSTOP)
    GracefulServer(config, app.state.async_engine, shutdown_timeout).run()


class GracefulServer(uvicorn.Server):
    """uvicorn's server, whose shutdown first drains the engine (`AsyncEngine.drain`).

    uvicorn alone waits up to its timeout for connections to close, then cancels their
    tasks: a stream is cut with no error and no [DONE]. Here the engine ends every request
    itself once the grace period is over, so each handler still writes its proper ending
    before uvicorn closes the connection."""

    def __init__(self, config: uvicorn.Config, async_engine, shutdown_timeout: float):
        super().__init__(config)
        self.async_engine, self.shutdown_timeout = async_engine, shutdown_timeout

    async def shutdown(self, sockets=None):
        # uvicorn's shutdown closes the listening sockets at once (no new connections), then
        # waits for the open ones: those close as the drain lets their requests end
        drain = asyncio.ensure_future(self.async_engine.drain(self.shutdown_timeout))
        await super().shutdown(sockets)
        drain.cancel()

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
