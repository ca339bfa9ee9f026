"""The server's engine loop: run the commands that arrived, step, report; the one loop both
ways of running the engine share (a thread of the server's process, or an engine-core
process of its own: engine_process.py).

`LLMEngine` is not thread-safe, so one loop owns it. It talks to the API side (async_engine.py)
in plain, picklable messages, the same whether they cross a thread or a pipe:

  commands (API -> engine), run between two steps, in order:
      ("add", group_id, [(request_id, token_ids, params), ...])  add all of them, or none
      ("abort", request_id)                                      stop one, free its blocks
      ("fail_all", reason)                                       abort every request (reason:
                                                                 "shutting_down")
      ("stop",)                                                  fail all, report, return
  batches (engine -> API), `(events, kv_stats)`: one per step (and one before it when the
  commands it ran had something to say: their requests are accepted before the step runs):
      ("accepted", group_id)                                     every request added
      ("refused", group_id, index, ValueError)                   request `index` was refused
                                                                 (the client's fault; none added)
      ("add_failed", group_id)                                   adding failed (an engine bug)
      ("output", request_id, Delta)                              what a request produced this step
      ("failed", reason, [(request_id, num_preemptions), ...])   requests ended by the engine
                                                                 ("engine_failed", "shutting_down")

An output crosses as its delta (`Delta`: new text, new token ids, new logprobs), never its
cumulative text: a message stays O(new tokens) however long a stream grows. The API side
rebuilds the `RequestOutput`s (request_group.py). Text is made here, in the loop (the
engine's OutputProcessor detokenizes and checks stop strings as tokens arrive):
ARCHITECTURE.md, "Server", says why.
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Callable, NamedTuple

from llmlab.engine.engine import LLMEngine
from llmlab.request import RequestOutput

logger = logging.getLogger("llmlab.server")


class Delta(NamedTuple):
    """One request's output of one step, as it crosses to the API side."""
    delta_text: str
    delta_token_ids: list[int]
    delta_logprobs: list | None      # TokenLogprobs of delta_token_ids, if asked for
    finished: bool
    finish_reason: str | None
    num_cached_prompt_tokens: int
    prompt_logprobs: list | None     # with a request's first output only
    num_preemptions: int             # (for the metrics, when it finishes)


class EngineLoop:
    """Owns an LLMEngine: `run(receive)` until a "stop" command, giving every iteration's
    events to `send((events, kv_stats))`. `receive(wait)` returns the commands that arrived
    (blocking for at least one when `wait`: the engine has nothing to run)."""

    def __init__(self, engine: LLMEngine, send: Callable[[tuple], None]):
        self.engine, self.send = engine, send
        self.requests = {}     # request id -> the engine's Request, while unfinished
        self._reported = set()    # unfinished requests that had an output (their prompt logprobs went with it)
        self._events: list[tuple] = []
        self._sent_kv_stats = None

    def run(self, receive: Callable[[bool], list]) -> None:
        while True:
            for command in receive(not self.engine.has_unfinished_requests()):
                if command[0] == "stop":
                    self._fail_all("shutting_down")
                    self._flush()
                    return
                try:
                    getattr(self, "_" + command[0])(*command[1:])
                except Exception:    # keep the loop alive whatever one command does
                    logger.exception("engine command %s failed", command[0])
            if self._events:     # what the commands did (accepted, aborted) goes out before the step
                self._flush()
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except Exception:    # a bug in the engine: fail its requests, keep serving
                    logger.exception("engine.step() failed; aborting %d requests", len(self.requests))
                    self._fail_all("engine_failed")
                else:
                    for output in outputs:
                        self._output(output)
            self._flush()

    def _flush(self) -> None:
        """Send this iteration's events, and the KV stats when they changed."""
        kv_stats = self.engine.kv_stats()
        if self._events or kv_stats != self._sent_kv_stats:
            events, self._events, self._sent_kv_stats = self._events, [], kv_stats
            self.send((events, kv_stats))

    # ---- commands --------------------------------------------------------------------
    def _add(self, group_id: int, requests: list[tuple]) -> None:
        """Add every request of the group, or none: one the engine refuses aborts those
        added before it (they have not run a step yet)."""
        added = []
        for index, (request_id, token_ids, params) in enumerate(requests):
            try:
                self.engine.add_request(token_ids, params, request_id)
            except Exception as err:
                for other in added:
                    self.engine.abort(other)
                if isinstance(err, ValueError):     # the client's fault: a 400
                    self._events.append(("refused", group_id, index, err))
                else:
                    logger.exception("adding request %s failed", request_id)
                    self._events.append(("add_failed", group_id))
                return
            added.append(request_id)
        for request_id in added:
            self.requests[request_id] = self.engine.requests[request_id]
        self._events.append(("accepted", group_id))

    def _abort(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None:     # (no-op once finished)
            self.engine.abort(request_id)
            self._output(RequestOutput.of(request))    # the reader's last output: finish_reason "abort"

    def _fail_all(self, reason: str) -> None:
        ended = []
        for request_id, request in self.requests.items():
            try:
                self.engine.abort(request_id)
            except Exception:
                logger.exception("aborting request %s failed", request_id)
            ended.append((request_id, request.num_preemptions))
        self.requests.clear()
        self._reported.clear()
        if ended:
            self._events.append(("failed", reason, ended))

    def _output(self, output: RequestOutput) -> None:
        request = self.requests.get(output.request_id)
        if request is None:
            return
        first = output.request_id not in self._reported
        self._reported.add(output.request_id)
        if output.finished:
            del self.requests[output.request_id]
            self._reported.discard(output.request_id)
        self._events.append(("output", output.request_id, Delta(
            output.delta_text, output.delta_token_ids, output.delta_logprobs, output.finished,
            output.finish_reason, output.num_cached_prompt_tokens, output.prompt_logprobs if first else None,
            request.num_preemptions)))


class EngineThread:
    """The engine loop on a thread of this process: what a notebook or a test that hands
    `create_app` an LLMEngine gets (and `llmlab serve --engine-in-process`). The same
    interface as EngineProcess: start, send, stop, is_alive."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands = collections.deque()   # deque.append and popleft are thread-safe
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, deliver: Callable[[tuple], None], on_exit: Callable[[], None]) -> None:
        """Run the loop on a thread; `deliver(batch)` and `on_exit()` are called on it."""
        def run():
            try:
                EngineLoop(self.engine, deliver).run(self._receive)
            finally:
                on_exit()
        self._commands.clear()
        self._thread = threading.Thread(target=run, name="llmlab-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def send(self, command: tuple) -> None:
        self._commands.append(command)
        self._wakeup.set()

    def stop(self) -> None:
        """Stop the loop (it fails what is left with "shutting down") and wait for it."""
        if self._thread is not None:
            self.send(("stop",))
            self._thread.join()
            self._thread = None

    def _receive(self, wait: bool) -> list:
        if wait:
            self._wakeup.wait()     # idle: sleep until a command arrives
        self._wakeup.clear()        # before reading the commands, so none can be missed
        commands = []
        while self._commands:
            commands.append(self._commands.popleft())
        return commands
