"""`llmlab serve`'s engine core: the LLMEngine and its loop in a process of their own (as in
vLLM's current engine), so that the engine's host work (planning and preparing a step,
detokenizing, building outputs) and the API process's (HTTP, JSON, server-sent events,
tokenizing) each have an interpreter and a GIL of their own.

    API process                                   engine-core process (spawned)
      event loop: HTTP, SSE, JSON                   EngineLoop (engine_loop.py):
      tokenizer threads                               commands -> engine.step() -> batch
      reader thread: batch -> the event loop
                  ---- commands ("add", "abort", "fail_all", "stop") ---->
                  <--- one batch per step: (events, kv_stats) ------------

Both directions go through one `multiprocessing` pipe (a socket pair; messages are
pickled); engine_loop.py lists the messages. The process starts with a handshake: it builds
the engine from the EngineConfig and sends back what the API side needs without a model
(the tokenizer, max_model_len, the model's config, the KV cache's size), or the exception
that stopped it (a --max-model-len that cannot fit: the same ValueError as in-process).

Failures: when the engine process dies, the reader thread finds the pipe closed and the API
side ends every running request with a 500 (async_engine.py; `llmlab serve` then exits with
status 1). When the API process dies, the engine process finds the pipe closed (at its next
read or write: within a step) and exits. Ctrl-C reaches both processes (one process group):
the engine process ignores it and the API process leads the shutdown.
"""
from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
from typing import Callable

from llmlab.config import EngineConfig
from llmlab.model.tokenizer import tokenize_prompt

logger = logging.getLogger("llmlab.server")

STOP_TIMEOUT = 30.0    # seconds the engine process gets to finish its step and exit before it is killed


class EngineProcess:
    """The API process's handle on the engine core: what the server reads of an LLMEngine
    (config, sizes, tokenizer, max_model_len, model_config, kv_cache_tokens, device, tokenize,
    kv_stats), and the loop's interface (start, send, stop, is_alive; as EngineThread's)."""

    def __init__(self, config: EngineConfig, policy: str = "fcfs"):
        """Start the process and wait until its engine is built (minutes for a big model).
        `policy`: the scheduling policy's name or module:Name (resolved in the process)."""
        context = multiprocessing.get_context("spawn")   # never fork a process that may hold CUDA or threads
        self._connection, child_end = context.Pipe()
        self.process = context.Process(target=run_engine_core, args=(config, policy, child_end),
                                       name="llmlab-engine-core")
        self.process.start()
        child_end.close()    # only the child holds it now: its death closes the pipe
        try:
            kind, payload = self._connection.recv()
        except BaseException as err:    # it died; or a Ctrl-C here: it must not outlive us
            self.process.kill()
            self.process.join()
            if isinstance(err, EOFError):
                raise RuntimeError(f"the engine process exited while loading the model "
                                   f"(exit code {self.process.exitcode})") from None
            raise
        if kind == "error":
            self.process.join()
            raise payload
        self.config, self.sizes = payload["config"], payload["sizes"]   # with the sizes the engine chose
        self.tokenizer, self.max_model_len = payload["tokenizer"], payload["max_model_len"]
        self.model_config, self.kv_cache_tokens = payload["model_config"], payload["kv_cache_tokens"]
        self.device, self._kv_stats = payload["device"], payload["kv_stats"]
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def tokenize(self, prompt) -> tuple[list[int], str | None]:
        """As LLMEngine.tokenize (tokenize_prompt), here: prompts are tokenized in the API process."""
        return tokenize_prompt(self.tokenizer, prompt)

    def kv_stats(self) -> dict:
        """The KV stats the engine reported when it started (the batches carry the current ones)."""
        return self._kv_stats

    def start(self, deliver: Callable[[tuple], None], on_exit: Callable[[], None]) -> None:
        """Read the engine's batches on a thread: `deliver(batch)` each, `on_exit()` once the
        pipe closes (the process stopped, or died)."""
        def read():
            try:
                while True:
                    deliver(self._connection.recv())
            except (EOFError, OSError):
                pass
            finally:
                on_exit()
        self._reader = threading.Thread(target=read, name="llmlab-engine-reader", daemon=True)
        self._reader.start()

    @property
    def is_alive(self) -> bool:
        return self.process.is_alive() and self._reader is not None and self._reader.is_alive()

    @property
    def exitcode(self) -> int | None:
        """The process's exit status once it has ended (-N: killed by signal N)."""
        self.process.join(timeout=1.0)
        return self.process.exitcode

    def send(self, command: tuple) -> None:
        """Send a command (engine_loop.py); a dead process's are dropped (the reader reports it)."""
        with self._send_lock:
            try:
                self._connection.send(command)
            except OSError:
                pass

    def stop(self) -> None:
        """Stop the loop (it fails what is left with "shutting down" and sends a last batch),
        wait for the process to exit (kill it after STOP_TIMEOUT seconds), close the pipe."""
        if self._connection.closed:
            return
        self.send(("stop",))
        if self._reader is not None:
            self._reader.join(STOP_TIMEOUT)
        self.process.join(STOP_TIMEOUT)
        if self.process.is_alive():
            logger.warning("the engine process did not stop in %.0f s: killing it", STOP_TIMEOUT)
            self.process.kill()
            self.process.join()
        self._connection.close()


def run_engine_core(config: EngineConfig, policy: str, connection) -> None:
    """The engine process's main: build the engine, say so, run the loop until "stop" or
    until the API process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C reaches the whole process group
    from llmlab.engine.engine import LLMEngine
    from llmlab.engine.warm_up import freeze_heap
    from llmlab.policies import resolve_policy
    from llmlab.server.engine_loop import EngineLoop

    try:
        engine = LLMEngine(config, policy=resolve_policy(policy))
    except Exception as err:
        try:
            connection.send(("error", err))
        except Exception:    # an exception that does not pickle: its text
            connection.send(("error", RuntimeError(f"{type(err).__name__}: {err}")))
        return
    freeze_heap()    # the engine lives as long as this process (warm_up.py, "the garbage collector")
    connection.send(("ready", dict(config=engine.config, sizes=engine.sizes, tokenizer=engine.tokenizer, max_model_len=engine.max_model_len,
                                   model_config=engine.model_config, kv_cache_tokens=engine.kv_cache_tokens,
                                   device=engine.device, kv_stats=engine.kv_stats())))

    def receive(wait: bool) -> list:
        if wait:
            connection.poll(None)    # idle: sleep until a command arrives (or the pipe closes)
        commands = []
        while connection.poll():
            commands.append(connection.recv())   # EOFError once the API process is gone
        return commands

    try:
        EngineLoop(engine, connection.send).run(receive)
    except (EOFError, OSError):    # the pipe closed under us: nobody to serve
        logger.warning("llmlab engine process: the API process is gone; exiting")
    finally:
        connection.close()
